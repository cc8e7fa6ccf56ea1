"""MLflow ↔ Prefect glue shared by every stage's tasks.

One MLflow run per stage execution, opened through `dinov3_core.tracking.stage_run` (which joins
`$MLFLOW_RUN_ID` or nests under `$WSIDINO_MLFLOW_PARENT_RUN_ID`) and tagged with the Prefect flow run that
produced it, so either UI leads to the other: in MLflow search ``tags.`prefect.flow_run_id` = '…'``; in
Prefect the stage's markdown artifact names the MLflow run id.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from dinov3_core import tracking
from dinov3_core.tracking import TrackingConfig

STAGE_TAG = "wsidino.stage"
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


@contextlib.contextmanager
def stage_mlflow_run(
    cfg: TrackingConfig,
    stage: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    resume_run_id: str | None = None,
) -> Iterator[Any]:
    """Open the MLflow run of one stage execution, tagged with the Prefect flow run.

    Inside a pipeline run the stage nests under the pipeline's run and resumes the unfinished child a failed
    attempt left; on its own it resumes `resume_run_id` (the run of the stage's last, failed attempt).

    Call it from the task that logs (MLflow's active run is per thread). A failure inside the block marks the
    run FAILED and re-raises.

    Args:
        cfg: The stage's tracking section (enabled, uri, experiment); `uri` null → `$MLFLOW_TRACKING_URI`,
            else `sqlite:///mlflow.db` in the working directory.
        stage: Stage name for the run name and the `wsidino.stage` tag.
        params: MLflow params, usually `dinov3_core.config.flat_params(cfg)`.
        tags: Extra tags; they win over the Prefect tags.

    Yields:
        The active `mlflow.ActiveRun`, or `None` when `cfg.enabled` is false.
    """
    all_tags = {**prefect_run_tags(stage), **dict(tags or {})}
    parent = current_pipeline_run()
    run_id = find_stage_run(cfg, parent, stage) if parent and cfg.enabled else resume_run_id
    with tracking.stage_run(
        cfg, mlflow_run_name(stage), params=params, tags=all_tags, run_id=run_id, parent_run_id=parent
    ) as run:
        yield run


def current_pipeline_run() -> str | None:
    """The MLflow run id of the pipeline run this stage belongs to (None when the stage runs on its own)."""
    current = _PIPELINE_RUN.get()
    return current[0] if current else None


def find_stage_run(cfg: TrackingConfig, parent_run_id: str, stage: str, unfinished: bool = True) -> str | None:
    """A child run of `stage` under the pipeline run: with `unfinished`, one left by a failed attempt, which a
    retry resumes, so a stage keeps one MLflow run however often it is retried; otherwise any."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg))
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' and tags.`{STAGE_TAG}` = '{stage}'",
        max_results=10,
    )
    matching = [r for r in runs if r.info.status != "FINISHED" or not unfinished]
    return matching[0].info.run_id if matching else None


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
        yield run_id
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    else:
        client.set_terminated(run_id, status="FINISHED")
    finally:
        _PIPELINE_RUN.reset(token)


def mlflow_run_env(run: Any, cfg: TrackingConfig) -> dict[str, str]:
    """Environment that lets a launched subprocess (torchrun rank 0, a CLI stage) resume `run`.

    Args:
        run: The `mlflow.ActiveRun` yielded by `stage_mlflow_run`.
        cfg: The tracking config the run was opened with.

    Returns:
        `MLFLOW_RUN_ID`, `MLFLOW_TRACKING_URI` and `MLFLOW_EXPERIMENT_ID`; empty when `run` is `None`.
    """
    if run is None:
        return {}
    return {
        "MLFLOW_RUN_ID": run.info.run_id,
        "MLFLOW_TRACKING_URI": tracking.tracking_uri(cfg),
        "MLFLOW_EXPERIMENT_ID": run.info.experiment_id,
    }


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
