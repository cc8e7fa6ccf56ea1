"""What `wsidino pipeline` prints at the end: each stage, the training health, the evaluation, where every output
is, and how to open the MLflow UI on the run's experiment."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dinov3_core.stages.evaluate import EvaluateSummary
from dinov3_core.stages.export import ExportSummary
from dinov3_core.stages.training import TrainingSummary

if TYPE_CHECKING:
    from dinov3_core.pipeline.workdir import PipelineResult

# The training summary's health figures (dinov3_core.stages.training), in the order they are printed.
HEALTH_FIGURES = ("iteration", "dino_gap", "teacher_entropy", "agreement", "effective_rank", "invariance")


def stage_table(result: PipelineResult) -> str:
    lines = ["\n=== stages"]
    for stage, o in result.outcomes.items():
        lines.append(f"  {stage:<9} {o.status:<8} {o.reason or ''}")
    return "\n".join(lines)


def training_health(result: PipelineResult) -> str:
    """Each training stage's health verdict and last figures, to read beside the evaluation table."""
    lines = ['\n=== training health (docs/stages.md: "Is it learning?")']
    for stage, o in result.outcomes.items():
        if not isinstance(o.summary, TrainingSummary):
            continue
        figures = o.summary.as_dict()
        values = ", ".join(f"{k} {figures[k]}" for k in HEALTH_FIGURES if k in figures)
        lines.append(f"  {stage:<9} {o.summary.health or 'no verdict'}\n            {values}")
    return "\n".join(lines)


def experiment_page(uri: str, experiment: str) -> str:
    """The experiment's training-runs page in the MLflow UI (MLflow 3 opens an experiment on its GenAI traces
    overview otherwise, checked in a real browser by tests/test_ui_pages.py)."""
    from mlflow import MlflowClient

    try:
        found = MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    except Exception:
        found = None
    return f"#/experiments/{found.experiment_id}/runs" if found is not None else ""


def where_everything_is(result: PipelineResult, experiment: str, seconds: float) -> str:
    p = result.paths
    summaries = {s: o.summary for s, o in result.outcomes.items()}
    gram = summaries.get("gram")
    export = summaries.get("export")
    evaluate = summaries.get("evaluate")
    uri = result.tracking_uri or ""
    promoted = " → promoted to @champion" if isinstance(evaluate, EvaluateSummary) and evaluate.promoted else ""
    registered = (
        f"  (registered as {export.registered_model} v{export.model_version} @{export.alias}{promoted})"
        if isinstance(export, ExportSummary) and export.registered_model
        else ""
    )
    teacher = gram.gram_teacher if isinstance(gram, TrainingSummary) else None
    status = ", ".join(f"{s} {o.status}" for s, o in result.outcomes.items())
    lines = [
        f"\nPipeline finished in {seconds:.0f} s: {status}.",
        "",
        f"  tile store        {p.tile_store}  (QC pictures: slides/<id>/qc_thumbnail.png, qc_mask.png)",
        f"  pretraining       {p.pretrain}  (ckpt/, eval/training_<it>/teacher_checkpoint.pth, loss_curve.png)",
        f"  gram anchoring    {p.gram}" + (f"  (teacher {teacher})" if teacher else ""),
        f"  model             {p.model_dir}  (backbone.pth in the released key layout, model.onnx, MODEL_CARD.md)"
        + registered,
        f"  evaluation        {p.evaluation}  (evaluation.md, evaluation.json, confusion_*.png, embedding_*.png)",
        f"  features          {p.features}  (pictures: {p.features.parent / 'features'}/<id>/pca.png)",
        f"  MLflow            {uri}  (pipeline run {result.mlflow_run_id}, one child run per stage)",
    ]
    if uri.startswith("sqlite:///"):
        page = experiment_page(uri, experiment)
        lines += [
            "",
            "Open the MLflow UI:",
            f"  {_mlflow_command()} ui --backend-store-uri {uri} --port 5000   → http://127.0.0.1:5000/{page}",
        ]
    elif uri.startswith(("http://", "https://")):
        lines += ["", f"MLflow UI: {uri.rstrip('/')}/{experiment_page(uri, experiment)}"]
    lines += ["", "Rerun the same command: every stage whose inputs and config are unchanged is skipped."]
    return "\n".join(lines) + "\n"


def _mlflow_command() -> str:
    """The `mlflow` of this environment, as a path a newcomer can paste (no activated venv needed)."""
    import sys

    path = Path(sys.executable).parent / "mlflow"
    if not path.exists():
        return "mlflow"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def final_report(result: PipelineResult, experiment: str, seconds: float) -> str:
    parts = [stage_table(result)]
    if any(isinstance(o.summary, TrainingSummary) for o in result.outcomes.values()):
        parts.append(training_health(result))
    evaluation = result.outcomes.get("evaluate")
    if evaluation is not None and isinstance(evaluation.summary, EvaluateSummary) and evaluation.summary.evidence:
        parts.append(f"\n=== gate\n  {evaluation.summary.evidence}")
    table = result.paths.evaluation / "evaluation.md"
    evaluate = result.outcomes.get("evaluate")
    if evaluate is not None and evaluate.status == "skipped" and table.is_file():  # else just printed
        parts.append("\n" + table.read_text())
    parts.append(where_everything_is(result, experiment, seconds))
    return "\n".join(parts)


__all__ = ["HEALTH_FIGURES", "experiment_page", "final_report", "training_health", "where_everything_is"]
