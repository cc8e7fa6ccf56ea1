"""What `wsidino pipeline` prints at the end: each stage, the training health, the evaluation, where every output
is, and how to open the MLflow UI on the run's experiment."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The stage summary's health figures (dinov3_core.run.training_summary), in the order they are printed.
HEALTH_FIGURES = ("iteration", "dino_gap", "teacher_entropy", "agreement", "effective_rank", "invariance")


def stage_table(summary: Mapping[str, Any]) -> str:
    lines = ["\n=== stages"]
    for stage, o in summary["stages"].items():
        lines.append(f"  {stage:<9} {o.get('status'):<8} {o.get('reason') or ''}")
    return "\n".join(lines)


def training_health(summary: Mapping[str, Any]) -> str:
    """Each training stage's health verdict and last figures, to read beside the evaluation table."""
    lines = ['\n=== training health (docs/stages.md: "Is it learning?")']
    for stage in ("pretrain", "gram"):
        if stage not in summary["stages"]:
            continue
        figures = (summary["stages"][stage].get("summary")) or {}
        values = ", ".join(f"{k} {figures[k]}" for k in HEALTH_FIGURES if k in figures)
        lines.append(f"  {stage:<9} {figures.get('health', 'no verdict')}\n            {values}")
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


def where_everything_is(summary: Mapping[str, Any], experiment: str, seconds: float) -> str:
    p = summary["paths"]
    stages = summary["stages"]
    gram = (stages.get("gram") or {}).get("summary") or {}
    export = (stages.get("export") or {}).get("summary") or {}
    uri = summary.get("tracking_uri") or ""
    evaluate = (stages.get("evaluate") or {}).get("summary") or {}
    promoted = " → promoted to @champion" if evaluate.get("promoted") else ""
    registered = (
        f"  (registered as {export['registered_model']} v{export.get('model_version')} @{export.get('alias')}"
        f"{promoted})"
        if export.get("registered_model")
        else ""
    )
    status = ", ".join(f"{s} {o.get('status')}" for s, o in stages.items())
    lines = [
        f"\nPipeline finished in {seconds:.0f} s: {status}.",
        "",
        f"  tile store        {p['tile_store']}  (QC pictures: slides/<id>/qc_thumbnail.png, qc_mask.png)",
        f"  pretraining       {p['pretrain']}  (ckpt/, eval/training_<it>/teacher_checkpoint.pth, loss_curve.png)",
        f"  gram anchoring    {p['gram']}"
        + (f"  (teacher {gram['gram_teacher']})" if gram.get("gram_teacher") else ""),
        f"  model             {p['model_dir']}  (backbone.pth in the released key layout, model.onnx, MODEL_CARD.md)"
        + registered,
        f"  evaluation        {p['evaluation']}  (evaluation.md, evaluation.json, confusion_*.png, embedding_*.png)",
        f"  features          {p['features']}  (pictures: {Path(p['features']).parent / 'features'}/<id>/pca.png)",
        f"  MLflow            {uri}  (pipeline run {summary.get('mlflow_run_id')}, one child run per stage)",
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


def final_report(summary: Mapping[str, Any], experiment: str, seconds: float) -> str:
    parts = [stage_table(summary)]
    if any(s in summary["stages"] for s in ("pretrain", "gram")):
        parts.append(training_health(summary))
    table = Path(summary["paths"]["evaluation"]) / "evaluation.md"
    if (summary["stages"].get("evaluate") or {}).get("status") == "skipped" and table.is_file():  # else just printed
        parts.append("\n" + table.read_text())
    parts.append(where_everything_is(summary, experiment, seconds))
    return "\n".join(parts)


__all__ = ["HEALTH_FIGURES", "experiment_page", "final_report", "training_health", "where_everything_is"]
