"""Typed configuration of the pretrain stage (`PretrainConfig`), loaded with `dinov3_core.config.load_config`.

    cfg = load_config(PretrainConfig, "tiny", ["data.stores=[out/tiles.zarr]", "output_dir=out/pretrain"],
                      stage="pretrain")

Schedule lengths are in DINOv3 "epochs" of `train.epoch_length` iterations (upstream OFFICIAL_EPOCH_LENGTH,
1250): they are schedule units, not passes over the tile store. The data sampler counts its own passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import MISSING

from dinov3_core.config import ConfigError, require
from dinov3_core.data.augment_config import AugmentationConfig
from dinov3_core.losses import LossesConfig
from dinov3_core.tracking import TrackingConfig
from dinov3_core.train import model_config as MC
from dinov3_core.train.model_config import HeadsConfig, StudentConfig
from dinov3_core.train.parallel_config import ParallelismConfig
from dinov3_core.train.schedules import ScalingRule


@dataclass
class DataConfig:
    """Tile stores to train on and the host-side loader."""

    stores: list[str] = field(default_factory=list)  # tile store directories (…/tiles.zarr), at least one
    slide_ids: list[str] | None = None  # only these slides (null: all)
    min_tissue_fraction: float | None = None  # only tiles with at least this stored tissue fraction
    num_workers: int = 2  # DataLoader processes per rank (0: read in the training process)
    prefetch_factor: int = 2  # step batches each worker reads ahead
    multiprocessing_context: str | None = None  # null: torch's default (fork on Linux)
    # Stores tiled at several µm/px (`tile.mpp` a list): sample tiles across those levels with these weights, e.g.
    # {0.5: 0.5, 1.0: 0.3, 2.0: 0.2} (µm/px as tiled → share of the samples; normalised). null: the first level only.
    mpp_weights: Any = None

    def __post_init__(self) -> None:
        self.mpp_weights = check_mpp_weights(self.mpp_weights)


def check_mpp_weights(weights: Any) -> dict[float, float] | None:
    """`data.mpp_weights` as {µm/px: weight} with float keys, weights >= 0 summing to more than 0."""
    if weights is None:
        return None
    require(
        isinstance(weights, dict) and bool(weights),
        "mpp_weights",
        f"must map µm/px to a weight, e.g. {{0.5: 0.7, 1.0: 0.3}}, or be null; got {weights!r}",
    )
    out: dict[float, float] = {}
    for key, value in weights.items():
        try:
            mpp, weight = float(key), float(value)
        except (TypeError, ValueError):
            mpp, weight = float("nan"), float("nan")
        require(
            mpp > 0 and weight >= 0,
            "mpp_weights",
            f"needs positive µm/px keys and weights >= 0, got {key!r}: {value!r}",
        )
        out[mpp] = weight
    require(sum(out.values()) > 0, "mpp_weights", f"needs a positive weight, got {weights!r}")
    return out


@dataclass
class CropsConfig(AugmentationConfig):
    """Multi-crop augmentation (every `AugmentationConfig` key, official recipe by default), how its randomness
    is grouped, and the iBOT mask parameters. `MultiCropAugmentation` takes this section as it is."""

    # Images are augmented in groups of this many consecutive step-batch images, each group from its own
    # generator seeded by (seed, stream position). Crops are then identical however the step batch is split
    # over ranks and micro-batches, as long as the split keeps groups whole (this must divide the per-rank
    # step batch). 1 is always exact. The pixel work runs once over the rank's whole batch whatever the group
    # size (`augment_step`); larger groups only save the per-group parameter draws (group 1: 581 img/s against
    # 672 at 16 on one CPU thread, cpu recipe crops; before, group 1 ran a call per image at 200 img/s).
    rng_group_size: int = 8
    mask_ratio: tuple[float, float] = (0.1, 0.5)  # iBOT: ratios of the masked crops, linspace over this range
    mask_probability: float = 0.5  # iBOT: share of global crops that are masked

    def __post_init__(self) -> None:
        require(self.n_global_crops == 2, "n_global_crops", "must be 2 (the official DINO/iBOT objective)")
        require(self.n_local_crops >= 1, "n_local_crops", "must be >= 1 (DINOv3 needs local crops)")
        super().__post_init__()
        require(self.rng_group_size >= 1, "rng_group_size", f"must be >= 1, got {self.rng_group_size}")
        require(0.0 <= self.mask_probability <= 1.0, "mask_probability", "must be in [0, 1]")
        lo, hi = self.mask_ratio
        require(0.0 <= lo < hi <= 1.0, "mask_ratio", f"must satisfy 0 <= min < max <= 1, got {[lo, hi]}")


@dataclass
class OptimConfig:
    """AdamW, learning-rate and weight-decay schedules (docs/reference/dinov3.md#schedules, #parameter-groups)."""

    epochs: int = 100  # schedule length: epochs × train.epoch_length iterations
    lr: float = 1e-3  # base lr, scaled by `scaling_rule` with the global batch size
    min_lr: float = 1e-6  # end of the cosine (scaled like lr)
    warmup_epochs: float = 10.0
    scaling_rule: ScalingRule = "sqrt_wrt_1024"
    weight_decay: float = 0.04
    weight_decay_end: float = 0.4
    adamw_beta1: float = 0.9
    adamw_beta2: float = 0.999
    layer_decay: float = 0.9
    patch_embed_lr_mult: float = 0.2
    clip_grad: float = 3.0  # per submodule (backbone, dino_head, ibot_head); 0: no clipping (norms still logged)
    freeze_last_layer_epochs: float = 1.0  # the heads' last layers get lr 0 during these epochs

    def __post_init__(self) -> None:
        require(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        _require_epochs(self.freeze_last_layer_epochs, "freeze_last_layer_epochs")


@dataclass
class TeacherConfig:
    """EMA teacher momentum and teacher temperature schedules.

    "auto" (the default) fits them to the run's length (dinov3_core.train.schedules): upstream's values for a run of
    upstream's length, and for a short one a temperature that rises at upstream's pace and a final momentum that
    keeps the teacher following the student to the end. Numbers give upstream's fixed shapes.
    """

    # auto: upstream's 0.992, lowered for short runs so the EMA time constant 1/(1 − m) is ≤ 5 % of the run
    momentum_teacher: float | int | str = "auto"  # cosine from here to final_momentum_teacher over the run
    # auto: 1.0 capped so the EMA time constant at the end is ≤ 5 % of the run (0.99984 at 125k its, 0.98 at 1k)
    final_momentum_teacher: float | int | str = "auto"
    teacher_temp: float = 0.07
    warmup_teacher_temp: float = 0.04
    # auto: warmup_teacher_temp → teacher_temp over 37,500 iterations (upstream's 30 × 1250) whatever the run's
    # length; a shorter run ends part-way up. A number: over this many epochs of the run, then constant.
    warmup_teacher_temp_epochs: float | int | str = "auto"

    def __post_init__(self) -> None:
        for key in ("momentum_teacher", "final_momentum_teacher", "warmup_teacher_temp_epochs"):
            value = getattr(self, key)
            require(not isinstance(value, str) or value == "auto", key, f"must be a number or 'auto', got {value!r}")
        start, final = self.momentum_teacher, self.final_momentum_teacher
        if not isinstance(start, str):
            require(0.0 <= start < 1.0, "momentum_teacher", f"must be in [0, 1), got {start}")
        if not isinstance(final, str):
            low = 0.0 if isinstance(start, str) else start
            require(
                low <= final <= 1.0,
                "final_momentum_teacher",
                f"must be in [momentum_teacher ({start}), 1], got {final}",
            )
        if not isinstance(self.warmup_teacher_temp_epochs, str):
            _require_epochs(self.warmup_teacher_temp_epochs, "warmup_teacher_temp_epochs")


@dataclass
class TrainConfig:
    """Batching, device, precision and loop settings."""

    # Images per optimizer step over all ranks. null: batch_size_per_gpu × accumulation_steps × world size.
    global_batch_size: int | None = None
    # Micro-batch per rank, or "auto": chosen with accumulation_steps by the memory estimator to fit
    # `memory_budget_gb` (needs global_batch_size).
    batch_size_per_gpu: int | str = 64
    accumulation_steps: int = 1  # micro-batches per optimizer step (ignored with batch_size_per_gpu=auto)
    epoch_length: int = 1250  # iterations per schedule epoch (upstream OFFICIAL_EPOCH_LENGTH)
    stop_at: int | None = None  # stop before this iteration (with a checkpoint); the schedule is unchanged
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: bf16 on GPU, fp32 on CPU. bf16 on CPU (autocast) pays on CPUs with bf16 matrix units (AMX, AVX512-BF16)
    # for ViT-S and up; on vit_test's tiny matrices it loses, which is why it is not the CPU default
    # (docs/benchmarks.md, "Training step: ours vs upstream at equal configuration").
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # true: torch.compile each transformer block. step: the whole training step (teacher, student, heads, losses and
    # their backward) in one torch.compile, which also fuses what lies between blocks (1.14x per-block compile on
    # vit_test, CPU; docs/benchmarks.md); one compilation per micro-batch shape, not with pipeline parallelism.
    compile: bool | str = False
    activation_checkpointing: bool = False

    num_threads: int | None = None  # torch CPU threads per process (null: torch's default)
    log_period: int = 10  # iterations between metric lines
    gc_period: int = 100  # gc.collect() on every rank every this many iterations (automatic GC stays on)
    nan_patience: int = 3  # stop after this many consecutive non-finite losses (those steps are skipped)
    memory_budget_gb: float | None = None  # auto batch: per-rank budget; null: GPU memory or a share of RAM
    host_memory_fraction: float = 0.5  # auto batch on CPU: share of host RAM all local ranks may use
    # Watch memory while training and re-plan on sustained pressure (dinov3_core.train.memory_watch): fewer loader
    # workers, then a smaller micro-batch with more accumulation (same global batch), then activation checkpointing.
    # The limit is memory_budget_gb × memory_watch_threshold (null budget: GPU memory on GPU, this rank's share of
    # host RAM on CPU); host-wide low available memory or swapping in also count as pressure.
    memory_watch: bool = True  # false: still sampled into the metrics lines, never re-planned
    memory_watch_period: int = 5  # iterations between checks (a window: its peak memory decides)
    memory_watch_patience: int = 3  # consecutive windows over the limit before re-planning (a spike is not pressure)
    memory_watch_threshold: float = 1.0  # share of the budget a window's peak may reach

    def __post_init__(self) -> None:
        for key in (
            "epoch_length",
            "accumulation_steps",
            "log_period",
            "gc_period",
            "nan_patience",
            "memory_watch_period",
            "memory_watch_patience",
        ):
            require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        bs = self.batch_size_per_gpu
        if isinstance(bs, str):
            require(bs == "auto", "batch_size_per_gpu", f"must be a positive integer or 'auto', got {bs!r}")
            require(
                self.global_batch_size is not None,
                "batch_size_per_gpu",
                "auto needs global_batch_size (the target batch)",
            )
        else:
            require(bs >= 1, "batch_size_per_gpu", f"must be >= 1, got {bs}")
        if isinstance(self.compile, str):
            require(self.compile == "step", "compile", f"must be true, false or 'step', got {self.compile!r}")
        for key in ("global_batch_size", "stop_at"):
            value = getattr(self, key)
            require(value is None or value >= 1, key, f"must be >= 1 or null, got {value}")
        require(self.memory_watch_threshold > 0, "memory_watch_threshold", "must be > 0 (a share of the budget)")
        require(
            self.memory_budget_gb is None or self.memory_budget_gb > 0,
            "memory_budget_gb",
            f"must be > 0 GiB or null, got {self.memory_budget_gb}",
        )

    @property
    def compile_blocks(self) -> bool:
        """Each transformer block compiled on its own (`compile: true`)."""
        return self.compile is True

    @property
    def compile_step(self) -> bool:
        """The whole training step compiled as one (`compile: step`)."""
        return self.compile == "step"

    def uses_bf16(self, device_type: str) -> bool:
        """Whether the step computes in bf16 on this device type: the one reading of `precision`."""
        return self.precision == "bf16" or (self.precision == "auto" and device_type == "cuda")


@dataclass
class CheckpointingConfig:
    period: int = 1250  # iterations between DCP checkpoints (one is also written when training stops)
    max_to_keep: int = 3  # newest ckpt/<it>/ directories kept
    keep_every: int | None = None  # additionally keep ckpt/<it>_keep/ when (it+1) % keep_every == 0
    resume: bool = True  # continue from the latest complete checkpoint in output_dir/ckpt

    def __post_init__(self) -> None:
        for key in ("period", "max_to_keep"):
            require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        require(
            self.keep_every is None or self.keep_every >= 1,
            "keep_every",
            f"must be >= 1 or null, got {self.keep_every}",
        )


@dataclass
class HealthConfig:
    """Whether a run learns (dinov3_core.train.health): the DINO loss must leave ln K after the warm-ups, and the
    teacher's features must not collapse on held-out probe tiles."""

    policy: Literal["warn", "stop", "off"] = "warn"  # what a run that does not learn does: log it, or end there
    # Nats below ln K the DINO loss must reach, averaged over `patience` iterations. Runs that cannot learn stay
    # within ±0.005 (measured on the sample tiles); learning ones pass 0.02 within the first half of 1,000 iterations.
    min_gap: float = 0.02
    patience: int = 50  # iterations the gap is averaged over
    judge_at: float = 0.5  # share of the run by which the gap must be reached (never before warm-ups + patience)
    # The probe (dinov3_core.train.health_probe): tiles scored at every eval checkpoint (0: no probe), slides
    # kept out of training for it (0: the probe tiles come from the training slides), and the collapse alarm:
    # the teacher's CLS effective rank on the probe must stay above this (the evaluate gate's default).
    probe_tiles: int = 256
    holdout_slides: int = 0
    min_effective_rank: float = 0.02

    def __post_init__(self) -> None:
        require(self.min_gap >= 0, "min_gap", f"must be >= 0 nats, got {self.min_gap}")
        require(self.patience >= 1, "patience", f"must be >= 1 iteration, got {self.patience}")
        require(0.0 <= self.judge_at <= 1.0, "judge_at", f"must be a share of the run in [0, 1], got {self.judge_at}")
        require(self.probe_tiles == 0 or self.probe_tiles >= 2, "probe_tiles", "must be 0 (no probe) or >= 2")
        require(self.holdout_slides >= 0, "holdout_slides", f"must be >= 0, got {self.holdout_slides}")
        require(0 <= self.min_effective_rank < 1, "min_effective_rank", "must be in [0, 1)")


@dataclass
class EvaluationConfig:
    eval_period_iterations: int = 12500  # teacher-only eval/training_<it>/teacher_checkpoint.pth; 0: only at end

    def __post_init__(self) -> None:
        require(
            self.eval_period_iterations >= 0,
            "eval_period_iterations",
            f"must be >= 0 (0: only at the end), got {self.eval_period_iterations}",
        )


def _require_epochs(epochs: float, key: str) -> None:
    require(epochs >= 0 and math.isfinite(epochs), key, f"must be >= 0, got {epochs}")


@dataclass
class PretrainConfig:
    """Domain-adaptive (continued) DINOv3 pretraining on tile stores."""

    output_dir: str = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    crops: CropsConfig = field(default_factory=CropsConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    losses: LossesConfig = field(default_factory=LossesConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    # System metrics on: a training run is long enough for host/GPU utilisation curves to matter.
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(system_metrics=True))


# ---------------------------------------------------------------------------------------------- derived


def total_iterations(cfg: PretrainConfig) -> int:
    return cfg.optim.epochs * cfg.train.epoch_length


def length_summary(cfg: PretrainConfig) -> str:
    """How the run's length follows from the config (logged at start: a run's length is otherwise a riddle)."""
    total = total_iterations(cfg)
    text = f"{total} iterations = optim.epochs {cfg.optim.epochs} × train.epoch_length {cfg.train.epoch_length}"
    if cfg.train.stop_at is not None and cfg.train.stop_at < total:
        text += f"; this run stops at train.stop_at={cfg.train.stop_at} (the schedules keep the full length)"
    return text


def start_summary(cfg: PretrainConfig, resume_from: Any = None) -> str:
    """Where the weights come from (logged at start; loading is strict, so a run that got here matched every key)."""
    if resume_from is not None:
        return f"resumes from its checkpoint {resume_from}"
    pretrain_dir = getattr(cfg, "pretrain_dir", None)  # gram: continues the pretraining run's last checkpoint
    if pretrain_dir:
        return f"continues the pretraining run {pretrain_dir} (student, teacher, optimizer)"
    if cfg.student.pretrained_weights:
        return (
            f"warm start from {cfg.student.pretrained_weights} (every backbone tensor matched its key, strict; "
            "the heads start fresh)"
        )
    return "backbone from random initialisation (seed train.seed)"


def epochs_to_iterations(cfg: PretrainConfig, epochs: float) -> int:
    return round(epochs * cfg.train.epoch_length)


def validate(cfg: PretrainConfig) -> None:
    """Checks across sections that need no data, model or devices (each section checks its own keys when it is
    built, see `__post_init__`); each error names the key and what to set."""
    if not cfg.data.stores:
        raise ConfigError("data.stores is empty: set data.stores=[path/to/tiles.zarr] (one or more tile stores)")
    total = total_iterations(cfg)
    warmup = epochs_to_iterations(cfg, cfg.optim.warmup_epochs)
    if not 0 <= warmup <= total:
        raise ConfigError(f"optim.warmup_epochs gives {warmup} warmup iterations, outside [0, {total}]")
    # A schedule still warming up when the run ends cannot learn what the recipe intends (dinov3_core.train.health).
    for key, epochs, what in (
        ("teacher.warmup_teacher_temp_epochs", cfg.teacher.warmup_teacher_temp_epochs, "the teacher temperature"),
        ("optim.freeze_last_layer_epochs", cfg.optim.freeze_last_layer_epochs, "the heads' last layers"),
    ):
        if isinstance(epochs, str):
            continue  # auto: fitted to the run's length
        its = epochs_to_iterations(cfg, epochs)
        if its and its >= total:
            raise ConfigError(
                f"{key}={epochs} epochs is {its} iterations, but the run has {total} (optim.epochs × "
                f"train.epoch_length): {what} would still be warming up or frozen when it ends; shorten {key} or "
                "lengthen the run"
            )
    patch = MC.patch_size(cfg)
    for key, size in (("crops.global_size", cfg.crops.global_size), ("crops.local_size", cfg.crops.local_size)):
        if size % patch:
            raise ConfigError(f"{key}={size} is not a multiple of the patch size {patch}")
