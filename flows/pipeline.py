"""The whole pipeline as one Prefect flow: each stage is its stage flow, run as a subflow, under one MLflow run.

    from flows.pipeline import pipeline_flow
    from tasks.params import PipelineParams
    pipeline_flow(PipelineParams(slides="slides/", workdir="runs/lab1"))

    <workdir>/tiles.zarr          tile store (QC pictures under slides/<id>/)
    <workdir>/pretrain/           pretraining run: ckpt/, eval/ (teacher-only checkpoints), metrics
    <workdir>/gram/               gram-anchoring run (gram_teacher_selection.json names the chosen teacher)
    <workdir>/model/backbone.pth  teacher backbone, released key layout (+ config.yaml)
    <workdir>/model/model.onnx    ONNX export (registered in MLflow as @candidate)
    <workdir>/evaluation/         probes, health, the @champion decision (evaluation.json, evaluation.md)
    <workdir>/features.zarr       per-tile features, slide embeddings, PCA maps

A stage whose manifest shows the same config and inputs is skipped, so a rerun (or a retry of a failed run)
picks up at the first stage with work left; training stages resume from their last checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from dinov3_core.tracking import TrackingConfig
from flows.convert import convert_flow
from flows.evaluate import evaluate_flow
from flows.export import export_flow
from flows.extract import extract_flow
from flows.gram import gram_flow
from flows.pretrain import pretrain_flow
from flows.tile import tile_flow
from tasks.params import (
    ConvertParams,
    EvaluateParams,
    ExportParams,
    ExtractParams,
    GramParams,
    PipelineParams,
    PretrainParams,
    TileParams,
)
from tasks.tracking import pipeline_mlflow_run, record_pipeline


def layout(workdir: str | Path) -> dict[str, Path]:
    """Where each stage writes, under the work directory."""
    root = Path(workdir).resolve()
    return {
        "tile_store": root / "tiles.zarr",
        "pretrain": root / "pretrain",
        "gram": root / "gram",
        "model_dir": root / "model",
        "backbone": root / "model" / "backbone.pth",
        "onnx": root / "model" / "model.onnx",
        "evaluation": root / "evaluation",
        "features": root / "features.zarr",
    }


def stage_params(params: PipelineParams, stage: str) -> Any:
    """The stage flow's parameters for this pipeline run."""
    paths = layout(params.workdir)
    tracking = params.tracking
    force = stage in params.force
    if stage == "tile":
        return TileParams(
            input=params.slides, output=str(paths["tile_store"]), stage=params.tile, tracking=tracking, force=force
        )
    if stage == "pretrain":
        return PretrainParams(
            stores=[str(paths["tile_store"])], output_dir=str(paths["pretrain"]),
            pretrained_weights=params.pretrained_weights, stage=params.pretrain, launch=params.launch,
            tracking=tracking, force=force,
        )  # fmt: skip
    if stage == "gram":
        return GramParams(
            pretrain_dir=str(paths["pretrain"]), output_dir=str(paths["gram"]), stage=params.gram,
            launch=params.launch, tracking=tracking, force=force,
        )  # fmt: skip
    if stage == "convert":
        trained = paths["gram"] if params.gram_anchoring else paths["pretrain"]
        return ConvertParams(
            input=str(trained), output_dir=str(paths["model_dir"]), stage=params.convert, tracking=tracking,
            force=force,
        )  # fmt: skip
    if stage == "export":
        return ExportParams(
            weights=str(paths["backbone"]), output=str(paths["onnx"]), stage=params.export, tracking=tracking,
            force=force,
        )  # fmt: skip
    if stage == "evaluate":
        return EvaluateParams(
            store=str(paths["tile_store"]), candidate=str(paths["onnx"]), output=str(paths["evaluation"]),
            annotations=params.annotations, stage=params.evaluate, tracking=tracking, force=force,
        )  # fmt: skip
    if stage == "extract":
        return ExtractParams(
            store=str(paths["tile_store"]), model=extraction_model(params), output=str(paths["features"]),
            stage=params.extract, tracking=tracking, force=force,
        )  # fmt: skip
    raise ValueError(f"unknown stage {stage!r}")


def extraction_model(params: PipelineParams) -> str:
    """The model extract uses: the champion the evaluation settled on (the candidate when it was promoted or
    there is no champion yet), or the candidate when `extract_model` says so or nothing was evaluated."""
    paths = layout(params.workdir)
    evaluation = paths["evaluation"] / "evaluation.json"
    if params.extract_model == "champion" and evaluation.is_file():
        champion = json.loads(evaluation.read_text()).get("champion_model")
        if champion and Path(champion).is_file():
            return str(champion)
    return str(paths["onnx"])


STAGE_FLOWS: dict[str, Any] = {
    "tile": tile_flow,
    "pretrain": pretrain_flow,
    "gram": gram_flow,
    "convert": convert_flow,
    "export": export_flow,
    "evaluate": evaluate_flow,
    "extract": extract_flow,
}


OUTCOME_KEYS = ("status", "reason", "mlflow_run_id", "summary")


def _tracking_config(params: PipelineParams) -> TrackingConfig:
    t = params.tracking
    return TrackingConfig(enabled=t.enabled, uri=t.tracking_uri, experiment=t.experiment or "wsidino")


@flow(name="pipeline")
def pipeline_flow(params: PipelineParams) -> dict[str, Any]:
    """Slides → tiles → pretraining → gram → backbone → ONNX → evaluation → features, one stage flow after another.

    Stages from `start_at` to `stop_after` run as subflows; each is skipped when its manifest shows the same
    config and inputs (unless listed in `force`). One MLflow run for the pipeline with one child run per stage.

    Args:
        params: Slides, work directory, stage range, per-stage config names/overrides, launch, MLflow.

    Returns:
        Output locations, each stage's outcome and the MLflow parent run id.
    """
    logger = get_run_logger()
    paths = layout(params.workdir)
    stages = params.selected()
    outcomes: dict[str, Any] = {}
    tags = {"wsidino.workdir": str(Path(params.workdir).resolve()), "wsidino.stages": ",".join(stages)}
    with pipeline_mlflow_run(_tracking_config(params), tags=tags) as parent_run_id:
        for stage in stages:
            logger.info("stage %s", stage)
            outcomes[stage] = STAGE_FLOWS[stage](stage_params(params, stage))
    summary = {
        "workdir": str(Path(params.workdir).resolve()),
        "paths": {k: str(v) for k, v in paths.items()},
        "stages": {s: {k: o.get(k) for k in OUTCOME_KEYS} for s, o in outcomes.items()},
        "mlflow_run_id": parent_run_id,
    }
    record_pipeline(_tracking_config(params), parent_run_id, params.model_dump(mode="json"), summary)
    create_markdown_artifact(_markdown(summary), key="pipeline-summary", description="Pipeline outcome")
    return summary


def _markdown(summary: dict[str, Any]) -> str:
    lines = ["# Pipeline", "", f"Work directory: `{summary['workdir']}`", ""]
    lines += ["| stage | status | MLflow run | health (training stages) |", "|---|---|---|---|"]
    for stage, o in summary["stages"].items():
        health = (o.get("summary") or {}).get("health", "")  # pretrain / gram: learning, or not and why
        lines.append(f"| {stage} | {o.get('status')} | `{o.get('mlflow_run_id')}` | {health} |")
    lines += ["", "| output | path |", "|---|---|", *[f"| {k} | `{v}` |" for k, v in summary["paths"].items()]]
    lines += ["", f"MLflow pipeline run: `{summary['mlflow_run_id']}`"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    pipeline_flow.serve(name="pipeline-local")
