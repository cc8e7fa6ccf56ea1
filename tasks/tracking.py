"""MLflow ↔ Prefect glue: Prefect flow-run tags on every stage's run, and nesting stage runs under the pipeline's.

The stage runner (`dinov3_core.runner`) opens one MLflow run per stage execution; the Prefect task hands it the
tags below and the pipeline's run id, so either UI leads to the other: in MLflow search
``tags.`prefect.flow_run_id` = '…'``; in Prefect the stage's markdown artifact names the MLflow run id.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from dinov3_core.tracking import STAGE_TAG, TrackingConfig

# The MLflow run of the pipeline or retraining cycle that is executing: stage tasks opened inside nest under it.
_PIPELINE_RUN: ContextVar[tuple[str, TrackingConfig] | None] = ContextVar("wsidino_pipeline_run", default=None)


def prefect_run_tags(stage: str) -> dict[str, str]:
    """Tags linking an MLflow run to the current Prefect flow run (empty values are left out).

    Args:
        stage: Pipeline stage name, stored as `wsidino.stage`.

    Returns:
        `wsidino.stage`, and when called inside a flow run `prefect.flow_run_id`, `prefect.flow_run_name`,
        `prefect.flow_name`, `prefect.flow_run_url` (only when `PREFECT_UI_URL` resolves), plus
        `prefect.deployment_id` and `prefect.parent_flow_run_id` when the run has them.
    """
    from prefect.runtime import deployment, flow_run
    from prefect.settings import PREFECT_UI_URL

    tags: dict[str, str] = {STAGE_TAG: stage}
    run_id = flow_run.id
    if not run_id:
        return tags
    tags["prefect.flow_run_id"] = str(run_id)
    optional = {
        "prefect.flow_run_name": flow_run.name,
        "prefect.flow_name": flow_run.flow_name,
        "prefect.deployment_id": deployment.id,
        "prefect.parent_flow_run_id": flow_run.parent_flow_run_id,
        # `ui_url` formats "None/flow-runs/…" when no UI URL is configured: only tag a real URL.
        "prefect.flow_run_url": flow_run.ui_url if PREFECT_UI_URL.value() else None,
    }
    tags.update({k: str(v) for k, v in optional.items() if v})
    return tags


def mlflow_run_name(stage: str) -> str:
    """`<stage>` or `<stage>/<flow run name>` inside a Prefect flow run (e.g. `tile/amber-okapi`)."""
    from prefect.runtime import flow_run

    name = flow_run.name
    return f"{stage}/{name}" if name else stage


def current_pipeline_run() -> str | None:
    """The MLflow run id of the pipeline run this stage belongs to (None when the stage runs on its own)."""
    current = _PIPELINE_RUN.get()
    return current[0] if current else None


@contextlib.contextmanager
def nested_under(run_id: str | None, cfg: TrackingConfig) -> Iterator[None]:
    """Stage runs opened in the block nest under `run_id` (the pipeline's or a retraining cycle's run)."""
    if run_id is None:
        yield
        return
    token = _PIPELINE_RUN.set((run_id, cfg))
    try:
        yield
    finally:
        _PIPELINE_RUN.reset(token)
