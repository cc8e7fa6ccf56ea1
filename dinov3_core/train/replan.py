"""What the trainer does about sustained memory pressure (`dinov3_core.train.memory_watch`): re-plan in place at an
optimizer-step boundary, the same on every rank, one rung at a time:

1. fewer loader workers and prefetch 1 (host pressure only: workers live in host RAM);
2. a smaller micro-batch with more accumulation steps — the per-rank step batch, hence the global batch, the
   teacher's Sinkhorn targets (computed over the whole step) and the objective stay exactly the same;
3. activation checkpointing;
4. nothing left: the trainer checkpoints and raises `out_of_memory` (a `RunStopped`: output kept, exit code 1).

`RunPlan` is what a re-plan may change; checkpoints record it (meta.json `run_plan`), so a resumed run starts with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dinov3_core.errors import RunStopped
from dinov3_core.train import config as C
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.memory_watch import MemoryWatch, Pressure, pressure_limits


class MemoryPressureError(RunStopped):
    """Sustained memory pressure with nothing left to re-plan (the state is checkpointed first)."""


@dataclass(frozen=True)
class RunPlan:
    """The settings a re-plan may change. `micro_batch × accumulation_steps` is fixed: the per-rank step batch."""

    micro_batch: int
    accumulation_steps: int
    num_workers: int
    prefetch_factor: int
    activation_checkpointing: bool

    @property
    def step_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps

    def to_dict(self) -> dict[str, int | bool]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"micro-batch {self.micro_batch} × {self.accumulation_steps} accumulation step(s), "
            f"{self.num_workers} loader worker(s) × prefetch {self.prefetch_factor}, "
            f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}"
        )


@dataclass(frozen=True)
class Replan:
    what: str  # "loader", "micro_batch", "activation_checkpointing"
    before: RunPlan
    after: RunPlan

    def event(self, iteration: int, why: str) -> dict[str, Any]:
        """The `training_metrics.json` line (and MLflow tag) of this re-plan."""
        return {
            "iteration": iteration,
            "event": "memory_replan",
            "what": self.what,
            "why": why,
            "before": self.before.to_dict(),
            "after": self.after.to_dict(),
        }


def next_plan(plan: RunPlan, pressure: Pressure, micro_ok: Callable[[int], bool] = lambda _: True) -> Replan | None:
    """The next rung of the ladder for this kind of pressure, or None when nothing is left to give. `micro_ok`: which
    micro-batches the run can take (pipeline parallelism: those that keep its micro-batch contract)."""
    if pressure == "host" and plan.num_workers > 0:
        return Replan("loader", plan, replace(plan, num_workers=plan.num_workers // 2, prefetch_factor=1))
    smaller = [d for d in range(1, plan.micro_batch // 2 + 1) if plan.step_batch % d == 0 and micro_ok(d)]
    if smaller:
        micro = smaller[-1]  # at least halves the micro-batch's activations
        after = replace(plan, micro_batch=micro, accumulation_steps=plan.step_batch // micro)
        return Replan("micro_batch", plan, after)
    if not plan.activation_checkpointing:
        return Replan("activation_checkpointing", plan, replace(plan, activation_checkpointing=True))
    return None


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
