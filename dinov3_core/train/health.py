"""Is the run learning? Signals at every log line, and an alarm that says so in plain words.

A run can complete without learning: with Sinkhorn-Knopp targets, a student that predicts nothing image-specific
sits at the DINO loss ln K (K prototypes). The signals, per training step, written with every metrics line:

* ``dino_gap`` = ln K − DINO global-crop loss, in nats: how far the loss has left its no-information level (0:
  nothing learnt; healthy runs reach tenths of a nat). The iBOT loss has no such fixed level (it averages over all
  global crops but only the masked ones contribute, so its level moves with the share of masked crops per step);
* ``teacher_entropy``: the mean entropy of the teacher's targets as a fraction of ln K (1: uniform targets that
  teach nothing; this rank's share of the step).

The alarm: once every warm-up is over (learning rate, teacher temperature, last-layer freeze), the DINO gap averaged
over `health.patience` iterations must reach `health.min_gap`. If it does not, the run logs why and what to change;
`health.policy=stop` ends it there (every rank at the same iteration: the gaps are of all-reduced losses).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from dinov3_core.errors import WsidinoError
from dinov3_core.train import config as C

HEALTH_FILE = "health.json"  # the verdict, in the run directory
ADVICE = (
    "likely causes: a teacher temperature still warming up or too high (teacher.teacher_temp, "
    "teacher.warmup_teacher_temp_epochs), a teacher momentum that reaches 1.0 too early (teacher.momentum_teacher, "
    "teacher.final_momentum_teacher), a learning rate too low or warming up too long (optim.lr, optim.warmup_epochs) "
    "or a run too short for its schedules (optim.epochs, train.epoch_length)"
)


class TrainingInertError(WsidinoError):
    """`health.policy=stop` and the losses stayed at their no-information level after the warm-ups."""


def no_information_gaps(values: dict[str, float], cfg: C.PretrainConfig) -> dict[str, float]:
    """ln K minus the DINO loss on global crops of one step."""
    return {"dino_gap": math.log(cfg.heads.dino.n_prototypes) - values["dino_global_loss"]}


def warmups_end(cfg: C.PretrainConfig) -> int:
    """The first iteration after every warm-up: before it, a loss at ln K says nothing."""
    epochs = (cfg.optim.warmup_epochs, cfg.teacher.warmup_teacher_temp_epochs, cfg.optim.freeze_last_layer_epochs)
    return max(C.epochs_to_iterations(cfg, e) for e in epochs)


def schedule_warnings(cfg: C.PretrainConfig, stop_iteration: int) -> list[str]:
    """Schedules that work against a run of this length (logged at start; the impossible ones are refused by
    `config.validate`), each naming the keys to change."""
    total = C.total_iterations(cfg)
    out = []
    temp = C.epochs_to_iterations(cfg, cfg.teacher.warmup_teacher_temp_epochs)
    if temp > total / 2:
        out.append(
            f"the teacher temperature warms up over {temp} of {total} iterations (teacher.warmup_teacher_temp_epochs): "
            "most of the run learns from soft targets; shorten it or lengthen the run"
        )
    start = warmups_end(cfg)
    if cfg.health.policy != "off" and stop_iteration < start + cfg.health.patience:
        out.append(
            f"no health verdict in this run: it stops at iteration {stop_iteration}, before the warm-ups end "
            f"({start}) plus health.patience ({cfg.health.patience})"
        )
    return out


class HealthWatch:
    """Judges the DINO gap once, `patience` iterations after the warm-ups; remembers the verdict."""

    def __init__(self, cfg: C.PretrainConfig) -> None:
        self.cfg = cfg.health
        self.start = warmups_end(cfg)
        self.gaps: deque[float] = deque(maxlen=self.cfg.patience)
        self.message: str | None = None
        self.judged = False

    def observe(self, iteration: int, values: dict[str, Any]) -> str | None:
        """Feed one step; returns the alarm message the first time the run is judged not to learn."""
        if self.cfg.policy == "off" or self.judged or iteration < self.start:
            return None
        gap = values.get("dino_gap")
        if gap is None or not math.isfinite(gap):
            return None
        self.gaps.append(gap)
        if len(self.gaps) < self.gaps.maxlen:  # type: ignore[operator]
            return None
        self.judged = True
        mean = sum(self.gaps) / len(self.gaps)
        if mean >= self.cfg.min_gap:
            return None
        self.message = (
            f"not learning: over iterations {iteration - len(self.gaps) + 1}…{iteration}, after every warm-up, the "
            f"DINO loss was on average {mean:.3f} nats below its no-information level ln K (negative: above it; "
            f"health.min_gap asks for {self.cfg.min_gap}); {ADVICE}"
        )
        if self.cfg.policy == "stop":
            raise TrainingInertError(self.message + " (health.policy=stop; health.policy=warn lets it run on)")
        return self.message

    def verdict(self) -> str:
        """For the run's summary and its MLflow tag `wsidino.health`."""
        if self.message is not None:
            return self.message
        if self.judged:
            return "learning: the DINO loss left its no-information level after the warm-ups"
        if self.cfg.policy == "off":
            return "not judged: health.policy=off"
        return (f"not judged yet: the verdict comes {self.cfg.patience} iterations (health.patience) after the "
                f"warm-ups end at iteration {self.start}")  # fmt: skip


__all__ = [
    "ADVICE",
    "HEALTH_FILE",
    "HealthWatch",
    "TrainingInertError",
    "no_information_gaps",
    "schedule_warnings",
    "warmups_end",
]
