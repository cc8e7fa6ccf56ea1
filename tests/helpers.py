"""Shared test helpers: plain functions and constants that several test modules use (fixtures are in
conftest.py). Project modules and torch are imported inside the functions, so importing this module stays
cheap for the tests that need only a path or a slide list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

    from dinov3_core.tiling.config import TileConfig
    from dinov3_core.train.config import PretrainConfig

REPO = Path(__file__).resolve().parents[1]
DIST_SCRIPTS = REPO / "tests" / "dist_scripts"
PRETRAIN_RUNS_SCRIPT = DIST_SCRIPTS / "pretrain_runs.py"

# On top of configs/pretrain/tiny.yaml: no lr warmup and no frozen last layer (every step moves every
# weight), a global batch of 8, no MLflow. Modules add their own schedule (batch per process, stop, checkpoint periods).
TINY_PRETRAIN: dict[str, Any] = {
    "tracking.enabled": False,
    "optim.warmup_epochs": 0,
    "optim.freeze_last_layer_epochs": 0,
    "train.global_batch_size": 8,
}


# ------------------------------------------------------------------------------------------- slides, tiles


def by_name(samples: Any, name: str) -> Path:
    """The good sample slide called `name` (e.g. "tissue_20x.svs") of a `sample_slides` set."""
    found = [p for p in samples.slides if p.name == name]
    assert found, f"no sample slide {name!r} in {[p.name for p in samples.slides]}"
    return found[0]


def slide_list(path: Path, slides: Iterable[Path]) -> Path:
    """A slide-list file at `path`: one slide path a line."""
    path.write_text("".join(f"{p}\n" for p in slides))
    return path


def tile_config(input_: Path | str, output: Path, **overrides: Any) -> TileConfig:
    """The default tile config for `input_` → `output`, quiet (no progress bar, no MLflow), plus `overrides`."""
    from dinov3_core.config import load_config
    from dinov3_core.tiling.config import TileConfig

    values = {"input": str(input_), "output": str(output), "progress": False, "tracking.enabled": False}
    return load_config(TileConfig, None, {**values, **overrides})


def tile_store(slides: Iterable[Path], store: Path, **overrides: Any) -> Path:
    """Each slide tiled into `store` by the real tile stage, one run a slide."""
    from dinov3_core.tiling.engine import run_tile

    for slide in slides:
        run_tile(tile_config(slide, store, **overrides))
    return store


# ---------------------------------------------------------------------------------------------- training


def pretrain_values(store: Path, out: Path, **overrides: Any) -> dict[str, Any]:
    """Overrides of the `tiny` pretrain config: `TINY_PRETRAIN`, one tile store, `out`, then `overrides`."""
    return {**TINY_PRETRAIN, "data.stores": [str(store)], "output_dir": str(out), **overrides}


def pretrain_config(store: Path, out: Path, **overrides: Any) -> PretrainConfig:
    from dinov3_core.config import load_config
    from dinov3_core.train.config import PretrainConfig

    return load_config(PretrainConfig, "tiny", pretrain_values(store, out, **overrides), stage="pretrain")


# Activations that dwarf allocator noise: 224/96 px crops through a 192-wide, 4-block backbone (~30 MiB an image,
# still ~1 s a step of 8 images on one core); no probe or evaluation between steps, so memory is the step's alone.
WIDE: dict[str, Any] = {
    "crops.global_size": 224,
    "crops.local_size": 96,
    "crops.n_local_crops": 4,
    "student.backbone_overrides": {"embed_dim": 192, "num_heads": 3, "depth": 4},
    "health.probe_tiles": 0,
    "evaluation.eval_period_iterations": 0,
}

# `python -m dinov3_core.train` on the tiny recipe: what a training process runs, before its `key=<json>` overrides.
TRAIN_MODULE = ("-m", "dinov3_core.train", "--config", "tiny")


def train_argv(store: Path, out: Path, **overrides: Any) -> list[str]:
    """`pretrain_values(store, out, **overrides)` as the command line's `key=<json>` overrides."""
    return [f"{k}={json.dumps(v)}" for k, v in pretrain_values(store, out, **overrides).items()]


def train_process(
    store: Path, out: Path, *, env: dict[str, str], timeout: float = 300, **overrides: Any
) -> subprocess.CompletedProcess[str]:
    """One `python -m dinov3_core.train --config tiny` process (its own memory and CUDA context) on
    `pretrain_values(store, out, **overrides)`, with `env` on top of this process's; the test fails with the end of
    both streams (the error's last lines first: a report that keeps only the message's start still shows the cause)
    if it exits non-zero."""
    cmd = [sys.executable, *TRAIN_MODULE, *train_argv(store, out, **overrides)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
        pytest.fail(f"exit {proc.returncode}; stderr ends:\n{tail}\n--- stdout\n{proc.stdout[-3000:]}")
    return proc


def replanned_and_reference(
    store: Path, out: Path, reference: Path, stop_at: int, squeezed: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The same `stop_at` iterations (global KoLeo, one checkpoint at the end) trained twice: into `reference` in
    this process with the memory watch off, and into `out` by 2 torchrun processes under `squeezed` (a memory budget
    that every window exceeds). Returns `out`'s metrics rows and both last checkpoints' models (`out`'s first)."""
    from dinov3_core.train.metrics import read_metrics
    from dinov3_core.train.pretrain import run_pretrain

    common = {
        "losses.koleo_scope": "global",
        "train.stop_at": stop_at,
        "checkpointing.period": stop_at,
        "evaluation.eval_period_iterations": 0,
        "health.probe_tiles": 0,
    }
    run_pretrain(pretrain_config(store, reference, **common, **{"train.memory_watch": False}))
    torchrun(*TRAIN_MODULE, *train_argv(store, out, **common, **squeezed), timeout=300)
    last = str(stop_at - 1)
    got, ref = load_dcp(out / "ckpt" / last)["model"], load_dcp(reference / "ckpt" / last)["model"]
    return read_metrics(out / "training_metrics.json"), got, ref


@contextmanager
def torch_threads(n: int | None = None) -> Iterator[None]:
    """Restores torch's intra-op thread count on exit (training sets its own); sets it to `n` inside if given."""
    import torch

    threads = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def torchrun(*args: str, timeout: float, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc-per-node=<nproc> <args>` from the repository root, one intra-op thread per
    process; the test fails with the tail of both streams if it exits non-zero."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-5000:]}"
        pytest.fail(f"torchrun exited {proc.returncode}\n{tail}")
    return proc


# ------------------------------------------------------------------------------------------- checkpoints


def load_dcp(path: Path) -> dict[str, Any]:
    """A DCP checkpoint directory as one plain state dict (offline, one process, like `dcp_to_torch`)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, target)
    try:
        return torch.load(target, weights_only=False)
    finally:
        target.unlink()


def flat_tensors(d: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict, keyed by their dotted path."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "") -> float:
    """Largest absolute difference over the keys starting with `prefix`; both must hold the same such keys."""
    keys = [k for k in a if k.startswith(prefix)]
    assert keys and set(keys) == {k for k in b if k.startswith(prefix)}
    return max((a[k].float() - b[k].float()).abs().max().item() for k in keys)


# ------------------------------------------------------------------------------------------ records, MLflow


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (a manifest, a selection record), or {} where there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else {}


def sqlite_uri(directory: Path) -> str:
    """An MLflow tracking URI: a SQLite database `mlflow.db` in `directory`."""
    return f"sqlite:///{directory / 'mlflow.db'}"


def export_registered(weights: Path, name: str, tracking_uri: str, size: int = 32) -> tuple[Path, str]:
    """`weights` exported to `model.onnx` beside them by the real export stage (parity checked at `size` px, batch 2)
    and registered as a new version of `name`, as the pipeline's export stage does: the ONNX file and the version."""
    from dinov3_core.config import load_config
    from dinov3_core.export.config import ExportConfig
    from dinov3_core.runner import run_stage

    onnx = weights.parent / "model.onnx"
    values = {"weights": str(weights), "output": str(onnx), "register_name": name, "tracking.uri": tracking_uri}
    outcome = run_stage(
        "export", load_config(ExportConfig, None, {**values, "parity_sizes": [size], "parity_batches": [2]})
    )
    version = outcome.manifest.summary["model_version"]
    assert version, outcome.manifest.summary
    return onnx, str(version)


def eval_backbone(root: Path, arch: str, *, colour_blind: bool = False) -> Path:
    """A seeded `arch` backbone at inference settings saved as `root/backbone.pth` with its `config.yaml` (what
    convert writes); `colour_blind`: the patch embedding made blind to mean colour (a worse model on stains)."""
    import torch
    import yaml

    from dinov3_core.inference.backbone import INFERENCE_OVERRIDES
    from dinov3_core.models import backbone_kwargs, build_backbone, save_backbone

    torch.manual_seed(0)
    model = build_backbone(arch, **INFERENCE_OVERRIDES).eval()
    if colour_blind:
        with torch.no_grad():
            w = model.patch_embed.proj.weight
            w -= w.mean(dim=(2, 3), keepdim=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(
        yaml.safe_dump({"arch": arch, "backbone_kwargs": backbone_kwargs(arch, **INFERENCE_OVERRIDES)})
    )
    return save_backbone(model, root / "backbone.pth")
