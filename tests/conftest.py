"""Shared pytest fixtures: the one home for what several test modules use (plain helpers: tests/helpers.py).

Real inputs, each built once per session on first use; treat them as read-only, other tests share them:

* `sample_slides`: the "test" preset of realistic sample slides;
* `small_tile_store`: the 20× sample slide at 64 px, 0.5 µm/px (~260 tiles), for the training tests;
* `stage_tile_store`: the same slide at 64 px, 2 µm/px (tens of tiles), and on it `pretrain_run` (a tiny
  pretrain run, 1 process) and `pretrain_run_2ranks` (torchrun, 2 gloo processes, FSDP2); from the former
  `converted` (its backbone) and `exported` (ONNX);
* `stage_extract_store`: two SVS sample slides at 32 px, 2 µm/px in one store, for extract.

Also: every test logs to a session MLflow database (never ./mlflow.db of the checkout), `one_thread`, and the
orchestration back ends of tests/prefect_fixtures.py (a Prefect API server and MLflow; started only for the
tests that ask for `prefect_api` or `mlflow_tracking`).

Project modules are imported inside the fixtures, so a broken module fails the tests that use it, not collection.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests import helpers

if TYPE_CHECKING:
    from wsidino_dev.sample_slides import SampleSet

pytest_plugins = ["tests.prefect_fixtures"]


@pytest.fixture(scope="session")
def sample_slides(tmp_path_factory: pytest.TempPathFactory) -> SampleSet:
    """The "test" preset of realistic sample slides (3 good slides + negatives), written once per session.

    Real files OpenSlide opens: an Aperio SVS at 0.25 µm/px (40×, 4096×3072) and one at 0.5 µm/px (20×),
    a zlib generic TIFF at 0.25 µm/px, and ``negatives`` (no_mpp, truncated, not_a_slide, no_tissue).
    Generating them takes a few seconds. Treat the files as read-only: other tests share them.
    """
    # Imported here so a problem in the generator only fails the tests that use it, not collection.
    from wsidino_dev.sample_slides import make_sample_slides

    return make_sample_slides(tmp_path_factory.mktemp("sample_slides"), "test")


@pytest.fixture(scope="session", autouse=True)
def _isolated_mlflow(tmp_path_factory: pytest.TempPathFactory):
    """Every stage logs to MLflow by default: tests that name no tracking URI log into a session database in a
    temporary directory, never into ./mlflow.db of the checkout."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", helpers.sqlite_uri(tmp_path_factory.mktemp("mlflow")))
    yield
    monkeypatch.undo()


@pytest.fixture
def one_thread():
    """2 shared cores: intra-op threads only add contention (up to 40× slower ops) to tests that run training
    steps. Modules that want it everywhere say `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    with helpers.torch_threads(1):
        yield


# ------------------------------------------------------------------------------------------------ tile stores


@pytest.fixture(scope="session")
def small_tile_store(sample_slides: SampleSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tile store for training tests: the 20× sample slide tiled at 64 px (~260 tiles). Read-only.

    Lossless (zstd), as before JPEG became the default: the training-equivalence tests compare differently cut runs
    at 1e-5, and float32 reduction-order noise depends on the pixels (on the JPEG tiles it reached 1.9e-5)."""
    from dinov3_core.tiling.engine import run_tile

    slide = helpers.by_name(sample_slides, "tissue_20x.svs")
    store = tmp_path_factory.mktemp("small_store") / "tiles.zarr"
    assert run_tile(helpers.tile_config(slide, store, tile_size=64, compressor="zstd")).total_tiles > 100
    return store


@pytest.fixture(scope="session")
def stage_tile_store(sample_slides: SampleSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 20× sample slide tiled at 64 px, 2 µm/px: a small real tile store (tens of tiles)."""
    slide = helpers.by_name(sample_slides, "tissue_20x.svs")
    return helpers.tile_store([slide], tmp_path_factory.mktemp("stage_store") / "tiles.zarr", tile_size=64, mpp=2.0)


@pytest.fixture(scope="session")
def stage_extract_store(sample_slides: SampleSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two sample slides tiled at 32 px, 2 µm/px: two slides in one store for extract."""
    slides = [p for p in sample_slides.slides if p.suffix == ".svs"][:2]
    return helpers.tile_store(slides, tmp_path_factory.mktemp("extract_store") / "tiles.zarr", tile_size=32, mpp=2.0)


# ---------------------------------------------------------------------------- a tiny pretrain run and its models

# The stage tests' run (convert, export, extract): 4 iterations, micro-batches of 4.
STAGE_RUN: dict[str, Any] = {
    "train.batch_size_per_gpu": 4,
    "train.stop_at": 4,
    "checkpointing.period": 2,
    "checkpointing.max_to_keep": 5,
    "evaluation.eval_period_iterations": 4,
}


@pytest.fixture(scope="session")
def pretrain_run(stage_tile_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny pretrain run, 1 process: checkpoints ckpt/1, ckpt/3; eval teacher eval/training_3."""
    from dinov3_core.train.pretrain import run_pretrain

    out = tmp_path_factory.mktemp("stage_pretrain") / "run"
    with helpers.torch_threads():
        run_pretrain(helpers.pretrain_config(stage_tile_store, out, **STAGE_RUN))
    return out


@pytest.fixture(scope="session")
def pretrain_run_2ranks(stage_tile_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run with torchrun, 2 gloo processes (FSDP2: each rank wrote its shards), 2 iterations."""
    import json

    out = tmp_path_factory.mktemp("stage_pretrain_2r") / "run"
    values = helpers.pretrain_values(stage_tile_store, out, **{**STAGE_RUN, "train.stop_at": 2})
    helpers.torchrun(str(helpers.PRETRAIN_RUNS_SCRIPT), json.dumps(values), timeout=300)
    return out


@pytest.fixture(scope="session")
def converted(pretrain_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`backbone.pth` (+ config.yaml) converted from the tiny run's latest checkpoint (teacher)."""
    from dinov3_core.config import load_config
    from dinov3_core.convert.config import ConvertConfig
    from dinov3_core.convert.convert import run_convert

    out = tmp_path_factory.mktemp("converted")
    return run_convert(load_config(ConvertConfig, None, {"input": str(pretrain_run), "output_dir": str(out)})).backbone


@pytest.fixture(scope="session")
def exported(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The converted backbone exported to ONNX (fp32, cls + patch tokens), parity-checked."""
    from dinov3_core.config import load_config
    from dinov3_core.export.config import ExportConfig
    from dinov3_core.export.onnx_export import run_export

    out = tmp_path_factory.mktemp("exported") / "model.onnx"
    return run_export(load_config(ExportConfig, None, {"weights": str(converted), "output": str(out)}))
