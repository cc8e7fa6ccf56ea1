"""Typed config of a whole-pipeline run (`load_pipeline_config`; named configs: configs/pipeline/).

    wsidino pipeline --slides /data/slides --workdir /runs/lab1 --config vitb16-1gpu --weights vitb16 \
        pretrain.train.stop_at=2000 --from convert --force export

A named pipeline config picks each stage's named config (cpu: the demo and smoke path; vit{s,b,l}16-1gpu: one
GPU; vitb16: one 8-GPU node). Any stage key goes after the stage's name (`pretrain.train.stop_at=100`).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omegaconf import MISSING

from dinov3_core.chain import ChainConfig, StageChoice, add_stage_overrides, default_choices, route_overrides
from dinov3_core.config import ConfigError, load_config, parse_overrides
from dinov3_core.stages import STAGES, get_stage
from dinov3_core.tracking import TrackingConfig

WEIGHTS_DIR_ENV = "WSIDINO_WEIGHTS_DIR"
# Released backbones a `weights` preset can name, as Meta ships them: dinov3_<name>_pretrain_<dataset>-<hash>.pth
WEIGHT_PRESETS = ("vits16", "vits16plus", "vitb16", "vitl16", "vitl16plus", "vith16plus", "vit7b16")


def _stage(value: str, key: str) -> None:
    get_stage(value, key)  # a ConfigError naming the key and the closest stage


@dataclass
class PipelineConfig(ChainConfig):
    """Slides → tiles → pretraining → gram → backbone → ONNX → evaluation → features under `workdir`."""

    slides: str = MISSING  # a directory (searched recursively), a glob, a slide file, or a .txt/.csv list
    workdir: str = MISSING  # every output, and the MLflow store unless tracking.uri says otherwise
    annotations: str | None = None  # QuPath <slide_id>.geojson folder or CSV for evaluate (null: label-free)
    # Released DINOv3 backbone to warm-start from: a local .pth, or a preset (vitb16, …) looked up in
    # `weights_dir` as Meta names the file (never downloaded). null: the pretrain config's own (random init).
    weights: str | None = None
    weights_dir: str | None = None  # null → $WSIDINO_WEIGHTS_DIR
    gram_anchoring: bool = True  # false: convert the pretraining run directly
    start_at: str = "tile"  # `--from`: earlier stages are taken as they are on disk
    stop_after: str = "extract"  # `--to`
    force: list[str] = field(default_factory=list)  # rerun these even when their manifest is current
    yes: bool = False  # `--yes`: run even when the training would take more than a day on this machine's CPU
    # champion: extract with the registry's @champion after evaluation (the candidate when it was promoted or
    # there is no champion yet); candidate: with this run's model.
    extract_model: Literal["champion", "candidate"] = "champion"
    # Each stage's named config and overrides (`pretrain.config=vitb16-1gpu`, `pretrain.train.stop_at=100`)
    stages: dict[str, StageChoice] = field(default_factory=default_choices)
    # uri null: $MLFLOW_TRACKING_URI, else sqlite:///<workdir>/mlflow.db (artifacts in <workdir>/mlartifacts)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        _stage(self.start_at, "start_at")
        _stage(self.stop_after, "stop_after")
        for name in self.force:
            _stage(name, "force")
        names = STAGES.names
        if names.index(self.start_at) > names.index(self.stop_after):
            raise ConfigError(f"{self.start_at} comes after stop_after={self.stop_after}", key="start_at")

    def selected(self) -> list[str]:
        """The stages this run covers, in order (gram left out when gram anchoring is off)."""
        names = STAGES.names
        return self.chained(names[names.index(self.start_at) : names.index(self.stop_after) + 1])

    def tracking_uri(self) -> str:
        """The configured server or store, else $MLFLOW_TRACKING_URI, else a SQLite store in the workdir."""
        default = f"sqlite:///{Path(self.workdir).expanduser().resolve() / 'mlflow.db'}"
        return self.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or default


def load_pipeline_config(config: str | None, overrides: Sequence[str] | Mapping[str, Any] = ()) -> PipelineConfig:
    """Schema defaults ← named config (configs/pipeline/<name>.yaml) or YAML ← overrides (stage keys
    routed).

    The tracking URI is resolved here (a fixed `tracking.uri` from then on), so every stage logs to the same
    store as the pipeline's own run."""
    values = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides)
    own, extra = route_overrides(values)
    cfg = load_config(PipelineConfig, config, own, stage="pipeline")
    add_stage_overrides(cfg, extra)
    cfg.tracking.uri = cfg.tracking_uri()
    return cfg


def resolve_weights(cfg: PipelineConfig) -> Path | None:
    """The warm-start file `weights` names: a path, or a preset found in the weights folder."""
    if not cfg.weights:
        return None
    given = Path(cfg.weights).expanduser()
    if given.is_file():
        return given.resolve()
    name = cfg.weights.removeprefix("dinov3_")
    if name not in WEIGHT_PRESETS:
        if given.suffix in (".pth", ".pt", ".safetensors") or os.sep in cfg.weights:
            raise ConfigError(f"weights: file not found: {given}; give the path of a released DINOv3 backbone .pth")
        close = difflib.get_close_matches(name, WEIGHT_PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"weights: {cfg.weights!r} is neither a file nor a preset{hint}; presets: {', '.join(WEIGHT_PRESETS)}"
        )
    folder = cfg.weights_dir or os.environ.get(WEIGHTS_DIR_ENV)
    if not folder:
        raise ConfigError(
            f"weights={name}: set weights_dir=DIR (or ${WEIGHTS_DIR_ENV}) to the folder holding Meta's released "
            f"dinov3_{name}_pretrain_*.pth, or give the file's path; weights are never downloaded"
        )
    found = sorted(Path(folder).expanduser().glob(f"dinov3_{name}_pretrain_*.pth"))
    if not found:
        raise ConfigError(
            f"weights={name}: no dinov3_{name}_pretrain_*.pth in {folder}; download it from Meta's DINOv3 release "
            "(https://github.com/facebookresearch/dinov3) into that folder, or give the file's path"
        )
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ConfigError(f"weights={name}: several files in {folder} ({names}); give the one you mean as a path")
    return found[0].resolve()


__all__ = ["WEIGHTS_DIR_ENV", "WEIGHT_PRESETS", "PipelineConfig", "load_pipeline_config", "resolve_weights"]
