"""The forms of the flows that chain stages, `pipeline` and `retrain`: their own keys, the launch of their training
jobs, and each stage's key after its name (`pretrain.train.stop_at=100`), as `wsidino pipeline` and
`wsidino retrain` take them. The pieces they share with the stage forms are in `tasks.params`.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dinov3_core.forms import optional_field, required_field, ui
from dinov3_core.stages import STAGES, StageName
from tasks.launch_params import LaunchParams
from tasks.params import Override, TrackingParams, form_values, launch_field, overrides_field, tracking_field


class PipelineParams(BaseModel):
    """Slides → tiles → pretraining → gram anchoring → backbone → ONNX → evaluation → features, in one work
    directory: the fields of `wsidino pipeline` (README: "On your own slides").

    Stages whose manifest shows the same inputs and config are skipped (unless listed in `force`), so a rerun
    or a retried failed run resumes at the first stage with something to do.
    """

    model_config = ConfigDict(extra="forbid", title="Pipeline parameters")
    INPUTS: ClassVar[dict[str, str]] = {
        "slides": "your slides (a folder, a glob, a slide file or a .txt/.csv list)",
        "weights": "a released DINOv3 .pth, a preset name (vitb16, ...) or empty",
        "annotations": "your annotations, or empty",
    }

    slides: str = required_field(
        0, "Slides", "A directory (searched recursively), a glob, a slide file, or a .txt/.csv list of slide paths."
    )
    workdir: str = required_field(
        1,
        "Work directory",
        "Every stage's output goes under it, e.g. /data/runs/lab1 (the MLflow store too, unless a "
        "tracking URI is set below).",
    )
    config: str = Field(
        "cpu",
        title="Pipeline config",
        description="A name under configs/pipeline/: cpu (demo and smoke runs), vits16-1gpu, vitb16-1gpu, "
        "vitl16-1gpu (one GPU), vitb16, vitl16 (8 GPUs; docs/hardware.md), or a YAML path.",
        json_schema_extra=ui(2),
    )
    weights: str | None = optional_field(
        3,
        "Released DINOv3 weights",
        "Warm start: a local .pth, or a preset (vitb16, …) found in weights_dir / $WSIDINO_WEIGHTS_DIR. "
        "Empty: random init.",
    )
    annotations: str | None = optional_field(
        4,
        "Annotations",
        "QuPath <slide_id>.geojson folder (or CSV slide_id,x,y,label) for the evaluate stage. "
        "Empty: label-free health only, no promotion.",
    )
    start_at: StageName = Field("tile", title="Start at (--from)", json_schema_extra=ui(5))
    stop_after: StageName = Field("extract", title="Stop after (--to)", json_schema_extra=ui(6))
    force: list[StageName] = Field(
        default_factory=list,
        title="Force stages",
        description="Recompute these even when up to date.",
        json_schema_extra=ui(7),
    )
    overrides: list[Override] = overrides_field(
        8,
        "Pipeline keys (gram_anchoring=false, extract_model=candidate, weights_dir=/weights) or any "
        "stage's key after its name (pretrain.train.stop_at=100, tile.workers=8, pretrain.config=vitb16-1gpu).",
    )
    launch: LaunchParams = launch_field(9, "Training launch")
    tracking: TrackingParams = tracking_field(10)

    @model_validator(mode="after")
    def _ordered(self) -> PipelineParams:
        if STAGES.names.index(self.start_at) > STAGES.names.index(self.stop_after):
            raise ValueError(f"start_at={self.start_at} comes after stop_after={self.stop_after}")
        return self

    def unused_inputs(self) -> set[str]:
        """The inputs this run does not read (`tasks.inputs`): those of stages outside start_at..stop_after, and
        `weights` when it names a preset rather than a file (resolved later, in weights_dir)."""
        stages = STAGES.names[STAGES.names.index(self.start_at) : STAGES.names.index(self.stop_after) + 1]
        unused = {name for name, stage in (("slides", "tile"), ("annotations", "evaluate")) if stage not in stages}
        path_like = self.weights and (self.weights.endswith((".pth", ".pt", ".safetensors")) or os.sep in self.weights)
        if "pretrain" not in stages or not path_like:
            unused.add("weights")
        return unused

    def config_values(self) -> dict[str, Any]:
        fields = {
            "slides": self.slides,
            "workdir": self.workdir,
            "weights": self.weights,
            "annotations": self.annotations,
            "start_at": self.start_at,
            "stop_after": self.stop_after,
            "force": list(self.force) or None,
        }
        return form_values(self.overrides, self.tracking, fields, "pipeline")


class RetrainParams(BaseModel):
    """One scheduled-retraining cycle: tile new slides, train from the champion when the cohort grew, evaluate,
    promote only if better, extract with the champion (docs/retraining.md).

    Each run is a new cycle under `<root>/cycles/`; retrying a failed run resumes its cycle.
    """

    model_config = ConfigDict(extra="forbid", title="Retrain parameters")
    INPUTS: ClassVar[dict[str, str]] = {
        "slides": "your slides (a folder, a glob, or a .txt/.csv list)",
        "annotations": "your annotations, or empty",
    }

    slides: str = required_field(
        0, "Slides", "The cohort's slides (grows between runs): a directory, a glob, or a .txt/.csv list."
    )
    root: str = required_field(
        1, "Retraining root", "tiles.zarr, cycles/<id>/ and features/ live here, e.g. /data/retrain."
    )
    annotations: str | None = optional_field(
        2,
        "Annotations",
        "QuPath <slide_id>.geojson folder (or CSV slide_id,x,y,label) for the gate. Empty: label-free "
        "health only, no promotion unless evaluate.gate.label_free=true.",
    )
    config: str = Field(
        "tiny",
        title="Retrain config",
        description="A name under configs/retrain/ (tiny: CPU-sized; vitb16: GPU host) or a YAML path.",
        json_schema_extra=ui(3),
    )
    overrides: list[Override] = overrides_field(
        4,
        "Retrain keys (trigger.min_new_slides=5, length.iterations=2000, retention.keep_last=3, "
        "warm_start=released, pretrained_weights=/w.pth) or any stage's key after its name "
        "(pretrain.train.stop_at=100, evaluate.gate.margin=0.01).",
    )
    force: bool = Field(
        False,
        title="Train even if nothing changed",
        description="trigger.force: train this cycle regardless.",
        json_schema_extra=ui(5),
    )
    launch: LaunchParams = launch_field(6, "Training launch")
    tracking: TrackingParams = tracking_field(7)

    def config_values(self) -> dict[str, Any]:
        fields = {
            "slides": self.slides,
            "root": self.root,
            "annotations": self.annotations,
            "trigger.force": True if self.force else None,
        }
        return form_values(self.overrides, self.tracking, fields, "retrain")


__all__ = ["PipelineParams", "RetrainParams"]
