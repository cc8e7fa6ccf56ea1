"""The convert stage as a Prefect flow: DCP checkpoint → backbone.pth in the released DINOv3 key layout."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.inputs import fails_in_one_line
from tasks.params import ConvertParams
from tasks.stage_task import load_stage_config, run_stage_task


@flow(name="convert")
@fails_in_one_line
def convert_flow(params: ConvertParams) -> dict[str, Any]:
    """Extract the teacher backbone of a training checkpoint (no optimizer state, no duplicates).

    Args:
        params: Checkpoint or run directory, model directory, config, MLflow.

    Returns:
        The stage outcome (backbone.pth and config.yaml paths, sizes).
    """
    cfg = load_stage_config("convert", params.stage.config, params.config_values())
    return run_stage_task("convert", cfg, force=params.force).as_dict()


if __name__ == "__main__":
    convert_flow.serve(name="convert-local")
