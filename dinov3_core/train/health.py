"""Is the run learning? Signals at every log line, and an alarm that says so in plain words.

A run can complete without learning: with Sinkhorn-Knopp targets, a student that predicts nothing image-specific
sits at the DINO loss ln K (K prototypes). The signals, per training step, written with every metrics line:

* ``dino_gap`` = ln K − DINO global-crop loss, in nats: how far the loss has left its no-information level (0:
  nothing learnt; healthy runs reach tenths of a nat). The iBOT loss has no such fixed level (it averages over all
  global crops but only the masked ones contribute, so its level moves with the share of masked crops per step);
* ``teacher_entropy``: the mean entropy of the teacher's targets as a fraction of ln K (1: uniform targets that
  teach nothing; this rank's share of the step);
* ``agreement``: the share of global-crop images whose student DINO prediction (argmax) on one crop names the
  prototype the teacher's target for the other crop puts first, as the loss pairs them (chance: 1/K). Not a
  verdict: on the cpu recipe it peaks early (0.15 at iteration 200) and falls (0.05 at 1,000) as the targets
  spread over more prototypes while the gap keeps growing; near 1/K throughout, the student follows nothing.

At every eval checkpoint the fixed probe tiles (`health_probe`) give ``effective_rank`` (the teacher's CLS
features; near 0: collapsed) and ``invariance`` (augmentation-invariance retrieval; chance 1/N).

The alarms: after the warm-ups (learning rate, last-layer freeze) the DINO gap averaged over `health.patience`
iterations must reach `health.min_gap` by `health.judge_at` of the run, and the probe's effective rank must stay at
or above `health.min_effective_rank` (an absolute floor, the evaluate gate's: the normalised rank is comparable
across models and needs no baseline, which a warm start or a resume would not have). If not, the run logs why and
what to change; `health.policy=stop` ends it there (every rank at the same iteration: the gaps are of all-reduced
losses, the probe features all-gathered).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from dinov3_core.errors import WsidinoError
from dinov3_core.train import config as C
from dinov3_core.train.optim import teacher_momentum, temperature_schedule
from dinov3_core.train.schedules import momentum_schedule, teacher_settled_from

HEALTH_FILE = "health.json"  # the verdict, in the run directory
ADVICE = (
    "likely causes: too few images per step for the Sinkhorn targets (train.global_batch_size: on the sample tiles "
    "8 stays at ln K where 32 learns), a teacher temperature too high (teacher.teacher_temp, "
    "teacher.warmup_teacher_temp, teacher.warmup_teacher_temp_epochs), a teacher that follows the student too slowly "
    "or freezes early (teacher.momentum_teacher, teacher.final_momentum_teacher: 'auto' fits both to the run), a "
    "learning rate too low or warming up too long (optim.lr, optim.warmup_epochs) or a run too short "
    "(optim.epochs, train.epoch_length)"
)


COLLAPSE_ADVICE = (
    "likely causes: a learning rate too high or warming up too fast (optim.lr, optim.warmup_epochs), the KoLeo "
    "regulariser off or too weak (losses.koleo_weight), a teacher temperature too low (teacher.teacher_temp) or a "
    "teacher that follows the student too closely (teacher.momentum_teacher)"
)


class TrainingInertError(WsidinoError):
    """`health.policy=stop` and the run did not learn after the warm-ups: losses at their no-information level,
    or collapsed teacher features."""


def no_information_gaps(values: dict[str, float], cfg: C.PretrainConfig) -> dict[str, float]:
    """ln K minus the DINO loss on global crops of one step."""
    return {"dino_gap": math.log(cfg.heads.dino.n_prototypes) - values["dino_global_loss"]}


def warmups_end(cfg: C.PretrainConfig) -> int:
    """The first iteration after the learning-rate warm-up and the last-layer freeze: before it, a loss at ln K says
    nothing. The teacher-temperature warm-up does not delay the verdict: a temperature still rising is lower than
    its peak, its targets sharper, so a student that learns leaves ln K during it too."""
    epochs = (cfg.optim.warmup_epochs, cfg.optim.freeze_last_layer_epochs)
    return max(C.epochs_to_iterations(cfg, e) for e in epochs)


# The share of a run after which the EMA teacher has settled (schedules.teacher_settled_from) that is worth a warning:
# upstream's own 125k-iteration schedule settles over its last ~9 %.
SETTLED_TAIL_WARNING = 0.2


def schedule_warnings(cfg: C.PretrainConfig, stop_iteration: int) -> list[str]:
    """Schedules that work against a run of this length (logged at start; the impossible ones are refused by
    `config.validate`), each naming the keys to change."""
    total = C.total_iterations(cfg)
    out = []
    t = cfg.teacher
    if not isinstance(t.warmup_teacher_temp_epochs, str):
        temp = C.epochs_to_iterations(cfg, t.warmup_teacher_temp_epochs)
        if temp > total / 2 and t.teacher_temp > t.warmup_teacher_temp:
            out.append(
                f"the teacher temperature warms up over {temp} of {total} iterations "
                "(teacher.warmup_teacher_temp_epochs): most of the run learns from ever softer targets; "
                "teacher.warmup_teacher_temp_epochs=auto keeps upstream's pace"
            )
    base, final = teacher_momentum(cfg)
    settled = teacher_settled_from(momentum_schedule(total, base=base, final=final))
    if total - settled > SETTLED_TAIL_WARNING * total:
        lag = 1.0 / (1.0 - base)
        if lag > SETTLED_TAIL_WARNING * total:  # the start value alone is too slow for this run
            fix = (
                f"at a momentum of {base:g} the teacher averages the student over ~{lag:.0f} iterations; "
                "teacher.momentum_teacher=auto fits it to the run's length, or lengthen the run"
            )
        else:
            fix = "teacher.final_momentum_teacher=auto fits the final value to the run's length"
        out.append(
            f"the EMA teacher barely moves after iteration {settled} of {total} (momentum {base:g} → {final:g}, "
            f"teacher.momentum_teacher / teacher.final_momentum_teacher): the last {(total - settled) / total:.0%} "
            f"of the run learns from a teacher that no longer follows the student; {fix}"
        )
    start = warmups_end(cfg)
    if cfg.health.policy != "off" and stop_iteration < start + cfg.health.patience:
        out.append(
            f"no health verdict in this run: it stops at iteration {stop_iteration}, before the warm-ups end "
            f"({start}) plus health.patience ({cfg.health.patience})"
        )
    return out


def schedule_summary(cfg: C.PretrainConfig) -> str:
    """The teacher schedules as this run uses them (logged at start, so "auto" is never a mystery)."""
    total, t = C.total_iterations(cfg), cfg.teacher
    temp = temperature_schedule(cfg)
    base, final = teacher_momentum(cfg)
    return (
        f"teacher schedules over {total} iterations: temperature {temp(0):.4g} → {temp(total - 1):.4g} "
        f"(warmup_teacher_temp_epochs={t.warmup_teacher_temp_epochs}), momentum {base:.6g} → {final:.6g} "
        f"(momentum_teacher={t.momentum_teacher}, final_momentum_teacher={t.final_momentum_teacher})"
    )


class HealthWatch:
    """Judges the DINO gap, averaged over `health.patience` iterations, after the warm-ups: "learning" as soon as it
    reaches `health.min_gap`; "not learning" if it has not by the deadline (`health.judge_at` of the run, and never
    before warm-ups + patience). A run that learns late under the warn policy gets its verdict corrected. Every
    probe measurement after the warm-ups is checked for collapse."""

    def __init__(self, cfg: C.PretrainConfig) -> None:
        self.cfg = cfg.health
        self.start = warmups_end(cfg)
        self.deadline = max(self.start + self.cfg.patience, math.ceil(self.cfg.judge_at * C.total_iterations(cfg)))
        self.gaps: deque[float] = deque(maxlen=self.cfg.patience)
        self.message: str | None = None  # the alarm, if one was raised
        self.learning_at: int | None = None  # the iteration whose window first reached min_gap
        self.judged = False
        self.collapse: str | None = None  # the effective rank's alarm
        self.probe: tuple[int, dict[str, Any]] | None = None  # the latest probe measurement

    def observe(self, iteration: int, values: dict[str, Any]) -> str | None:
        """Feed one step (with the probe's scores when it was measured); returns an alarm message the first time
        the run is judged not to learn, or its features to have collapsed."""
        if "effective_rank" in values:
            self.probe = (iteration, values)
        if self.cfg.policy == "off" or iteration < self.start:
            return None
        alarms = [a for a in (self._observe_rank(iteration, values), self._observe_gap(iteration, values)) if a]
        return "; and ".join(alarms) or None

    def _observe_rank(self, iteration: int, values: dict[str, Any]) -> str | None:
        rank = values.get("effective_rank")
        if self.collapse is not None or rank is None or rank >= self.cfg.min_effective_rank:
            return None
        self.collapse = (
            f"not learning: features collapsed: at iteration {iteration}, after every warm-up, the teacher's CLS "
            f"features on the probe tiles have an effective rank of {rank:.4f} (health.min_effective_rank asks for "
            f"{self.cfg.min_effective_rank}; 0: every tile gets the same vector), augmentation invariance "
            f"{values.get('invariance', math.nan):.3f}; {COLLAPSE_ADVICE}"
        )
        return self._alarm(self.collapse)

    def _observe_gap(self, iteration: int, values: dict[str, Any]) -> str | None:
        if self.learning_at is not None:
            return None
        gap = values.get("dino_gap")
        if gap is None or not math.isfinite(gap):
            return None
        self.gaps.append(gap)
        if len(self.gaps) < self.cfg.patience:
            return None
        mean = sum(self.gaps) / len(self.gaps)
        if mean >= self.cfg.min_gap:
            self.judged, self.learning_at = True, iteration
            return None
        if self.judged or iteration + 1 < self.deadline:
            return None
        self.judged = True
        self.message = (
            f"not learning: by iteration {iteration} (health.judge_at={self.cfg.judge_at:g} of the run, after every "
            f"warm-up) the DINO loss was still at its no-information level ln K: {mean:.3f} nats below it on average "
            f"over iterations {iteration - len(self.gaps) + 1}…{iteration} (negative: above it; health.min_gap asks "
            f"for {self.cfg.min_gap}); {ADVICE}"
        )
        return self._alarm(self.message)

    def _alarm(self, message: str) -> str:
        if self.cfg.policy == "stop":
            raise TrainingInertError(message + " (health.policy=stop; health.policy=warn lets it run on)")
        return message

    def verdict(self) -> str:
        """For the run's summary and its MLflow tag `wsidino.health`."""
        gap = self._gap_verdict()
        if self.collapse is not None:  # whatever the losses did, collapsed features are not learning
            return self.collapse + (f"; and {gap}" if gap.startswith("not learning") else "")
        return gap + self._probe_note() if gap.startswith("learning") else gap

    def _probe_note(self) -> str:
        if self.probe is None:
            return ""
        it, v = self.probe
        return (
            f"; probe at iteration {it}: effective rank {v['effective_rank']:.3f}, augmentation invariance "
            f"{v.get('invariance', math.nan):.3f}"
        )

    def _gap_verdict(self) -> str:
        if self.learning_at is not None and self.message is not None:
            return (
                f"learning late: the DINO loss left its no-information level only by iteration "
                f"{self.learning_at}, after the alarm; {ADVICE}"
            )
        if self.message is not None:
            return self.message
        if self.learning_at is not None:
            return f"learning: the DINO loss left its no-information level by iteration {self.learning_at}"
        if self.cfg.policy == "off":
            return "not judged: health.policy=off"
        return (
            f"not judged yet: the verdict is due by iteration {self.deadline} (health.judge_at of the run, at "
            f"least health.patience={self.cfg.patience} iterations after the warm-ups end at {self.start})"
        )


__all__ = [
    "ADVICE",
    "COLLAPSE_ADVICE",
    "HEALTH_FILE",
    "HealthWatch",
    "TrainingInertError",
    "no_information_gaps",
    "schedule_summary",
    "schedule_warnings",
    "warmups_end",
]
