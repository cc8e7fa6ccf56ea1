"""Shared real inputs of the convert / export / extract tests: one tiny pretrain run (1 process) and one
2-process (torchrun, gloo, FSDP2) run, a tile store, a converted backbone and its ONNX export.

Each is built once per session (a module-level cache: the fixtures are imported by several test modules, and
pytest would otherwise build an imported session fixture once per module).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dinov3_core.config import load_config
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.engine import run_tile
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.pretrain import run_pretrain

DIST_SCRIPT = Path(__file__).parent / "dist_scripts" / "pretrain_runs.py"
_CACHE: dict[str, Any] = {}

RUN_OVERRIDES: dict[str, Any] = {
    "tracking.enabled": False,
    "optim.warmup_epochs": 0,
    "optim.freeze_last_layer_epochs": 0,
    "train.global_batch_size": 8,
    "train.batch_size_per_gpu": 4,
    "train.stop_at": 4,
    "checkpointing.period": 2,
    "checkpointing.max_to_keep": 5,
    "evaluation.eval_period_iterations": 4,
}


def _once(key: str, make: Callable[[], Any]) -> Any:
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


@pytest.fixture(scope="session")
def stage_tile_store(sample_slides, tmp_path_factory) -> Path:
    """The 20× sample slide tiled at 64 px, 2 µm/px: a small real tile store (tens of tiles)."""

    def make() -> Path:
        slide = next(p for p in sample_slides.slides if p.name.startswith("tissue_20x"))
        store = tmp_path_factory.mktemp("stage_store") / "tiles.zarr"
        values = {"input": str(slide), "output": str(store), "tile_size": 64, "mpp": 2.0}
        run_tile(load_config(TileConfig, None, {**values, "progress": False, "tracking.enabled": False}))
        return store

    return _once("store", make)


@pytest.fixture(scope="session")
def stage_extract_store(sample_slides, tmp_path_factory) -> Path:
    """Two sample slides tiled at 32 px, 2 µm/px: two slides in one store for extract."""

    def make() -> Path:
        root = tmp_path_factory.mktemp("extract_store")
        store = root / "tiles.zarr"
        for slide in [p for p in sample_slides.slides if p.suffix == ".svs"][:2]:
            values = {"input": str(slide), "output": str(store), "tile_size": 32, "mpp": 2.0}
            run_tile(load_config(TileConfig, None, {**values, "progress": False, "tracking.enabled": False}))
        return store

    return _once("extract_store", make)


@pytest.fixture(scope="session")
def pretrain_run(stage_tile_store, tmp_path_factory) -> Path:
    """A real tiny pretrain run, 1 process: checkpoints ckpt/1, ckpt/3; eval teacher eval/training_3."""

    def make() -> Path:
        out = tmp_path_factory.mktemp("stage_pretrain") / "run"
        values = {**RUN_OVERRIDES, "data.stores": [str(stage_tile_store)], "output_dir": str(out)}
        threads = torch.get_num_threads()
        try:
            run_pretrain(load_config(PretrainConfig, "tiny", values, stage="pretrain"))
        finally:
            torch.set_num_threads(threads)
        return out

    return _once("pretrain", make)


@pytest.fixture(scope="session")
def pretrain_run_2ranks(stage_tile_store, tmp_path_factory) -> Path:
    """The same run with torchrun, 2 gloo processes (FSDP2: each rank wrote its shards), 2 iterations."""

    def make() -> Path:
        out = tmp_path_factory.mktemp("stage_pretrain_2r") / "run"
        values = {**RUN_OVERRIDES, "train.stop_at": 2, "data.stores": [str(stage_tile_store)], "output_dir": str(out)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(DIST_SCRIPT)]
        proc = subprocess.run([*cmd, json.dumps(values)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            pytest.fail(f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return out

    return _once("pretrain_2r", make)


@pytest.fixture(scope="session")
def converted(pretrain_run, tmp_path_factory) -> Path:
    """`backbone.pth` (+ config.yaml) converted from the tiny run's latest checkpoint (teacher)."""
    from dinov3_core.export.config import ConvertConfig
    from dinov3_core.export.convert import run_convert

    def make() -> Path:
        out = tmp_path_factory.mktemp("converted")
        cfg = load_config(ConvertConfig, None, {"input": str(pretrain_run), "output_dir": str(out)})
        return run_convert(cfg).backbone

    return _once("converted", make)


@pytest.fixture(scope="session")
def exported(converted, tmp_path_factory) -> Any:
    """The converted backbone exported to ONNX (fp32, cls + patch tokens), parity-checked."""
    from dinov3_core.export.config import ExportConfig
    from dinov3_core.export.onnx_export import run_export

    def make() -> Any:
        out = tmp_path_factory.mktemp("exported") / "model.onnx"
        cfg = load_config(ExportConfig, None, {"weights": str(converted), "output": str(out)})
        return run_export(cfg)

    return _once("exported", make)
