"""Prefect tasks and Prefect/MLflow glue around the plain stage functions of `dinov3_core`.

`tasks.tracking` is shared by every stage; `tasks.<stage>` holds one stage's tasks and its flow parameters.
"""
