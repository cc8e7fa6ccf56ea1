"""Typed config of the convert stage (load with `dinov3_core.config.load_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omegaconf import MISSING

from dinov3_core.config import require
from dinov3_core.tracking import TrackingConfig


@dataclass
class ConvertConfig:
    """DCP training checkpoint → released-layout `backbone.pth` (+ `config.yaml`, optional `.safetensors`)."""

    input: str = MISSING  # a DCP checkpoint dir (`<run>/ckpt/<it>/`) or a pretrain output dir (→ latest complete)
    output_dir: str = MISSING  # receives backbone.pth, config.yaml (and backbone.safetensors / full.pt)
    which: Literal["teacher", "student"] = "teacher"
    safetensors: bool = False  # also write backbone.safetensors
    full_consolidation: bool = False  # also write every key of the checkpoint into full.pt (dcp_to_torch_save)
    # A LoRA run (student.lora.rank > 0): backbone.pth always has the adapters merged in; this also writes the
    # unmerged adapter tensors (adapter.safetensors) and their settings (adapter.yaml) beside it.
    save_adapter: bool = False
    # Which checkpoint of a run: the latest (DCP), or the teacher-only eval checkpoint with the best kNN balanced
    # accuracy on `annotations` of `store` (dinov3_core.evaluate.checkpoints; the curve lands in <run>/eval/).
    select: Literal["latest", "best_knn"] = "latest"
    store: str | None = None  # tile store with annotated slides (select=best_knn)
    annotations: str | None = None  # QuPath GeoJSON folder or CSV (select=best_knn)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        require(
            self.select == "latest" or bool(self.store and self.annotations),
            "select",
            "best_knn scores the run's eval checkpoints on labelled tiles: set store=<tiles.zarr> and "
            "annotations=<GeoJSON folder or CSV> too",
        )
