"""Reading QuPath GeoJSON exports: classified polygons and multipolygons, repaired when invalid, with everything
left out counted (unclassified features, points, lines, empty geometry) and errors naming the file and feature.

QuPath writes one `FeatureCollection` per image (or a bare list of features, or one Feature); the class is
`properties.classification.name` (older exports: `classification.names`, joined with ": ").
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import shapely
import shapely.errors
import shapely.geometry

from dinov3_core.errors import WsidinoError

logger = logging.getLogger(__name__)

POLYGONAL = frozenset({"Polygon", "MultiPolygon"})
# QuPath's annotation exports are a few MB, tens with detailed outlines; a million small polygons is hundreds of MB
# and takes several times that in memory to read. Beyond the cap, the file is more likely a cell-detection export than
# annotations.
MAX_GEOJSON_BYTES = 512 << 20
CHUNK = 1 << 16  # geometries built together by shapely.from_ragged_array
PROGRESS_EVERY_S = 10.0
NO_CLASSIFICATION = "no classification"
EMPTY_GEOMETRY = "empty geometry"


class LabelError(WsidinoError, ValueError):
    """The annotations cannot label the tile store: wrong path, unknown slides or tiles, another coordinate system."""


class MalformedAnnotations(LabelError):
    """An annotation file is not GeoJSON / CSV of the expected shape; the message names the file and the place."""


@dataclass
class GeoJsonAnnotations:
    """The classified polygons of one GeoJSON file, and what was left out or repaired on the way."""

    path: Path
    shapes: list[tuple[str, shapely.Geometry]]  # (class name, Polygon | MultiPolygon), valid, 2-D, non-empty
    skipped: dict[str, int]  # reason → features ignored
    repaired: int  # invalid polygons repaired with shapely.make_valid
    # class name → the RGB its features carry (`classification.color`, the first seen): what QuPath draws it in
    colours: dict[str, tuple[int, int, int]] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------- GeoJSON


def read_geojson(path: str | Path) -> GeoJsonAnnotations:
    """The (class, polygon) pairs of a QuPath GeoJSON export: a FeatureCollection, a list of features or a Feature.

    Features without a classification and geometries other than Polygon / MultiPolygon are skipped and counted;
    invalid polygons (self-intersections, ...) are repaired with `shapely.make_valid`. Raises `MalformedAnnotations`
    naming the file (and the feature index) for bad JSON or an unreadable geometry.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as err:
        raise LabelError(f"cannot read annotation file {path}: {err.strerror or err}") from None
    if size > MAX_GEOJSON_BYTES:
        raise MalformedAnnotations(
            f"{path} is {size / 2**20:.0f} MB, over the {MAX_GEOJSON_BYTES >> 20} MB an annotation file may take; "
            "export only the annotations that label tissue (not cell detections), or simplify their outlines in "
            "QuPath (Objects › Annotations › Simplify shape), and export again"
        )
    if size > 50 << 20:
        logger.info("reading %s (%.0f MB of annotations)", path, size / 2**20)
    try:
        doc = json.loads(path.read_text(encoding="utf-8-sig"))
    except OSError as err:
        raise LabelError(f"cannot read annotation file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise MalformedAnnotations(f"{path} is not UTF-8 text; export it again from QuPath as GeoJSON") from None
    except json.JSONDecodeError as err:
        raise MalformedAnnotations(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); export it again from "
            "QuPath (File › Export objects as GeoJSON)"
        ) from None

    names: list[str] = []
    geometries: list[dict[str, Any]] = []
    index: list[int] = []  # feature number of each kept geometry, for messages
    skipped: Counter[str] = Counter()
    colours: dict[str, tuple[int, int, int]] = {}
    features = _features(doc, path)
    ticker = _Ticker(f"reading {path}", len(features))
    for i, feature in enumerate(features):
        ticker.tick(i)
        where = f"{path}, feature {i}"
        if not isinstance(feature, dict):
            raise MalformedAnnotations(f"{where} is a {type(feature).__name__}, not a GeoJSON Feature object")
        geometry = feature.get("geometry")
        if geometry is None:
            skipped[EMPTY_GEOMETRY] += 1
            continue
        if not isinstance(geometry, dict) or not isinstance(geometry.get("type"), str):
            raise MalformedAnnotations(f"{where}: 'geometry' must be an object with a 'type'; got {geometry!r:.80}")
        if geometry["type"] not in POLYGONAL:
            skipped[f"unsupported geometry ({geometry['type']})"] += 1
            continue
        name = _class_name(feature, where)
        if name is None:
            skipped[NO_CLASSIFICATION] += 1
            continue
        if name not in colours and (colour := _class_colour(feature)) is not None:
            colours[name] = colour
        names.append(name)
        geometries.append(geometry)
        index.append(i)
    shapes = np.concatenate(
        [_read_geometries(geometries[k : k + CHUNK], index[k : k + CHUNK], path) for k in range(0, len(index), CHUNK)]
        or [np.empty(0, dtype=object)]
    )
    shapes = shapely.force_2d(shapes)
    invalid = np.flatnonzero(~shapely.is_empty(shapes) & ~shapely.is_valid(shapes))
    repaired = 0
    for k in invalid:  # few: each repaired alone
        shapes[k] = _polygonal_part(shapely.make_valid(shapes[k]))
        repaired += not shapes[k].is_empty  # a sliver repairs into lines only: counted as skipped, below
    empty = shapely.is_empty(shapes)
    skipped[EMPTY_GEOMETRY] += int(empty.sum())
    if not skipped[EMPTY_GEOMETRY]:
        del skipped[EMPTY_GEOMETRY]
    kept = [(names[k], shapes[k]) for k in np.flatnonzero(~empty).tolist()]
    return GeoJsonAnnotations(path, kept, dict(sorted(skipped.items())), repaired, colours)


class _Ticker:
    """A log line every PROGRESS_EVERY_S seconds through a long loop (a file of a million objects)."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total = what, total
        self.start = self.last = time.monotonic()

    def tick(self, done: int) -> None:
        if done % 4096 == 0 and (now := time.monotonic()) - self.last >= PROGRESS_EVERY_S:
            self.last = now
            logger.info("%s: %d/%d objects, %.0f s", self.what, done, self.total, now - self.start)


def _read_geometries(geometries: list[dict[str, Any]], index: list[int], path: Path) -> np.ndarray:
    """Polygons and multipolygons built together from their coordinates (shapely.from_ragged_array), so a file of a
    million small objects takes seconds; a chunk holding anything but closed rings of ≥ 4 finite [x, y(, z)]
    numbers is built one geometry at a time as before, which names the feature at fault."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        built = _ragged(geometries)
    if built is None:
        return np.array(
            [_read_geometry(g, f"{path}, feature {i}") for g, i in zip(geometries, index, strict=True)],
            dtype=object,
        )
    coords, which = shapely.get_coordinates(built, return_index=True)
    bad = which[~np.isfinite(coords).all(axis=1)]
    if len(bad):
        _read_geometry(geometries[bad[0]], f"{path}, feature {index[bad[0]]}")  # raises, naming the feature
    return built


def _ragged(geometries: list[dict[str, Any]]) -> np.ndarray | None:
    """The geometries in bulk, or None when one of them is not of the plain shape (see `_read_geometries`)."""
    points: list[Any] = []
    ring_sizes: list[int] = []
    rings_per_part: list[int] = []
    parts_per_geometry: list[int] = []
    multi: list[bool] = []
    try:
        for geometry in geometries:
            is_multi = geometry["type"] == "MultiPolygon"
            coordinates = geometry["coordinates"]
            parts = coordinates if is_multi else (coordinates,)
            for part in parts:
                for ring in part:
                    points.extend(ring)
                    ring_sizes.append(len(ring))
                rings_per_part.append(len(part))
            parts_per_geometry.append(len(parts))
            multi.append(is_multi)
        xy = np.asarray(points, dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        return None
    sizes = np.asarray(ring_sizes, dtype=np.int64)
    if xy.ndim != 2 or xy.shape[1] not in (2, 3) or len(sizes) == 0 or (sizes < 4).any():
        return None
    if 0 in rings_per_part or 0 in parts_per_geometry:
        return None  # an empty polygon: built alone
    ring_offsets = np.concatenate([[0], np.cumsum(sizes)])
    if not (xy[ring_offsets[:-1]] == xy[ring_offsets[1:] - 1]).all():
        return None  # a ring not closed (shapely.geometry.shape closes it), or a NaN corner
    part_offsets = np.concatenate([[0], np.cumsum(rings_per_part)])
    parts_built = shapely.from_ragged_array(shapely.GeometryType.POLYGON, xy, (ring_offsets, part_offsets))
    is_multi = np.asarray(multi)
    first_part = np.concatenate([[0], np.cumsum(parts_per_geometry)[:-1]])
    out = np.empty(len(geometries), dtype=object)
    out[~is_multi] = parts_built[first_part[~is_multi]]
    if is_multi.any():
        owner = np.repeat(np.arange(len(geometries)), parts_per_geometry)
        mine = is_multi[owner]
        shapely.multipolygons(parts_built[mine], indices=owner[mine], out=out)
    return out


def _features(doc: Any, path: Path) -> list[Any]:
    """The feature list of the three shapes QuPath writes."""
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict) and doc.get("type") == "FeatureCollection":
        features = doc.get("features")
        if not isinstance(features, list):
            raise MalformedAnnotations(f"{path}: the FeatureCollection has no 'features' list")
        return features
    if isinstance(doc, dict) and doc.get("type") == "Feature":
        return [doc]
    found = doc.get("type") if isinstance(doc, dict) else type(doc).__name__
    raise MalformedAnnotations(
        f"{path}: expected a GeoJSON FeatureCollection, a list of features or a Feature, got {found!r}; "
        "export the annotations from QuPath with File › Export objects as GeoJSON"
    )


def _class_name(feature: dict[str, Any], where: str) -> str | None:
    """properties.classification.name; None when the feature has no classification."""
    properties = feature.get("properties") or {}
    if not isinstance(properties, dict):
        raise MalformedAnnotations(f"{where}: 'properties' must be an object")
    classification = properties.get("classification")
    if isinstance(classification, dict):
        name = classification.get("name")
        names = classification.get("names")
        # Derived classes ("Tumor: Positive") may come as a list of names only.
        if name is None and isinstance(names, list) and names and all(isinstance(n, str) for n in names):
            name = ": ".join(names)
    else:
        name = classification
    if name is None or name == "":
        return None
    if not isinstance(name, str):
        raise MalformedAnnotations(f"{where}: classification name must be a string, got {name!r:.80}")
    return name


def _class_colour(feature: dict[str, Any]) -> tuple[int, int, int] | None:
    """The class's RGB as QuPath exports it: `classification.color` [r, g, b] (0.2 and later) or a packed
    `colorRGB` integer (older exports); None when absent or not a colour (a colour is a nicety, never an error)."""
    classification = (feature.get("properties") or {}).get("classification")
    if not isinstance(classification, dict):
        return None
    colour = classification.get("color", classification.get("colorRGB"))
    if isinstance(colour, bool):
        return None
    if isinstance(colour, int):
        return ((colour >> 16) & 255, (colour >> 8) & 255, colour & 255)
    if isinstance(colour, list) and len(colour) >= 3 and all(isinstance(c, int | float) for c in colour[:3]):
        rgb = tuple(int(min(255, max(0, round(c)))) for c in colour[:3])
        return (rgb[0], rgb[1], rgb[2])
    return None


def _read_geometry(geometry: dict[str, Any], where: str) -> shapely.Geometry:
    try:
        # A NaN coordinate makes GEOS warn; it is reported below as an error instead.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            shape = shapely.geometry.shape(geometry)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, shapely.errors.ShapelyError) as err:
        raise MalformedAnnotations(
            f"{where}: cannot read the {geometry['type']} geometry ({type(err).__name__}: {err}); each ring must be "
            "a list of at least 4 [x, y] points, the first repeated last. Export it again from QuPath"
        ) from None
    if not np.isfinite(shapely.get_coordinates(shape)).all():
        raise MalformedAnnotations(f"{where}: the geometry has a NaN or infinite coordinate; fix or delete it")
    return shapely.force_2d(shape)


def _polygonal_part(shape: shapely.Geometry) -> shapely.Geometry:
    """The polygons of a repaired geometry: make_valid turns a bow-tie into two triangles but a sliver into lines."""
    parts = shapely.get_parts(shape)
    keep = [p for p in parts if p.geom_type in POLYGONAL]
    return shapely.union_all(keep) if keep else shapely.Polygon()


__all__ = ["GeoJsonAnnotations", "LabelError", "MalformedAnnotations", "read_geojson"]
