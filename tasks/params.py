"""Flow parameters as pydantic models: what the Prefect UI renders as forms.

Each form names only the required paths, a config name and `key=value` overrides (plus the launch settings of
training stages, `LaunchParams`: `dinov3_core.launch.training.LaunchSettings` and the chosen backend's section):
every config field is declared once, in its stage's dataclass, and `dinov3_core.config.load_config` checks every
key against it (naming the closest valid key on a typo) and validates its values. So a bound can never differ
between a form and the stage. Optional fields render as plain inputs, empty meaning None (`dinov3_core.forms`).
The sections the forms share (config and overrides, MLflow, launch, force) are declared once, by the `*_field`
functions below, each form placing them at its own positions. Each form's `INPUTS` names its input paths (field →
what to set it to): `tasks.inputs` checks that they exist before its flow runs anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from dinov3_core.config import ConfigError, parse_overrides
from dinov3_core.forms import optional_field, required_field, ui
from tasks.launch_params import LaunchParams, LocalLaunch

Override = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*=.*$")]


class TrackingParams(BaseModel):
    """Where MLflow runs go."""

    model_config = ConfigDict(extra="forbid", title="MLflow")

    tracking_uri: str | None = optional_field(
        0,
        "MLflow tracking URI",
        "e.g. http://127.0.0.1:5000. Empty: the config's, else $MLFLOW_TRACKING_URI, "
        "else the mlflow.db of the work directory the output is in (a pipeline's workdir, else the output's folder).",
    )
    experiment: str | None = optional_field(
        1,
        "MLflow experiment",
        "Empty: the config's (default wsidino).",
        min_length=1,
    )
    enabled: bool = Field(True, title="Log to MLflow", json_schema_extra=ui(2))

    def config_values(self) -> dict[str, Any]:
        values: dict[str, Any] = {"tracking.enabled": self.enabled}
        if self.tracking_uri:
            values["tracking.uri"] = self.tracking_uri
        if self.experiment:
            values["tracking.experiment"] = self.experiment
        return values


def overrides_field(position: int, description: str, title: str = "Overrides") -> Any:
    """A form's `key=value` overrides (each checked against the config's keys when the config loads)."""
    return Field(default_factory=list, title=title, description=description, json_schema_extra=ui(position))


class StageOptions(BaseModel):
    """A named config (or YAML path) plus `key=value` overrides for one stage."""

    model_config = ConfigDict(extra="forbid")

    config: str | None = optional_field(
        0,
        "Named config or YAML",
        "A name under configs/<stage>/ (e.g. tiny, vitb16-continued, default) or a YAML path. "
        "Empty: the built-in defaults.",
    )
    overrides: list[Override] = overrides_field(
        1,
        "Any other key of the stage's config as key=value (`wsidino <stage> --help` lists examples; "
        "`--print-config` shows every key); a misspelt key is named with the closest valid one.",
        title="Config overrides",
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


# The fields every form repeats, each declared once here; `position` is the field's place in its form (`ui`).


def stage_field(position: int, config: str | None = None, description: str | None = None) -> Any:
    """A stage form's "Config" section; `config` is the named config the form starts with."""
    return Field(
        default_factory=lambda: StageOptions(config=config),
        title="Config",
        description=description,
        json_schema_extra=ui(position),
    )


def tracking_field(position: int) -> Any:
    """A form's "MLflow" section."""
    return Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(position))


def launch_field(position: int, title: str = "Launch", description: str | None = None) -> Any:
    """A form's launch section: a training job's processes, nodes and backend (local unless chosen)."""
    return Field(default_factory=LocalLaunch, title=title, description=description, json_schema_extra=ui(position))


def force_field(position: int, description: str | None = None) -> Any:
    """A stage form's "Force": run even when the stage manifest says the outputs are up to date."""
    return Field(False, title="Force", description=description, json_schema_extra=ui(position))


def form_values(
    overrides: Sequence[str], tracking: TrackingParams, fields: dict[str, Any], where: str
) -> dict[str, Any]:
    """A form's config values: its own `fields` and its MLflow section, merged with its overrides (`merge_values`)."""
    return merge_values(overrides, {**fields, **tracking.config_values()}, where)


class DaskParams(BaseModel):
    """Where the tile flow tiles: the tile engine's own process pool on this host, or slide groups on Dask."""

    model_config = ConfigDict(extra="forbid", title="Dask")

    address: str | None = optional_field(
        0,
        "Dask scheduler address",
        "e.g. tcp://10.0.0.5:8786: tile on this running Dask cluster, one slide group per worker "
        "thread. Every worker must see the slides and the store at the same paths (shared filesystem) and have "
        "wsidino installed; start workers with `dask worker <address> --nthreads 1`.",
        min_length=1,
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
    INPUTS: ClassVar[dict[str, str]] = {"input": "your slides (a folder, a glob, a slide file or a .txt/.csv list)"}

    input: str = required_field(
        0, "Slides", "A directory (searched recursively), a glob, one slide file, or a .txt/.csv list of slide paths."
    )
    output: str = required_field(
        1, "Tile store", "Tile store directory, e.g. /data/cohort/tiles.zarr (created if missing; reruns resume)."
    )
    stage: StageOptions = stage_field(
        2, "default", "e.g. overrides mpp=0.5, tile_size=224, workers=8, compressor=jpeg, filters.pen_filter=true."
    )
    tracking: TrackingParams = tracking_field(3)
    force: bool = force_field(
        4,
        "Check every slide even when the stage manifest shows the same slides and settings "
        "(complete slides are still skipped one by one).",
    )
    dask: DaskParams = Field(
        default_factory=DaskParams,
        title="Dask",
        description="Tile on a Dask cluster (an existing scheduler or a temporary local one) instead of this "
        "host's process pool; the tiles are the same either way.",
        json_schema_extra=ui(5),
    )

    def config_values(self) -> dict[str, Any]:
        fields = {"input": self.input, "output": self.output}
        return form_values(self.stage.overrides, self.tracking, fields, "tile")


class PretrainParams(BaseModel):
    """DINOv3 self-supervised (continued) pretraining on tile stores, as a torchrun job."""

    model_config = ConfigDict(extra="forbid", title="Pretrain stage parameters")
    INPUTS: ClassVar[dict[str, str]] = {
        "stores": "tile stores written by the tile stage",
        "pretrained_weights": "a released DINOv3 .pth, or empty",
    }

    stores: list[str] = required_field(0, "Tile stores", "Tile store directories (…/tiles.zarr).")
    output_dir: str = required_field(
        1, "Run directory", "Checkpoints (ckpt/), teacher-only eval checkpoints (eval/), metrics. Reruns resume here."
    )
    pretrained_weights: str | None = optional_field(
        2,
        "Released DINOv3 weights",
        "Local .pth of a released DINOv3 backbone to warm-start from (never downloaded). Empty: the config's.",
    )
    stage: StageOptions = stage_field(3, "tiny")
    launch: LaunchParams = launch_field(4)
    tracking: TrackingParams = tracking_field(5)
    force: bool = force_field(6, "Run even when the stage manifest says the outputs are up to date.")

    def config_values(self) -> dict[str, Any]:
        fields = {
            "data.stores": list(self.stores),
            "output_dir": self.output_dir,
            "student.pretrained_weights": self.pretrained_weights,
        }
        return form_values(self.stage.overrides, self.tracking, fields, "pretrain")


class GramParams(BaseModel):
    """Gram anchoring: continue a pretraining run with a frozen gram teacher chosen from its eval checkpoints."""

    model_config = ConfigDict(extra="forbid", title="Gram stage parameters")
    INPUTS: ClassVar[dict[str, str]] = {
        "pretrain_dir": "a pretraining run directory",
        "stores": "tile stores, or empty",
        "teacher_path": "a teacher checkpoint, or empty",
    }

    pretrain_dir: str = required_field(
        0, "Pretraining run", "The pretraining run directory to continue; its eval/ holds the gram-teacher candidates."
    )
    output_dir: str = required_field(1, "Run directory", "The gram stage's own run directory (reruns resume).")
    stores: list[str] | None = Field(
        None, title="Tile stores", description="Empty: the pretraining run's stores.", json_schema_extra=ui(2)
    )
    teacher_path: str | None = optional_field(
        3,
        "Gram teacher file",
        "An explicit teacher checkpoint. Empty: chosen from <pretrain_dir>/eval by the config's policy.",
    )
    stage: StageOptions = stage_field(4, "tiny")
    launch: LaunchParams = launch_field(5)
    tracking: TrackingParams = tracking_field(6)
    force: bool = force_field(7)

    def config_values(self) -> dict[str, Any]:
        fields = {
            "pretrain_dir": self.pretrain_dir,
            "output_dir": self.output_dir,
            "data.stores": list(self.stores) if self.stores else None,
            "gram.teacher_path": self.teacher_path,
        }
        return form_values(self.stage.overrides, self.tracking, fields, "gram")


class ConvertParams(BaseModel):
    """DCP training checkpoint → backbone.pth with the released DINOv3 key layout (teacher backbone only)."""

    model_config = ConfigDict(extra="forbid", title="Convert stage parameters")
    INPUTS: ClassVar[dict[str, str]] = {"input": "a pretrain or gram run directory, or its ckpt/<iteration>/"}

    input: str = required_field(
        0,
        "Checkpoint or run",
        "A ckpt/<iteration>/ directory, or a pretrain/gram run directory (its latest checkpoint).",
    )
    output_dir: str = required_field(1, "Model directory", "Receives backbone.pth and config.yaml.")
    stage: StageOptions = stage_field(2)
    tracking: TrackingParams = tracking_field(3)
    force: bool = force_field(4)

    def config_values(self) -> dict[str, Any]:
        fields = {"input": self.input, "output_dir": self.output_dir}
        return form_values(self.stage.overrides, self.tracking, fields, "convert")


class ExportParams(BaseModel):
    """backbone.pth → ONNX (dynamic batch and image size), checked against PyTorch with ONNX Runtime, registered."""

    model_config = ConfigDict(extra="forbid", title="Export stage parameters")
    INPUTS: ClassVar[dict[str, str]] = {"weights": "a backbone.pth (convert's output)"}

    weights: str = required_field(0, "Backbone weights", "backbone.pth (from convert) or a released backbone.")
    output: str = required_field(1, "ONNX file", "e.g. /models/lab/model.onnx")
    stage: StageOptions = stage_field(
        2, description="e.g. overrides register_alias=candidate, register_name=wsidino-backbone."
    )
    tracking: TrackingParams = tracking_field(3)
    force: bool = force_field(4)

    def config_values(self) -> dict[str, Any]:
        fields = {"weights": self.weights, "output": self.output}
        return form_values(self.stage.overrides, self.tracking, fields, "export")


class EvaluateParams(BaseModel):
    """Frozen-feature probes of the candidate, the registry's champion and a baseline; the @champion gate."""

    model_config = ConfigDict(extra="forbid", title="Evaluate stage parameters")
    INPUTS: ClassVar[dict[str, str]] = {
        "store": "a tile store written by the tile stage",
        "candidate": "a model.onnx or backbone.pth",
        "annotations": "your annotations, or empty",
    }

    store: str = required_field(0, "Tile store", "Holds the annotated slides.")
    candidate: str = required_field(1, "Candidate model", "model.onnx (export) or backbone.pth (convert).")
    output: str = required_field(2, "Evaluation directory", "evaluation.json, evaluation.md, pictures, cache.")
    annotations: str | None = optional_field(
        3,
        "Annotations",
        "A folder of QuPath <slide_id>.geojson exports (level-0 pixels), or a CSV slide_id,x,y,label. "
        "Empty: label-free health only (no promotion unless gate.label_free=true).",
    )
    stage: StageOptions = stage_field(
        4, description="e.g. overrides gate.margin=0.01, probe.bootstrap=2000, patients=/data/patients.csv."
    )
    launch: LaunchParams = launch_field(
        5,
        description="More than one process (one per GPU): each model's labelled tiles are embedded by a torchrun "
        "job, split over the ranks; probes and the gate run once, in the flow.",
    )
    tracking: TrackingParams = tracking_field(6)
    force: bool = force_field(7)

    def config_values(self) -> dict[str, Any]:
        fields = {
            "store": self.store,
            "candidate": self.candidate,
            "output": self.output,
            "annotations": self.annotations,
        }
        return form_values(self.stage.overrides, self.tracking, fields, "evaluate")


class ExtractParams(BaseModel):
    """Features for every tile of a tile store, slide embeddings and PCA feature maps, into zarr."""

    model_config = ConfigDict(extra="forbid", title="Extract stage parameters")
    INPUTS: ClassVar[dict[str, str]] = {"store": "a tile store written by the tile stage", "model": "a model file"}

    store: str = required_field(0, "Tile store")
    model: str = required_field(1, "Model", "model.onnx (ONNX Runtime) or backbone.pth (PyTorch).")
    output: str = required_field(2, "Feature store", "e.g. /data/cohort/features.zarr")
    stage: StageOptions = stage_field(3)
    launch: LaunchParams = launch_field(
        4,
        description="More than one process (one per GPU): a torchrun job; slides and large slides' tile ranges "
        "are split over the ranks.",
    )
    tracking: TrackingParams = tracking_field(5)
    force: bool = force_field(6)

    def config_values(self) -> dict[str, Any]:
        fields = {"store": self.store, "model": self.model, "output": self.output}
        return form_values(self.stage.overrides, self.tracking, fields, "extract")


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
    "force_field",
    "form_values",
    "launch_field",
    "merge_values",
    "overrides_field",
    "stage_field",
    "tracking_field",
]
