"""A run that learns, end to end: the `cpu` recipe (1,000 iterations of 32, what `make demo` trains; ~2 min on 2
cores) on the demo sample slides' real-tissue tiles, through the CLI and so under torchrun, leaves ln K, is called
"learning", and its backbone beats its own initialisation on a probe of the slides' annotations with the test slide
kept out of the probe's training side. The same recipe with upstream's teacher shapes stays at ln K and gets the
alarm: the fitted schedules are what make the difference. (Shortened runs or the small "test" slides are too noisy
to judge a probe on: 400 iterations on their 190 tiles scored below the initialisation.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dinov3_core.train.metrics import read_metrics
from tests.helpers import tile_store

SHORT = {"tracking.enabled": False, "health.probe_tiles": 64}  # the recipe as shipped, a smaller health probe
UPSTREAM = {
    "teacher.momentum_teacher": 0.992,
    "teacher.final_momentum_teacher": 1.0,
    "teacher.warmup_teacher_temp": 0.04,
    "teacher.warmup_teacher_temp_epochs": 1.2,
}


@pytest.fixture(scope="module")
def demo_slides(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from wsidino_dev.sample_slides import make_sample_slides

    return make_sample_slides(tmp_path_factory.mktemp("demo_slides"), "demo", negatives=False)


@pytest.fixture(scope="module")
def store(demo_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's three good slides with the tile stage's defaults (224 px, 0.5 µm/px): ~800 real-tissue tiles."""
    return tile_store(demo_slides.slides, tmp_path_factory.mktemp("learn_store") / "tiles.zarr")


def pretrain(store: Path, out: Path, overrides: dict[str, Any]) -> list[dict[str, Any]]:
    args = [f"{k}={v}" for k, v in {**SHORT, **overrides}.items()]
    # Two processes of one thread each, as `make demo` runs it: one process of two threads slowed to ~10 img/s
    # (from ~200) when another job took a core, its OpenMP threads waiting on each other; it then timed out.
    cmd = [sys.executable, "-m", "dinov3_core.cli", "pretrain", "--config", "cpu", "--nproc-per-node", "2"]
    cmd += ["--store", str(store), "--output-dir", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(out / "training_metrics.json")


def mean_gap(rows: list[dict[str, Any]], last: int = 50) -> float:
    tail = [r["dino_gap"] for r in rows][-last:]
    return sum(tail) / len(tail)


@pytest.mark.timeout(1500)  # ~3 min alone on 2 cores; far more when the machine is shared
def test_the_cpu_recipe_learns_and_beats_its_initialisation(store: Path, demo_slides: Any, tmp_path: Path) -> None:
    from dinov3_core.config import load_config
    from dinov3_core.convert.config import ConvertConfig
    from dinov3_core.convert.convert import run_convert
    from dinov3_core.evaluate.config import EvaluateConfig
    from dinov3_core.evaluate.evaluation import run_evaluate

    rows = pretrain(store, tmp_path / "run", {})
    verdict = json.loads((tmp_path / "run" / "health.json").read_text())["verdict"]
    assert verdict.startswith("learning:"), verdict
    assert mean_gap(rows) > 0.1  # nats below ln K over the last 50 iterations (inert runs: within ±0.005)

    convert = {"input": str(tmp_path / "run"), "output_dir": str(tmp_path / "model")}
    backbone = run_convert(load_config(ConvertConfig, None, convert)).backbone
    values = {
        "store": str(store),
        "candidate": str(backbone),
        "output": str(tmp_path / "eval"),
        "annotations": str(demo_slides.root / "annotations"),
        "baseline": "init",
        "progress": False,
        "tracking.enabled": False,
        "probe.bootstrap": 50,
    }
    models = run_evaluate(load_config(EvaluateConfig, None, values)).report.models
    linear = {role: models[role]["probes"]["linear"]["balanced_accuracy"]["value"] for role in models}
    assert linear["candidate"] > linear["baseline"] + 0.05, linear


@pytest.mark.timeout(1500)
def test_the_same_run_with_upstream_teacher_shapes_stays_at_ln_k(store: Path, tmp_path: Path) -> None:
    # Up to the health verdict (iteration 499) only: the schedules keep the full run's length (train.stop_at), and
    # the second half would add 2 minutes to the suite without changing the verdict.
    rows = pretrain(store, tmp_path / "run", {**UPSTREAM, "train.stop_at": 500})
    verdict = json.loads((tmp_path / "run" / "health.json").read_text())["verdict"]
    assert verdict.startswith("not learning: by iteration 499"), verdict
    assert abs(mean_gap(rows)) < 0.02
