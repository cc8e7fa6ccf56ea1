"""Flow parameters as pydantic models: what the Prefect UI renders as forms.

Each form names only the required paths, a config name and `key=value` overrides (plus the launch settings of
training stages, `LaunchParams`: `dinov3_core.launch.training.LaunchSettings` and the chosen backend's section):
every config field is declared once, in its stage's dataclass, and `dinov3_core.config.load_config` checks every
key against it (naming the closest valid key on a typo) and validates its values. So a bound can never differ
between a form and the stage. Optional fields render as plain inputs, empty meaning None (`dinov3_core.forms`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from dinov3_core.config import ConfigError, parse_overrides
from dinov3_core.forms import ui
from tasks.launch_params import LaunchParams, LocalLaunch

Override = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*=.*$")]


class TrackingParams(BaseModel):
    """Where MLflow runs go."""

    model_config = ConfigDict(extra="forbid", title="MLflow")

    tracking_uri: str | None = Field(
        None,
        title="MLflow tracking URI",
        description="e.g. http://127.0.0.1:5000. Empty: the config's, else $MLFLOW_TRACKING_URI, "
        "else the mlflow.db of the work directory the output is in (a pipeline's workdir, else the output's folder).",
        json_schema_extra=ui(0),
    )
    experiment: str | None = Field(
        None,
        min_length=1,
        title="MLflow experiment",
        description="Empty: the config's (default wsidino).",
        json_schema_extra=ui(1),
    )
    enabled: bool = Field(True, title="Log to MLflow", json_schema_extra=ui(2))

    def config_values(self) -> dict[str, Any]:
        values: dict[str, Any] = {"tracking.enabled": self.enabled}
        if self.tracking_uri:
            values["tracking.uri"] = self.tracking_uri
        if self.experiment:
            values["tracking.experiment"] = self.experiment
        return values


class StageOptions(BaseModel):
    """A named config (or YAML path) plus `key=value` overrides for one stage."""

    model_config = ConfigDict(extra="forbid")

    config: str | None = Field(
        None,
        title="Named config or YAML",
        description="A name under dinov3_core/configs/<stage>/ (e.g. tiny, vitb16-continued, default) or a YAML path. "
        "Empty: the built-in defaults.",
        json_schema_extra=ui(0),
    )
    overrides: list[Override] = Field(
        default_factory=list,
        title="Config overrides",
        description="Any other key of the stage's config as key=value (`wsidino <stage> --help` lists examples; "
        "`--print-config` shows every key); a misspelt key is named with the closest valid one.",
        json_schema_extra=ui(1),
    )


def merge_values(overrides: Sequence[str], fields: dict[str, Any], where: str) -> dict[str, Any]:
    """`overrides` plus every set field; a key set both ways with different values is an error."""
    values = parse_overrides(overrides)
    for key, value in fields.items():
        if value is None:
            continue
        if key in values and values[key] != value:
            raise ConfigError(
                f"{where}: {key!r} is set both as a parameter ({value!r}) and in overrides ({values[key]!r}); "
                "set it once"
            )
        values[key] = value
    return values


class DaskParams(BaseModel):
    """Where the tile flow tiles: the tile engine's own process pool on this host, or slide groups on Dask."""

    model_config = ConfigDict(extra="forbid", title="Dask")

    address: str | None = Field(
        None,
        min_length=1,
        title="Dask scheduler address",
        description="e.g. tcp://10.0.0.5:8786: tile on this running Dask cluster, one slide group per worker "
        "thread. Every worker must see the slides and the store at the same paths (shared filesystem) and have "
        "wsidino installed; start workers with `dask worker <address> --nthreads 1`.",
        json_schema_extra=ui(0),
    )
    n_workers: int = Field(
        0,
        ge=0,
        le=1024,
        title="Local Dask workers",
        description="Without an address: 0 tiles with the engine's own `workers` processes (the CLI's engine; "
        "fastest on one machine); N tiles on a temporary local Dask cluster of N single-threaded workers.",
        json_schema_extra=ui(1),
    )

    @model_validator(mode="after")
    def _one_cluster(self) -> DaskParams:
        if self.address and self.n_workers:
            raise ValueError(
                f"dask: give a scheduler address ({self.address!r}) or a local cluster size "
                f"(n_workers={self.n_workers}), not both"
            )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.address or self.n_workers)


class TileParams(BaseModel):
    """Tile whole-slide images into a zarr tile store (µm/px-exact tiles, tissue mask, QC pictures)."""

    model_config = ConfigDict(extra="forbid", title="Tile stage parameters")

    input: str = Field(
        min_length=1,
        title="Slides",
        description="A directory (searched recursively), a glob, one slide file, or a .txt/.csv list of slide paths.",
        json_schema_extra=ui(0),
    )
    output: str = Field(
        min_length=1,
        title="Tile store",
        description="Tile store directory, e.g. /data/cohort/tiles.zarr (created if missing; reruns resume).",
        json_schema_extra=ui(1),
    )
    stage: StageOptions = Field(
        default_factory=lambda: StageOptions(config="default"),
        title="Config",
        description="e.g. overrides mpp=0.5, tile_size=224, workers=8, compressor=jpeg, filters.pen_filter=true.",
        json_schema_extra=ui(2),
    )
    tracking: TrackingParams = Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(3))
    force: bool = Field(
        False,
        title="Force",
        description="Check every slide even when the stage manifest shows the same slides and settings "
        "(complete slides are still skipped one by one).",
        json_schema_extra=ui(4),
    )
    dask: DaskParams = Field(
        default_factory=DaskParams,
        title="Dask",
        description="Tile on a Dask cluster (an existing scheduler or a temporary local one) instead of this "
        "host's process pool; the tiles are the same either way.",
        json_schema_extra=ui(5),
    )

    def config_values(self) -> dict[str, Any]:
        fields = {"input": self.input, "output": self.output, **self.tracking.config_values()}
        return merge_values(self.stage.overrides, fields, "tile")


class PretrainParams(BaseModel):
    """DINOv3 self-supervised (continued) pretraining on tile stores, as a torchrun job."""

    model_config = ConfigDict(extra="forbid", title="Pretrain stage parameters")

    stores: list[str] = Field(
        min_length=1,
        title="Tile stores",
        description="Tile store directories (…/tiles.zarr).",
        json_schema_extra=ui(0),
    )
    output_dir: str = Field(
        min_length=1,
        title="Run directory",
        description="Checkpoints (ckpt/), teacher-only eval checkpoints (eval/), metrics. Reruns resume here.",
        json_schema_extra=ui(1),
    )
    pretrained_weights: str | None = Field(
        None,
        title="Released DINOv3 weights",
        description="Local .pth of a released DINOv3 backbone to warm-start from (never downloaded). "
        "Empty: the config's.",
        json_schema_extra=ui(2),
    )
    stage: StageOptions = Field(
        default_factory=lambda: StageOptions(config="tiny"), title="Config", json_schema_extra=ui(3)
    )
    launch: LaunchParams = Field(default_factory=LocalLaunch, title="Launch", json_schema_extra=ui(4))
    tracking: TrackingParams = Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(5))
    force: bool = Field(
        False,
        title="Force",
        description="Run even when the stage manifest says the outputs are up to date.",
        json_schema_extra=ui(6),
    )

    def config_values(self) -> dict[str, Any]:
        fields = {
            "data.stores": list(self.stores),
            "output_dir": self.output_dir,
            "student.pretrained_weights": self.pretrained_weights,
            **self.tracking.config_values(),
        }
        return merge_values(self.stage.overrides, fields, "pretrain")


class GramParams(BaseModel):
    """Gram anchoring: continue a pretraining run with a frozen gram teacher chosen from its eval checkpoints."""

    model_config = ConfigDict(extra="forbid", title="Gram stage parameters")

    pretrain_dir: str = Field(
        min_length=1,
        title="Pretraining run",
        description="The pretraining run directory to continue; its eval/ holds the gram-teacher candidates.",
        json_schema_extra=ui(0),
    )
    output_dir: str = Field(
        min_length=1,
        title="Run directory",
        description="The gram stage's own run directory (reruns resume).",
        json_schema_extra=ui(1),
    )
    stores: list[str] | None = Field(
        None, title="Tile stores", description="Empty: the pretraining run's stores.", json_schema_extra=ui(2)
    )
    teacher_path: str | None = Field(
        None,
        title="Gram teacher file",
        description="An explicit teacher checkpoint. Empty: chosen from <pretrain_dir>/eval by the config's policy.",
        json_schema_extra=ui(3),
    )
    stage: StageOptions = Field(
        default_factory=lambda: StageOptions(config="tiny"), title="Config", json_schema_extra=ui(4)
    )
    launch: LaunchParams = Field(default_factory=LocalLaunch, title="Launch", json_schema_extra=ui(5))
    tracking: TrackingParams = Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(6))
    force: bool = Field(False, title="Force", json_schema_extra=ui(7))

    def config_values(self) -> dict[str, Any]:
        fields = {
            "pretrain_dir": self.pretrain_dir,
            "output_dir": self.output_dir,
            "data.stores": list(self.stores) if self.stores else None,
            "gram.teacher_path": self.teacher_path,
            **self.tracking.config_values(),
        }
        return merge_values(self.stage.overrides, fields, "gram")


class ConvertParams(BaseModel):
    """DCP training checkpoint → backbone.pth with the released DINOv3 key layout (teacher backbone only)."""

    model_config = ConfigDict(extra="forbid", title="Convert stage parameters")

    input: str = Field(
        min_length=1,
        title="Checkpoint or run",
        description="A ckpt/<iteration>/ directory, or a pretrain/gram run directory (its latest checkpoint).",
        json_schema_extra=ui(0),
    )
    output_dir: str = Field(
        min_length=1,
        title="Model directory",
        description="Receives backbone.pth and config.yaml.",
        json_schema_extra=ui(1),
    )
    stage: StageOptions = Field(default_factory=StageOptions, title="Config", json_schema_extra=ui(2))
    tracking: TrackingParams = Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(3))
    force: bool = Field(False, title="Force", json_schema_extra=ui(4))

    def config_values(self) -> dict[str, Any]:
        fields = {"input": self.input, "output_dir": self.output_dir, **self.tracking.config_values()}
        return merge_values(self.stage.overrides, fields, "convert")


class ExportParams(BaseModel):
    """backbone.pth → ONNX (dynamic batch and image size), checked against PyTorch with ONNX Runtime, registered."""

    model_config = ConfigDict(extra="forbid", title="Export stage parameters")

    weights: str = Field(
        min_length=1,
        title="Backbone weights",
        description="backbone.pth (from convert) or a released backbone.",
        json_schema_extra=ui(0),
    )
    output: str = Field(
        min_length=1, title="ONNX file", description="e.g. /models/lab/model.onnx", json_schema_extra=ui(1)
    )
    stage: StageOptions = Field(
        default_factory=StageOptions,
        title="Config",
        description="e.g. overrides register_alias=candidate, register_name=wsidino-backbone.",
        json_schema_extra=ui(2),
    )
    tracking: TrackingParams = Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(3))
    force: bool = Field(False, title="Force", json_schema_extra=ui(4))

    def config_values(self) -> dict[str, Any]:
        fields = {
            "weights": self.weights,
            "output": self.output,
            **self.tracking.config_values(),
        }
        return merge_values(self.stage.overrides, fields, "export")


class EvaluateParams(BaseModel):
    """Frozen-feature probes of the candidate, the registry's champion and a baseline; the @champion gate."""

    model_config = ConfigDict(extra="forbid", title="Evaluate stage parameters")

    store: str = Field(
        min_length=1, title="Tile store", description="Holds the annotated slides.", json_schema_extra=ui(0)
    )
    candidate: str = Field(
        min_length=1,
        title="Candidate model",
        description="model.onnx (export) or backbone.pth (convert).",
        json_schema_extra=ui(1),
    )
    output: str = Field(
        min_length=1,
        title="Evaluation directory",
        description="evaluation.json, evaluation.md, pictures, cache.",
        json_schema_extra=ui(2),
    )
    annotations: str | None = Field(
        None,
        title="Annotations",
        description="A folder of QuPath <slide_id>.geojson exports (level-0 pixels), or a CSV slide_id,x,y,label. "
        "Empty: label-free health only (no promotion unless gate.label_free=true).",
        json_schema_extra=ui(3),
    )
    stage: StageOptions = Field(
        default_factory=StageOptions,
        title="Config",
        description="e.g. overrides gate.margin=0.01, probe.bootstrap=2000, patients=/data/patients.csv.",
        json_schema_extra=ui(4),
    )
    launch: LaunchParams = Field(
        default_factory=LocalLaunch,
        title="Launch",
        description="More than one process (one per GPU): each model's labelled tiles are embedded by a torchrun "
        "job, split over the ranks; probes and the gate run once, in the flow.",
        json_schema_extra=ui(5),
    )
    tracking: TrackingParams = Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(6))
    force: bool = Field(False, title="Force", json_schema_extra=ui(7))

    def config_values(self) -> dict[str, Any]:
        fields = {
            "store": self.store,
            "candidate": self.candidate,
            "output": self.output,
            "annotations": self.annotations,
            **self.tracking.config_values(),
        }
        return merge_values(self.stage.overrides, fields, "evaluate")


class ExtractParams(BaseModel):
    """Features for every tile of a tile store, slide embeddings and PCA feature maps, into zarr."""

    model_config = ConfigDict(extra="forbid", title="Extract stage parameters")

    store: str = Field(min_length=1, title="Tile store", json_schema_extra=ui(0))
    model: str = Field(
        min_length=1,
        title="Model",
        description="model.onnx (ONNX Runtime) or backbone.pth (PyTorch).",
        json_schema_extra=ui(1),
    )
    output: str = Field(
        min_length=1, title="Feature store", description="e.g. /data/cohort/features.zarr", json_schema_extra=ui(2)
    )
    stage: StageOptions = Field(default_factory=StageOptions, title="Config", json_schema_extra=ui(3))
    launch: LaunchParams = Field(
        default_factory=LocalLaunch,
        title="Launch",
        description="More than one process (one per GPU): a torchrun job; slides and large slides' tile ranges "
        "are split over the ranks.",
        json_schema_extra=ui(4),
    )
    tracking: TrackingParams = Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(5))
    force: bool = Field(False, title="Force", json_schema_extra=ui(6))

    def config_values(self) -> dict[str, Any]:
        fields = {"store": self.store, "model": self.model, "output": self.output, **self.tracking.config_values()}
        return merge_values(self.stage.overrides, fields, "extract")


__all__ = [
    "ConvertParams",
    "DaskParams",
    "EvaluateParams",
    "ExportParams",
    "ExtractParams",
    "GramParams",
    "Override",
    "PretrainParams",
    "StageOptions",
    "TileParams",
    "TrackingParams",
    "merge_values",
]
