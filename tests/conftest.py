"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from wsidino_dev.sample_slides import SampleSet


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
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    yield
    monkeypatch.undo()


@pytest.fixture(scope="session")
def small_tile_store(sample_slides: SampleSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tile store for training tests: the 20× sample slide tiled at 64 px (~260 tiles). Read-only."""
    from dinov3_core.config import load_config
    from dinov3_core.tiling.config import TileConfig
    from dinov3_core.tiling.engine import run_tile

    slide = next(p for p in sample_slides.slides if p.name.startswith("tissue_20x"))
    store = tmp_path_factory.mktemp("small_store") / "tiles.zarr"
    values = {"input": str(slide), "output": str(store), "tile_size": 64, "progress": False, "tracking.enabled": False}
    result = run_tile(load_config(TileConfig, None, values))
    assert result.total_tiles > 100
    return store


@pytest.fixture
def one_thread():
    """2 shared cores: intra-op threads only add contention to tests that run training steps."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
