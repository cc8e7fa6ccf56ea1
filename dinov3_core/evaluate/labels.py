"""Tile labels from the lab's annotations: QuPath GeoJSON polygons or a CSV of tile origins.

Two inputs, one result (`LabelReport`: per slide the labelled rows of the tile store, counts, warnings):

* a folder of ``<slide_id>.geojson`` files exported from QuPath, in level-0 pixel coordinates. A tile takes a
  class when its **centre** lies inside that class's polygons (unioned per class, so holes are excluded and
  overlapping polygons of one class count once) and, with ``min_overlap`` > 0, when those polygons also cover at
  least that fraction of the tile's area. A tile claimed by two or more classes is *ambiguous*: counted and left
  out, never guessed.
* a CSV with the header ``slide_id,x,y,label``: x, y are a tile's level-0 origin exactly as in the store's
  ``coords``. Conflicting labels for one tile make it ambiguous.

``rows`` index the slide's arrays in the store (``tiles``, ``coords``, ...), ascending; slides come sorted.
Every tile of a labelled slide is exactly one of labelled, unlabelled or ambiguous.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import shapely
import shapely.errors
import shapely.geometry

from dinov3_core.evaluate.geojson import (
    GeoJsonAnnotations,
    LabelError,
    MalformedAnnotations,
    read_geojson,
)
from dinov3_core.evaluate.label_report import (
    LabelReport,
    SlideLabels,
    SlideTiles,
    listed,
    read_slide,
    slide_labels,
)
from dinov3_core.evaluate.labels_csv import label_csv, read_csv
from dinov3_core.tiling import store as ts

__all__ = [
    "GeoJsonAnnotations",
    "LabelError",
    "LabelReport",
    "MalformedAnnotations",
    "SlideLabels",
    "label_tiles",
    "read_geojson",
]

GEOJSON_SUFFIX = ".geojson"
CORNER_FRACTION = 1 / 8  # annotations confined to this share of the slide in x and y look like thumbnail coords
# Area ratios are computed in floating point: a tile covered exactly at the threshold must not fall just below it.
OVERLAP_TOLERANCE = 1e-9
QUPATH_EXPORT = (
    "export the annotations from QuPath in level-0 pixel coordinates (File › Export objects as GeoJSON on the "
    "full-resolution image, no downsample)"
)


def label_tiles(
    store: str | Path,
    annotations: str | Path,
    *,
    min_overlap: float = 0.0,
    slide_ids: Iterable[str] | None = None,
) -> LabelReport:
    """Label the tiles of `store` from `annotations`: a folder of ``<slide_id>.geojson`` or a ``.csv`` file.

    ``min_overlap`` (GeoJSON only): the share of a tile's area its class's polygons must cover besides its centre
    (0 = centre rule only). ``slide_ids``: label only these slides of the store (default: all).
    """
    try:
        overlap = float(min_overlap)
    except (TypeError, ValueError):
        overlap = math.nan  # fails the range check below, with the value in the message
    if not 0.0 <= overlap <= 1.0:
        raise LabelError(f"min_overlap must be a fraction of a tile's area in [0, 1], got {min_overlap!r}")
    root = ts.check_store(Path(store).expanduser())
    store_ids = ts.complete_slide_ids(root)
    if not store_ids:
        raise LabelError(f"tile store {root} has no slides to label; run `wsidino tile` first")
    selected = _select(store_ids, slide_ids, root)
    source = Path(annotations).expanduser()
    if source.is_dir():
        return _label_geojson(root, source, store_ids, selected, overlap)
    if source.is_file() and source.suffix.lower() == ".csv":
        return label_csv(root, source, store_ids, selected, overlap)
    what = "does not exist" if not source.exists() else "is neither a folder nor a .csv file"
    raise LabelError(
        f"annotations {source} {what}; give a folder of <slide_id>.geojson files exported from QuPath or a CSV "
        "file with the header slide_id,x,y,label"
    )


def annotation_problems(annotations: str | Path) -> list[str]:
    """Why the annotations cannot be read, one line per file, each naming it (empty: every file parses). Checked
    before a pipeline starts, so a broken export is found before hours of training, not after."""
    source = Path(annotations).expanduser()
    try:
        if source.is_dir():
            paths = sorted(p for p in source.iterdir() if p.name.lower().endswith(GEOJSON_SUFFIX) and p.is_file())
            if not paths:
                raise LabelError(
                    f"no {GEOJSON_SUFFIX} files in {source}; export one <slide_id>{GEOJSON_SUFFIX} per slide from "
                    "QuPath, or give a CSV file with the header slide_id,x,y,label"
                )
            problems = []
            for path in paths:
                try:
                    read_geojson(path)
                except LabelError as err:
                    problems.append(str(err) if str(path) in str(err) else f"{path}: {err}")
            return problems
        if source.is_file() and source.suffix.lower() == ".csv":
            read_csv(source)
            return []
        what = "does not exist" if not source.exists() else "is neither a folder nor a .csv file"
        raise LabelError(f"{source} {what}; give a folder of <slide_id>.geojson files exported from QuPath or a CSV "
                         "file with the header slide_id,x,y,label")  # fmt: skip
    except LabelError as err:
        return [str(err)]
    except OSError as err:
        return [f"{source}: cannot read it ({err.strerror})"]


def _select(store_ids: list[str], slide_ids: Iterable[str] | None, root: Path) -> list[str]:
    if slide_ids is None:
        return list(store_ids)
    wanted = {slide_ids} if isinstance(slide_ids, str) else set(slide_ids)
    absent = sorted(wanted - set(store_ids))
    if absent:
        raise LabelError(f"slide id(s) not in the tile store {root}: {listed(absent)}; pick from {listed(store_ids)}")
    return sorted(wanted)


# ----------------------------------------------------------------------------------------------- by polygons


def _label_geojson(
    root: Path, folder: Path, store_ids: list[str], selected: list[str], min_overlap: float
) -> LabelReport:
    files, unknown = _match_files(folder, store_ids)
    report = LabelReport(annotations=folder, min_overlap=min_overlap, unknown=unknown)
    report.missing = [sid for sid in selected if sid not in files]
    if len(report.missing) == len(selected):
        raise LabelError(
            f"no .geojson file in {folder} names a selected slide of the tile store {root} (files: "
            f"{listed(unknown) or 'only ones for unselected slides'}); name each file <slide_id>.geojson, slide ids: "
            f"{listed(selected)}"
        )
    skipped: Counter[str] = Counter()
    for sid in selected:
        if sid not in files:
            continue
        found = read_geojson(files[sid])
        skipped.update(found.skipped)
        report.repaired_features += found.repaired
        slide = read_slide(root, sid)
        _check_bounds(found, slide)
        labels = _label_by_polygons(slide, found.shapes, min_overlap)
        report.slides[sid] = labels
        if not found.shapes:
            report.warnings.append(
                f"{found.path} has no classified Polygon or MultiPolygon (skipped: {found.skipped or 'none'}); "
                f"slide {sid!r} gets no labels. Classify the annotations in QuPath before exporting"
            )
        elif warning := _corner_warning(found, slide, labels):
            report.warnings.append(warning)
    report.skipped_features = dict(sorted(skipped.items()))
    return report


def _match_files(folder: Path, store_ids: list[str]) -> tuple[dict[str, Path], list[str]]:
    """slide id → its file; and the stems of files naming no slide of the store."""
    paths = sorted(p for p in folder.iterdir() if p.name.lower().endswith(GEOJSON_SUFFIX) and p.is_file())
    if not paths:
        raise LabelError(
            f"no {GEOJSON_SUFFIX} files in {folder}; export one <slide_id>{GEOJSON_SUFFIX} per slide from QuPath, "
            "or give a CSV file with the header slide_id,x,y,label"
        )
    known = set(store_ids)
    found: dict[str, Path] = {}
    unknown: list[str] = []
    for path in paths:
        stem = path.name[: -len(GEOJSON_SUFFIX)]
        # QuPath scripts often name the export after the image file ("slide.svs.geojson"); slide ids have no suffix.
        sid = stem if stem in known else Path(stem).stem if Path(stem).stem in known else None
        if sid is None:
            unknown.append(stem)
        elif sid in found:
            raise LabelError(f"{found[sid]} and {path} both annotate slide {sid!r}; merge them in QuPath, keep one")
        else:
            found[sid] = path
    return found, unknown


def _label_by_polygons(
    slide: SlideTiles, shapes: list[tuple[str, shapely.Geometry]], min_overlap: float
) -> SlideLabels:
    by_class: dict[str, list[shapely.Geometry]] = defaultdict(list)
    for name, shape in shapes:
        by_class[name].append(shape)
    names = sorted(by_class)
    centres = slide.coords + slide.tile / 2
    hits = np.zeros((len(names), len(slide.coords)), dtype=bool)
    for k, name in enumerate(names):
        union = shapely.union_all(by_class[name])
        shapely.prepare(union)  # a prepared geometry answers point queries for 10⁵ tiles in milliseconds
        inside = shapely.contains_xy(union, centres[:, 0], centres[:, 1])
        if min_overlap > 0 and inside.any():
            idx = np.flatnonzero(inside)
            inside[idx] = _covered_fraction(union, slide.coords[idx], slide.tile) >= min_overlap - OVERLAP_TOLERANCE
        hits[k] = inside
    return slide_labels(slide.slide_id, hits, names)


def _covered_fraction(union: shapely.Geometry, origins: np.ndarray, tile: float) -> np.ndarray:
    """Share of each tile's area inside `union`; the exact intersection only for tiles not wholly covered."""
    boxes = shapely.box(origins[:, 0], origins[:, 1], origins[:, 0] + tile, origins[:, 1] + tile)
    fraction = np.ones(len(boxes))
    partial = ~shapely.covers(union, boxes)
    fraction[partial] = shapely.area(shapely.intersection(boxes[partial], union)) / (tile * tile)
    return fraction


def _check_bounds(found: GeoJsonAnnotations, slide: SlideTiles) -> None:
    """Annotations beyond the slide (by more than a tile) cannot be level-0 pixels of this slide."""
    if not found.shapes or slide.width is None or slide.height is None:
        return
    x0, y0, x1, y1 = shapely.total_bounds([shape for _, shape in found.shapes])
    t = slide.tile
    if x0 < -t or y0 < -t or x1 > slide.width + t or y1 > slide.height + t:
        raise LabelError(
            f"{found.path}: the annotations span x {x0:.0f}…{x1:.0f}, y {y0:.0f}…{y1:.0f} px, beyond slide "
            f"{slide.slide_id!r} ({slide.width}×{slide.height} px at level 0): they look like they are in another "
            f"coordinate system (another image's, or scaled up); check the file belongs to this slide and "
            f"{QUPATH_EXPORT}"
        )


def _corner_warning(found: GeoJsonAnnotations, slide: SlideTiles, labels: SlideLabels) -> str | None:
    """Annotations squeezed into the top-left corner that label nothing: likely coordinates of a thumbnail."""
    if slide.width is None or slide.height is None or len(labels.rows) or labels.ambiguous:
        return None
    _, _, x1, y1 = shapely.total_bounds([shape for _, shape in found.shapes])
    if x1 >= slide.width * CORNER_FRACTION or y1 >= slide.height * CORNER_FRACTION:
        return None
    centres = slide.coords + slide.tile / 2
    if not ((centres[:, 0] > x1) | (centres[:, 1] > y1)).any():
        return None  # every tile is in that corner too: nothing suggests a scale mismatch
    return (
        f"{found.path}: every annotation lies within x < {x1:.0f}, y < {y1:.0f} px, the top-left corner of slide "
        f"{slide.slide_id!r} ({slide.width}×{slide.height} px at level 0), and labels no tile: the annotations look "
        f"like they are in another coordinate system (e.g. exported from a downsampled thumbnail); {QUPATH_EXPORT}"
    )
