"""MLflow ↔ Prefect glue: the pipeline's parent MLflow run, and Prefect flow-run tags on every stage's run.

The stage runner (`dinov3_core.run`) opens one MLflow run per stage execution; the Prefect task hands it the
tags below and the pipeline's run id, so either UI leads to the other: in MLflow search
``tags.`prefect.flow_run_id` = '…'``; in Prefect the stage's markdown artifact names the MLflow run id.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from dinov3_core import tracking
from dinov3_core.tracking import STAGE_TAG, TrackingConfig

PIPELINE_TAG = "wsidino.pipeline"

# The MLflow run of the pipeline flow run that is executing (stage subflows run in its thread and nest under it).
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
def pipeline_mlflow_run(cfg: TrackingConfig, tags: Mapping[str, str] | None = None) -> Iterator[str | None]:
    """The parent MLflow run of one pipeline flow run; stage runs opened inside nest under it.

    A retried flow run (same Prefect flow-run id) reopens its parent run instead of starting a second one.
    Ends FINISHED, or FAILED when the block raises.

    Yields:
        The parent run id, or None when tracking is off.
    """
    if not cfg.enabled:
        yield None
        return
    import mlflow
    from mlflow import MlflowClient

    uri = tracking.tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)  # ensure_experiment works on the global URI
    client = MlflowClient(tracking_uri=uri)
    experiment_id = tracking.ensure_experiment(cfg.experiment, uri)
    all_tags = {**prefect_run_tags("pipeline"), PIPELINE_TAG: "true", **dict(tags or {})}
    flow_run_id = all_tags.get("prefect.flow_run_id")
    existing = []
    if flow_run_id:
        existing = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.`{PIPELINE_TAG}` = 'true'",
            max_results=1,
        )
    if existing:
        run_id = existing[0].info.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        run_id = client.create_run(experiment_id, run_name=mlflow_run_name("pipeline"), tags=all_tags).info.run_id
    token = _PIPELINE_RUN.set((run_id, cfg))
    try:
        with tracking.terminated_after(client, run_id):
            yield run_id
    finally:
        _PIPELINE_RUN.reset(token)


@contextlib.contextmanager
def nested_under(run_id: str | None, cfg: TrackingConfig) -> Iterator[None]:
    """Stage runs opened in the block nest under `run_id` (a retraining cycle's run, opened by the cycle)."""
    if run_id is None:
        yield
        return
    token = _PIPELINE_RUN.set((run_id, cfg))
    try:
        yield
    finally:
        _PIPELINE_RUN.reset(token)


def record_pipeline(cfg: TrackingConfig, run_id: str | None, params: Mapping[str, Any], summary: Any) -> None:
    """Parameters (flattened, for comparing runs) and the outcome of each stage on the pipeline's MLflow run."""
    if run_id is None:
        return
    from mlflow import MlflowClient

    from dinov3_core.config import flatten

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg))
    flat = {k: ("null" if v is None else str(v))[:6000] for k, v in flatten(params).items()}
    existing = client.get_run(run_id).data.params
    for key, value in flat.items():
        if key not in existing:  # a retried flow run logs the same parameters again; params are write-once
            client.log_param(run_id, key, value)
    client.log_dict(run_id, summary, "pipeline_summary.json")
