"""GeoJSON annotations at scale (dinov3_core/evaluate/geojson.py, labels.py): a size cap, geometries built in bulk,
tiles labelled through an R-tree, with the same labels as the per-class union the labelling used before.

Real files on a real tile store (the `small_tile_store` fixture: the 20× sample slide tiled at 64 px).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shapely
import shapely.geometry

from dinov3_core.evaluate.geojson import MAX_GEOJSON_BYTES, MalformedAnnotations, read_geojson
from dinov3_core.evaluate.label_report import SlideLabels, SlideTiles, read_slide, slide_labels
from dinov3_core.evaluate.labels import OVERLAP_TOLERANCE, _label_by_polygons, label_tiles
from dinov3_core.tiling import store as ts


def union_labels(slide: SlideTiles, shapes: list[tuple[str, shapely.Geometry]], min_overlap: float) -> SlideLabels:
    """The labelling before the R-tree, verbatim: per class the union of its polygons, prepared, the centre rule,
    then the covered fraction of the tiles whose centre it holds."""
    by_class: dict[str, list[shapely.Geometry]] = {}
    for name, shape in shapes:
        by_class.setdefault(name, []).append(shape)
    names = sorted(by_class)
    centres = slide.coords + slide.tile / 2
    hits = np.zeros((len(names), len(slide.coords)), dtype=bool)
    for k, name in enumerate(names):
        union = shapely.union_all(by_class[name])
        shapely.prepare(union)
        inside = shapely.contains_xy(union, centres[:, 0], centres[:, 1])
        if min_overlap > 0 and inside.any():
            idx = np.flatnonzero(inside)
            o, t = slide.coords[idx], slide.tile
            boxes = shapely.box(o[:, 0], o[:, 1], o[:, 0] + t, o[:, 1] + t)
            fraction = np.ones(len(boxes))
            partial = ~shapely.covers(union, boxes)
            fraction[partial] = shapely.area(shapely.intersection(boxes[partial], union)) / (t * t)
            inside[idx] = fraction >= min_overlap - OVERLAP_TOLERANCE
        hits[k] = inside
    return slide_labels(slide.slide_id, hits, names)


@pytest.fixture(scope="module")
def slide(small_tile_store: Path) -> SlideTiles:
    (slide_id,) = ts.complete_slide_ids(small_tile_store)
    return read_slide(small_tile_store, slide_id)


def tricky_scene(slide: SlideTiles, seed: int) -> list[tuple[str, shapely.Geometry]]:
    """Shapes whose edges run through tile centres: same-class squares side by side (their shared edge is inside
    the union), a hole filled by another polygon of the class, overlapping classes, multipolygons, triangles."""
    rng = np.random.default_rng(seed)
    t = slide.tile
    cx, cy = slide.coords[:, 0] + t / 2, slide.coords[:, 1] + t / 2
    shapes: list[tuple[str, shapely.Geometry]] = []
    for _ in range(40):
        k = rng.integers(len(cx))
        x, y = float(cx[k]), float(cy[k])  # an edge or corner through this centre
        name = str(rng.choice(["Tumor", "Stroma", "Immune"]))
        w, h = float(rng.integers(1, 4) * t / 2), float(rng.integers(1, 4) * t / 2)
        kind = rng.integers(5)
        if kind == 0:  # two squares of one class meeting at x
            shapes += [(name, shapely.box(x - w, y - h, x, y + h)), (name, shapely.box(x, y - h, x + w, y + h))]
        elif kind == 1:  # a hole whose edge holds the centre, filled by a second polygon of the class
            hole = [(x, y - h / 2), (x + w, y - h / 2), (x + w, y + h / 2), (x, y + h / 2)]
            outer = shapely.Polygon(shapely.box(x - w, y - h, x + 2 * w, y + h).exterior.coords, [hole])
            shapes += [(name, outer), (name, shapely.Polygon(hole))]
        elif kind == 2:
            shapes.append(
                (name, shapely.MultiPolygon([shapely.box(x - w, y, x, y + h), shapely.box(x, y - h, x + w, y)]))
            )
        elif kind == 3:
            shapes.append((name, shapely.Polygon([(x - w, y - h), (x + w, y + h), (x - w, y + h)])))  # diagonal
        else:
            shapes.append((name, shapely.box(x + rng.uniform(-w, 0), y + rng.uniform(-h, 0), x + w, y + h)))
    return shapes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_overlap", [0.0, 0.25, 0.5, 1.0])
def test_the_r_tree_labels_as_the_class_union_did(slide: SlideTiles, seed: int, min_overlap: float) -> None:
    shapes = tricky_scene(slide, seed)
    centres = shapely.points(slide.coords + slide.tile / 2)
    on_edges = shapely.touches(np.array([s for _, s in shapes])[:, None], centres[None, :]).any(axis=0)
    assert on_edges.sum() >= 10  # the boundary conventions are what this compares
    got, want = _label_by_polygons(slide, shapes, min_overlap), union_labels(slide, shapes, min_overlap)
    assert got.rows.tolist() == want.rows.tolist()
    assert got.labels.tolist() == want.labels.tolist()
    assert (got.ambiguous, got.unlabelled, got.classes) == (want.ambiguous, want.unlabelled, want.classes)
    assert len(want.rows) > 0


def feature(geometry: dict[str, Any], name: str = "Tumor") -> dict[str, Any]:
    return {"type": "Feature", "geometry": geometry, "properties": {"classification": {"name": name}}}


def test_bulk_geometries_equal_one_at_a_time(tmp_path: Path) -> None:
    """The shapes read in bulk are those shapely.geometry.shape makes of each feature (then 2-D)."""
    rng = np.random.default_rng(1)
    geometries: list[dict[str, Any]] = []
    for i in range(300):
        x, y = rng.uniform(0, 1000, 2).round(2).tolist()
        ring = [[x, y], [x + 5, y], [x + 5, y + 7], [x, y + 7], [x, y]]
        hole = [[x + 1, y + 1], [x + 2, y + 1], [x + 2, y + 2], [x + 1, y + 1]]
        geometries.append(
            [
                {"type": "Polygon", "coordinates": [ring]},
                {"type": "Polygon", "coordinates": [ring, hole]},
                {"type": "Polygon", "coordinates": [[[*p, 3.0] for p in ring]]},  # QuPath may write z
                {"type": "MultiPolygon", "coordinates": [[ring], [[[a + 10, b] for a, b in ring]]]},
            ][i % 4]
        )
    path = tmp_path / "bulk.geojson"
    path.write_text(json.dumps({"type": "FeatureCollection", "features": [feature(g) for g in geometries]}))
    found = read_geojson(path)
    want = [shapely.force_2d(shapely.geometry.shape(g)) for g in geometries]
    assert len(found.shapes) == len(want)
    assert all(shapely.equals_exact(s, w, tolerance=0) for (_, s), w in zip(found.shapes, want, strict=True))
    assert [s.geom_type for _, s in found.shapes] == [w.geom_type for w in want]
    # one unclosed ring (shapely closes it) sends its chunk the old way: same shapes
    geometries[5] = {"type": "Polygon", "coordinates": [[[0, 0], [4, 0], [4, 4], [0, 4]]]}
    path.write_text(json.dumps([feature(g) for g in geometries]))
    again = read_geojson(path)
    closed = shapely.geometry.shape(geometries[5])
    assert shapely.equals_exact(again.shapes[5][1], closed, tolerance=0) and len(closed.exterior.coords) == 5
    assert [s.wkb for _, s in again.shapes[6:]] == [s.wkb for _, s in found.shapes[6:]]


def test_a_file_over_the_cap_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.geojson"
    with path.open("wb") as f:  # sparse: over the cap on disk without writing it
        f.truncate(MAX_GEOJSON_BYTES + 1)
    start = time.perf_counter()
    with pytest.raises(MalformedAnnotations) as err:
        read_geojson(path)
    assert time.perf_counter() - start < 1
    said = str(err.value)
    assert f"{path} is 512 MB, over the 512 MB" in said and "not cell detections" in said, said


def write_grid(path: Path, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`n` 1×1 px squares on a 1.7 × 1.1 px grid over the slide's tissue, three classes: (x0, y0, class index)."""
    side = int(np.ceil(np.sqrt(n)))
    i = np.arange(n)
    x0 = np.round(128 + (i % side) * 1.7, 2)
    y0 = np.round(192 + (i // side) * 1.1, 2)
    k = np.random.default_rng(0).integers(0, 3, n)
    names = ["Immune", "Stroma", "Tumor"]
    with path.open("w") as f:
        f.write('{"type": "FeatureCollection", "features": [')
        f.write(
            ",".join(
                '{"type": "Feature", "geometry": {"type": "Polygon", "coordinates": '
                f"[[[{x}, {y}], [{x + 1:.2f}, {y}], [{x + 1:.2f}, {y + 1:.2f}], [{x}, {y + 1:.2f}], [{x}, {y}]]]}}, "
                f'"properties": {{"objectType": "annotation", "classification": {{"name": "{names[c]}"}}}}}}'
                for x, y, c in zip(x0.tolist(), y0.tolist(), k.tolist(), strict=True)
            )
        )
        f.write("]}")
    return x0, y0, k


def test_a_million_small_polygons_label_in_bounded_time(
    small_tile_store: Path, slide: SlideTiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ann"
    folder.mkdir()
    path = folder / f"{slide.slide_id}.geojson"
    x0, y0, k = write_grid(path, 1_000_000)
    size_mb = path.stat().st_size / 2**20
    start = time.perf_counter()
    report = label_tiles(small_tile_store, folder)
    seconds = time.perf_counter() - start
    got = report.slides[slide.slide_id]
    # Expected by grid arithmetic: the square whose column and row hold the centre, strictly inside it.
    side = int(np.ceil(np.sqrt(len(x0))))
    cx, cy = slide.coords[:, 0] + slide.tile / 2, slide.coords[:, 1] + slide.tile / 2
    col, row = np.floor((cx - 128) / 1.7).astype(int), np.floor((cy - 192) / 1.1).astype(int)
    j = row * side + col
    ok = (col >= 0) & (col < side) & (row >= 0) & (j < len(x0))
    j = np.where(ok, j, 0)
    inside = ok & (x0[j] < cx) & (cx < x0[j] + 1) & (y0[j] < cy) & (cy < y0[j] + 1)
    names = np.array(["Immune", "Stroma", "Tumor"])
    assert got.rows.tolist() == np.flatnonzero(inside).tolist()
    assert got.labels.tolist() == names[k[j[inside]]].tolist()
    assert len(got.rows) > 20 and got.ambiguous == 0
    print(f"1e6 polygons ({size_mb:.0f} MB): labelled {len(slide.coords)} tiles in {seconds:.1f} s")
    assert seconds < 120, seconds
    # min_overlap: every tile is ~1/6 covered by each class's squares; a claim needs its class to cover 10 %
    start = time.perf_counter()
    strict = label_tiles(small_tile_store, folder, min_overlap=0.1).slides[slide.slide_id]
    print(f"... with min_overlap=0.1 in {time.perf_counter() - start:.1f} s")
    assert set(strict.rows.tolist()) <= set(got.rows.tolist()) and len(strict.rows) > 0
