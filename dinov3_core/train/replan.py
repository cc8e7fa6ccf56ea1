"""The memory watch's side of the trainer (`dinov3_core.train.memory_watch`): `start_watch` starts it with limits
from the batch planner's budget; sustained pressure re-plans in place at an optimizer-step boundary, the same on
every rank, one rung of `batch_plan.next_plan` at a time; with no rung left the trainer checkpoints and raises
`out_of_memory` (a `RunStopped`: output kept, exit code 1).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

from dinov3_core.errors import RunStopped
from dinov3_core.train import checkpoint as ckpt
from dinov3_core.train import config as C
from dinov3_core.train.batch_plan import RunPlan, micro_batch_ok, next_plan
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.memory_watch import (
    MemoryWatch,
    Pressure,
    device_peak_bytes,
    pressure_limits,
    release_freed_memory,
)
from dinov3_core.train.metrics import MetricsWriter
from dinov3_core.train.metrics_window import MetricsWindow
from dinov3_core.train.nonfinite import NonFiniteGuard
from dinov3_core.train.step_batches import StepBatch

logger = logging.getLogger(__name__)


class Replannable(Protocol):
    """What re-planning needs of the trainer (`loop.Trainer`, `gram.anchoring.GramTrainer`): its plan and the
    means to step, checkpoint and report."""

    cfg: C.PretrainConfig
    env: DistEnv
    optimizer: torch.optim.Optimizer
    run_plan: RunPlan
    nonfinite: NonFiniteGuard
    ckpt_root: Path
    memory_replans: int
    metrics: MetricsWriter
    window: MetricsWindow | None
    stage: str

    def train_step(self, iteration: int, batch: StepBatch) -> dict[str, float]: ...
    def set_run_plan(self, plan: RunPlan) -> None: ...
    def batch_fields(self) -> dict[str, int]: ...
    def save(self, iteration: int) -> Path: ...


class MemoryPressureError(RunStopped):
    """Sustained memory pressure with nothing left to re-plan (the state is checkpointed first)."""


def start_watch(cfg: C.PretrainConfig, env: DistEnv, budget_bytes: int) -> MemoryWatch:
    """The running memory watch, its limits from the batch planner's budget. It always samples (the metrics lines
    carry its windows); only with `train.memory_watch` does it judge them."""
    train = cfg.train
    limits = pressure_limits(
        budget_bytes=budget_bytes,
        explicit_budget=train.memory_budget_gb is not None,
        device=env.device,
        local_world_size=env.local_world_size,
        threshold=train.memory_watch_threshold,
    )
    watch = MemoryWatch(limits, train.memory_watch_patience, env.device, env.distributed, judging=train.memory_watch)
    return watch.start()


def out_of_memory(cfg: C.PretrainConfig, plan: RunPlan, why: str, saved: Path | None) -> MemoryPressureError:
    """The error of a run with no rung left: the limit, the plan it reached, where its state is, what to change."""
    budget = cfg.train.memory_budget_gb
    return MemoryPressureError(
        f"training does not fit its memory: {why}, already at {plan.describe()}. Limit: train.memory_budget_gb="
        f"{budget if budget is not None else 'null (the machine)'} × train.memory_watch_threshold="
        f"{cfg.train.memory_watch_threshold}. "
        f"{f'State saved in {saved}; to resume' if saved is not None else 'No checkpoint yet; to start'}, "
        "free memory (other programs), raise "
        "train.memory_budget_gb, train fewer weights (student.lora.rank, student.freeze_blocks), use smaller crops "
        "(crops.global_size, crops.local_size, crops.n_local_crops) or heads (heads.*.n_prototypes), or more "
        "processes; then rerun"
    )


def step_within_memory(trainer: Replannable, iteration: int, batch: StepBatch) -> dict[str, float]:
    """`trainer.train_step`; when the device runs out of memory in a one-process run, the next rung of the re-plan
    ladder (smaller micro-batch, then activation checkpointing) and the same step again. The batch planner's
    estimate is a model: this is what keeps `batch_size_per_gpu=auto` from ending a run on its first step.
    The retried step is the same step (same samples, same augmentation and RNG draws); only its micro-batch
    split differs. With several processes an out-of-memory error stops the run as before: the others are
    inside a collective and cannot take the same decision."""
    while True:
        try:
            return trainer.train_step(iteration, batch)
        except torch.OutOfMemoryError as err:
            if trainer.env.distributed:
                raise
            trainer.optimizer.zero_grad(set_to_none=True)
            first_line = (str(err).strip().splitlines() or [""])[0][:200]
            why = f"out of device memory in iteration {iteration} ({first_line})"
            del err  # its traceback holds the failed step's tensors
            release_freed_memory()
            replan(trainer, iteration, "device", why, step_done=False)


def replan(trainer: Replannable, iteration: int, pressure: Pressure, why: str, *, step_done: bool = True) -> bool:
    """Take the next rung of the re-plan ladder after step `iteration` (every rank alike); True when the loader
    must be rebuilt. With nothing left: checkpoint (`step_done`: the step completed, else the last checkpoint
    is the state), then stop with what to change."""
    cfg, world_size = trainer.cfg, trainer.env.world_size
    step = next_plan(trainer.run_plan, pressure, micro_ok=lambda micro: micro_batch_ok(cfg, world_size, micro))
    if step is None:
        done = step_done and not trainer.nonfinite.streak
        saved = trainer.save(iteration) if done else ckpt.latest_checkpoint(trainer.ckpt_root)
        raise out_of_memory(cfg, trainer.run_plan, why, saved)
    trainer.memory_replans += 1
    trainer.set_run_plan(step.after)
    release_freed_memory()  # same iteration on every rank, like the scheduled collections
    # A high-water-mark reset keeps what is reserved at that moment: reset now, after the old plan's cache went
    # back, so the next window judges the new plan rather than counting the old one's peak once more.
    device_peak_bytes(trainer.env.device)
    event = step.event(iteration, why) | trainer.batch_fields()
    trainer.metrics.write(event)
    logger.warning(  # every rank: its own log file shows it took the same decision
        "%s: memory pressure after iteration %d (%s): re-planned %s: %s → %s",
        trainer.stage,
        iteration,
        why,
        step.what,
        step.before.describe(),
        step.after.describe(),
    )
    if trainer.window is not None:
        trainer.window.report(event)
    return step.before.num_workers != step.after.num_workers
