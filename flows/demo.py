"""`make demo`: the pipeline flow end to end on built-in sample slides, small model, CPU (about 5 minutes).

    python -m flows.demo --output demo-output [--nproc 2]

Without `PREFECT_API_URL` Prefect starts a temporary local server whose database lives in
`<output>/prefect/` (so the runs can be browsed afterwards); MLflow logs to `<output>/mlflow.db`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

DEMO_EXPERIMENT = "wsidino-demo"


def _prefect_env(output: Path) -> None:
    """Settings that must be in place before prefect is imported."""
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_HOME", str(output / "prefect"))
        # The temporary server needs more than the default 20 s to start on a 2-core machine.
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def demo_params(output: Path, nproc: int, tile_workers: int) -> Any:
    from dinov3_core.launch.training import LaunchSettings
    from tasks.params import PipelineParams, StageOptions, TrackingParams

    return PipelineParams(
        slides=str(output / "slides"),
        workdir=str(output),
        annotations=str(output / "slides" / "annotations"),  # QuPath-style GeoJSON written with the sample slides
        tile=StageOptions(config="default", overrides=[f"workers={tile_workers}"]),
        pretrain=StageOptions(config="cpu"),  # long enough to learn: the evaluation finds it better than its init
        gram=StageOptions(config="tiny"),
        launch=LaunchSettings(nproc_per_node=nproc, retries=1),
        tracking=TrackingParams(tracking_uri=f"sqlite:///{output / 'mlflow.db'}", experiment=DEMO_EXPERIMENT),
    )


def run_demo(output: Path, nproc: int, tile_workers: int) -> int:
    output = output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    _prefect_env(output)
    from flows.pipeline import pipeline_flow
    from wsidino_dev.sample_slides import make_sample_slides

    start = time.perf_counter()
    print(f"=== sample slides → {output / 'slides'}", flush=True)
    make_sample_slides(output / "slides", preset="demo", negatives=False)
    print("=== pipeline flow: tile → pretrain → gram → convert → export → extract", flush=True)
    state = pipeline_flow(demo_params(output, nproc, tile_workers), return_state=True)
    if not state.is_completed():
        print(f"demo pipeline ended {state.name}: {state.message}", file=sys.stderr)
        return 1
    summary = state.result()
    print(training_health(summary))
    table = Path(summary["paths"]["evaluation"]) / "evaluation.md"
    if table.is_file():
        print("\n" + table.read_text())
    print(where_everything_is(output, summary, time.perf_counter() - start))
    return 0


def training_health(summary: dict[str, Any]) -> str:
    """Each training stage's health verdict and last figures, to read beside the evaluation table."""
    lines = ['\n=== training health (README: "Is it learning?")']
    for stage in ("pretrain", "gram"):
        figures = ((summary["stages"].get(stage) or {}).get("summary")) or {}
        values = ", ".join(f"{k} {figures[k]}" for k in HEALTH_FIGURES if k in figures)
        lines.append(f"  {stage:<9} {figures.get('health', 'no verdict')}\n            {values}")
    return "\n".join(lines)


# The stage summary's health figures (dinov3_core.run.training_summary), in the order they are printed.
HEALTH_FIGURES = ("iteration", "dino_gap", "teacher_entropy", "agreement", "effective_rank", "invariance")


def where_everything_is(output: Path, summary: dict[str, Any], seconds: float) -> str:
    p = summary["paths"]
    stages = summary["stages"]
    gram = (stages.get("gram") or {}).get("summary") or {}
    export = (stages.get("export") or {}).get("summary") or {}
    uri = f"sqlite:///{output / 'mlflow.db'}"
    status = ", ".join(f"{s} {o.get('status')}" for s, o in stages.items())
    experiment = experiment_page(uri)
    return (
        f"\nDemo pipeline finished in {seconds:.0f} s ({status}).\n\n"
        f"  sample slides     {output / 'slides'}\n"
        f"  tile store        {p['tile_store']}  (QC pictures: slides/<id>/qc_thumbnail.png, qc_mask.png)\n"
        f"  pretraining       {p['pretrain']}  (ckpt/, eval/training_<it>/teacher_checkpoint.pth, loss_curve.png)\n"
        f"  gram anchoring    {p['gram']}\n"
        f"  gram teacher      {gram.get('gram_teacher', 'see gram/gram_teacher_selection.json')}\n"
        f"  backbone          {p['backbone']}  (released DINOv3 key layout)\n"
        f"  ONNX model        {p['onnx']}  (registered as {export.get('registered_model', '?')} "
        f"v{export.get('model_version', '?')} @{export.get('alias', '?')})\n"
        f"  evaluation        {p['evaluation']}  (evaluation.json, evaluation.md, confusion_*.png, embedding_*.png)\n"
        f"  features          {p['features']}  (slides/<id>/pca.png; extracted with the @champion)\n"
        f"  stage manifests   <each output>/stage_manifest.json, model.onnx.stage_manifest.json\n"
        f"  MLflow runs       {uri}  (pipeline run {summary['mlflow_run_id']}, one child per stage)\n\n"
        "Open the UIs:\n"
        f"  MLflow   .venv/bin/mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"
        f"   → http://127.0.0.1:5000/{experiment}\n"
        f"  Prefect  PREFECT_HOME={output / 'prefect'} .venv/bin/prefect server start --host 127.0.0.1"
        "   → http://127.0.0.1:4200\n"
        "  (or `make serve` for both servers, a worker and every deployment)\n"
        "Rerun `make demo`: every stage is skipped (manifests match); force one with the pipeline's force list.\n"
    )


def experiment_page(uri: str) -> str:
    """The demo experiment's page in the MLflow UI (it otherwise opens on another tab)."""
    from mlflow import MlflowClient

    try:
        found = MlflowClient(tracking_uri=uri).get_experiment_by_name(DEMO_EXPERIMENT)
    except Exception:
        found = None
    return f"#/experiments/{found.experiment_id}" if found is not None else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="demo-output")
    parser.add_argument("--nproc", type=int, default=2, help="training processes (torchrun, gloo on CPU)")
    parser.add_argument("--tile-workers", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    sys.exit(run_demo(Path(args.output), args.nproc, args.tile_workers))


if __name__ == "__main__":
    main()
