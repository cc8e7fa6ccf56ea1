"""Resumable DCP checkpoints (`ckpt/<iteration>/`) and teacher-only eval checkpoints (`eval/training_<it>/`).

Training checkpoint layout (DCP, docs/reference/dinov3.md#checkpoints): `.metadata` + `__<rank>_0.distcp` with keys
`model.student.*`, `model.teacher.*`, `optimizer.state.student.<fqn>.*`, `optimizer.param_groups.*` and
`train_state.{iteration, sampler.*, rng.*}`; plus `meta.json` for people and tools. Every rank writes its shards
into `ckpt/.tmp-<it>/`; after a barrier rank 0 renames it to `ckpt/<it>/`, so an integer-named directory is
always complete (a crash leaves only a `.tmp-*` directory, removed at the next start). DCP reshards on load,
so a run resumes on another number of ranks. Rank 0 also writes `checksums.json` (CRC-32C of every file,
`dinov3_core.checksums`) before the rename: a resume checks the checkpoint in full (and its checksums file against
the stage manifest's record of it) and falls back to the newest intact one, naming the damaged or unverifiable one
(`latest_intact_checkpoint`), so flipped bytes are never trained on.

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
from dataclasses import dataclass
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

from dinov3_core import checksums, manifest
from dinov3_core.errors import WsidinoError
from dinov3_core.models.adaptation import has_lora, lora_scalings, merge_lora_state_dict
from dinov3_core.train.distributed import DistEnv, barrier, gather_pp_state
from dinov3_core.train.param_groups import clean_param_name

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


def verify_checkpoint(path: Path) -> tuple[str, list[str]]:
    """("", []) when `path` is intact; else ("is damaged" or "cannot be verified", what is wrong). Its files are read
    in full against its `checksums.json`, and that file against the record the run's stage manifest keeps of it
    (when it has one): a checksums file rewritten to match a tampered shard is caught there. A checkpoint without a
    readable checksums file cannot be verified, and is never taken for intact."""
    missing = checksums.unverifiable(path)
    if missing:
        return "cannot be verified", [missing]
    record = manifest.checkpoint_records(path.parent.parent / manifest.MANIFEST_NAME).get(str(path.resolve()))
    said = checksums.check_file(record, full=True) if record is not None else None
    if said:
        return "is damaged", [f"{said} (the stage manifest's record of it)"]
    damaged = checksums.check_directory(path, full=True)
    return ("is damaged", damaged) if damaged else ("", [])


def latest_intact_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint that `verify_checkpoint` finds intact; a damaged or unverifiable one is
    skipped with a warning naming it and what is wrong. None: no intact checkpoint."""
    for _, path in reversed(complete_checkpoints(root)):
        verdict, problems = verify_checkpoint(path)
        if not verdict:
            return path
        logger.warning("checkpoint %s %s (%s); falling back to an older one", path, verdict, "; ".join(problems))
    return None


def remove_partial(root: Path) -> None:
    """Delete `.tmp-*` directories: checkpoints a crash interrupted (rank 0, before training starts)."""
    if root.is_dir():
        for path in root.glob(f"{TMP_PREFIX}*"):
            logger.info("removing incomplete checkpoint %s", path)
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------ compatibility


@dataclass(frozen=True)
class ModelLayout:
    """Keys and shapes of the whole (unsplit) model, and the parameters it trains: what a checkpoint must match.
    Taken before pipeline parallelism cuts the student into stages (each process then holds only some keys)."""

    shapes: dict[str, tuple[int, ...]]  # `model.<fqn>` → full shape
    trainable: frozenset[str]  # clean parameter names with requires_grad

    @classmethod
    def of(cls, model: nn.Module) -> ModelLayout:
        shapes = {f"model.{k}": tuple(v.shape) for k, v in get_model_state_dict(model).items()}
        trainable = frozenset(clean_param_name(n) for n, p in model.named_parameters() if p.requires_grad)
        return cls(shapes, trainable)


def check_compatible(path: Path, model: nn.Module | ModelLayout) -> None:
    """Raise CheckpointError unless `path` holds exactly this model's keys with these shapes.

    Reads only `.metadata`, before anything is loaded or written, so a checkpoint of another architecture in
    output_dir stops the run with nothing overwritten. Under pipeline parallelism pass the `ModelLayout` taken
    before the split: a checkpoint holds every stage's keys.
    """
    layout = model if isinstance(model, ModelLayout) else ModelLayout.of(model)
    try:
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:  # unpickling / IO errors come in many types
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(err).__name__}: {err}); delete it") from None
    expected = layout.shapes
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
    _check_lora(path, saved, expected)
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
    _check_trainable(path, saved, layout.trainable)


def _lora_rank(shapes: dict[str, tuple[int, ...]]) -> int:
    """LoRA rank of a model's keys: rows of any `lora_A` weight ([r, in]), 0 without LoRA."""
    return next((shape[0] for key, shape in shapes.items() if ".lora_A." in key), 0)


def _check_lora(path: Path, saved: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    """LoRA on one side only, another rank, or adapters on other layers: say which setting to change, before the
    generic key listing (whose `base_layer` / `lora_A` names would leave the person guessing)."""
    saved_shapes = {k: tuple(m.size) for k, m in saved.items() if k.startswith("model.") and hasattr(m, "size")}
    ours, theirs = _lora_rank(expected), _lora_rank(saved_shapes)
    lora_keys = {k for k in (*saved_shapes, *expected) if ".lora_" in k}
    meta = read_meta(path).get("adaptation", {})
    if ours != theirs:
        raise CheckpointError(
            f"checkpoint {path} was trained with student.lora.rank={theirs} (meta.json adaptation: "
            f"{meta or 'not recorded'}) but this config has student.lora.rank={ours}. Nothing was changed. Set "
            f"student.lora.rank={theirs} (and the checkpoint's other student.lora / student.freeze_blocks settings) "
            "to resume it, or use a new output_dir for this config"
        )
    if any((k in saved_shapes) != (k in expected) for k in lora_keys):
        raise CheckpointError(
            f"checkpoint {path} has LoRA adapters on other layers than this config (student.lora.targets / "
            f"student.freeze_blocks; checkpoint meta.json adaptation: {meta or 'not recorded'}). Nothing was "
            "changed. Use the checkpoint's settings to resume it, or a new output_dir for this config"
        )


def _check_trainable(path: Path, saved: dict[str, Any], ours: frozenset[str]) -> None:
    """The parameters with AdamW state in the checkpoint must be the ones this config trains (frozen ones have
    none): another `student.freeze_blocks` would otherwise fail inside the load, after config.yaml is written."""
    prefix, suffix = "optimizer.state.", ".exp_avg"
    theirs = {k[len(prefix) : -len(suffix)] for k in saved if k.startswith(prefix) and k.endswith(suffix)}
    if theirs and theirs != ours:
        frozen_here, trained_here = sorted(theirs - ours), sorted(ours - theirs)
        raise CheckpointError(
            f"checkpoint {path} trained other parameters than this config (checkpoint meta.json adaptation: "
            f"{read_meta(path).get('adaptation') or 'not recorded'}; trained there, frozen here: "
            f"{len(frozen_here)} {frozen_here[:3]}; trained here only: {len(trained_here)} {trained_here[:3]}). "
            "Nothing was changed. Set student.freeze_blocks / student.freeze_patch_embed as the checkpoint was "
            "trained to resume it, or use a new output_dir for this config"
        )


# ----------------------------------------------------------------------------------------- save and load


def _full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any], *, flat: bool = True
) -> dict[str, Any]:
    """The DCP state. The optimizer's param groups are written per parameter (`optimizer.param_groups.<fqn>.lr`):
    each pipeline stage has its own groups, so a list of groups would differ between processes (and could not be
    resumed on another pipeline layout). Checkpoints written before (`flat=False`) keep loading their way."""
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optimizer": optim_sd, "train_state": train_state}


def _has_flat_optimizer(path: Path) -> bool:
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "optimizer.param_groups."
    return not any(k.startswith(prefix) and k[len(prefix) :].split(".", 1)[0].isdigit() for k in keys)


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
        checksums.write_checksums(tmp)  # before the rename: a complete checkpoint always has its checksums
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
    flat = _has_flat_optimizer(path)
    state = _full_state(model, optimizer, train_state_template, flat=flat)  # also creates the optimizer state
    with _single_process_quiet(env):
        dcp.load(state, checkpoint_id=str(path))
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
    )
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
    if env.pp_size > 1:  # each process holds one stage of it
        return gather_pp_state(teacher, env, everywhere=False)
    if env.distributed:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(teacher, options=options)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in teacher.state_dict().items()}


def save_eval_teacher(output_dir: Path, iteration: int, teacher: nn.Module, env: DistEnv) -> Path:
    """`eval/training_<it>/teacher_checkpoint.pth` = {"teacher": full CPU state dict}; rank 0 writes, atomically.

    LoRA adapters are merged into the base weights (on the CPU copy; the teacher is untouched), so the file has
    the released key layout every consumer (gram teacher, evaluate, convert best_knn, warm start) loads strictly."""
    state = teacher_full_state_dict(teacher, env)
    if has_lora(teacher) and env.is_main:
        state = merge_lora_state_dict(state, lora_scalings(teacher))
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
