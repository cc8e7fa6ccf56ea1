"""Tile labels from QuPath GeoJSON and CSV (dinov3_core/evaluate/labels.py) on a real tile store.

The annotations are written by hand from the store's real coords; the expected labels are computed here by brute
force (even-odd ray casting on the rings, interval arithmetic for the covered area), independently of shapely.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shapely
import zarr

from dinov3_core.evaluate.labels import LabelError, MalformedAnnotations, label_tiles, read_geojson
from dinov3_core.tiling import store as ts

Ring = list[list[float]]


def rect(x0: float, y0: float, x1: float, y1: float) -> Ring:
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]


# The scene, on the 20× sample slide tiled at 64 px (tiles at x 128…1856, y 192…1280 in three tissue blobs).
TUMOR = [[rect(128, 256, 640, 768)], [rect(256, 704, 512, 1024)]]  # two overlapping polygons of one class
INFLAMMATION = [[rect(512, 640, 768, 960)]]  # overlaps TUMOR: the shared tiles are ambiguous
HOLE_TILE = (1024, 640)  # its centre lies in the hole of the stroma polygon
STROMA = [[rect(832, 256, 1280, 960), rect(1000, 620, 1100, 720)]]
NECROSIS = [[rect(1472, 256, 1664, 512)], [rect(1536, 1024, 1792, 1280)]]  # one MultiPolygon
FAT_BOWTIE = [[[1140, 980], [1350, 1230], [1350, 980], [1140, 1230], [1140, 980]]]  # self-intersecting
CLASSES = {"Tumor": TUMOR, "Inflammation": INFLAMMATION, "Stroma": STROMA, "Necrosis": NECROSIS, "Fat": [FAT_BOWTIE]}


def feature(geometry: dict[str, Any] | None, name: str | None = None) -> dict[str, Any]:
    properties: dict[str, Any] = {"objectType": "annotation"}
    if name is not None:
        properties["classification"] = {"name": name, "color": [200, 0, 0]}
    return {"type": "Feature", "id": "x", "geometry": geometry, "properties": properties}


def polygon(rings: list[Ring]) -> dict[str, Any]:
    return {"type": "Polygon", "coordinates": rings}


def scene_features(scale: float = 1.0) -> list[dict[str, Any]]:
    """The scene as QuPath would export it, plus features that must be skipped; coordinates times `scale`."""

    def s(rings: list[Ring]) -> list[Ring]:
        return [[[x * scale, y * scale] for x, y in ring] for ring in rings]

    return [
        feature(polygon(s(TUMOR[0])), "Tumor"),
        feature(polygon(s(TUMOR[1])), "Tumor"),
        feature(polygon(s(INFLAMMATION[0])), "Inflammation"),
        feature(polygon(s(STROMA[0])), "Stroma"),
        feature({"type": "MultiPolygon", "coordinates": [s(p) for p in NECROSIS]}, "Necrosis"),
        feature(polygon(s(FAT_BOWTIE)), "Fat"),
        feature(polygon(s([rect(1408, 512, 1856, 1024)]))),  # no classification: ignored
        {**feature(polygon(s([rect(1408, 512, 1856, 1024)]))), "properties": {"classification": None}},
        feature({"type": "Point", "coordinates": [1500 * scale, 700 * scale]}, "Tumor"),
        feature(
            {"type": "LineString", "coordinates": [[1400 * scale, 600 * scale], [1800 * scale, 900 * scale]]}, "Tumor"
        ),
    ]


def write_json(path: Path, payload: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))
    return path


def collection(features: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "FeatureCollection", "features": features}


# ------------------------------------------------------------------------------------------- brute force


def in_ring(px: float, py: float, ring: Ring) -> bool:
    """Even-odd ray casting; for a bow-tie it gives the two triangles that make_valid repairs it into."""
    inside = False
    for (x1, y1), (x2, y2) in itertools.pairwise(ring):
        if (y1 > py) != (y2 > py) and px < x1 + (py - y1) * (x2 - x1) / (y2 - y1):
            inside = not inside
    return inside


def in_polygon(px: float, py: float, rings: list[Ring]) -> bool:
    return in_ring(px, py, rings[0]) and not any(in_ring(px, py, hole) for hole in rings[1:])


def expected_labels(coords: np.ndarray, tile: int, classes: dict[str, list[list[Ring]]]) -> tuple[dict, set]:
    """row → class for tiles whose centre one class claims; rows claimed by two or more classes."""
    labelled, ambiguous = {}, set()
    for row, (x, y) in enumerate(coords.tolist()):
        cx, cy = x + tile / 2, y + tile / 2
        claims = [name for name, polys in classes.items() if any(in_polygon(cx, cy, p) for p in polys)]
        if len(claims) == 1:
            labelled[row] = claims[0]
        elif len(claims) > 1:
            ambiguous.add(row)
    return labelled, ambiguous


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def slide(small_tile_store: Path) -> tuple[str, np.ndarray, int]:
    """(slide id, coords, tile size at level 0) of the real store's only slide."""
    (slide_id,) = ts.complete_slide_ids(small_tile_store)
    coords = np.asarray(zarr.open_array(str(ts.slide_dir(small_tile_store, slide_id) / "coords"), mode="r")[...])
    return slide_id, coords, int(ts.read_slide_attrs(small_tile_store, slide_id)["tile_size_level0"])


def row_of(coords: np.ndarray, xy: tuple[int, int]) -> int:
    (rows,) = np.nonzero((coords[:, 0] == xy[0]) & (coords[:, 1] == xy[1]))
    assert len(rows) == 1, f"no tile at {xy} in the store"
    return int(rows[0])


# --------------------------------------------------------------------------------------------------- GeoJSON


def test_geojson_labels_match_brute_force(small_tile_store: Path, slide, tmp_path: Path) -> None:
    slide_id, coords, tile = slide
    folder = tmp_path / "ann"
    write_json(folder / f"{slide_id}.geojson", collection(scene_features()))
    write_json(folder / "other_slide.geojson", collection([]))
    # No tile centre on a polygon edge, so the boundary convention cannot decide the expectation.
    boundaries = shapely.union_all([shapely.LinearRing(r) for polys in CLASSES.values() for p in polys for r in p])
    assert shapely.distance(boundaries, shapely.points(coords + tile / 2)).min() > 1

    report = label_tiles(small_tile_store, folder)

    labelled, ambiguous = expected_labels(coords, tile, CLASSES)
    got = report.slides[slide_id]
    assert got.rows.dtype == np.int64
    assert got.rows.tolist() == sorted(labelled)
    assert got.labels.tolist() == [labelled[r] for r in sorted(labelled)]
    assert got.ambiguous == len(ambiguous) > 0
    assert got.n_tiles == len(coords)
    assert got.unlabelled == len(coords) - len(labelled) - len(ambiguous)
    assert got.classes == {name: list(labelled.values()).count(name) for name in sorted(CLASSES)}
    assert all(n > 0 for n in got.classes.values()), got.classes  # every shape of the scene labels something
    # The hole: its tile is not stroma, the tile left of it is.
    assert row_of(coords, HOLE_TILE) not in labelled and row_of(coords, HOLE_TILE) not in got.rows
    assert labelled[row_of(coords, (HOLE_TILE[0] - 64, HOLE_TILE[1]))] == "Stroma"
    # Both parts of the MultiPolygon label tiles.
    necrosis_y = {int(coords[r, 1]) for r, name in labelled.items() if name == "Necrosis"}
    assert min(necrosis_y) < 512 and max(necrosis_y) >= 1024
    assert report.skipped_features == {
        "no classification": 2,
        "unsupported geometry (LineString)": 1,
        "unsupported geometry (Point)": 1,
    }
    assert report.repaired_features == 1  # the bow-tie
    assert report.unknown == ["other_slide"] and report.missing == [] and report.warnings == []
    summary = json.loads(json.dumps(report.summary()))
    assert summary["slides"][slide_id]["labelled"] == len(labelled)
    assert summary["classes"] == got.classes


def test_read_geojson_repairs_and_skips(tmp_path: Path) -> None:
    bowtie_3d = [[[x, y, 0.0] for x, y in FAT_BOWTIE[0]]]  # QuPath may write a z coordinate
    path = write_json(
        tmp_path / "a.geojson",
        [
            feature(polygon(bowtie_3d), "Fat"),
            {**feature(polygon([rect(0, 0, 10, 10)])), "properties": {"classification": {"names": ["Tumor", "Pos"]}}},
            feature(polygon([[[0, 0], [5, 5], [9, 9], [0, 0]]]), "Sliver"),  # zero area: nothing left after repair
            feature(None, "Nothing"),
        ],
    )
    found = read_geojson(path)
    assert [name for name, _ in found.shapes] == ["Fat", "Tumor: Pos"]
    fat = found.shapes[0][1]
    assert fat.geom_type == "MultiPolygon" and len(fat.geoms) == 2 and fat.is_valid and not fat.has_z
    # Two triangles meeting where the diagonals cross: half the bounding box.
    assert fat.area == pytest.approx(210 * 250 / 2)
    assert found.repaired == 1 and found.skipped == {"empty geometry": 2}


def test_every_qupath_layout_gives_the_same_labels(small_tile_store: Path, slide, tmp_path: Path) -> None:
    """A FeatureCollection, a bare list of features and a single Feature; a file named after the image file."""
    slide_id, coords, tile = slide
    features = scene_features()
    as_list = write_json(tmp_path / "list" / f"{slide_id}.svs.geojson", features)
    as_collection = write_json(tmp_path / "fc" / f"{slide_id}.geojson", collection(features))
    assert label_tiles(small_tile_store, as_list.parent).slides[slide_id].rows.tolist() == (
        label_tiles(small_tile_store, as_collection.parent).slides[slide_id].rows.tolist()
    )

    single = write_json(tmp_path / "one" / f"{slide_id}.geojson", features[0])
    got = label_tiles(small_tile_store, single.parent).slides[slide_id]
    labelled, _ = expected_labels(coords, tile, {"Tumor": [TUMOR[0]]})
    assert got.rows.tolist() == sorted(labelled) and set(got.labels) == {"Tumor"}


def test_min_overlap_needs_the_tile_area_covered(small_tile_store: Path, slide, tmp_path: Path) -> None:
    slide_id, coords, tile = slide
    x0, y0 = 384, 512  # a tile inside the first blob: the polygon covers its top-left 40×40 px and its centre
    target = row_of(coords, (x0, y0))
    box = (x0 - 100, y0 - 100, x0 + 40, y0 + 40)
    write_json(tmp_path / "ann" / f"{slide_id}.geojson", [feature(polygon([rect(*box)]), "Tumor")])

    def fraction(x: int, y: int) -> float:
        wx = max(0, min(x + tile, box[2]) - max(x, box[0]))
        wy = max(0, min(y + tile, box[3]) - max(y, box[1]))
        return wx * wy / tile**2

    centred = [r for r, (x, y) in enumerate(coords.tolist()) if in_polygon(x + tile / 2, y + tile / 2, [rect(*box)])]
    assert fraction(x0, y0) == pytest.approx(0.390625)
    for min_overlap in (0.0, 0.39, 0.5, 0.625):
        got = label_tiles(small_tile_store, tmp_path / "ann", min_overlap=min_overlap).slides[slide_id]
        expected = [r for r in centred if fraction(*coords[r]) >= min_overlap]
        assert got.rows.tolist() == expected, min_overlap
        assert (target in got.rows) == (min_overlap < 0.5)
        assert got.unlabelled == len(coords) - len(expected)
    # Tiles covered exactly 0.625 (40 of 64 px in one direction) pass a threshold of exactly 0.625.
    assert any(fraction(*coords[r]) == 0.625 for r in centred)


def test_thumbnail_coordinates_are_reported(small_tile_store: Path, slide, tmp_path: Path) -> None:
    """Annotations drawn on a 16× downsampled thumbnail fall into the slide's top-left corner and label nothing."""
    slide_id, *_ = slide
    path = write_json(tmp_path / "ann" / f"{slide_id}.geojson", collection(scene_features(scale=1 / 16)))
    report = label_tiles(small_tile_store, path.parent)
    assert len(report.slides[slide_id].rows) == 0
    assert len(report.warnings) == 1
    assert str(path) in report.warnings[0]
    assert "another coordinate system" in report.warnings[0] and "level-0" in report.warnings[0]


def test_annotations_beyond_the_slide_are_an_error(small_tile_store: Path, slide, tmp_path: Path) -> None:
    slide_id, *_ = slide
    path = write_json(
        tmp_path / "ann" / f"{slide_id}.geojson",
        [feature(polygon([rect(256, 256, 640, 640)]), "Tumor"), feature(polygon([rect(1000, 900, 5000, 1400)]), "X")],
    )
    with pytest.raises(LabelError, match="another coordinate system") as err:
        label_tiles(small_tile_store, path.parent)
    assert str(path) in str(err.value) and "level-0" in str(err.value)


@pytest.mark.parametrize(
    ("content", "where"),
    [
        ('{"type": "FeatureCollection", "features": [', "not valid JSON"),
        (
            json.dumps([feature(polygon([rect(0, 0, 9, 9)]), "A"), feature(polygon([[[0, 0], [5, 5]]]), "B")]),
            "feature 1",
        ),
        (json.dumps([feature(polygon([[[0, 0], [5, "a"], [5, 0], [0, 0]]]), "B")]), "feature 0"),
        (json.dumps({"type": "Polygon", "coordinates": [rect(0, 0, 9, 9)]}), "FeatureCollection"),
        (json.dumps([feature(polygon([[[0, 0], [5, float("nan")], [5, 0], [0, 0]]]), "B")]), "NaN"),
    ],
)
def test_malformed_geojson_names_the_file(
    small_tile_store: Path, slide, tmp_path: Path, content: str, where: str
) -> None:
    slide_id, *_ = slide
    path = tmp_path / f"{slide_id}.geojson"
    path.write_text(content)
    with pytest.raises(MalformedAnnotations, match=where) as err:
        label_tiles(small_tile_store, tmp_path)
    assert str(path) in str(err.value)


def test_unusable_inputs_are_errors(small_tile_store: Path, slide, tmp_path: Path) -> None:
    slide_id, *_ = slide
    write_json(tmp_path / "ann" / "someone_else.geojson", collection([]))
    with pytest.raises(LabelError, match=re.escape("<slide_id>.geojson")):
        label_tiles(small_tile_store, tmp_path / "ann")
    with pytest.raises(LabelError, match="does not exist"):
        label_tiles(small_tile_store, tmp_path / "nowhere")
    write_json(tmp_path / "ok" / f"{slide_id}.geojson", collection([]))
    with pytest.raises(LabelError, match="not in the tile store"):
        label_tiles(small_tile_store, tmp_path / "ok", slide_ids=["nope"])
    with pytest.raises(LabelError, match="min_overlap"):
        label_tiles(small_tile_store, tmp_path / "ok", min_overlap=1.5)
    # A file without any classified polygon labels nothing and says so.
    report = label_tiles(small_tile_store, tmp_path / "ok")
    assert len(report.slides[slide_id].rows) == 0 and "no classified" in report.warnings[0]


# ------------------------------------------------------------------------------------------------------- CSV


def write_csv(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_csv_labels_exact_tiles(small_tile_store: Path, slide, tmp_path: Path) -> None:
    slide_id, coords, _ = slide
    xy = coords.tolist()
    lines = ["slide_id,x,y,label"]
    lines += [f"{slide_id},{x},{y},Tumor" for x, y in xy[20:30]]
    lines += [f"{slide_id},{x}.0,{y},Stroma" for x, y in xy[5:8]]  # spreadsheets write integers as 1024.0
    lines += ["", f"{slide_id},{xy[40][0]},{xy[40][1]},Tumor", f"{slide_id},{xy[40][0]},{xy[40][1]},Stroma"]
    lines += [f"{slide_id},{xy[41][0]},{xy[41][1]},Fat"] * 2  # a repeated row is no conflict
    report = label_tiles(small_tile_store, write_csv(tmp_path / "labels.csv", lines))

    got = report.slides[slide_id]
    assert got.rows.tolist() == [5, 6, 7, *range(20, 30), 41]
    assert got.labels.tolist() == ["Stroma"] * 3 + ["Tumor"] * 10 + ["Fat"]
    assert got.ambiguous == 1 and got.unlabelled == len(coords) - 15
    assert got.classes == {"Fat": 1, "Stroma": 3, "Tumor": 10}
    assert report.missing == [] and report.unknown == []


def test_csv_rows_outside_the_store_are_errors(small_tile_store: Path, slide, tmp_path: Path) -> None:
    slide_id, coords, _ = slide
    (x, y), (x2, y2) = coords[:2].tolist()
    good = f"{slide_id},{x},{y},Tumor"
    path = write_csv(tmp_path / "a.csv", ["slide_id,x,y,label", good, "ghost_slide,0,0,Tumor", good])
    with pytest.raises(LabelError, match=r"line\(s\) 3 name slides .*ghost_slide") as err:
        label_tiles(small_tile_store, path)
    assert str(path) in str(err.value)

    path = write_csv(tmp_path / "b.csv", ["slide_id,x,y,label", good, f"{slide_id},{x2 + 1},{y2},Tumor"])
    with pytest.raises(LabelError, match=r"line\(s\) 3 give x,y that are no tile") as err:
        label_tiles(small_tile_store, path)
    assert str(path) in str(err.value) and "coords" in str(err.value)

    path = write_csv(tmp_path / "c.csv", [good])
    with pytest.raises(MalformedAnnotations, match="header") as err:
        label_tiles(small_tile_store, path)
    assert str(path) in str(err.value)

    path = write_csv(tmp_path / "d.csv", ["slide_id,x,y,label", f"{slide_id},{x},12.5,Tumor"])
    with pytest.raises(MalformedAnnotations, match=re.escape("line 2: y='12.5'")):
        label_tiles(small_tile_store, path)
