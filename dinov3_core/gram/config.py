"""Typed configuration of the gram stage (`GramConfig` = `PretrainConfig` + `gram` + `pretrain_dir`).

    cfg = load_config(GramConfig, "tiny", {"pretrain_dir": "out/pretrain", "data.stores": ["out/tiles.zarr"],
                                           "output_dir": "out/gram"}, stage="gram")

Every schedule of the gram stage counts from the stage's FIRST iteration (0), in the stage's own output_dir:
lr / wd / momentum / teacher temperature (`optim.*`, `teacher.*`, `train.epoch_length`), the gram weight
warmup, the local DINO weight schedule and the gram-teacher refresh. Nothing is indexed on the pretraining
run's absolute iteration (upstream's 7B gram config waits until iteration 1M;
docs/reference/dinov3.md#gram-teacher).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from dinov3_core.config import ConfigError, require
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
    # Loss (docs/reference/dinov3.md#losses): student vs gram-teacher x_norm_patchtokens of the same global crops.
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
    # Local DINO loss weight λ_local: from losses.local_loss_weight to local_weight_end linearly over
    # local_weight_iterations stage iterations. null: λ_local stays at losses.local_loss_weight.
    local_weight_end: float | None = None
    local_weight_iterations: int = 0
    # Refresh of the gram teacher from the EMA teacher after stage iteration `it` when (it+1) >= first_update,
    # (it+1 − first_update) % update_frequency == 0 and fewer than max_updates refreshes happened (stage-relative).
    rep_update: bool = True
    update_frequency: int = 10000
    first_update: int = 0
    max_updates: int | None = None

    def __post_init__(self) -> None:
        for key in ("warmup_iterations", "local_weight_iterations", "first_update"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.update_frequency >= 1, "update_frequency", f"must be >= 1, got {self.update_frequency}")
        require(
            self.max_updates is None or self.max_updates >= 0,
            "max_updates",
            f"must be >= 0 or null, got {self.max_updates}",
        )
        require(
            not (self.remove_neg and self.remove_only_teacher_neg),
            "remove_neg",
            "cannot be combined with remove_only_teacher_neg (they are mutually exclusive)",
        )
        require(
            self.teacher_crop_size is None or self.teacher_crop_size >= 1,
            "teacher_crop_size",
            f"must be >= 1 or null, got {self.teacher_crop_size}",
        )
        require(self.selection_tiles >= 1, "selection_tiles", f"must be >= 1, got {self.selection_tiles}")


@dataclass
class GramConfig(PretrainConfig):
    """Gram-anchoring stage: continues a pretraining run (its latest DCP checkpoint: student, teacher,
    optimizer) into its own output_dir, or starts from `student.pretrained_weights` when pretrain_dir is null."""

    pretrain_dir: str | None = None
    inherit_model: bool = True  # take student.*, heads.* (and data.stores when unset) from <pretrain_dir>/config.yaml
    gram: GramSection = field(default_factory=GramSection)

    # Keys of earlier versions, each declared once now under its new name (named in the unknown-key error).
    MOVED_KEYS: ClassVar[dict[str, str]] = {"gram.local_weight_start": "losses.local_loss_weight"}


def validate_gram(cfg: GramConfig) -> None:
    """Checks across sections (each section checks its own keys when it is built, see `__post_init__`)."""
    if cfg.pretrain_dir is None and not cfg.student.pretrained_weights:
        raise ConfigError(
            "set pretrain_dir (a pretraining output_dir to continue) or student.pretrained_weights (a released / "
            "converted backbone to start from)"
        )
    validate(cfg)
