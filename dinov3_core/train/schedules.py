"""Per-iteration schedules (DINOv3 "v2" schedules, docs/reference/dinov3.md#schedules) and the learning-rate
batch-size scaling rule.

A schedule is a small immutable callable evaluated in closed form — nothing of length `total_iters` is
materialised (1M iterations for long runs) — and `as_array()` gives the upstream numpy array for plotting or
comparison. Iterations past the end return the final value, like upstream's CosineScheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

ScalingRule = Literal["sqrt_wrt_1024", "linear_wrt_256", "none"]


@dataclass(frozen=True)
class WarmupCosineSchedule:
    """Linear warmup start → peak over `warmup_iters` (endpoint excluded), cosine peak → end over
    `cosine_iters` (both endpoints included), then constant `end` (upstream `linear_warmup_cosine_decay`)."""

    start: float
    peak: float
    end: float
    warmup_iters: int
    cosine_iters: int
    total_iters: int

    def __call__(self, iteration: int) -> float:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        if iteration < self.warmup_iters:
            return self.start + (self.peak - self.start) * iteration / self.warmup_iters
        step = iteration - self.warmup_iters
        if step < self.cosine_iters:
            progress = step / (self.cosine_iters - 1) if self.cosine_iters > 1 else 0.0
            return self.end + (self.peak - self.end) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.end

    def __len__(self) -> int:
        return self.total_iters

    def as_array(self) -> np.ndarray:
        """float64 [total_iters], built like upstream's array."""
        warmup = np.linspace(self.start, self.peak, self.warmup_iters, endpoint=False)
        cosine = (np.cos(np.linspace(0.0, np.pi, self.cosine_iters)) + 1.0) / 2.0 * (self.peak - self.end) + self.end
        constant = np.full(self.total_iters - self.warmup_iters - self.cosine_iters, self.end, dtype=np.float64)
        return np.concatenate([warmup, cosine, constant])


def linear_warmup_cosine(
    start: float,
    peak: float,
    end: float,
    warmup_iters: int,
    total_iters: int,
    cosine_iters: int | None = None,
) -> WarmupCosineSchedule:
    """The v2 schedule: warmup ++ cosine ++ constant; `cosine_iters` defaults to the rest after warmup."""
    if cosine_iters is None:
        cosine_iters = total_iters - warmup_iters
    if warmup_iters < 0 or cosine_iters < 0 or warmup_iters + cosine_iters > total_iters:
        raise ValueError(
            f"need 0 <= warmup_iters ({warmup_iters}), 0 <= cosine_iters ({cosine_iters}) and "
            f"warmup + cosine <= total_iters ({total_iters})"
        )
    return WarmupCosineSchedule(start, peak, end, warmup_iters, cosine_iters, total_iters)


# Upstream's teacher-temperature warm-up in iterations (30 epochs × 1250). Schedules that fit a run's length keep
# this *pace* (docs/reference/dinov3.md#schedules): prototypes organise over tens of thousands of updates whatever
# the run's length, so a shorter run ends at the temperature upstream had reached by its last iteration instead of
# squeezing the whole warm-up into it (tried on 1,000 iterations: a warm-up over 30 % of the run stays at ln K, the
# paced one learns).
UPSTREAM_TEMP_WARMUP_ITERS = 30 * 1250
# Fitted final teacher momentum: at the end of a run the teacher's EMA time constant 1/(1 − m) is at most this share
# of the run. Upstream's cosine to 1.0 freezes the teacher over the last ~8 % of its 125k iterations, which costs
# nothing there; cut to 1,000 iterations the same curve freezes it over the last ~40 %.
END_EMA_SHARE = 0.05


def teacher_temp_schedule(
    warmup_iters: int, total_iters: int, *, start: float = 0.04, peak: float = 0.07
) -> WarmupCosineSchedule:
    """Teacher temperature: linear 0.04 → 0.07 over the warmup (official 30 epochs), then constant."""
    return linear_warmup_cosine(start, peak, peak, warmup_iters, total_iters)


def paced_teacher_temp_schedule(
    total_iters: int, *, start: float = 0.04, peak: float = 0.07, pace_iters: int = UPSTREAM_TEMP_WARMUP_ITERS
) -> WarmupCosineSchedule:
    """Teacher temperature rising start → peak over `pace_iters` iterations, whatever the run's length: the value
    at iteration t is the same in a 1,000- and a 500,000-iteration run (a shorter run stops part-way up)."""
    warmup = min(pace_iters, total_iters)
    reached = start + (peak - start) * warmup / pace_iters
    return linear_warmup_cosine(start, reached, reached, warmup, total_iters)


# Upstream's starting EMA momentum (v1/v2 schedules): a time constant 1/(1 − m) of 125 iterations, 0.1 % of 125k.
UPSTREAM_START_MOMENTUM = 0.992
# Fitted start momentum: the teacher's time constant at the start is at most this share of the run. On 1,000
# iterations of the tiny recipe, 0.98 (50 iterations) left ln K twice as far as 0.992 (125 iterations).
START_EMA_SHARE = 0.05


def fitted_start_momentum(total_iters: int) -> float:
    """The starting EMA momentum for a run of `total_iters`: upstream's 0.992, lowered for runs so short that its
    time constant would exceed `START_EMA_SHARE` of the run (0.98 at 1,000 iterations, 0 — the student itself —
    at 20)."""
    return max(0.0, min(UPSTREAM_START_MOMENTUM, 1.0 - 1.0 / (START_EMA_SHARE * total_iters)))


def fitted_final_momentum(total_iters: int, base: float) -> float:
    """The final EMA momentum for a run of `total_iters`: upstream's 1.0 for long runs, capped so that the
    teacher's time constant at the end stays within `END_EMA_SHARE` of the run, and never below `base`."""
    return min(1.0, max(base, 1.0 - 1.0 / (END_EMA_SHARE * total_iters)))


def teacher_settled_from(schedule: WarmupCosineSchedule) -> int:
    """The first iteration from which the EMA teacher barely moves any more: more than half of the final teacher is
    already the teacher of that iteration, i.e. Σ_{s ≥ t} (1 − m_s) < ln 2. Every EMA has such a tail (≈ 87
    iterations at a constant 0.992); upstream's cosine to 1.0 makes it the last ~9 % of 125k iterations and the
    last ~47 % of 1,000."""
    remaining = np.cumsum((1.0 - schedule.as_array())[::-1])[::-1]  # Σ_{s ≥ t} (1 − m_s)
    settled = np.flatnonzero(remaining < math.log(2.0))
    return int(settled[0]) if len(settled) else schedule.total_iters


def momentum_schedule(total_iters: int, *, base: float = 0.992, final: float = 1.0) -> WarmupCosineSchedule:
    """EMA teacher momentum: cosine base → final over the run; for final 1, m = 1 − (1−base)(1+cos(π·t))/2
    with t = it/(total−1) (v1 used t = it/total, a difference of one iteration)."""
    return linear_warmup_cosine(base, base, final, 0, total_iters)


def weight_decay_schedule(total_iters: int, *, start: float = 0.04, end: float = 0.4) -> WarmupCosineSchedule:
    """Weight decay: cosine 0.04 → 0.4 over the run."""
    return linear_warmup_cosine(start, start, end, 0, total_iters)


def scaled_lr(base_lr: float, global_batch: int, rule: ScalingRule = "sqrt_wrt_1024") -> float:
    """Learning rate after DINOv3's batch-size rule (applied to the schedule's peak and end).

    `sqrt_wrt_1024`: base·4·√(B/1024) — the factor 4 is upstream's (the v2-schedule code), so 1e-3 at B=1024
    gives 4e-3; `linear_wrt_256`: base·B/256; `none`: base.
    """
    if global_batch <= 0:
        raise ValueError(f"global_batch must be positive, got {global_batch}")
    if rule == "sqrt_wrt_1024":
        return base_lr * 4.0 * math.sqrt(global_batch / 1024.0)
    if rule == "linear_wrt_256":
        return base_lr * global_batch / 256.0
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown scaling rule {rule!r}; use sqrt_wrt_1024, linear_wrt_256 or none")
