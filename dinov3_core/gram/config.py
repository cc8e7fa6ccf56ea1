"""Typed configuration of the gram stage (`GramConfig` = `PretrainConfig` + `gram` + `pretrain_dir`).

    cfg = load_config(GramConfig, "tiny", {"pretrain_dir": "out/pretrain", "data.stores": ["out/tiles.zarr"],
                                           "output_dir": "out/gram"}, stage="gram")

Every schedule of the gram stage counts from the stage's FIRST iteration (0), in the stage's own output_dir:
lr / wd / momentum / teacher temperature (`optim.*`, `teacher.*`, `train.epoch_length`), the gram weight
warmup, the local DINO weight schedule and the gram-teacher refresh. Nothing is indexed on the pretraining
run's absolute iteration (upstream's 7B gram config waits until iteration 1M; facts §8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dinov3_core.config import ConfigError
from dinov3_core.train.config import PretrainConfig, validate


@dataclass
class GramSection:
    """Gram anchoring: which teacher, the loss, its schedules and the teacher refresh."""

    # Gram teacher: an explicit file (eval teacher_checkpoint.pth or a released backbone) wins over the policy.
    teacher_path: str | None = None
    teacher_policy: Literal["latest", "iteration", "best_dense"] = "latest"  # over <pretrain_dir>/eval/*
    teacher_iteration: int | None = None  # `iteration` policy: nearest eval checkpoint to this iteration
    teacher_fraction: float | None = None  # … or to this fraction of the pretraining run's total iterations
    selection_tiles: int = 32  # best_dense: held-out tiles scored per candidate
    # Loss (facts §6): student vs gram-teacher x_norm_patchtokens of the same global crops.
    loss_weight: float = 1.0  # target weight
    warmup_iterations: int = 0  # weight 0 → loss_weight linearly over these stage iterations (0: at once)
    normalized: bool = True
    img_level: bool = True
    remove_neg: bool = False
    remove_only_teacher_neg: bool = False
    # Higher-resolution gram teacher (upstream crops.gram_teacher_crops_size): the student's global crops are
    # upsampled (bicubic) to this size for the gram teacher, whose patch map is resized back to the student grid
    # (bicubic, no antialias) before normalisation. NOT a re-crop of the source tile at higher resolution — the
    # same as upstream for tiles no larger than the student crop (#220). null: the student's crops as they are.
    teacher_crop_size: int | None = None
    # Local DINO loss weight: local_weight_start → local_weight_end linearly over local_weight_iterations.
    local_weight_start: float = 1.0
    local_weight_end: float = 1.0
    local_weight_iterations: int = 0
    # Refresh of the gram teacher from the EMA teacher after stage iteration `it` when (it+1) >= first_update,
    # (it+1 − first_update) % update_frequency == 0 and fewer than max_updates refreshes happened (stage-relative).
    rep_update: bool = True
    update_frequency: int = 10000
    first_update: int = 0
    max_updates: int | None = None


@dataclass
class GramConfig(PretrainConfig):
    """Gram-anchoring stage: continues a pretraining run (its latest DCP checkpoint: student, teacher,
    optimizer) into its own output_dir, or starts from `student.pretrained_weights` when pretrain_dir is null."""

    pretrain_dir: str | None = None
    inherit_model: bool = True  # take student.*, heads.* (and data.stores when unset) from <pretrain_dir>/config.yaml
    gram: GramSection = field(default_factory=GramSection)


def validate_gram(cfg: GramConfig) -> None:
    g = cfg.gram
    if cfg.pretrain_dir is None and not cfg.student.pretrained_weights:
        raise ConfigError(
            "set pretrain_dir (a pretraining output_dir to continue) or student.pretrained_weights (a released / "
            "converted backbone to start from)"
        )
    if cfg.pretrain_dir is None and not g.teacher_path and not cfg.student.pretrained_weights:
        raise ConfigError("without pretrain_dir, set gram.teacher_path (the gram teacher backbone file)")
    for key, value in (
        ("gram.warmup_iterations", g.warmup_iterations),
        ("gram.local_weight_iterations", g.local_weight_iterations),
        ("gram.first_update", g.first_update),
    ):
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if g.update_frequency < 1:
        raise ConfigError(f"gram.update_frequency must be >= 1, got {g.update_frequency}")
    if g.max_updates is not None and g.max_updates < 0:
        raise ConfigError("gram.max_updates must be >= 0 or null")
    if g.remove_neg and g.remove_only_teacher_neg:
        raise ConfigError("gram.remove_neg and gram.remove_only_teacher_neg are mutually exclusive")
    if g.teacher_crop_size is not None and g.teacher_crop_size < 1:
        raise ConfigError(f"gram.teacher_crop_size must be >= 1 or null, got {g.teacher_crop_size}")
    if g.selection_tiles < 1:
        raise ConfigError("gram.selection_tiles must be >= 1")
    validate(cfg)
