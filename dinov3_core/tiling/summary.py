"""What the tile stage's manifest keeps of a run (`TileSummary`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dinov3_core.stage import Summary


@dataclass
class TileSummary(Summary):
    ok: int = 0  # slides tiled by this run
    skipped: int = 0  # slides already in the store with the same settings
    failed: int = 0  # slides that could not be tiled (their rows say why)
    duplicate: int = 0  # inputs that are another input's bytes (or part of its DICOM slide): not tiled twice
    tiles_total: int = 0
    failed_slides: list[str] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return self.failed

    @property
    def usable(self) -> int:
        """Slides in the store after this run."""
        return self.ok + self.skipped

    def unusable(self) -> str | None:
        if self.usable:
            return None
        failed = ", ".join(self.failed_slides) or "none"
        return (
            f"no slide could be tiled (failed: {failed}); the tile log above says why for each (e.g. no µm/px in "
            "the file: set tile.mpp_overrides; not a slide; no tissue)"
        )


__all__ = ["TileSummary"]
