"""TileDataset read throughput and index memory, on a tile store written with the tile writer's primitives.

Tiles are random 224 px crops (with flips and 90° turns) of scikit-image's IHC image, so they compress like
real tissue (zstd, 256-tile shards, as `wsidino tile` writes them). The store is fresh, i.e. in the page
cache: the figures are the CPU cost of locating, reading and decoding tiles, not disk speed.

Measures, for the direct shard reader (`reader="auto"`) and plain zarr (`reader="zarr"`):
- random access: `dataset[i]` for random i, one process;
- `read_batch` of random indices and of consecutive indices;
- zarr's orthogonal selection (`array.get_orthogonal_selection((rows, …))`) on one slide, for comparison;
- DataLoader, 2 fork workers, shuffled batches (steady state, after the first batch);
- index memory: bytes per tile of the index (numpy `nbytes` and tracemalloc) on a 10⁸-tile layout of empty
  chunks (10⁷ with --quick), and with `min_tissue_fraction`.

Usage: python benchmarks/tile_dataset.py [--quick] [--output DIR]   (writes DIR/tile_dataset.json)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from torch.utils.data import DataLoader

from dinov3_core.data import TileDataset
from dinov3_core.tiling import store as ts

TILE = 224
SHARD = 256


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_tiles(n: int, rng: np.random.Generator) -> np.ndarray:
    from skimage import data

    texture = data.immunohistochemistry()  # 512×512 RGB, shipped with scikit-image
    out = np.empty((n, TILE, TILE, 3), dtype=np.uint8)
    for k in range(n):
        y, x = rng.integers(0, texture.shape[0] - TILE, 2)
        crop = np.rot90(texture[y : y + TILE, x : x + TILE], int(rng.integers(4)))
        out[k] = crop[:, ::-1] if rng.random() < 0.5 else crop
    return out


def build_store(root: Path, n_slides: int, tiles_per_slide: int) -> Path:
    rng = np.random.default_rng(0)
    ts.init_store(root)
    side = int(np.ceil(np.sqrt(tiles_per_slide)))
    for k in range(n_slides):
        rows = np.arange(tiles_per_slide)
        columns = {
            "coords": np.stack([rows % side * TILE, rows // side * TILE], axis=1).astype(np.int64),
            "tissue_fraction": rng.random(tiles_per_slide).astype(np.float32),
        }
        incoming = ts.begin_slide(
            root,
            f"slide{k:03d}",
            n_tiles=tiles_per_slide,
            tile_size=TILE,
            tiles_per_shard=SHARD,
            columns=columns,
        )
        array = incoming.tiles_array()
        for a, b in incoming.shard_ranges():
            incoming.write_tiles(a, make_tiles(b - a, rng), array)
        ts.commit_slide(incoming, {"tile_size": TILE, "compressor": "zstd"})
    return root


class Clock:
    """Wall and CPU time (all threads of this process) of a block: the box may be shared, CPU time is not."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def rate(self, n_tiles: int, *, cpu: bool = True) -> dict[str, float | None]:
        return {
            "tiles": n_tiles,
            "seconds": round(self.wall, 4),
            "tiles_per_s": round(n_tiles / self.wall, 1),
            "tiles_per_cpu_s": round(n_tiles / self.cpu, 1) if cpu else None,
        }


def bench_getitem(ds: TileDataset, n: int, rng: np.random.Generator) -> dict[str, float]:
    idx = rng.integers(0, len(ds), n)
    ds[int(idx[0])]  # open the first reader outside the clock
    with Clock() as clock:
        for i in idx:
            ds[int(i)]
    return clock.rate(n)


def bench_read_batch(ds: TileDataset, n_batches: int, batch: int, rng: np.random.Generator, *, contiguous: bool):
    ds.read_batch([0])
    batches = []
    for _ in range(n_batches):
        if contiguous:
            a = int(rng.integers(0, len(ds) - batch))
            batches.append(np.arange(a, a + batch))
        else:
            batches.append(rng.integers(0, len(ds), batch))
    with Clock() as clock:
        for b in batches:
            ds.read_batch(b)
    return clock.rate(n_batches * batch)


def bench_orthogonal(store: Path, n_tiles: int, rng: np.random.Generator) -> dict[str, float]:
    """zarr's own multi-row read: one orthogonal selection of sorted random rows of one slide."""
    slide = ts.complete_slide_ids(store)[0]
    array = zarr.open_array(str(ts.slide_dir(store, slide) / "tiles"), mode="r")
    rows = np.sort(rng.choice(array.shape[0], n_tiles, replace=False))
    with Clock() as clock:
        array.get_orthogonal_selection((rows, slice(None), slice(None), slice(None)))
    return clock.rate(n_tiles)


def bench_loader(ds: TileDataset, n_batches: int, batch: int, workers: int) -> dict[str, float]:
    """Shuffled batches through a DataLoader; the clock starts when the first batch has arrived."""
    loader = DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        multiprocessing_context="fork",
        prefetch_factor=2,
    )
    it = iter(loader)
    next(it)
    seen = 0
    with Clock() as clock:
        for _ in range(n_batches):
            seen += len(next(it).index)
    del it
    return clock.rate(seen, cpu=False)  # the work happens in the workers


def empty_chunked_store(root: Path, n_slides: int, per_slide: int, *, tissue: bool) -> Path:
    """Slides of 16 px tiles whose tile and coords chunks are never written: large layouts at no disk cost.

    With `tissue`, every other tile has a tissue fraction of 0.9, the others 0.2 (the column is written)."""
    ts.init_store(root)
    fraction = np.tile(np.array([0.2, 0.9], dtype=np.float32), per_slide // 2)
    for k in range(n_slides):
        incoming = ts.begin_slide(
            root,
            f"s{k:03d}",
            n_tiles=per_slide,
            tile_size=16,
            tiles_per_shard=4096,
            columns={"tissue_fraction": fraction} if tissue else None,
        )
        group = zarr.open_group(str(incoming.path), mode="r+")
        group.create_array("coords", shape=(per_slide, 2), chunks=(2**20, 2), dtype="int64")
        ts.commit_slide(incoming, {"tile_size": 16})
    return root


def bench_index_memory(work: Path, n_slides: int, per_slide: int) -> dict[str, Any]:
    """Index bytes per tile (numpy nbytes and tracemalloc) for a large layout, unfiltered and filtered."""
    huge = empty_chunked_store(work / "huge.zarr", n_slides, per_slide, tissue=False)
    filtered = empty_chunked_store(work / "filtered.zarr", 2, per_slide, tissue=True)
    out: dict[str, Any] = {}
    for name, path, kwargs in [
        ("unfiltered", huge, {}),
        ("min_tissue_fraction=0.5", filtered, {"min_tissue_fraction": 0.5}),
    ]:
        tracemalloc.start()
        start = time.perf_counter()
        ds = TileDataset(path, **kwargs)
        seconds = time.perf_counter() - start
        retained, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[name] = {
            "tiles": len(ds),
            "slides": len(ds.slide_ids),
            "index_nbytes": ds.index_nbytes,
            "index_bytes_per_tile": ds.index_nbytes / len(ds),
            "tracemalloc_retained_bytes_per_tile": retained / len(ds),
            "tracemalloc_peak_bytes_per_tile": peak / len(ds),
            "construct_seconds": round(seconds, 3),
        }
    shutil.rmtree(huge, ignore_errors=True)
    shutil.rmtree(filtered, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output", help="directory for tile_dataset.json")
    parser.add_argument("--quick", action="store_true", help="small store and few repetitions (~1 min)")
    parser.add_argument("--workdir", default=None, help="where to build the stores (default: a temp dir)")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    n_slides, per_slide = (2, 512) if args.quick else (8, 1024)
    n_items, n_batches, loader_batches = (300, 5, 10) if args.quick else (2000, 30, 40)
    mem_slides, mem_per_slide = (2, 5_000_000) if args.quick else (20, 5_000_000)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-tile-dataset-"))
    rng = np.random.default_rng(1)
    torch.set_num_threads(1)  # reading is single-threaded per process; keep torch from competing

    try:
        log(f"building a {n_slides}×{per_slide}-tile store in {work}")
        start = time.perf_counter()
        store = build_store(work / "bench.zarr", n_slides, per_slide)
        bytes_per_tile = ts.stored_bytes(store / "slides") / (n_slides * per_slide)
        build_seconds = time.perf_counter() - start

        results: dict[str, Any] = {}
        for reader in ("auto", "zarr"):
            ds = TileDataset(store, reader=reader)  # type: ignore[arg-type]
            log(f"reader={reader}: random access")
            results[f"getitem/{reader}"] = bench_getitem(ds, n_items if reader == "auto" else n_items // 4, rng)
            log(f"reader={reader}: read_batch")
            nb = n_batches if reader == "auto" else max(2, n_batches // 4)
            results[f"read_batch random/{reader}"] = bench_read_batch(ds, nb, args.batch_size, rng, contiguous=False)
            results[f"read_batch contiguous/{reader}"] = bench_read_batch(ds, nb, args.batch_size, rng, contiguous=True)
            log(f"reader={reader}: DataLoader")
            lb = loader_batches if reader == "auto" else max(3, loader_batches // 4)
            results[f"DataLoader 2 workers/{reader}"] = bench_loader(ds, lb, args.batch_size, workers=2)
        log("zarr orthogonal selection")
        results["orthogonal selection (1 slide)/zarr"] = bench_orthogonal(store, 8 if args.quick else 16, rng)
        log("index memory")
        memory = bench_index_memory(work, mem_slides, mem_per_slide)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    lines = [
        f"TileDataset, {n_slides} slides × {per_slide} tiles of {TILE} px (zstd, "
        f"{bytes_per_tile / 1024:.1f} KiB per tile stored, page-cached), batch {args.batch_size}, "
        f"torch {torch.__version__}, zarr {zarr.__version__}",
        "",
        "| read | reader | tiles/s (wall) | tiles per CPU-s |",
        "|---|---|---:|---:|",
    ]
    for key, value in results.items():
        what, reader = key.split("/")
        per_cpu = "–" if value["tiles_per_cpu_s"] is None else f"{value['tiles_per_cpu_s']:,.0f}"
        lines.append(f"| {what} | {reader} | {value['tiles_per_s']:,.0f} | {per_cpu} |")
    lines += [
        "",
        "| index | tiles | slides | index bytes/tile | tracemalloc retained bytes/tile | peak bytes/tile |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in memory.items():
        lines.append(
            f"| {name} | {m['tiles']:,} | {m['slides']} | {m['index_bytes_per_tile']:.4f} | "
            f"{m['tracemalloc_retained_bytes_per_tile']:.4f} | {m['tracemalloc_peak_bytes_per_tile']:.4f} |"
        )
    print("\n".join(lines))
    payload = {
        "quick": args.quick,
        "store": {
            "slides": n_slides,
            "tiles_per_slide": per_slide,
            "tile_size": TILE,
            "bytes_per_tile": bytes_per_tile,
            "build_seconds": round(build_seconds, 2),
        },
        "batch_size": args.batch_size,
        "throughput": results,
        "index_memory": memory,
    }
    (out_dir / "tile_dataset.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
