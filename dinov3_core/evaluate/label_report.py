"""The result of labelling a tile store (`labels`, `labels_csv`): per slide the labelled rows, counts and warnings
(`LabelReport`, `SlideLabels`), a slide's tile origins (`read_slide`) and the rule that turns class hits into
labels (`slide_labels`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from dinov3_core.tiling import store as ts

CSV_COLUMNS = ("slide_id", "x", "y", "label")
SHOWN = 5  # line numbers / names listed in a message before "and N more"


@dataclass
class SlideLabels:
    """The labelled tiles of one slide. n_tiles = len(rows) + unlabelled + ambiguous."""

    slide_id: str
    rows: np.ndarray  # int64 rows into the slide's store arrays (tiles, coords), ascending; labelled tiles only
    labels: np.ndarray  # object array of class names, one per row
    n_tiles: int  # tiles of the slide in the store
    unlabelled: int  # claimed by no class (centre in no polygon, or overlap below min_overlap)
    ambiguous: int  # claimed by two or more classes: left out, never guessed
    classes: dict[str, int]  # class → labelled tiles, every class the slide's annotations name (0 included), sorted

    def summary(self) -> dict[str, Any]:
        return {
            "n_tiles": self.n_tiles,
            "labelled": len(self.rows),
            "unlabelled": self.unlabelled,
            "ambiguous": self.ambiguous,
            "classes": dict(self.classes),
        }


@dataclass
class LabelReport:
    """What `label_tiles` found: per-slide labels and everything a user should be told about the annotations."""

    annotations: Path
    min_overlap: float
    slides: dict[str, SlideLabels] = field(default_factory=dict)  # slides with annotations, sorted by id
    missing: list[str] = field(default_factory=list)  # selected store slides without annotations (warning)
    unknown: list[str] = field(default_factory=list)  # annotation files naming no slide of the store (warning)
    skipped_features: dict[str, int] = field(default_factory=dict)  # reason → GeoJSON features ignored
    repaired_features: int = 0  # invalid polygons repaired with shapely.make_valid
    colours: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # class → RGB of its annotations
    warnings: list[str] = field(default_factory=list)

    @property
    def classes(self) -> dict[str, int]:
        """Class → labelled tiles over all slides, sorted by class name."""
        total: Counter[str] = Counter()
        for labels in self.slides.values():
            total.update(labels.classes)
        return {name: total[name] for name in sorted(total)}

    def summary(self) -> dict[str, Any]:
        """A JSON-ready account (no per-tile arrays) for evaluation.json and the logs."""
        return {
            "annotations": str(self.annotations),
            "min_overlap": self.min_overlap,
            "classes": self.classes,
            "slides": {sid: labels.summary() for sid, labels in self.slides.items()},
            "missing": list(self.missing),
            "unknown": list(self.unknown),
            "skipped_features": dict(self.skipped_features),
            "repaired_features": self.repaired_features,
            "colours": {name: list(self.colours[name]) for name in sorted(self.colours)},
            "warnings": list(self.warnings),
        }


# ------------------------------------------------------------------------------------------------ labelling


@dataclass(frozen=True)
class SlideTiles:
    slide_id: str
    coords: np.ndarray  # (N, 2) int64 level-0 tile origins (x, y)
    tile: float  # tile side at level 0
    width: int | None  # level-0 size; None in a store that does not record it (bounds checks are skipped)
    height: int | None


def listed(items: Sequence[Any]) -> str:
    shown = ", ".join(str(i) for i in items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def read_slide(root: Path, slide_id: str) -> SlideTiles:
    attrs = ts.read_slide_attrs(root, slide_id)
    n = int(attrs.get("tile_count", 0))
    if "tile_size_level0" not in attrs:
        raise ts.TileStoreError(
            f"slide {slide_id!r} in tile store {root} has no tile_size_level0 attribute; re-tile it with `wsidino tile`"
        )
    coords = np.empty((0, 2), dtype=np.int64)
    if n:  # a slide without tiles may have no columns at all
        try:
            coords = np.asarray(zarr.open_array(str(ts.slide_dir(root, slide_id) / "coords"), mode="r")[...])
        except (OSError, ValueError, KeyError) as err:
            raise ts.TileStoreError(
                f"slide {slide_id!r} in tile store {root} has no readable coords array ({err}); delete the slide's "
                "folder and re-run `wsidino tile`"
            ) from None
    if coords.shape != (n, 2):
        raise ts.TileStoreError(
            f"slide {slide_id!r} in tile store {root} has coords of shape {coords.shape} for {n} tiles; delete the "
            "slide's folder and re-run `wsidino tile`"
        )
    width, height = attrs.get("level0_width"), attrs.get("level0_height")
    return SlideTiles(
        slide_id,
        coords.astype(np.int64, copy=False),
        float(attrs["tile_size_level0"]),
        int(width) if width is not None else None,
        int(height) if height is not None else None,
    )


def slide_labels(slide_id: str, hits: np.ndarray, names: list[str]) -> SlideLabels:
    """Labels from a (classes × tiles) boolean matrix: one class → labelled, two or more → ambiguous."""
    n = hits.shape[1]
    claims = hits.sum(axis=0)
    rows = np.flatnonzero(claims == 1).astype(np.int64)
    which = hits[:, rows].argmax(axis=0) if names else np.empty(0, dtype=np.int64)
    labels = np.array(names, dtype=object)[which] if names else np.empty(0, dtype=object)
    counts = np.bincount(which, minlength=len(names))
    ambiguous = int((claims > 1).sum())
    return SlideLabels(
        slide_id=slide_id,
        rows=rows,
        labels=labels,
        n_tiles=n,
        unlabelled=n - len(rows) - ambiguous,
        ambiguous=ambiguous,
        classes={name: int(counts[k]) for k, name in enumerate(names)},
    )
