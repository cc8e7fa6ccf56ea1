"""When the trainer writes what (a component of `loop.Trainer.train`): the teacher-only eval checkpoint on the
evaluation schedule (`evaluation.eval_period_iterations`, and the last iteration), the full DCP checkpoint every
`checkpointing.period` iterations and at the end, then the `train.checkpoint` event on every rank. How a checkpoint
is written and read is `checkpoint`'s."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from dinov3_core import events
from dinov3_core.train import checkpoint as ckpt
from dinov3_core.train import config as C
from dinov3_core.train.distributed import DistEnv


@dataclass(frozen=True)
class CheckpointSchedule:
    cfg: C.PretrainConfig
    env: DistEnv
    output_dir: Path
    stage: str  # for the event
    stop_iteration: int

    def is_last(self, iteration: int) -> bool:
        return iteration == self.stop_iteration - 1

    def eval_due(self, iteration: int) -> bool:
        """The health probe and the eval checkpoint run after this iteration."""
        period = self.cfg.evaluation.eval_period_iterations
        return bool(period and (iteration + 1) % period == 0) or self.is_last(iteration)

    def after_step(self, iteration: int, teacher: nn.Module, save: Callable[[int], Path], result: Any) -> None:
        """Write what is due after `iteration` into `result` (`eval_checkpoints`, `last_checkpoint`); `save` writes
        the full training state (the trainer's: its train state and meta). Collective: every rank calls it."""
        if self.eval_due(iteration):
            result.eval_checkpoints.append(ckpt.save_eval_teacher(self.output_dir, iteration, teacher, self.env))
        if (iteration + 1) % self.cfg.checkpointing.period == 0 or self.is_last(iteration):
            result.last_checkpoint = save(iteration)
            events.emit(
                "train.checkpoint",
                stage=self.stage,
                output_dir=str(self.output_dir),
                iteration=iteration,
                rank=self.env.rank,
            )
