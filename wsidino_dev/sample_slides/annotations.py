"""Class annotations of a `TissueCanvas` as QuPath-style GeoJSON: the polygons its sections were rendered from.

Every tissue section is split into areas of the classes in `texture.CLASS_NAMES` by coarse planning fields
(`TissueCanvas.plan`). The renderer thresholds the bilinearly upsampled fields at fixed levels; here the same
levels are traced on the coarse grid (marching squares, exact on the grid lines), mapped to level-0 pixel
coordinates (x right, y down, (0, 0) the top-left corner of the first pixel) and simplified, so each polygon
follows the rendered boundary to within a pixel or two:

* the section outline where tissue reaches half its opacity (`canvas.TISSUE_EDGE_LEVEL`), holes (lumens, tears)
  included;
* epithelium/stroma and tumour/squamous-epithelium boundaries in the middle of their cross-fades;
* marker ink (`PEN_EDGE_PX`) cut out: ink is no tissue class.

One feature per section and class: a Polygon, or a MultiPolygon where a class falls into several pieces there.
Properties as QuPath exports them: ``objectType: "annotation"`` and ``classification: {name, color}``.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import shapely
from shapely.geometry.base import BaseGeometry

from wsidino_dev.sample_slides.canvas import PEN_EDGE_PX, TISSUE_EDGE_LEVEL, TissueCanvas
from wsidino_dev.sample_slides.texture import CLASS_COLORS, CLASS_NAMES

# Parts and holes smaller than this (level-0 px²) are dropped: specks no annotator would draw (10 × 10 px).
MIN_AREA_PX = 100.0
# Simplification: the tolerance (level-0 px) starts here and doubles, up to MAX_TOLERANCE_PX, while a polygon
# has more than MAX_VERTICES vertices.
TOLERANCE_PX = 0.5
MAX_TOLERANCE_PX = 4.0
MAX_VERTICES = 300
# Coordinates are written on this grid (level-0 px).
GRID_PX = 0.01


@dataclass(frozen=True)
class Annotation:
    """One feature: a class's area in one tissue section (level-0 pixel coordinates)."""

    name: str  # the class, one of CLASS_NAMES
    section: int  # index of the section in `TissueCanvas.regions`
    geometry: BaseGeometry  # Polygon or MultiPolygon


def _level_set(field: np.ndarray, level: float, *, x0: float, y0: float, scale: int) -> BaseGeometry:
    """{field > level} of a coarse field, as a polygon in level-0 px (coarse cell (r, c) has its centre at
    ((c + 0.5)·scale + x0, (r + 0.5)·scale + y0), as `fields.upsample` places it)."""
    from skimage import measure  # deferred: scikit-image is slow to import

    padded = np.pad(field, 1, constant_values=min(float(field.min()), level) - 1.0)  # every contour closes
    rings = []
    for contour in measure.find_contours(padded, level):
        if len(contour) >= 4:
            xy = np.column_stack([x0 + (contour[:, 1] - 0.5) * scale, y0 + (contour[:, 0] - 0.5) * scale])
            rings.append(shapely.Polygon(xy))
    if not rings:
        return shapely.Polygon()
    # Nested contours alternate between outlines and holes: their symmetric difference is the set.
    return shapely.make_valid(functools.reduce(shapely.symmetric_difference, rings))


def _polygons(geometry: BaseGeometry) -> list[shapely.Polygon]:
    if isinstance(geometry, shapely.Polygon):
        return [] if geometry.is_empty else [geometry]
    return [p for g in getattr(geometry, "geoms", []) for p in _polygons(g)]


def _clean(geometry: BaseGeometry) -> BaseGeometry:
    """Without specks and pinholes, simplified to at most MAX_VERTICES per polygon where the tolerance allows,
    on the GRID_PX grid: a Polygon, a MultiPolygon, or empty."""
    parts = []
    for polygon in _polygons(geometry):
        if polygon.area < MIN_AREA_PX:
            continue
        holes = [ring for ring in polygon.interiors if shapely.Polygon(ring).area >= MIN_AREA_PX]
        polygon = shapely.Polygon(polygon.exterior, holes)
        tolerance = TOLERANCE_PX
        simple = polygon.simplify(tolerance)
        while shapely.get_num_coordinates(simple) > MAX_VERTICES and tolerance < MAX_TOLERANCE_PX:
            tolerance *= 2
            simple = polygon.simplify(tolerance)
        parts.extend(_polygons(shapely.set_precision(simple, GRID_PX)))
    parts = [p for p in parts if p.area >= MIN_AREA_PX]
    if not parts:
        return shapely.Polygon()
    return parts[0] if len(parts) == 1 else shapely.MultiPolygon(parts)


def canvas_annotations(canvas: TissueCanvas) -> list[Annotation]:
    """The class areas of every tissue section of `canvas`, in level-0 pixel coordinates, non-empty ones only."""
    scale = canvas.scale
    ink = shapely.Polygon()
    if canvas.pen is not None:
        # Ink shows where the stroke's distance field is below PEN_EDGE_PX / 2 full-res px.
        ink = _level_set(-canvas.pen.distance, -PEN_EDGE_PX / 2 / scale, x0=0, y0=0, scale=scale)
    out = []
    for index, region in enumerate(canvas.regions):
        at = {"x0": region.x0, "y0": region.y0, "scale": scale}
        tissue = _level_set(region.shape_field, TISSUE_EDGE_LEVEL, **at).difference(ink)
        epithelium = _level_set(region.epithelium, 0.0, **at)
        tumour = _level_set(region.tumour, 0.0, **at)
        in_epithelium = tissue.intersection(epithelium)
        tumour_area, squamous_area, stroma_area = CLASS_NAMES  # the order of canvas class indices
        areas = {
            tumour_area: in_epithelium.intersection(tumour),
            squamous_area: in_epithelium.difference(tumour),
            stroma_area: tissue.difference(epithelium),
        }
        for name in CLASS_NAMES:
            geometry = _clean(areas[name])
            if not geometry.is_empty:
                out.append(Annotation(name=name, section=index, geometry=geometry))
    return out


def _rounded(coordinates: Any) -> Any:
    if isinstance(coordinates[0], float | int):
        return [round(float(c), 2) for c in coordinates]
    return [_rounded(c) for c in coordinates]


def feature_collection(annotations: list[Annotation], slide_id: str) -> dict[str, Any]:
    """QuPath's GeoJSON export of `annotations`: a FeatureCollection with deterministic feature ids."""
    features = []
    for a in annotations:
        geometry = shapely.geometry.mapping(a.geometry)
        features.append(
            {
                "type": "Feature",
                "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"wsidino-sample/{slide_id}/{a.section}/{a.name}")),
                "geometry": {"type": geometry["type"], "coordinates": _rounded(geometry["coordinates"])},
                "properties": {
                    "objectType": "annotation",
                    "classification": {"name": a.name, "color": list(CLASS_COLORS[a.name])},
                },
            }
        )
    return {"type": "FeatureCollection", "features": features}


def class_collection(shapes: dict[str, BaseGeometry]) -> dict[str, Any]:
    """A FeatureCollection of one QuPath annotation per class, `shapes` (class name → level-0 geometry), without
    colours or ids: annotations written by a labelling script rather than exported by QuPath."""
    features = [
        {
            "type": "Feature",
            "geometry": shapely.geometry.mapping(shape),
            "properties": {"objectType": "annotation", "classification": {"name": name}},
        }
        for name, shape in shapes.items()
    ]
    return {"type": "FeatureCollection", "features": features}


def write_annotations(path: Path, canvas: TissueCanvas, slide_id: str) -> dict[str, Any]:
    """Write the GeoJSON of `canvas` to `path`; returns a summary: features and level-0 area (px²) per class."""
    annotations = canvas_annotations(canvas)
    collection = feature_collection(annotations, slide_id)
    path.write_text(json.dumps(collection, separators=(",", ":")) + "\n")
    return {
        "features": len(annotations),
        "area_px": {name: round(sum(a.geometry.area for a in annotations if a.name == name)) for name in CLASS_NAMES},
    }
