"""The lab's annotations checked against the slides before anything is trained: every GeoJSON file names a slide
of the cohort, its polygons lie on that slide in level-0 pixels (an export from a downsampled image is found and
its factor named), and the classes are listed with the tiles each would label.

Tiles are counted on the grid the tile stage cuts (its tile size at its µm/px) whose centres fall on tissue (the
slide's thumbnail mask, as the tile stage computes it) inside a polygon: the centre rule of `labels.label_tiles`,
before the tile stage's other filters (blur, pen, tissue fraction), so it is an estimate from above.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import shapely
from shapely import affinity

from dinov3_core.evaluate.geojson import LabelError, read_geojson
from dinov3_core.evaluate.labels import GEOJSON_SUFFIX, QUPATH_EXPORT

# Downsample factors an export from a lower-resolution image is tried at (QuPath exports of a pyramid level or a
# thumbnail are scaled by one of these).
DOWNSAMPLES = (2, 4, 8, 16, 32, 64)
MOSTLY_ON_TISSUE = 0.85  # share of the annotated tile centres on tissue, for a file drawn on this image


@dataclass
class AnnotationCheck:
    """What the annotations would give the evaluation, and what stops them."""

    problems: list[str] = field(default_factory=list)  # one line each, naming the file
    classes: dict[str, int] = field(default_factory=dict)  # class → tiles it would label (all slides)
    slides: int = 0  # annotated slides of the cohort

    def describe(self) -> str:
        if not self.classes:
            return f"annotations: {self.slides} slide(s), no tile labelled"
        counts = ", ".join(f"{name} {n}" for name, n in sorted(self.classes.items()))
        return f"annotations: {self.slides} slide(s); tiles each class would label: {counts}"


def check_annotations(folder: str | Path, slides: Mapping[str, str | Path], tiling: Any) -> AnnotationCheck:
    """Check a folder of `<slide_id>.geojson` files against the cohort's slides (slide id → file).

    Args:
        folder: The annotations folder (a CSV is checked when it is labelled, against the tile store).
        slides: The slides the chain will tile, by the id the tile stage gives them.
        tiling: The chain's `TileConfig` (tile size, µm/px, tissue mask, µm/px overrides).
    """
    out = AnnotationCheck()
    source = Path(folder).expanduser()
    if not source.is_dir():
        return out
    for path in sorted(p for p in source.iterdir() if p.name.lower().endswith(GEOJSON_SUFFIX) and p.is_file()):
        stem = path.name[: -len(GEOJSON_SUFFIX)]
        # QuPath scripts often name the export after the image file ("slide.svs.geojson"); slide ids have no suffix.
        slide_id = stem if stem in slides else Path(stem).stem if Path(stem).stem in slides else None
        if slide_id is None:
            close = difflib.get_close_matches(stem, list(slides), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            out.problems.append(
                f"{path}: names no slide of the cohort{hint} (slides: {_some(slides)}); name it "
                f"<slide_id>{GEOJSON_SUFFIX}"
            )
            continue
        try:
            problem, counts = _check_slide(path, slide_id, Path(slides[slide_id]), tiling)
        except LabelError as err:
            problem, counts = str(err), {}
        out.slides += 1
        if problem:
            out.problems.append(problem)
        for name, n in counts.items():
            out.classes[name] = out.classes.get(name, 0) + n
    return out


def _check_slide(path: Path, slide_id: str, slide_path: Path, tiling: Any) -> tuple[str | None, dict[str, int]]:
    from dinov3_core.tiling.slide import SlideError, describe_slide, load_mpp_overrides, open_slide, read_downsampled
    from dinov3_core.tiling.tissue import grid_coords, tissue_mask

    found = read_geojson(path)
    if not found.shapes:
        return None, {}
    try:
        slide = open_slide(slide_path)
        overrides = {**load_mpp_overrides(tiling.mpp_overrides), **tiling.mpp_by_slide}
        info = describe_slide(slide, slide_path, overrides, tiling.default_mpp)
    except SlideError:
        return None, {}  # the tile stage names the slide's problem; its annotations are checked once it is tiled
    x0, y0, x1, y1 = (float(v) for v in shapely.total_bounds([shape for _, shape in found.shapes]))
    target_mpp = float(min(tiling.mpp) if isinstance(tiling.mpp, list | tuple) else tiling.mpp)
    tile = max(1, round(tiling.tile_size * target_mpp / info.mpp))  # level-0 px
    where = f"slide {slide_id!r} ({info.width}×{info.height} px at level 0)"
    if x0 < -tile or y0 < -tile or x1 > info.width + tile or y1 > info.height + tile:
        return (
            f"{path}: the annotations span x {x0:.0f}…{x1:.0f}, y {y0:.0f}…{y1:.0f} px, beyond {where}: they are in "
            f"another image's coordinates (another slide's, or scaled up); {QUPATH_EXPORT}"
        ), {}
    thumb, scale = read_downsampled(slide, info, tiling.tissue.thumbnail_mpp)
    mask, _ = tissue_mask(thumb, info.mpp * scale, tiling.tissue)
    centres = grid_coords(info.width, info.height, tile, tile).astype(np.float64) + tile / 2
    mx = np.clip((centres[:, 0] / scale).astype(int), 0, mask.shape[1] - 1)
    my = np.clip((centres[:, 1] / scale).astype(int), 0, mask.shape[0] - 1)
    tissue = mask[my, mx]
    counts, share = _counts(found.shapes, centres, tissue, 1.0)
    # Annotators draw on tissue: polygons that lie mostly on glass, but on tissue at a pyramid level's scale, were
    # drawn on that level (or a thumbnail) and exported in its pixels.
    if share < MOSTLY_ON_TISSUE:
        for factor in DOWNSAMPLES:
            if x1 * factor > info.width + tile or y1 * factor > info.height + tile:
                break
            more, more_share = _counts(found.shapes, centres, tissue, factor)
            if more_share >= MOSTLY_ON_TISSUE and sum(more.values()) >= 2 * max(1, sum(counts.values())):
                return (
                    f"{path}: the annotations lie mostly off the tissue of {where}, but on it at {factor}× their "
                    f"coordinates: they look exported from an image downsampled {factor}×; {QUPATH_EXPORT}"
                ), {}
    if not sum(counts.values()):
        return (
            f"{path}: the annotations (x {x0:.0f}…{x1:.0f}, y {y0:.0f}…{y1:.0f} px) cover no tissue of {where}, so "
            f"they label no tile; check that the file belongs to this slide and {QUPATH_EXPORT}"
        ), {}
    return None, counts


def _counts(
    shapes: list[tuple[str, shapely.Geometry]], centres: np.ndarray, tissue: np.ndarray, factor: float
) -> tuple[dict[str, int], float]:
    """Tile centres (level-0 px) on tissue in each class's polygons, the polygons scaled by `factor` first; and the
    share of all centres in the polygons that are on tissue."""
    counts: dict[str, int] = {}
    inside_any = np.zeros(len(centres), dtype=bool)
    for name, shape in shapes:
        scaled = affinity.scale(shape, factor, factor, origin=(0, 0)) if factor != 1 else shape
        inside = shapely.contains_xy(scaled, centres[:, 0], centres[:, 1])
        inside_any |= inside
        hits = int((inside & tissue).sum())
        if hits:
            counts[str(name)] = counts.get(str(name), 0) + hits
    share = float((inside_any & tissue).sum() / inside_any.sum()) if inside_any.any() else 0.0
    return counts, share


def _some(ids: Mapping[str, Any], n: int = 5) -> str:
    names = sorted(ids)
    return ", ".join(names[:n]) + (f" … ({len(names)} in all)" if len(names) > n else "")


__all__ = ["AnnotationCheck", "check_annotations"]
