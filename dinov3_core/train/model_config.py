"""The model sections of the pretrain config (`student`, `heads`) and what follows from them alone: the backbone's
constructor overrides, the heads' kwargs, the adaptation (LoRA / frozen blocks) recorded in checkpoints, and the
structure a warm start must match. `config.PretrainConfig` holds them; the optimisation, schedule and data
sections stay in `config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from dinov3_core.config import ConfigError, require
from dinov3_core.models import backbone_kwargs

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "ffn")  # dinov3_core.models.adaptation.TARGETS


@dataclass
class LoRAConfig:
    """LoRA adapters on the student backbone's Linear layers (peft); the teacher follows them by EMA."""

    rank: int = 0  # 0: off (every backbone weight trains, as upstream)
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter input (student only: the teacher runs in eval mode)
    # qkv, proj (attention), fc1, fc2 (GELU MLP), ffn (every FFN linear, SwiGLU w1/w2/w3 included)
    targets: list[str] = field(default_factory=lambda: ["qkv", "proj"])

    def __post_init__(self) -> None:
        require(self.rank >= 0, "rank", f"must be >= 0 (0: no LoRA), got {self.rank}")
        require(self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        require(bool(self.targets), "targets", f"must name at least one of {list(LORA_TARGETS)}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        require(not unknown, "targets", f"unknown {unknown}; valid: {list(LORA_TARGETS)}")


@dataclass
class StudentConfig:
    """Backbone architecture, or a released backbone to continue from (warm start with fresh heads)."""

    arch: str = "vit_large"  # preset (vit_test, vit_small, …) or released name (vitb16, …); "auto": from the file
    pretrained_weights: str | None = None  # released backbone .pth (or eval teacher_checkpoint.pth): warm start
    drop_path_rate: float = 0.3
    layerscale: float | None = None  # null: the arch's own setting (released archs: 1e-5)
    n_storage_tokens: int | None = None  # null: the arch's own setting (released archs: 4)
    backbone_overrides: dict[str, Any] = field(default_factory=dict)  # any other DinoVisionTransformer kwarg
    # Parameter-efficient adaptation (dinov3_core.models.adaptation): the first freeze_blocks blocks get no
    # gradient; with freeze_patch_embed also the patch embedding and learned tokens, so backward stops at block
    # K (less activation memory). Checked against the depth when the model is built.
    freeze_blocks: int = 0
    freeze_patch_embed: bool = True
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        require(
            self.freeze_blocks >= 0, "freeze_blocks", f"must be >= 0 (0: every block trains), got {self.freeze_blocks}"
        )
        require(
            self.arch != "auto" or bool(self.pretrained_weights),
            "arch",
            "auto needs pretrained_weights (the arch is read from the file)",
        )


@dataclass
class HeadConfig:
    n_prototypes: int = 65536
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    nlayers: int = 3


@dataclass
class HeadsConfig:
    dino: HeadConfig = field(default_factory=HeadConfig)
    ibot: HeadConfig = field(default_factory=HeadConfig)


# What makes two backbones' weights interchangeable: a warm start must match these exactly.
STRUCTURE = ("embed_dim", "depth", "num_heads", "patch_size", "n_storage_tokens")


class ModelSections(Protocol):
    """A config with the model sections (`PretrainConfig`, `GramConfig`): all the functions below read."""

    student: StudentConfig


def structure_mismatch(theirs: Mapping[str, Any], cfg: ModelSections) -> str:
    """The structural settings in which a backbone's constructor kwargs (`theirs`) differ from what `cfg` trains,
    as "embed_dim 64 vs 768, …" (theirs vs the config's); empty when they fit or a setting is unknown."""
    ours = backbone_kwargs(cfg.student.arch, **backbone_overrides(cfg))
    diff = {k: (theirs[k], ours[k]) for k in STRUCTURE if k in theirs and k in ours and theirs[k] != ours[k]}
    return ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items())


def backbone_overrides(cfg: ModelSections) -> dict[str, Any]:
    """Constructor overrides for the student backbone on top of its arch (preset or released)."""
    s = cfg.student
    out: dict[str, Any] = {"drop_path_rate": s.drop_path_rate}
    if s.layerscale is not None:
        out["layerscale_init"] = s.layerscale
    if s.n_storage_tokens is not None:
        out["n_storage_tokens"] = s.n_storage_tokens
    out.update(s.backbone_overrides)
    return out


def adaptation_meta(cfg: ModelSections) -> dict[str, Any]:
    """The settings that shape the trainable model (checkpoint meta.json: convert merges LoRA with them)."""
    s = cfg.student
    lora = {"rank": s.lora.rank, "alpha": s.lora.alpha, "dropout": s.lora.dropout, "targets": list(s.lora.targets)}
    return {"freeze_blocks": s.freeze_blocks, "freeze_patch_embed": s.freeze_patch_embed, "lora": lora}


def head_kwargs(head: HeadConfig) -> dict[str, int]:
    return {
        "out_dim": head.n_prototypes,
        "hidden_dim": head.hidden_dim,
        "bottleneck_dim": head.bottleneck_dim,
        "nlayers": head.nlayers,
    }


def adaptation_summary(cfg: ModelSections) -> str:
    """What of the backbone trains, for the start line ("" when all of it does)."""
    s, parts = cfg.student, []
    if s.lora.rank:
        parts.append(f"LoRA r={s.lora.rank} on {', '.join(s.lora.targets)}, base weights frozen")
    if s.freeze_blocks:
        parts.append(f"first {s.freeze_blocks} block(s){' and patch embedding' if s.freeze_patch_embed else ''} frozen")
    return "; ".join(parts)


def configured_depth(cfg: ModelSections) -> int | None:
    """Blocks of the configured backbone; None when only the weights file tells (student.arch=auto)."""
    if "depth" in cfg.student.backbone_overrides:
        return int(cfg.student.backbone_overrides["depth"])
    if cfg.student.arch == "auto":
        return None
    return int(backbone_kwargs(cfg.student.arch)["depth"])


def patch_size(cfg: ModelSections) -> int:
    if "patch_size" in cfg.student.backbone_overrides:
        return int(cfg.student.backbone_overrides["patch_size"])
    if cfg.student.arch == "auto":
        return 16  # checked again against the file when it is read
    try:
        return int(backbone_kwargs(cfg.student.arch).get("patch_size", 16))
    except ValueError as err:
        raise ConfigError(f"student.arch: {err}") from None
