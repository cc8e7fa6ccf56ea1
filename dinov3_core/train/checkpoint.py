"""Resumable DCP checkpoints (`ckpt/<iteration>/`) and teacher-only eval checkpoints (`eval/training_<it>/`).

Training checkpoint layout (DCP, facts §13): `.metadata` + `__<rank>_0.distcp` with keys
`model.student.*`, `model.teacher.*`, `optimizer.state.student.<fqn>.*`, `optimizer.param_groups.*` and
`train_state.{iteration, sampler.*, rng.*}`; plus `meta.json` for people and tools. Every rank writes its shards
into `ckpt/.tmp-<it>/`; after a barrier rank 0 renames it to `ckpt/<it>/`, so an integer-named directory is
always complete (a crash leaves only a `.tmp-*` directory, removed at the next start). DCP reshards on load,
so a run resumes on another number of ranks.

Randomness needs no generator state: every draw is seeded from (seed, iteration / stream position, rank),
see `pipeline`. `train_state.rng` records that seed; the sampler state records the stream position.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from dinov3_core.errors import WsidinoError
from dinov3_core.train.distributed import DistEnv, barrier

logger = logging.getLogger(__name__)

CKPT_DIR = "ckpt"
EVAL_DIR = "eval"
TMP_PREFIX = ".tmp-"
META_FILE = "meta.json"
EVAL_FILE = "teacher_checkpoint.pth"


class CheckpointError(WsidinoError):
    """A checkpoint that cannot be resumed into this run (other architecture, unreadable)."""


# ------------------------------------------------------------------------------------------------ listing


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `root` (integer-named directories with DCP metadata), oldest first.
    `<it>_keep` copies are not listed: they are archives, never resumed from or deleted."""
    if not root.is_dir():
        return []
    found = [(int(p.name), p) for p in root.iterdir() if p.name.isdigit() and (p / ".metadata").is_file()]
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def remove_partial(root: Path) -> None:
    """Delete `.tmp-*` directories: checkpoints a crash interrupted (rank 0, before training starts)."""
    if root.is_dir():
        for path in root.glob(f"{TMP_PREFIX}*"):
            logger.info("removing incomplete checkpoint %s", path)
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------ compatibility


def check_compatible(path: Path, model: nn.Module) -> None:
    """Raise CheckpointError unless `path` holds exactly this model's keys with these shapes.

    Reads only `.metadata`, before anything is loaded or written, so a checkpoint of another architecture in
    output_dir stops the run with nothing overwritten.
    """
    try:
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:  # unpickling / IO errors come in many types
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(err).__name__}: {err}); delete it") from None
    expected = {f"model.{k}": tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    saved_model = {
        k: tuple(m.size) for k, m in saved.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    missing = sorted(set(expected) - set(saved_model))
    unexpected = sorted(set(saved_model) - set(expected))
    misshaped = [
        f"{k}: checkpoint {list(saved_model[k])} vs model {list(shape)}"
        for k, shape in expected.items()
        if k in saved_model and saved_model[k] != shape
    ]
    if missing or unexpected or misshaped:
        details = "; ".join(
            f"{title} ({len(items)}): {', '.join(items[:5])}{' …' if len(items) > 5 else ''}"
            for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
            if items
        )
        raise CheckpointError(
            f"checkpoint {path} was written by a different architecture than this config builds ({details}). "
            "Nothing was changed. Use a new output_dir for this config, or the config the checkpoint was "
            "trained with (see its meta.json and config.yaml)"
        )


# ----------------------------------------------------------------------------------------- save and load


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "train_state": train_state}


def save_checkpoint(
    root: Path,
    iteration: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    meta: dict[str, Any],
    env: DistEnv,
    *,
    max_to_keep: int,
    keep_every: int | None,
) -> Path:
    """Write `root/<iteration>/` atomically on all ranks, then apply retention. Collective."""
    final = root / str(iteration)
    tmp = root / f"{TMP_PREFIX}{iteration}"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    start = time.perf_counter()
    with _single_process_quiet(env):
        dcp.save(_full_state(model, optimizer, train_state), checkpoint_id=str(tmp))
    if env.is_main:
        meta = {**meta, "iteration": iteration, "world_size": env.world_size, "torch": torch.__version__}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    barrier(env)  # every rank's shards are on disk
    if env.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep_every and (iteration + 1) % keep_every == 0:
            keep = root / f"{iteration}_keep"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(final, keep, copy_function=os.link)  # hard links: no extra space
        for _, old in complete_checkpoints(root)[:-max_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint %s written in %.2f s", final, time.perf_counter() - start)
    barrier(env)
    return final


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state_template: dict[str, Any],
    env: DistEnv,
) -> dict[str, Any]:
    """Load model, optimizer and train state in place (resharded to this run's ranks). Collective.

    Returns the loaded train state (same structure as the template, values from the checkpoint).
    """
    state = _full_state(model, optimizer, train_state_template)  # also creates the optimizer state to load into
    with _single_process_quiet(env):
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["train_state"]


@contextlib.contextmanager
def _single_process_quiet(env: DistEnv) -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group: that is the intent here."""
    with warnings.catch_warnings():
        if not env.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------- eval teacher


def eval_checkpoint_path(output_dir: Path, iteration: int) -> Path:
    return output_dir / EVAL_DIR / f"training_{iteration}" / EVAL_FILE


def teacher_full_state_dict(teacher: nn.Module, env: DistEnv) -> dict[str, Tensor]:
    """Unsharded CPU state dict of the teacher (`backbone.*`, `dino_head.*`, `ibot_head.*`); complete on rank 0
    (all ranks must call it under FSDP: it all-gathers)."""
    if env.distributed:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(teacher, options=options)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in teacher.state_dict().items()}


def save_eval_teacher(output_dir: Path, iteration: int, teacher: nn.Module, env: DistEnv) -> Path:
    """`eval/training_<it>/teacher_checkpoint.pth` = {"teacher": full CPU state dict}; rank 0 writes, atomically."""
    state = teacher_full_state_dict(teacher, env)
    path = eval_checkpoint_path(output_dir, iteration)
    if env.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save({"teacher": state}, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    barrier(env)
    return path
