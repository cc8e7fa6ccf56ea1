"""The whole pipeline as one Prefect flow: `dinov3_core.pipeline.run.run_pipeline`, each stage as the `run-stage`
task (artifacts, GPU slots, crash retries of training), under one MLflow run. `wsidino pipeline` runs the same
function with the in-process stage runner, so the form's fields are the command's options.

    from flows.pipeline import pipeline_flow
    from tasks.chain_params import PipelineParams
    pipeline_flow(PipelineParams(slides="slides/", workdir="runs/lab1", config="cpu"))

Outputs under the work directory: tiles.zarr, pretrain/, gram/, model/ (backbone.pth, model.onnx, MODEL_CARD.md),
evaluation/, features.zarr (and mlflow.db unless a tracking URI is set). A retry of a failed flow run resumes at
the first stage with work left, in the same MLflow run; training resumes from its last checkpoint.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed

from dinov3_core import tracking
from dinov3_core.pipeline.config import load_pipeline_config
from dinov3_core.pipeline.run import PipelineResult, run_pipeline
from tasks.chain_params import PipelineParams
from tasks.inputs import fails_in_one_line
from tasks.stage_task import prefect_stage_runner
from tasks.tracking import prefect_run_tags


@flow(name="pipeline")
@fails_in_one_line
def pipeline_flow(params: PipelineParams) -> Any:
    """Slides → tiles → pretraining → gram → backbone → ONNX → evaluation → features, one stage after another.

    Stages from `start_at` to `stop_after` run as `run-stage` tasks; each is skipped when its manifest shows the
    same config and inputs (unless listed in `force`). One MLflow run for the pipeline with one child per stage.

    Args:
        params: Slides, work directory, pipeline config, weights, stage range, overrides, launch, MLflow.

    Returns:
        Output locations, each stage's outcome and the MLflow parent run id.
    """
    logger = get_run_logger()
    cfg = load_pipeline_config(params.config, params.config_values())
    result = run_pipeline(
        cfg,
        prefect_stage_runner(params.launch),
        attempt_key=str(flow_run.id) if flow_run.id else None,
        log=logger.info,
        tags=prefect_run_tags("pipeline"),
        world_size=params.launch.world_size,
    )
    summary = result.as_dict()  # the flow's result: JSON for the Prefect API and UI
    create_markdown_artifact(_markdown(result), key="pipeline-summary", description=result.message[:500])
    return Completed(message=result.message[:4000], data=summary)


def _markdown(result: PipelineResult) -> str:
    uri = result.tracking_uri
    lines = ["# Pipeline", "", f"Work directory: `{result.workdir}`", ""]
    lines += ["| stage | status | MLflow run | health (training stages) |", "|---|---|---|---|"]
    for stage, o in result.outcomes.items():
        health = (o.summary.health_report() or "").split("\n")[0]  # pretrain / gram: learning, or not and why
        lines.append(f"| {stage} | {o.status} | {_run_link(uri, o.mlflow_run_id)} | {health} |")
    lines += ["", "| output | path |", "|---|---|", *[f"| {k} | `{v}` |" for k, v in result.paths.named().items()]]
    lines += ["", f"MLflow pipeline run: {_run_link(uri, result.mlflow_run_id)} ({uri})"]
    return "\n".join(lines) + "\n"


def _run_link(uri: str | None, run_id: str | None) -> str:
    """A link to the run's MLflow page when tracking goes to a server; the id otherwise (a local store has no UI
    address this process knows)."""
    url = tracking.ui_url(uri, run_id)
    return f"[{run_id}]({url})" if url else f"`{run_id}`"


if __name__ == "__main__":
    pipeline_flow.serve(name="pipeline-local")
