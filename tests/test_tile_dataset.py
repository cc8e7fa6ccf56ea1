"""TileDataset on real zarr tile stores written with the tile writer's own primitives (no mocks).

Every synthetic tile's pixels encode (slide code, row), so a read is checked exactly against where it must
come from; coords and tissue fractions are functions of (code, row) too.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from torch.utils.data import DataLoader

from dinov3_core.data import TileDataset, TileSample
from dinov3_core.data.tile_readers import ShardFileTiles, ZarrTiles
from dinov3_core.tiling import store as ts
from tests.helpers import REPO, by_name, tile_config

T = 16  # tile size of the synthetic stores: small, so every tile can be checked in a few seconds
SHARD = 64
# store name → [(slide id, slide code, tile count)]; a1 has no tiles and must be left out of the index.
LAYOUT = {
    "A": [("a0", 1, 37), ("a1", 2, 0), ("a2", 3, 5), ("a3", 4, 300)],
    "B": [("b0", 5, 20), ("b1", 6, 1)],
}
CODES = {sid: code for slides in LAYOUT.values() for sid, code, _ in slides}


def expected_tile(code: int, row: int, size: int = T) -> np.ndarray:
    """Channel 0 = slide code, 1 = row % 256, 2 = row // 256 plus an x/y gradient (catches transposes)."""
    tile = np.empty((size, size, 3), dtype=np.uint8)
    tile[..., 0] = code
    tile[..., 1] = row % 256
    yy, xx = np.mgrid[0:size, 0:size]
    tile[..., 2] = (row // 256 + xx + 2 * yy) % 256
    return tile


def expected_coords(code: int, rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.int64)
    return np.stack([1000 * code + T * (rows % 50), T * (rows // 50)], axis=1)


def tissue(rows: np.ndarray) -> np.ndarray:
    return (np.asarray(rows) % 10 / 10).astype(np.float32)  # 0.0 … 0.9: ≥ 0.5 keeps rows with row % 10 ≥ 5


def write_slide(
    root: Path,
    slide_id: str,
    code: int,
    n: int,
    *,
    tile_size: int = T,
    compressor: ts.Compressor = "zstd",
    tiles: np.ndarray | None = None,
    commit: bool = True,
) -> ts.IncomingSlide:
    rows = np.arange(n)
    columns = {
        "coords": expected_coords(code, rows),
        "tissue_fraction": tissue(rows),
        "pen_fraction": np.zeros(n, dtype=np.float32),
        "blur_score": np.full(n, 100.0, dtype=np.float32),
    }
    incoming = ts.begin_slide(
        root,
        slide_id,
        n_tiles=n,
        tile_size=tile_size,
        tiles_per_shard=SHARD,
        compressor=compressor,
        # begin_slide cannot create zero-length columns (zarr rejects chunks=None): a slide with no tiles is
        # written without them, which readers must accept.
        columns=columns if n else None,
    )
    if tiles is None:
        tiles = np.stack([expected_tile(code, r, tile_size) for r in rows]) if n else None
    array = incoming.tiles_array()
    for a, b in incoming.shard_ranges():
        incoming.write_tiles(a, tiles[a:b], array)
    if commit:
        ts.commit_slide(incoming, {"tile_size": tile_size, "compressor": compressor})
    return incoming


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tile-stores")
    out = {}
    for name, slides in LAYOUT.items():
        root = ts.init_store(base / f"{name}.zarr")
        for slide_id, code, n in slides:
            write_slide(root, slide_id, code, n)
        out[name] = root
    # Debris of a crashed run in A: a half-written slide and a stray folder under .incoming/.
    write_slide(out["A"], "zz", 9, 10, commit=False)
    (out["A"] / ts.INCOMING / "junk").mkdir()
    return out


def all_expected(ds: TileDataset) -> list[tuple[str, int]]:
    """(slide id, row) of every dataset index of an unfiltered dataset."""
    return [(sid, r) for sid, n in zip(ds.slide_ids, ds.tile_counts.tolist(), strict=True) for r in range(n)]


# ------------------------------------------------------------------------------------------------- indexing


def test_every_global_index_maps_to_its_tile(stores: dict[str, Path]) -> None:
    ds = TileDataset([stores["A"], stores["B"]])
    assert ds.slide_ids == ["a0", "a2", "a3", "b0", "b1"]  # a1 (0 tiles) and .incoming/zz are not there
    assert ds.tile_counts.dtype == np.int64
    assert ds.tile_counts.tolist() == [37, 5, 300, 20, 1]
    assert len(ds) == 363 and ds.tile_size == T
    assert [ds.slide_store(s) for s in range(5)] == [stores["A"]] * 3 + [stores["B"]] * 2

    for i, (sid, row) in enumerate(all_expected(ds)):
        sample = ds[i]
        assert isinstance(sample, TileSample)
        assert sample.index == i and sample.slide_id == sid and sample.tile_index == row
        assert ds.slide_ids[sample.slide_index] == sid
        assert (sample.x, sample.y) == tuple(expected_coords(CODES[sid], [row])[0])
        assert sample.image.dtype == torch.uint8 and sample.image.shape == (T, T, 3)
        np.testing.assert_array_equal(sample.image.numpy(), expected_tile(CODES[sid], row))
        assert ds.locate(i) == (sample.slide_index, row)
        assert ds.global_index(sample.slide_index, row) == i

    assert ds[-1].slide_id == "b1" and ds[np.int64(3)].index == 3 and ds[torch.tensor(4)].index == 4
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds.global_index(0, 37)


def test_read_batch_matches_items(stores: dict[str, Path]) -> None:
    ds = TileDataset([stores["A"], stores["B"]])
    rng = np.random.default_rng(0)
    idx = np.concatenate([rng.permutation(len(ds)), rng.integers(0, len(ds), 50), [-1, 0, 0]])  # repeats too
    batch = ds.read_batch(idx)
    assert batch.shape == (len(idx), T, T, 3) and batch.dtype == np.uint8
    expected = np.stack([ds[int(i)].image.numpy() for i in idx])
    np.testing.assert_array_equal(batch, expected)
    assert ds.read_batch([]).shape == (0, T, T, 3)
    with pytest.raises(IndexError):
        ds.read_batch([0, len(ds)])


def test_zarr_reader_reads_the_same_pixels(stores: dict[str, Path]) -> None:
    fast = TileDataset([stores["A"], stores["B"]])
    slow = TileDataset([stores["A"], stores["B"]], reader="zarr")
    everything = np.arange(len(fast))
    np.testing.assert_array_equal(fast.read_batch(everything), slow.read_batch(everything))
    np.testing.assert_array_equal(fast[100].image, slow[100].image)
    assert isinstance(fast._tiles(0), ShardFileTiles) and isinstance(slow._tiles(0), ZarrTiles)


def test_unstored_chunks_read_as_fill_value(tmp_path: Path) -> None:
    """zarr stores neither an all-zero tile nor a shard of them; both readers must return zeros there."""
    root = ts.init_store(tmp_path / "zeros.zarr")
    tiles = np.stack([expected_tile(7, r) for r in range(3 * SHARD)])
    tiles[:SHARD] = 0  # whole first shard: no shard file at all
    tiles[SHARD + 3] = 0  # one empty chunk inside a stored shard
    write_slide(root, "z", 7, len(tiles), tiles=tiles)
    assert not (root / "slides/z/tiles/c/0").exists()
    for reader in ("auto", "zarr"):
        ds = TileDataset(root, reader=reader)  # type: ignore[arg-type]
        np.testing.assert_array_equal(ds.read_batch(np.arange(len(ds))), tiles)
        np.testing.assert_array_equal(ds[SHARD + 3].image.numpy(), tiles[SHARD + 3])


@pytest.mark.parametrize("compressor", ["jpeg", "none"])
def test_other_compressors_are_readable(tmp_path: Path, compressor: ts.Compressor) -> None:
    root = ts.init_store(tmp_path / f"{compressor}.zarr")
    size = 64  # JPEG works on 8×8 blocks: a realistic tile size keeps the error small
    yy, xx = np.mgrid[0:size, 0:size]
    tiles = np.empty((10, size, size, 3), dtype=np.uint8)
    for r in range(10):  # smooth content, as JPEG expects
        tiles[r] = np.stack([40 + 10 * r + xx, 200 - yy, np.full_like(xx, 120 + 5 * r)], axis=-1)
    write_slide(root, "s", 1, 10, tile_size=size, compressor=compressor, tiles=tiles)
    fast, slow = TileDataset(root), TileDataset(root, reader="zarr")
    assert isinstance(fast._tiles(0), ShardFileTiles)
    got = fast.read_batch(np.arange(10))
    np.testing.assert_array_equal(got, slow.read_batch(np.arange(10)))  # same decoder: bit-identical
    np.testing.assert_array_equal(fast[3].image.numpy(), got[3])
    error = np.abs(got.astype(int) - tiles.astype(int))
    if compressor == "none":
        assert error.max() == 0
    else:
        assert error.mean() < 2.0 and error.max() < 24


def test_unknown_layout_falls_back_to_zarr(tmp_path: Path) -> None:
    """A tiles array zarr can read but not in the writer's layout (unsharded here) is read through zarr."""
    root = ts.init_store(tmp_path / "plain.zarr")
    incoming = write_slide(root, "s", 3, 4, commit=False)
    group = zarr.open_group(str(incoming.path), mode="r+")
    del group["tiles"]
    plain = group.create_array("tiles", shape=(4, T, T, 3), chunks=(1, T, T, 3), dtype="uint8")
    plain[...] = np.stack([expected_tile(3, r) for r in range(4)])
    ts.commit_slide(incoming, {"tile_size": T})
    ds = TileDataset(root)
    assert isinstance(ds._tiles(0), ZarrTiles)
    np.testing.assert_array_equal(ds.read_batch([3, 1]), np.stack([expected_tile(3, 3), expected_tile(3, 1)]))


# ------------------------------------------------------------------------------------- selection, filtering


def test_slide_subset(stores: dict[str, Path]) -> None:
    ds = TileDataset([stores["A"], stores["B"]], slide_ids=["b0", "a2", "a1"])
    assert ds.slide_ids == ["a2", "b0"]  # store then id order; a1 has no tiles
    assert len(ds) == 25
    assert [(s.slide_id, s.tile_index) for s in (ds[0], ds[4], ds[5], ds[24])] == [
        ("a2", 0),
        ("a2", 4),
        ("b0", 0),
        ("b0", 19),
    ]
    np.testing.assert_array_equal(ds[7].image.numpy(), expected_tile(CODES["b0"], 2))
    with pytest.raises(ValueError, match="nope"):
        TileDataset(stores["A"], slide_ids=["a0", "nope"])
    with pytest.raises(ValueError, match="no tiles left"):
        TileDataset(stores["A"], slide_ids=["a1"])


def test_min_tissue_fraction_filter(stores: dict[str, Path]) -> None:
    ds = TileDataset([stores["A"], stores["B"]], min_tissue_fraction=0.5)
    assert ds.slide_ids == ["a0", "a3", "b0"]  # a2 (rows 0–4) and b1 (row 0) have no tile with ≥ 50 % tissue
    kept = {sid: [r for r in range(n) if r % 10 >= 5] for sid, _, n in LAYOUT["A"] + LAYOUT["B"]}
    assert ds.tile_counts.tolist() == [len(kept["a0"]), len(kept["a3"]), len(kept["b0"])]
    assert ds._index.rows is not None and ds._index.rows.dtype == np.int32 and len(ds._index.rows) == len(ds)

    expected = [(sid, r) for sid in ds.slide_ids for r in kept[sid]]
    for i, (sid, row) in enumerate(expected):
        sample = ds[i]
        assert (sample.slide_id, sample.tile_index) == (sid, row)
        np.testing.assert_array_equal(sample.image.numpy(), expected_tile(CODES[sid], row))
        assert ds.global_index(sample.slide_index, row) == i
    with pytest.raises(KeyError, match="filtered"):
        ds.global_index(0, 4)  # a0 row 4 has 40 % tissue
    np.testing.assert_array_equal(ds.slide_coords(1), expected_coords(CODES["a3"], kept["a3"]))
    batch = ds.read_batch(np.arange(len(ds))[::-1])
    np.testing.assert_array_equal(batch[-1], expected_tile(CODES["a0"], 5))
    # The per-tile index is the int32 kept-row array: 4 bytes per tile plus a few bytes per slide.
    assert ds.index_nbytes == 4 * len(ds) + 8 * (len(ds.slide_ids) + 1) + 8 * 3 + 4 * 3
    with pytest.raises(ValueError, match="min_tissue_fraction"):
        TileDataset(stores["A"], min_tissue_fraction=1.5)


def test_coords_attrs_and_preload(stores: dict[str, Path]) -> None:
    ds = TileDataset([stores["A"], stores["B"]])
    for s, sid in enumerate(ds.slide_ids):
        coords = ds.slide_coords(s)
        assert coords.dtype == np.int64
        np.testing.assert_array_equal(coords, expected_coords(CODES[sid], np.arange(ds.tile_counts[s])))
        attrs = ds.slide_attrs(s)
        assert attrs["slide_id"] == sid and attrs["tile_count"] == ds.tile_counts[s] and attrs["complete"]
    pre = TileDataset([stores["A"], stores["B"]], preload_coords=True, min_tissue_fraction=0.3)
    lazy = TileDataset([stores["A"], stores["B"]], min_tissue_fraction=0.3, coords_cache_mb=0)  # always evicts
    assert pre._coords is not None and pre._coords.dtype == np.int32
    for i in range(len(pre)):
        assert pre[i][1:] == lazy[i][1:]
    for s in range(len(pre.slide_ids)):
        np.testing.assert_array_equal(pre.slide_coords(s), lazy.slide_coords(s))


def test_image_format_and_transform(stores: dict[str, Path]) -> None:
    ds = TileDataset(stores["B"], image_format="numpy")
    assert isinstance(ds[0].image, np.ndarray) and ds[0].image.shape == (T, T, 3)
    chw = TileDataset(stores["B"], transform=lambda img: img.permute(2, 0, 1).float() / 255)
    img = chw[3].image
    assert img.shape == (3, T, T) and img.dtype == torch.float32
    torch.testing.assert_close(img, torch.from_numpy(expected_tile(CODES["b0"], 3)).permute(2, 0, 1) / 255)
    batch = next(iter(DataLoader(chw, batch_size=4)))  # __getitems__ path with a transform
    assert batch.image.shape == (4, 3, T, T)
    with pytest.raises(ValueError, match="image_format"):
        TileDataset(stores["B"], image_format="pil")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ processes, pickle


def test_pickle_round_trip_drops_handles(stores: dict[str, Path]) -> None:
    ds = TileDataset([stores["A"], stores["B"]], min_tissue_fraction=0.2)
    before = [ds[i] for i in (0, 50, len(ds) - 1)]  # opens readers and fills the coords cache
    assert ds._handles and ds._coords_cache
    state = ds.__getstate__()
    assert not {"_handles", "_coords_cache", "_pid"} & state.keys()
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone._handles and len(clone) == len(ds) and clone.slide_ids == ds.slide_ids
    after = [clone[i] for i in (0, 50, len(ds) - 1)]
    for a, b in zip(before, after, strict=True):
        assert a[1:] == b[1:]
        assert torch.equal(a.image, b.image)


def check_dataloader_matches_direct_indexing(a: str, b: str, context: str) -> None:
    ds = TileDataset([Path(a), Path(b)])
    direct = [ds[i] for i in range(len(ds))]  # the parent has used zarr (and its IO thread) before forking
    loader = DataLoader(ds, batch_size=32, num_workers=2, multiprocessing_context=context, shuffle=False)
    batches = list(loader)
    first = batches[0]
    assert isinstance(first, TileSample)  # default_collate keeps the NamedTuple
    assert first.image.shape == (32, T, T, 3) and first.image.dtype == torch.uint8
    assert first.index.dtype == torch.int64 and isinstance(first.slide_id, tuple)
    images = torch.cat([b.image for b in batches])
    assert torch.equal(images, torch.stack([d.image for d in direct]))
    for field in ("index", "slide_index", "tile_index", "x", "y"):
        got = torch.cat([getattr(b, field) for b in batches]).tolist()
        assert got == [getattr(d, field) for d in direct], field
    assert [s for b in batches for s in b.slide_id] == [d.slide_id for d in direct]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_match_direct_indexing(stores: dict[str, Path], context: str) -> None:
    """In a fresh interpreter, as a training process is: a process that has run Prefect flows in-process (this
    test session does) makes every forked child exit with code 1 at its end, DataLoader workers included."""
    code = (
        "import sys; from tests.test_tile_dataset import check_dataloader_matches_direct_indexing as check; "
        "check(*sys.argv[1:])"
    )
    args = [sys.executable, "-c", code, str(stores["A"]), str(stores["B"]), context]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_forked_child_reopens_handles(stores: dict[str, Path]) -> None:
    ds = TileDataset(stores["B"])
    ds[0]
    parent_handles = ds._handles
    ds._pid = -1  # what a forked child sees: a PID that did not open the handles
    ds[1]
    assert ds._handles is not parent_handles and ds._pid > 0


# ------------------------------------------------------------------------------------------------- errors


def test_incoming_debris_is_ignored(stores: dict[str, Path]) -> None:
    assert (stores["A"] / ts.INCOMING / "junk").is_dir()
    assert any(p.name.startswith("zz-") for p in (stores["A"] / ts.INCOMING).iterdir())
    ds = TileDataset(stores["A"])
    assert "zz" not in ds.slide_ids and len(ds) == 37 + 5 + 300


def test_store_errors(tmp_path: Path, stores: dict[str, Path]) -> None:
    missing = tmp_path / "missing.zarr"
    with pytest.raises(ts.TileStoreError, match=f"{missing}.*does not exist"):
        TileDataset(missing)
    not_store = tmp_path / "folder"
    not_store.mkdir()
    (not_store / "notes.txt").write_text("hi")
    with pytest.raises(ts.TileStoreError, match=f"no tile store at {not_store}"):
        TileDataset(not_store)
    other_zarr = tmp_path / "other.zarr"
    zarr.open_group(str(other_zarr), mode="w", zarr_format=3)
    with pytest.raises(ts.TileStoreError, match="not a wsidino tile store"):
        TileDataset(other_zarr)

    empty = ts.init_store(tmp_path / "empty.zarr")
    with pytest.raises(ts.TileStoreError, match=r"empty tile store .*empty\.zarr.*wsidino tile"):
        TileDataset(empty)
    # All slides failed or had no tissue: the message points at the manifest.
    write_slide(empty, "blank", 1, 0)
    ts.write_manifest(empty, [{"slide_id": "bad", "status": "failed", "error": "truncated file"}])
    with pytest.raises(ts.TileStoreError, match=r"1 slide\(s\) with 0 tiles, 1 failed.*manifest\.json"):
        TileDataset(empty)
    with pytest.raises(ValueError, match="given twice"):
        TileDataset([stores["A"], stores["A"]])
    with pytest.raises(ValueError, match="no tile store given"):
        TileDataset([])


def test_mixed_tile_sizes_are_refused(tmp_path: Path, stores: dict[str, Path]) -> None:
    big = ts.init_store(tmp_path / "big.zarr")
    write_slide(big, "c0", 1, 3, tile_size=32)
    with pytest.raises(ts.TileStoreError, match=r"mix tile sizes \(16 px in .*A\.zarr.*32 px in .*big\.zarr"):
        TileDataset([stores["A"], big])


def test_corrupt_slide_is_named(tmp_path: Path) -> None:
    root = ts.init_store(tmp_path / "corrupt.zarr")
    write_slide(root, "good", 1, 3)
    write_slide(root, "bad", 2, 3)
    (root / "slides/bad/tiles/zarr.json").write_text("{not json")
    with pytest.raises(ts.TileStoreError, match=r"slide 'bad'.*corrupt"):
        TileDataset(root)
    shutil.rmtree(root / "slides/bad")
    # A truncated shard file fails its index checksum instead of decoding garbage.
    shard = root / "slides/good/tiles/c/0/0/0/0"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ts.TileStoreError, match="corrupt shard"):
        TileDataset(root)[0]


def test_tissue_filter_needs_the_tissue_column(tmp_path: Path) -> None:
    root = ts.init_store(tmp_path / "no-tissue.zarr")
    incoming = ts.begin_slide(
        root,
        "s",
        n_tiles=2,
        tile_size=T,
        tiles_per_shard=SHARD,
        columns={"coords": expected_coords(1, [0, 1])},
    )
    incoming.write_tiles(0, np.stack([expected_tile(1, 0), expected_tile(1, 1)]))
    ts.commit_slide(incoming, {"tile_size": T})
    assert len(TileDataset(root)) == 2
    with pytest.raises(ts.TileStoreError, match=r"'s'.*no tissue_fraction"):
        TileDataset(root, min_tissue_fraction=0.5)


# ------------------------------------------------------------------------------------------------- memory


def _big_slide(root: Path, slide_id: str, n: int, fraction: np.ndarray | None = None) -> None:
    """n 16 px tiles whose tile and coords chunks were never written: they cost nothing on disk."""
    columns = {"tissue_fraction": fraction} if fraction is not None else None
    incoming = ts.begin_slide(root, slide_id, n_tiles=n, tile_size=16, tiles_per_shard=4096, columns=columns)
    group = zarr.open_group(str(incoming.path), mode="r+")
    group.create_array("coords", shape=(n, 2), chunks=(2**20, 2), dtype="int64", dimension_names=["tile", "xy"])
    ts.commit_slide(incoming, {"tile_size": 16})


def test_index_memory_is_bytes_per_tile_not_objects(tmp_path: Path) -> None:
    n_per_slide, n_slides = 5_000_000, 20  # 10⁸ tiles
    root = ts.init_store(tmp_path / "huge.zarr")
    for k in range(n_slides):
        _big_slide(root, f"s{k:02d}", n_per_slide)
    tracemalloc.start()
    try:
        ds = TileDataset(root)
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ds) == n_per_slide * n_slides == 10**8
    assert ds._index.rows is None and ds._coords is None  # no per-tile array at all
    assert ds.index_nbytes == 8 * (n_slides + 1) + 8 * n_slides + 4 * n_slides
    assert retained / len(ds) < 0.01 and peak / len(ds) < 0.01  # ~10⁻⁴ bytes per tile
    # O(1) lookups at the far end of the index, and a real read of a never-written (fill value) tile.
    assert ds.locate(10**8 - 1) == (n_slides - 1, n_per_slide - 1)
    assert ds.global_index(7, 123) == 7 * n_per_slide + 123
    sample = ds[10**8 - 1]
    assert sample.slide_id == "s19" and int(sample.image.sum()) == 0 and (sample.x, sample.y) == (0, 0)

    # With a tissue filter the index is one int32 per kept tile.
    filtered_root = ts.init_store(tmp_path / "filtered.zarr")
    fraction = np.tile(np.array([0.2, 0.9], dtype=np.float32), n_per_slide // 2)
    for k in range(2):
        _big_slide(filtered_root, f"f{k}", n_per_slide, fraction)
    tracemalloc.start()
    try:
        ds = TileDataset(filtered_root, min_tissue_fraction=0.5)
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ds) == n_per_slide  # every other tile of two slides
    assert ds._index.rows is not None and ds._index.rows.dtype == np.int32
    assert ds.index_nbytes / len(ds) < 4.01
    assert retained / len(ds) < 16, f"{retained / len(ds):.1f} bytes per tile retained"
    assert ds.locate(len(ds) - 1) == (1, n_per_slide - 1)


# ------------------------------------------------------------------------------------ the real tile stage


def test_tiles_from_the_real_stage_equal_openslide_reads(sample_slides: Any, tmp_path: Path) -> None:
    """Tile a sample slide at its own level-0 µm/px (no resize) with zstd: dataset tiles equal read_region."""
    import openslide

    from dinov3_core.tiling.engine import run_tile

    slide_path = by_name(sample_slides, "tissue_20x.svs")  # 0.5 µm/px at level 0
    values = {"mpp": 0.5, "tile_size": 128, "compressor": "zstd", "tiles_per_shard": 16, "workers": 1}
    result = run_tile(tile_config(slide_path, tmp_path / "tiles.zarr", **values, qc_thumbnail_px=256))
    assert result.counts["ok"] == 1, result.outcomes
    ds = TileDataset(result.store)
    attrs = ds.slide_attrs(0)
    assert attrs["level_used"] == 0 and attrs["read_size"] == attrs["tile_size"] == 128  # no resize
    assert len(ds) == attrs["tile_count"] > 0
    with openslide.OpenSlide(str(slide_path)) as slide:
        for i in range(len(ds)):
            sample = ds[i]
            rgba = np.asarray(slide.read_region((sample.x, sample.y), 0, (128, 128)))
            rgb = rgba[..., :3].copy()
            rgb[rgba[..., 3] == 0] = 255  # the stage paints transparent (outside the scan) as glass
            np.testing.assert_array_equal(sample.image.numpy(), rgb, err_msg=f"tile {i} at {sample[5:]}")
    batch = ds.read_batch(np.arange(len(ds)))
    np.testing.assert_array_equal(batch, np.stack([ds[i].image.numpy() for i in range(len(ds))]))
    manifest = json.loads((result.store / ts.MANIFEST).read_text())
    assert manifest["slides"][0]["tile_count"] == len(ds)
