"""What the convert stage's manifest keeps of a run (`ConvertSummary`)."""

from __future__ import annotations

from dataclasses import dataclass

from dinov3_core.stage import Summary


@dataclass
class ConvertSummary(Summary):
    checkpoint: str | None = None
    iteration: int | None = None
    arch: str | None = None
    backbone_mb: float | None = None
    checkpoint_mb: float | None = None


__all__ = ["ConvertSummary"]
