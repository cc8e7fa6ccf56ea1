"""`make demo`: every stage that exists so far, end to end, on built-in sample slides (CPU, a few minutes)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dinov3_core.cli import main as cli_main


def run_demo(output: Path, workers: int) -> int:
    output = output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    slides_dir = output / "slides"
    store = output / "tiles.zarr"
    tracking_uri = f"sqlite:///{output / 'mlflow.db'}"
    os.environ.setdefault("MLFLOW_TRACKING_URI", tracking_uri)
    steps: list[tuple[str, list[str]]] = [
        ("sample slides", ["make-sample-slides", str(slides_dir), "--preset", "demo", "--no-negatives"]),
        (
            "tile",
            [
                "tile",
                "--input",
                str(slides_dir),
                "--output",
                str(store),
                "--workers",
                str(workers),
                f"tracking.uri={tracking_uri}",
                "tracking.experiment=wsidino-demo",
            ],
        ),
        (
            "pretrain",
            [
                "pretrain",
                "--config",
                "tiny",
                "--store",
                str(store),
                "--output-dir",
                str(output / "pretrain"),
                f"tracking.uri={tracking_uri}",
                "tracking.experiment=wsidino-demo",
            ],
        ),
        (
            "gram",
            [
                "gram",
                "--config",
                "tiny",
                "--pretrain-dir",
                str(output / "pretrain"),
                "--output-dir",
                str(output / "gram"),
                f"tracking.uri={tracking_uri}",
                "tracking.experiment=wsidino-demo",
            ],
        ),
        (
            "convert",
            [
                "convert",
                "--input",
                str(output / "gram"),
                "--output-dir",
                str(output / "model"),
                f"tracking.uri={tracking_uri}",
                "tracking.experiment=wsidino-demo",
            ],
        ),
        (
            "export",
            [
                "export",
                "--weights",
                str(output / "model" / "backbone.pth"),
                "--output",
                str(output / "model" / "model.onnx"),
                f"tracking.uri={tracking_uri}",
                "tracking.experiment=wsidino-demo",
            ],
        ),
        (
            "extract",
            [
                "extract",
                "--store",
                str(store),
                "--model",
                str(output / "model" / "model.onnx"),
                "--output",
                str(output / "features.zarr"),
                f"tracking.uri={tracking_uri}",
                "tracking.experiment=wsidino-demo",
            ],
        ),
    ]
    for name, argv in steps:
        start = time.perf_counter()
        print(f"\n=== {name}: wsidino {' '.join(argv)}", flush=True)
        code = cli_main(argv)
        if code != 0:
            print(f"demo step '{name}' failed (exit {code})", file=sys.stderr)
            return code
        print(f"=== {name} done in {time.perf_counter() - start:.1f} s", flush=True)
    print(
        "\nDemo outputs:\n"
        f"  sample slides   {slides_dir}\n"
        f"  tile store      {store}  (manifest: {store / 'manifest.json'})\n"
        f"  QC pictures     {store / 'slides'}/<slide>/qc_thumbnail.png\n"
        f"  pretraining     {output / 'pretrain'}  (ckpt/, eval/training_<it>/teacher_checkpoint.pth, "
        "training_metrics.json, loss_curve.png)\n"
        f"  gram anchoring  {output / 'gram'}  (gram_teacher_selection.json: the chosen eval teacher)\n"
        f"  backbone, ONNX  {output / 'model'}  (backbone.pth in the released key layout, model.onnx)\n"
        f"  features        {output / 'features.zarr'}  (per-tile CLS + mean patch, slide embeddings, "
        "slides/<id>/pca.png)\n"
        f"  MLflow runs     {tracking_uri}\n"
        f"  MLflow UI       .venv/bin/mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port 5000\n"
    )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", default="demo-output")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    sys.exit(run_demo(Path(args.output), args.workers))


if __name__ == "__main__":
    main()
