"""Whether a checkpoint may be resumed into this run, besides fitting the model (`checkpoint.check_compatible`):
it was trained under this config's schedule and batch, and it lies within this run's `train.stop_at`.

Each checkpoint's meta.json records the values of `SCHEDULE_KEYS` and the global batch it was trained with
(`schedule_record`); a checkpoint written before that record existed is compared with its run's config.yaml, read
before this run rewrites it. A resume that would continue the learning-rate, weight-decay, momentum or temperature
curves of another length or batch, or train on crops of another shape, is refused naming each key, old → new.
`train.stop_at` moved within the checkpoint's reach and memory re-plans of micro-batch × accumulation (which keep
the global batch) stay legitimate resumes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dinov3_core.train import checkpoint as ckpt
from dinov3_core.train import config as C

__all__ = ["GLOBAL_BATCH", "SCHEDULE_KEYS", "check_schedule", "recorded_schedule", "schedule_record"]

# Keys whose change alters the schedules (their length, shape or values per iteration) or what one step trains on.
SCHEDULE_KEYS = (
    "optim.epochs",
    "train.epoch_length",
    "optim.lr",
    "optim.min_lr",
    "optim.warmup_epochs",
    "optim.scaling_rule",
    "optim.weight_decay",
    "optim.weight_decay_end",
    "optim.freeze_last_layer_epochs",
    "teacher.momentum_teacher",
    "teacher.final_momentum_teacher",
    "teacher.teacher_temp",
    "teacher.warmup_teacher_temp",
    "teacher.warmup_teacher_temp_epochs",
    "crops.n_global_crops",
    "crops.n_local_crops",
    "crops.global_size",
    "crops.local_size",
    "crops.global_scale",
    "crops.local_scale",
)
# The resolved images per optimizer step (train.global_batch_size, else batch_size_per_gpu × accumulation_steps ×
# processes): the lr scaling rule and the sampler's stream depend on it, not on how a rank splits it.
GLOBAL_BATCH = "global batch"
SCHEDULE_META = "schedule"  # meta.json key


def _plain(value: Any) -> Any:
    """JSON's view of a value (tuples become lists), so a recorded value and a config value compare equal."""
    return json.loads(json.dumps(value, default=str))


def _dig(doc: Any, key: str) -> tuple[bool, Any]:
    for part in key.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return False, None
        doc = doc[part]
    return True, doc


def schedule_record(cfg: C.PretrainConfig, global_batch: int) -> dict[str, Any]:
    """What a checkpoint's meta.json keeps of the schedule it was trained under."""
    values = {key: _plain(_dig_attr(cfg, key)) for key in SCHEDULE_KEYS}
    return {**values, GLOBAL_BATCH: global_batch}


def _dig_attr(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def recorded_schedule(path: Path) -> dict[str, Any]:
    """The schedule `path` was trained under: its meta.json record, else (older checkpoints) its run's config.yaml
    and the meta.json global batch; keys recorded nowhere are left out (they cannot be compared)."""
    meta = ckpt.read_meta(path)
    if isinstance(meta.get(SCHEDULE_META), dict):
        return dict(meta[SCHEDULE_META])
    run_config = path.parent.parent / "config.yaml"
    doc = yaml.safe_load(run_config.read_text()) if run_config.is_file() else {}
    found = {key: _dig(doc, key) for key in SCHEDULE_KEYS}
    recorded = {key: _plain(value) for key, (present, value) in found.items() if present}
    if meta.get("global_batch") is not None:
        recorded[GLOBAL_BATCH] = meta["global_batch"]
    return recorded


def _same(old: Any, new: Any) -> bool:
    if isinstance(old, int | float) and isinstance(new, int | float) and not isinstance(old, bool):
        return float(old) == float(new)
    return old == new


def check_schedule(path: Path, cfg: C.PretrainConfig, global_batch: int, stop_iteration: int) -> None:
    """Raise `CheckpointError` naming every schedule or batch key that differs between `path` and this run (old →
    new), or when `path` lies past where this run stops. Reads meta.json and config.yaml only: nothing is written."""
    ours = schedule_record(cfg, global_batch)
    theirs = recorded_schedule(path)
    changed = [
        f"{key} {theirs[key]} → {ours[key]}" for key in ours if key in theirs and not _same(theirs[key], ours[key])
    ]
    if changed:
        raise ckpt.CheckpointError(
            f"checkpoint {path} was trained under another schedule or batch than this config: {', '.join(changed)}. "
            "Nothing was changed. Resume it with the checkpoint's values (its meta.json), use a new output_dir for "
            f"this config, or move {path.parent} away to start over"
        )
    iteration = int(ckpt.read_meta(path).get("iteration", path.name))
    if iteration >= stop_iteration:
        where = (
            f"train.stop_at={cfg.train.stop_at}"
            if cfg.train.stop_at is not None and cfg.train.stop_at < C.total_iterations(cfg)
            else f"the schedule's end ({C.total_iterations(cfg)} iterations)"
        )
        raise ckpt.CheckpointError(
            f"checkpoint {path} is at iteration {iteration}, past {where}: this run would export a model trained "
            f"longer than its config says. Nothing was changed. Set train.stop_at above {iteration}, or use a new "
            "output_dir to train to this stop"
        )
