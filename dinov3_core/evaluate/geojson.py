"""Reading QuPath GeoJSON exports: classified polygons and multipolygons, repaired when invalid, with everything
left out counted (unclassified features, points, lines, empty geometry) and errors naming the file and feature.

QuPath writes one `FeatureCollection` per image (or a bare list of features, or one Feature); the class is
`properties.classification.name` (older exports: `classification.names`, joined with ": ").
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import shapely
import shapely.errors
import shapely.geometry

from dinov3_core.errors import WsidinoError

POLYGONAL = frozenset({"Polygon", "MultiPolygon"})
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


# ------------------------------------------------------------------------------------------------- GeoJSON


def read_geojson(path: str | Path) -> GeoJsonAnnotations:
    """The (class, polygon) pairs of a QuPath GeoJSON export: a FeatureCollection, a list of features or a Feature.

    Features without a classification and geometries other than Polygon / MultiPolygon are skipped and counted;
    invalid polygons (self-intersections, ...) are repaired with `shapely.make_valid`. Raises `MalformedAnnotations`
    naming the file (and the feature index) for bad JSON or an unreadable geometry.
    """
    path = Path(path)
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

    shapes: list[tuple[str, shapely.Geometry]] = []
    skipped: Counter[str] = Counter()
    repaired = 0
    for i, feature in enumerate(_features(doc, path)):
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
        shape = _read_geometry(geometry, where)
        if not shape.is_empty and not shape.is_valid:
            shape = _polygonal_part(shapely.make_valid(shape))
            repaired += not shape.is_empty  # a sliver repairs into lines only: counted as skipped, below
        if shape.is_empty:
            skipped[EMPTY_GEOMETRY] += 1
            continue
        shapes.append((name, shape))
    return GeoJsonAnnotations(path, shapes, dict(sorted(skipped.items())), repaired)


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
