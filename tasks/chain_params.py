"""The forms of the flows that chain stages, `pipeline` and `retrain`: their own keys, the launch of their training
jobs, and each stage's key after its name (`pretrain.train.stop_at=100`), as `wsidino pipeline` and
`wsidino retrain` take them. The pieces they share with the stage forms are in `tasks.params`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dinov3_core.forms import ui
from dinov3_core.stages import STAGES, StageName
from tasks.launch_params import LaunchParams, LocalLaunch
from tasks.params import Override, TrackingParams, merge_values


class PipelineParams(BaseModel):
    """Slides → tiles → pretraining → gram anchoring → backbone → ONNX → evaluation → features, in one work
    directory: the fields of `wsidino pipeline` (README: "On your own slides").

    Stages whose manifest shows the same inputs and config are skipped (unless listed in `force`), so a rerun
    or a retried failed run resumes at the first stage with something to do.
    """

    model_config = ConfigDict(extra="forbid", title="Pipeline parameters")

    slides: str = Field(
        min_length=1,
        title="Slides",
        description="A directory (searched recursively), a glob, a slide file, or a .txt/.csv list of slide paths.",
        json_schema_extra=ui(0),
    )
    workdir: str = Field(
        min_length=1,
        title="Work directory",
        description="Every stage's output goes under it, e.g. /data/runs/lab1 (the MLflow store too, unless a "
        "tracking URI is set below).",
        json_schema_extra=ui(1),
    )
    config: str = Field(
        "cpu",
        title="Pipeline config",
        description="A name under dinov3_core/configs/pipeline/: cpu (demo and smoke runs), vits16-1gpu, vitb16-1gpu, "
        "vitl16-1gpu (one GPU), vitb16, vitl16 (8 GPUs; docs/hardware.md), or a YAML path.",
        json_schema_extra=ui(2),
    )
    weights: str | None = Field(
        None,
        title="Released DINOv3 weights",
        description="Warm start: a local .pth, or a preset (vitb16, …) found in weights_dir / $WSIDINO_WEIGHTS_DIR. "
        "Empty: random init.",
        json_schema_extra=ui(3),
    )
    annotations: str | None = Field(
        None,
        title="Annotations",
        description="QuPath <slide_id>.geojson folder (or CSV slide_id,x,y,label) for the evaluate stage. "
        "Empty: label-free health only, no promotion.",
        json_schema_extra=ui(4),
    )
    start_at: StageName = Field("tile", title="Start at (--from)", json_schema_extra=ui(5))
    stop_after: StageName = Field("extract", title="Stop after (--to)", json_schema_extra=ui(6))
    force: list[StageName] = Field(
        default_factory=list,
        title="Force stages",
        description="Recompute these even when up to date.",
        json_schema_extra=ui(7),
    )
    overrides: list[Override] = Field(
        default_factory=list,
        title="Overrides",
        description="Pipeline keys (gram_anchoring=false, extract_model=candidate, weights_dir=/weights) or any "
        "stage's key after its name (pretrain.train.stop_at=100, tile.workers=8, pretrain.config=vitb16-1gpu).",
        json_schema_extra=ui(8),
    )
    launch: LaunchParams = Field(default_factory=LocalLaunch, title="Training launch", json_schema_extra=ui(9))
    tracking: TrackingParams = Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(10))

    @model_validator(mode="after")
    def _ordered(self) -> PipelineParams:
        if STAGES.names.index(self.start_at) > STAGES.names.index(self.stop_after):
            raise ValueError(f"start_at={self.start_at} comes after stop_after={self.stop_after}")
        return self

    def config_values(self) -> dict[str, Any]:
        fields = {
            "slides": self.slides,
            "workdir": self.workdir,
            "weights": self.weights,
            "annotations": self.annotations,
            "start_at": self.start_at,
            "stop_after": self.stop_after,
            "force": list(self.force) or None,
            **self.tracking.config_values(),
        }
        return merge_values(self.overrides, fields, "pipeline")


class RetrainParams(BaseModel):
    """One scheduled-retraining cycle: tile new slides, train from the champion when the cohort grew, evaluate,
    promote only if better, extract with the champion (docs/retraining.md).

    Each run is a new cycle under `<root>/cycles/`; retrying a failed run resumes its cycle.
    """

    model_config = ConfigDict(extra="forbid", title="Retrain parameters")

    slides: str = Field(
        min_length=1,
        title="Slides",
        description="The cohort's slides (grows between runs): a directory, a glob, or a .txt/.csv list.",
        json_schema_extra=ui(0),
    )
    root: str = Field(
        min_length=1,
        title="Retraining root",
        description="tiles.zarr, cycles/<id>/ and features/ live here, e.g. /data/retrain.",
        json_schema_extra=ui(1),
    )
    annotations: str | None = Field(
        None,
        title="Annotations",
        description="QuPath <slide_id>.geojson folder (or CSV slide_id,x,y,label) for the gate. Empty: label-free "
        "health only, no promotion unless evaluate.gate.label_free=true.",
        json_schema_extra=ui(2),
    )
    config: str = Field(
        "tiny",
        title="Retrain config",
        description="A name under dinov3_core/configs/retrain/ (tiny: CPU-sized; vitb16: GPU host) or a YAML path.",
        json_schema_extra=ui(3),
    )
    overrides: list[Override] = Field(
        default_factory=list,
        title="Overrides",
        description="Retrain keys (trigger.min_new_slides=5, length.iterations=2000, retention.keep_last=3, "
        "warm_start=released, pretrained_weights=/w.pth) or any stage's key after its name "
        "(pretrain.train.stop_at=100, evaluate.gate.margin=0.01).",
        json_schema_extra=ui(4),
    )
    force: bool = Field(
        False,
        title="Train even if nothing changed",
        description="trigger.force: train this cycle regardless.",
        json_schema_extra=ui(5),
    )
    launch: LaunchParams = Field(default_factory=LocalLaunch, title="Training launch", json_schema_extra=ui(6))
    tracking: TrackingParams = Field(default_factory=TrackingParams, title="MLflow", json_schema_extra=ui(7))

    def config_values(self) -> dict[str, Any]:
        fields = {
            "slides": self.slides,
            "root": self.root,
            "annotations": self.annotations,
            "trigger.force": True if self.force else None,
            **self.tracking.config_values(),
        }
        return merge_values(self.overrides, fields, "retrain")


__all__ = ["PipelineParams", "RetrainParams"]
