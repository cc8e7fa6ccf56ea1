"""AdamW over the student with DINOv3 parameter groups, the per-iteration schedules, and gradient clipping.

Wraps `schedules.py` and `param_groups.py`: each iteration sets every group's lr = lr(it) × lr_multiplier
(last layers: 0 while frozen) and weight_decay = wd(it) × wd_multiplier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dinov3_core.train import config as C
from dinov3_core.train.param_groups import build_param_groups
from dinov3_core.train.schedules import (
    WarmupCosineSchedule,
    fitted_final_momentum,
    fitted_start_momentum,
    linear_warmup_cosine,
    momentum_schedule,
    paced_teacher_temp_schedule,
    scaled_lr,
    teacher_temp_schedule,
    weight_decay_schedule,
)


@dataclass(frozen=True)
class ScheduleValues:
    lr: float
    last_layer_lr: float
    wd: float
    momentum: float
    teacher_temp: float


@dataclass(frozen=True)
class Schedules:
    lr: WarmupCosineSchedule
    wd: WarmupCosineSchedule
    momentum: WarmupCosineSchedule
    teacher_temp: WarmupCosineSchedule
    freeze_last_layer_iters: int

    def at(self, iteration: int) -> ScheduleValues:
        lr = self.lr(iteration)
        return ScheduleValues(
            lr=lr,
            last_layer_lr=0.0 if iteration < self.freeze_last_layer_iters else lr,
            wd=self.wd(iteration),
            momentum=self.momentum(iteration),
            teacher_temp=self.teacher_temp(iteration),
        )


def build_schedules(cfg: C.PretrainConfig, global_batch: int) -> Schedules:
    """Schedules over epochs × epoch_length iterations; lr peak and end scaled by the global batch size."""
    total = C.total_iterations(cfg)
    o = cfg.optim
    start_momentum, final_momentum = teacher_momentum(cfg)
    peak = scaled_lr(o.lr, global_batch, o.scaling_rule)
    end = scaled_lr(o.min_lr, global_batch, o.scaling_rule)
    return Schedules(
        lr=linear_warmup_cosine(0.0, peak, end, C.epochs_to_iterations(cfg, o.warmup_epochs), total),
        wd=weight_decay_schedule(total, start=o.weight_decay, end=o.weight_decay_end),
        momentum=momentum_schedule(total, base=start_momentum, final=final_momentum),
        teacher_temp=temperature_schedule(cfg),
        freeze_last_layer_iters=C.epochs_to_iterations(cfg, o.freeze_last_layer_epochs),
    )


def teacher_momentum(cfg: C.PretrainConfig) -> tuple[float, float]:
    """(start, final) EMA momentum: `teacher.momentum_teacher` and `teacher.final_momentum_teacher`, each fitted to
    the run's length when "auto"."""
    t, total = cfg.teacher, C.total_iterations(cfg)
    start = fitted_start_momentum(total) if t.momentum_teacher == "auto" else float(t.momentum_teacher)
    final = (
        fitted_final_momentum(total, start) if t.final_momentum_teacher == "auto" else float(t.final_momentum_teacher)
    )
    return start, final


def temperature_schedule(cfg: C.PretrainConfig) -> WarmupCosineSchedule:
    """The teacher temperature: at upstream's pace ("auto") or warmed over `warmup_teacher_temp_epochs`."""
    t, total = cfg.teacher, C.total_iterations(cfg)
    if t.warmup_teacher_temp_epochs == "auto":
        return paced_teacher_temp_schedule(total, start=t.warmup_teacher_temp, peak=t.teacher_temp)
    warmup = min(total, C.epochs_to_iterations(cfg, float(t.warmup_teacher_temp_epochs)))
    return teacher_temp_schedule(warmup, total, start=t.warmup_teacher_temp, peak=t.teacher_temp)


def build_optimizer(student: nn.Module, cfg: C.PretrainConfig) -> torch.optim.AdamW:
    """AdamW over layer-decayed groups; call after FSDP wrapping (the groups hold the sharded parameters)."""
    groups = build_param_groups(
        student,
        layer_decay=cfg.optim.layer_decay,
        patch_embed_lr_mult=cfg.optim.patch_embed_lr_mult,
        n_blocks=student["backbone"].n_blocks,  # the whole depth: a pipeline stage holds only some blocks
    )
    for group in groups:
        group.pop("names")  # not needed after grouping; kept out of every checkpoint
    # fused: one kernel per parameter instead of about ten element-wise passes over all of them (foreach): the same
    # update to float rounding, several times faster on CPU (docs/benchmarks.md), and the recommended AdamW on CUDA.
    return torch.optim.AdamW(groups, lr=0.0, betas=(cfg.optim.adamw_beta1, cfg.optim.adamw_beta2), fused=True)


def apply_schedules(optimizer: torch.optim.Optimizer, values: ScheduleValues) -> None:
    for group in optimizer.param_groups:
        lr = values.last_layer_lr if group["is_last_layer"] else values.lr
        group["lr"] = lr * group["lr_multiplier"]
        group["weight_decay"] = values.wd * group["wd_multiplier"]


def clip_gradients(student: nn.ModuleDict, max_norm: float) -> dict[str, Tensor]:
    """Clip each submodule's gradients to `max_norm` separately (0: no clipping); returns the pre-clip norms
    (`<name>_grad_norm`, global over ranks under FSDP), as 0-d tensors on the training device."""
    norms: dict[str, Tensor] = {}
    for name, module in student.items():
        params = [p for p in module.parameters() if p.grad is not None]
        if not params:
            continue
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
        norms[f"{name}_grad_norm"] = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return norms
