"""Typed config of a retraining cycle (`load_retrain_config`; named configs under configs/retrain/).

    wsidino retrain --slides /data/slides --root /data/retrain --config tiny \
        trigger.min_new_slides=5 pretrain.train.stop_at=100

A key that starts with a stage name and is not one of `StageChoice`'s own (`pretrain.train.stop_at=100`) is that
stage's config override: it is appended to `<stage>.overrides` and checked against the stage's own schema when
the cycle builds the stage configs, before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import MISSING

from dinov3_core.chain import ChainConfig, StageChoice, add_stage_overrides, default_choices, route_overrides
from dinov3_core.config import ConfigError, load_config, parse_overrides, require
from dinov3_core.errors import WsidinoError
from dinov3_core.tracking import TrackingConfig


class RetrainError(WsidinoError):
    """A cycle cannot start or go on: another cycle holds the root, the registry is unreachable, a champion that
    does not fit the configured architecture."""


@dataclass
class TriggerConfig:
    """When a cycle trains: the cohort changed enough since the last trained cycle (else the champion's data)."""

    min_new_slides: int = 1  # new or re-scanned slides
    min_new_tiles: int = 0  # tiles of those slides (0: no tile condition)
    force: bool = False  # train even when the cohort did not change

    def __post_init__(self) -> None:
        require(self.min_new_slides >= 0, "min_new_slides", f"must be >= 0, got {self.min_new_slides}")
        require(self.min_new_tiles >= 0, "min_new_tiles", f"must be >= 0, got {self.min_new_tiles}")


@dataclass
class LengthConfig:
    """How long each cycle trains, set per cycle (never inherited from the previous run).

    `iterations`: exactly this many; `passes`: this many passes over the snapshot's tiles (iterations =
    passes × tiles / global batch, at least `min_iterations`); neither: the pretrain config's own length."""

    iterations: int | None = None
    passes: float | None = None
    min_iterations: int = 100

    def __post_init__(self) -> None:
        require(self.iterations is None or self.passes is None, "iterations", "set iterations or passes, not both")
        require(self.iterations is None or self.iterations >= 1, "iterations", f"must be >= 1, got {self.iterations}")
        require(self.passes is None or self.passes > 0, "passes", f"must be > 0, got {self.passes}")
        require(self.min_iterations >= 1, "min_iterations", f"must be >= 1, got {self.min_iterations}")


@dataclass
class RetentionConfig:
    """What finished cycles keep. The champion's cycle and the running cycle are never touched."""

    keep_last: int = 3  # non-champion trained cycles that keep backbone, ONNX and evaluation
    delete_checkpoints: bool = True  # DCP checkpoints (ckpt/) of finished non-champion cycles
    # Their teacher-only eval checkpoints (eval/training_*/teacher_checkpoint.pth: one model each, several a run)
    delete_eval_checkpoints: bool = True
    keep_previous_champions: bool = True  # cycles once promoted keep backbone, ONNX and evaluation (rollback)
    delete_replaced_features: bool = True  # an old champion's feature store, once the new one is complete

    def __post_init__(self) -> None:
        require(self.keep_last >= 0, "keep_last", f"must be >= 0, got {self.keep_last}")


@dataclass
class RetrainConfig(ChainConfig):
    """One retraining cycle over the cohort under `root` (see docs/retraining.md)."""

    slides: str = MISSING  # the cohort's slides: directory, glob, or .txt/.csv list (grows between cycles)
    root: str = MISSING  # tiles.zarr, cycles/<id>/, features/ and the cycle lock live here
    annotations: str | None = None  # QuPath GeoJSON folder or CSV for the evaluation (null: label-free only)
    gram_anchoring: bool = True
    # champion: the registry's @champion backbone (fails when there is none); released: `pretrained_weights`;
    # scratch: random init; auto: champion, else released weights when set, else scratch.
    warm_start: Literal["auto", "champion", "released", "scratch"] = "auto"
    pretrained_weights: str | None = None  # local released DINOv3 backbone .pth (never downloaded)
    # Warm-start from @champion even when the gate never promoted it (the alias moved by hand): recorded, not advised.
    trust_unvetted_champion: bool = False
    register_name: str = "wsidino-backbone"
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    length: LengthConfig = field(default_factory=LengthConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    # Each stage's named config and overrides (`pretrain.config=vitb16-continued`, `pretrain.train.stop_at=100`)
    stages: dict[str, StageChoice] = field(default_factory=default_choices)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def load_retrain_config(config: str | None, overrides: Sequence[str] | Mapping[str, Any] = ()) -> RetrainConfig:
    """Schema defaults ← named config (configs/retrain/<name>.yaml) or YAML ← overrides (stage keys
    routed)."""
    values = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides)
    own, extra = route_overrides(values)
    cfg = load_config(RetrainConfig, config, own, stage="retrain")
    add_stage_overrides(cfg, extra)
    if cfg.warm_start == "released" and not cfg.pretrained_weights:
        raise ConfigError("warm_start=released needs pretrained_weights (a local released DINOv3 backbone .pth)")
    return cfg


__all__ = [
    "LengthConfig",
    "RetentionConfig",
    "RetrainConfig",
    "RetrainError",
    "StageChoice",
    "TriggerConfig",
    "load_retrain_config",
    "route_overrides",
]
