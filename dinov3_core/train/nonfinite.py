"""The NaN guard of the training step: a step with a non-finite loss or gradient is skipped (no optimizer step, no
EMA update), and `train.nan_patience` such steps in a row stop the run; the trainer writes no checkpoint while a
streak lasts, so a restart resumes from the last good state."""

from __future__ import annotations

import logging
from pathlib import Path

from dinov3_core.errors import RunStopped

logger = logging.getLogger(__name__)


class TrainingDivergedError(RunStopped):
    """Too many consecutive non-finite losses."""


class NonFiniteGuard:
    def __init__(self, patience: int, ckpt_root: Path) -> None:
        self.patience, self.ckpt_root = patience, ckpt_root
        self.streak = 0  # consecutive skipped steps

    def observe(self, iteration: int, finite: bool, losses: dict[str, float]) -> None:
        """Count step `iteration`: a finite one ends the streak; the `patience`-th skipped one in a row raises."""
        if finite:
            self.streak = 0
            return
        self.streak += 1
        logger.warning("iteration %d: non-finite loss or gradient %s; step skipped", iteration, losses)
        if self.streak >= self.patience:
            raise TrainingDivergedError(
                f"training diverged: {self.streak} consecutive iterations with non-finite loss or "
                f"gradients (last: iteration {iteration}, losses {losses}). Lower optim.lr, raise "
                "optim.warmup_epochs or check the tiles; training resumes from the latest checkpoint in "
                f"{self.ckpt_root}"
            )
