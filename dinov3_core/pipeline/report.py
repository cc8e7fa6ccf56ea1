"""What `wsidino pipeline` prints at the end: each stage, the training health, the evaluation, where every output
is, and how to open the MLflow UI on the run's experiment."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dinov3_core.stages import get_stage

if TYPE_CHECKING:
    from dinov3_core.pipeline.run import PipelineResult


def stage_table(result: PipelineResult) -> str:
    lines = ["\n=== stages"]
    for stage, o in result.outcomes.items():
        lines.append(f"  {stage:<9} {o.status:<8} {o.reason or ''}")
    return "\n".join(lines)


def training_health(result: PipelineResult) -> str | None:
    """Each training stage's health verdict and last figures, to read beside the evaluation table."""
    lines = [f"  {stage:<9} {health}" for stage, o in result.outcomes.items() if (health := o.summary.health_report())]
    return '\n=== training health (docs/stages.md: "Is it learning?")\n' + "\n".join(lines) if lines else None


def experiment_page(uri: str, experiment: str) -> str:
    """The experiment's training-runs page in the MLflow UI (MLflow 3 opens an experiment on its GenAI traces
    overview otherwise, checked in a real browser by tests/test_ui_pages.py)."""
    from mlflow import MlflowClient

    try:
        found = MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    except Exception:
        found = None
    return f"#/experiments/{found.experiment_id}/runs?workflowType=machine_learning" if found is not None else ""


def where_everything_is(result: PipelineResult, experiment: str, seconds: float) -> str:
    uri = result.tracking_uri or ""
    status = ", ".join(f"{s} {o.status}" for s, o in result.outcomes.items())
    lines = [f"\nPipeline finished in {seconds:.0f} s: {status}.", ""]
    for name, path in result.paths.named().items():
        if not path.exists():  # a stage left out (--to, gram_anchoring=false) or one that made nothing
            continue
        contents = get_stage(name).place.contents
        outcome = result.outcomes.get(name)
        note = outcome.summary.note() if outcome is not None else ""
        lines.append(f"  {name:<9} {path}" + (f"  ({contents})" if contents else "") + (f"; {note}" if note else ""))
    lines.append(f"  {'MLflow':<9} {uri}  (pipeline run {result.mlflow_run_id}, one child run per stage)")
    if uri.startswith("sqlite:///"):
        page = experiment_page(uri, experiment)
        lines += [
            "",
            "Open the MLflow UI:",
            f"  {_mlflow_command()} ui --app-name wsidino --backend-store-uri {uri} --port 5000   "
            f"→ http://127.0.0.1:5000/{page}",
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
    health = training_health(result)
    if health:
        parts.append(health)
    verdicts = [f"  {v}" for o in result.outcomes.values() if (v := o.summary.verdict())]
    if verdicts:
        parts.append("\n=== gate\n" + "\n".join(verdicts))
    evaluation = result.paths.output("evaluate") / "evaluation.md" if "evaluate" in result.paths.places else None
    evaluate = result.outcomes.get("evaluate")
    if evaluate is not None and evaluate.status == "skipped" and evaluation and evaluation.is_file():  # else printed
        parts.append("\n" + evaluation.read_text())
    parts.append(where_everything_is(result, experiment, seconds))
    return "\n".join(parts)


__all__ = ["experiment_page", "final_report", "training_health", "where_everything_is"]
