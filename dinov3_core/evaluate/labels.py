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

import logging
import math
import time
from collections import Counter
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

logger = logging.getLogger(__name__)

GEOJSON_SUFFIX = ".geojson"
PROGRESS_EVERY_S = 10.0
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
        raise LabelError(
            f"{source} {what}; give a folder of <slide_id>.geojson files exported from QuPath or a CSV "
            "file with the header slide_id,x,y,label"
        )
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
        for name, colour in found.colours.items():  # one colour per class: the first slide's, as QuPath keeps one
            report.colours.setdefault(name, colour)
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
    """Each class claims the tiles whose centre lies inside the union of its polygons (holes excluded, a centre on
    an edge claimed only where the union goes on beyond it) and, with `min_overlap`, whose area those polygons cover
    by at least that fraction.

    No union of the class is built: an R-tree over the tile centres (shapely.STRtree) finds the centres each polygon
    contains, with the polygon prepared, so a million small polygons take seconds. Only a centre on an edge, where
    the union may differ from its parts (two polygons of one class side by side), is decided on the union of the
    few polygons that touch it."""
    names = sorted({name for name, _ in shapes})
    centres = slide.coords + slide.tile / 2
    hits = np.zeros((len(names), len(slide.coords)), dtype=bool)
    if not shapes or not len(slide.coords):
        return slide_labels(slide.slide_id, hits, names)
    geoms = np.array([shape for _, shape in shapes], dtype=object)
    number = {name: k for k, name in enumerate(names)}
    klass = np.array([number[name] for name, _ in shapes], dtype=np.int64)
    points = shapely.points(centres)
    tree = shapely.STRtree(points)
    inside, centre = tree.query(geoms, predicate="contains")  # (polygon, tile) pairs; the polygon is prepared
    hits[klass[inside], centre] = True
    on_edge, edge_centre = tree.query(geoms, predicate="touches")
    if len(on_edge):
        _edge_centres(hits, geoms, klass, on_edge, edge_centre, centres)
    if min_overlap > 0:
        _apply_min_overlap(hits, geoms, klass, slide, min_overlap)
    return slide_labels(slide.slide_id, hits, names)


def _edge_centres(
    hits: np.ndarray,
    geoms: np.ndarray,
    klass: np.ndarray,
    polygon: np.ndarray,
    tile: np.ndarray,
    centres: np.ndarray,
) -> None:
    """A centre on the edge of a polygon of a class that does not already claim it: inside the class's union when
    the union of the class's polygons covering the centre (the only ones near it) has it in its interior."""
    open_ = ~hits[klass[polygon], tile]
    pairs = sorted(set(zip(klass[polygon[open_]].tolist(), tile[open_].tolist(), strict=True)))
    for k, t in pairs:
        near = polygon[(tile == t) & (klass[polygon] == k)]
        union = shapely.union_all(geoms[near])
        hits[k, t] = bool(shapely.contains_xy(union, centres[t, 0], centres[t, 1]))


def _apply_min_overlap(
    hits: np.ndarray, geoms: np.ndarray, klass: np.ndarray, slide: SlideTiles, min_overlap: float
) -> None:
    """Keep a class's claim on a tile only when the class's polygons cover at least `min_overlap` of its area."""
    claimed = np.flatnonzero(hits.any(axis=0))
    if not len(claimed):
        return
    t = slide.tile
    x, y = slide.coords[claimed, 0], slide.coords[claimed, 1]
    boxes = shapely.box(x, y, x + t, y + t)
    polygon, box = shapely.STRtree(boxes).query(geoms, predicate="intersects")
    claim = hits[klass[polygon], claimed[box]]  # pairs of a class with a tile it claims
    polygon, box = polygon[claim], box[claim]
    covered = np.zeros(hits.shape, dtype=bool)
    shapely.prepare(geoms[np.unique(polygon)])  # a large polygon answers many tiles' `covers` quickly
    whole = shapely.covers(geoms[polygon], boxes[box])
    covered[klass[polygon[whole]], claimed[box[whole]]] = True
    rest = ~covered[klass[polygon], claimed[box]]
    order = np.lexsort((polygon[rest], box[rest], klass[polygon[rest]]))
    kk, bb, pp = klass[polygon[rest]][order], box[rest][order], polygon[rest][order]
    if not len(kk):
        hits &= covered
        return
    starts = np.flatnonzero(np.r_[True, (kk[1:] != kk[:-1]) | (bb[1:] != bb[:-1])])
    ticker_start = last = time.monotonic()
    for n, (lo, hi) in enumerate(zip(starts, [*starts[1:], len(kk)], strict=True)):
        k, b = int(kk[lo]), int(bb[lo])
        union = shapely.union_all(geoms[pp[lo:hi]])
        share = 1.0 if shapely.covers(union, boxes[b]) else shapely.area(shapely.intersection(boxes[b], union)) / t**2
        covered[k, claimed[b]] = share >= min_overlap - OVERLAP_TOLERANCE
        if (now := time.monotonic()) - last >= PROGRESS_EVERY_S:
            last = now
            logger.info("%s: overlap of %d/%d tiles, %.0f s", slide.slide_id, n, len(starts), now - ticker_start)
    hits &= covered


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
