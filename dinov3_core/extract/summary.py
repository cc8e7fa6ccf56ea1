"""What the extract stage's manifest keeps of a run (`ExtractSummary`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dinov3_core.stage import Summary


@dataclass
class ExtractSummary(Summary):
    slides_extracted: int = 0
    slides_up_to_date: int = 0
    tiles: int | None = None
    tiles_per_s: float | None = None
    model_hash: str | None = None
    backend: str | None = None
    ranks: int | None = None  # a job of more than one rank: how many, and each one's rate
    tiles_per_s_per_rank: list[float] | None = None


def summarize(r: Mapping[str, Any]) -> ExtractSummary:
    """An extract run (`ExtractResult` as a dict, or the job's run record) as the manifest keeps it."""
    s = ExtractSummary(
        len(r.get("extracted", [])),
        len(r.get("skipped", [])),
        r.get("tiles"),
        round(float(r.get("tiles_per_s", 0.0)), 1),
        r.get("model_hash"),
        r.get("backend"),
    )
    ranks = r.get("ranks") or []
    if len(ranks) > 1:
        s.ranks, s.tiles_per_s_per_rank = len(ranks), [x["tiles_per_s"] for x in ranks]
    return s


__all__ = ["ExtractSummary", "summarize"]
