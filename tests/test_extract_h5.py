"""extract `format=both`: per-slide .h5 files read the way TRIDENT / CLAM code reads them (h5py: `features`,
`coords` and the coords' attributes), the same numbers as the zarr store, and a store extracted before the format
was asked gets its files on the next run without re-running the model."""

from __future__ import annotations

import h5py
import numpy as np
import zarr

from dinov3_core.config import load_config
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.extract import run_extract
from dinov3_core.extract.feature_store import h5_dir


def cfg(**values) -> ExtractConfig:
    return load_config(ExtractConfig, "default", {"progress": False, "pca_map": False, **values}, stage="extract")


def read_like_mil_tools(path) -> tuple[np.ndarray, np.ndarray, dict]:
    """What CLAM's / TRIDENT's dataset classes do: two datasets and the attributes of `coords`."""
    with h5py.File(path, "r") as f:
        return f["features"][:], f["coords"][:], dict(f["coords"].attrs)


def test_h5_files_hold_the_stores_features_in_the_mil_layout(stage_extract_store, converted, tmp_path) -> None:
    out = tmp_path / "features.zarr"
    result = run_extract(cfg(store=str(stage_extract_store), model=str(converted), output=str(out), format="both"))
    ds = TileDataset(stage_extract_store, image_format="numpy")
    files = sorted(h5_dir(out).glob("*.h5"))
    assert [f.stem for f in files] == sorted(result.extracted) == sorted(ds.slide_ids)
    assert h5_dir(out) == tmp_path / "features_h5"
    for s, slide_id in enumerate(ds.slide_ids):
        features, coords, attrs = read_like_mil_tools(h5_dir(out) / f"{slide_id}.h5")
        group = zarr.open_group(str(out / "slides" / slide_id), mode="r")
        assert features.dtype == np.float32 and features.shape == group["cls"].shape
        np.testing.assert_array_equal(features, group["cls"][:])
        np.testing.assert_array_equal(coords, ds.slide_coords(s))
        tile = ds.slide_attrs(s)
        assert attrs["patch_size"] == ds.tile_size and attrs["patch_size_level0"] == tile["tile_size_level0"]
        assert attrs["mpp"] == tile["mpp_effective"] and attrs["target_magnification"] == 10 / tile["mpp_effective"]
        assert attrs["overlap"] == ds.tile_size - tile["stride"] and attrs["name"] == slide_id
    assert not list(h5_dir(out).glob(".*incoming"))  # nothing half-written is left behind


def test_a_store_extracted_without_h5_gets_its_files_without_rerunning(
    stage_extract_store, converted, tmp_path
) -> None:
    out = tmp_path / "features.zarr"
    first = run_extract(cfg(store=str(stage_extract_store), model=str(converted), output=str(out)))
    assert first.extracted and not h5_dir(out).exists()
    again = run_extract(cfg(store=str(stage_extract_store), model=str(converted), output=str(out), format="both"))
    assert again.extracted == [] and sorted(again.skipped) == sorted(first.extracted)
    for slide_id in first.extracted:
        features, _, _ = read_like_mil_tools(h5_dir(out) / f"{slide_id}.h5")
        np.testing.assert_array_equal(features, zarr.open_group(str(out / "slides" / slide_id))["cls"][:])


def test_qupath_geojson_has_every_tile_as_a_classified_detection(stage_extract_store, converted, tmp_path) -> None:
    """The file QuPath imports: one square detection per tile at its level-0 position, classified by cluster, with
    measurements; read back with the project's QuPath GeoJSON reader (the one the evaluate stage uses)."""
    import json

    from dinov3_core.evaluate.geojson import read_geojson
    from dinov3_core.extract.feature_store import pictures_dir

    out = tmp_path / "features.zarr"
    run_extract(
        cfg(store=str(stage_extract_store), model=str(converted), output=str(out), qupath=True, qupath_clusters=3)
    )
    ds = TileDataset(stage_extract_store, image_format="numpy")
    for s, slide_id in enumerate(ds.slide_ids):
        path = pictures_dir(out) / slide_id / "tiles.geojson"
        doc = json.loads(path.read_text())
        coords, size = ds.slide_coords(s), ds.slide_attrs(s)["tile_size_level0"]
        assert doc["type"] == "FeatureCollection" and len(doc["features"]) == len(coords)
        first = doc["features"][0]
        assert first["properties"]["objectType"] == "detection"
        x, y = coords[0]
        assert first["geometry"]["coordinates"][0][0] == [x, y] and first["geometry"]["coordinates"][0][2] == [
            x + size,
            y + size,
        ]
        measured = {k for f in doc["features"] for k in f["properties"]["measurements"]}
        assert measured == {"PC1 (0-1 in slide)", "PC2 (0-1 in slide)", "PC3 (0-1 in slide)", "cluster"}
        read = read_geojson(path)
        classes = [name for name, _ in read.shapes]
        assert sorted(set(classes)) == ["cluster 1", "cluster 2", "cluster 3"] and len(classes) == len(coords)
        assert not read.skipped and read.repaired == 0
        assert read.shapes[0][1].area == size * size
