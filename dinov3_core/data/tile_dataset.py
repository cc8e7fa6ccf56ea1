"""Random access to every tile of one or more tile stores (docs/tile-store.md) by a global index.

Index layout and memory
-----------------------
Slides are concatenated in store order, then slide-id order. The index is a handful of numpy arrays, never one
Python object per tile, so forked DataLoader workers do not copy it page by page through reference-count
writes (distributed-facts §10):

* per slide: ``offsets`` (int64, n_slides + 1 cumulative tile counts), ``tile_counts`` (int64), the store each
  slide comes from (int32) and its id string: ~100 bytes per slide;
* per tile: **0 bytes** without ``min_tissue_fraction``: global index → slide by ``np.searchsorted`` on
  ``offsets``, and the tile's row in the slide's ``tiles`` array is ``index - offsets[slide]``;
* per tile with ``min_tissue_fraction``: **4 bytes** (int32 row of each kept tile in its slide's arrays);
* per tile with ``preload_coords=True``: **8 more bytes** (int32 (x, y) of every tile, loaded up front).

Without ``preload_coords``, level-0 coordinates are read per process on first use of a slide, one int64 block
per slide kept in an LRU cache of ``coords_cache_mb``. The block is the unit because the store writes each
slide's ``coords`` as a single chunk: reading one row would decompress the whole chunk anyway, every time. For
cohorts whose coords exceed the cache (16 bytes per tile), uniform random sampling re-reads a slide's block on
most accesses; use ``preload_coords=True`` there (8 bytes per tile, shared by forked workers).

Reading tiles
-------------
Through zarr-python 3.1 a single 224 px tile costs ~1.3 ms of CPU (benchmarks/tile_dataset.py), mostly
hand-offs between its event loop and thread pool (shard index read, chunk read and decode are each one), and
an integer-array (orthogonal) selection on a sharded array is ~10× slower still: inside a shard it becomes a
per-element coordinate selection. So, by default (``reader="auto"``), tiles are read straight from the shard
files when the ``tiles`` array has exactly the layout the tile writer produces (zarr v3 ``sharding_indexed``,
one tile per inner chunk, index at the end with crc32c, inner codec zstd / none / ``wsidino.jpeg``): one
``pread`` of the shard index (crc-checked), one of the chunk, one decode, ~0.3 ms of CPU per tile. Any other
layout, or ``reader="zarr"``, goes through zarr, where batches are fetched as slices of consecutive rows.
Both paths return identical pixels (tested tile by tile), including zarr's fill value for chunks that were
not stored.

Processes
---------
zarr arrays are opened lazily in the process that reads them and remembered with that process's PID; a forked
DataLoader worker sees a different PID and reopens (zarr itself resets its IO event loop after fork). No file
stays open between reads. Pickling drops every handle and cache, so the dataset also works with ``spawn``.
"""

from __future__ import annotations

import json
import operator
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import google_crc32c
import imagecodecs
import numcodecs
import numpy as np
import torch
import zarr
from torch.utils.data import Dataset

from dinov3_core.tiling import store as ts

__all__ = ["TileDataset", "TileSample"]

StorePaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
ImageFormat = Literal["torch", "numpy"]
ReaderMode = Literal["auto", "zarr"]

DEFAULT_COORDS_CACHE_MB = 64.0
MAX_OPEN_ARRAYS = 512  # per-process handles (parsed metadata, a few KiB each); least recently used are dropped
EMPTY_CHUNK = 2**64 - 1  # zarr sharding: (offset, nbytes) of a chunk that was not stored (all fill value)
_ZSTD = numcodecs.Zstd()  # stateless: a decompression context is made per call


class TileSample(NamedTuple):
    """One tile and where it comes from.

    A NamedTuple, so torch's ``default_collate`` batches it field by field into a ``TileSample``: ``image``
    becomes a stacked tensor [B, H, W, 3] (numpy images are converted to tensors too), the int fields become
    int64 tensors [B] and ``slide_id`` a tuple of B strings (torch leaves strings as they are). With a
    ``transform`` the field holds whatever the transform returned; it must then be collatable itself (tensors,
    numpy arrays, or dicts/lists of them).
    """

    image: Any  # torch.uint8 [H, W, 3] (default) | numpy uint8 (H, W, 3) | the transform's output
    index: int  # global index in the dataset
    slide_index: int  # position of the slide in `TileDataset.slide_ids`
    slide_id: str
    tile_index: int  # row of the tile in the slide's `tiles` / `coords` arrays in the store
    x: int  # level-0 px of the tile's top-left corner
    y: int


@dataclass(frozen=True)
class _SlideEntry:
    store: int
    slide_id: str
    n_tiles: int
    tile_size: int


class TileDataset(Dataset[TileSample]):
    """Map-style dataset over all tiles of one or more tile stores; ``dataset[i]`` is a `TileSample`.

    Args:
        stores: a tile store directory or a sequence of them (all must share one tile size).
        slide_ids: keep only these slides (ids as in the store; an unknown id is an error). Order does not
            matter: slides are always ordered by store, then id.
        min_tissue_fraction: keep only tiles whose stored ``tissue_fraction`` is at least this.
        transform: applied to each tile image (in ``image_format``); its output replaces ``image``.
        image_format: ``"torch"`` (uint8 tensor [H, W, 3], default) or ``"numpy"`` (uint8 array (H, W, 3)).
        preload_coords: load every tile's coords up front (8 bytes per tile) instead of per slide on demand.
        coords_cache_mb: per-process budget of the on-demand coords cache.
        reader: ``"auto"`` (direct shard-file reads for the writer's layout, zarr otherwise) or ``"zarr"``.

    Slides without tiles (none stored, or none left after filtering) are left out of the index, so every
    ``slide_index`` has at least one tile. ``.incoming/`` (slides being written, crash debris) is never read.
    Torch's DataLoader fetches whole batches through ``__getitems__`` (one `read_batch` per batch).
    Reading is not thread-safe (per-process LRU caches): give each thread its own dataset object; DataLoader
    workers are processes and need nothing. Do not re-tile a store while a dataset reads it: tile counts are
    fixed when the dataset is built.
    """

    def __init__(
        self,
        stores: StorePaths,
        *,
        slide_ids: Iterable[str] | None = None,
        min_tissue_fraction: float | None = None,
        transform: Callable[[Any], Any] | None = None,
        image_format: ImageFormat = "torch",
        preload_coords: bool = False,
        coords_cache_mb: float = DEFAULT_COORDS_CACHE_MB,
        reader: ReaderMode = "auto",
    ) -> None:
        if image_format not in ("torch", "numpy"):
            raise ValueError(f"image_format must be 'torch' or 'numpy', got {image_format!r}")
        if reader not in ("auto", "zarr"):
            raise ValueError(f"reader must be 'auto' or 'zarr', got {reader!r}")
        if min_tissue_fraction is not None and not 0.0 <= min_tissue_fraction <= 1.0:
            raise ValueError(f"min_tissue_fraction must be in [0, 1], got {min_tissue_fraction}")
        self.stores: tuple[Path, ...] = _store_paths(stores)
        self.transform = transform
        self.image_format: ImageFormat = image_format
        self.reader: ReaderMode = reader
        self.min_tissue_fraction = min_tissue_fraction
        self.coords_cache_bytes = int(coords_cache_mb * 2**20)

        entries = [e for i, root in enumerate(self.stores) for e in _scan_store(i, root)]
        entries = _select_slides(entries, slide_ids, self.stores)
        self.tile_size: int = _common_tile_size(entries, self.stores)

        rows: np.ndarray | None = None
        counts = np.array([e.n_tiles for e in entries], dtype=np.int64)
        if min_tissue_fraction is not None:
            rows, counts = self._kept_rows(entries, min_tissue_fraction)
        keep = counts > 0
        entries = [e for e, k in zip(entries, keep, strict=True) if k]
        counts = counts[keep]

        self.slide_ids: list[str] = [e.slide_id for e in entries]
        self.tile_counts: np.ndarray = counts
        self._slide_store = np.array([e.store for e in entries], dtype=np.int32)
        self._offsets = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum(counts, out=self._offsets[1:])
        self._rows = rows  # int32 row of each dataset tile in its slide's arrays, or None: row = local index
        if len(self) == 0:
            why = "slide_ids" if min_tissue_fraction is None else "slide_ids / min_tissue_fraction"
            raise ValueError(f"no tiles left in {_names(self.stores)} after selecting by {why}")

        self._reset_process_state()
        self._coords: np.ndarray | None = self._load_all_coords() if preload_coords else None

    # ------------------------------------------------------------------------------------------ construction

    def _kept_rows(self, entries: list[_SlideEntry], threshold: float) -> tuple[np.ndarray, np.ndarray]:
        """Rows with tissue_fraction ≥ threshold, concatenated over slides (int32: < 2³¹ tiles per slide)."""
        parts: list[np.ndarray] = []
        for e in entries:
            if e.n_tiles == 0:
                parts.append(np.empty(0, dtype=np.int32))
                continue
            try:
                fraction = _open_array(self.stores[e.store], e.slide_id, "tissue_fraction")[...]
            except FileNotFoundError:
                raise ts.TileStoreError(
                    f"slide {e.slide_id!r} in tile store {self.stores[e.store]} has no tissue_fraction "
                    "array, so min_tissue_fraction cannot apply; re-tile it or unset min_tissue_fraction"
                ) from None
            parts.append(np.flatnonzero(np.asarray(fraction) >= threshold).astype(np.int32))
        counts = np.array([len(p) for p in parts], dtype=np.int64)
        rows = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
        return rows, counts

    def _load_all_coords(self) -> np.ndarray:
        """(len, 2) int32 level-0 coords aligned with the global index; level-0 px always fit in int32."""
        out = np.empty((len(self), 2), dtype=np.int32)
        for s in range(len(self.slide_ids)):
            a, b = self._offsets[s], self._offsets[s + 1]
            block = np.asarray(self._array(s, "coords")[...])
            if block.size and block.max() > np.iinfo(np.int32).max:  # cannot happen for a real slide
                raise ts.TileStoreError(f"slide {self.slide_ids[s]} has coords beyond int32; use preload_coords=False")
            out[a:b] = block if self._rows is None else block[self._rows[a:b]]
        self._reset_process_state()  # the handles opened here are not needed by workers
        return out

    # ------------------------------------------------------------------------------------ per-process state

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._handles: OrderedDict[tuple[int, str], Any] = OrderedDict()
        self._coords_cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._coords_cache_used = 0

    def _check_process(self) -> None:
        # A forked worker inherits the parent's handles; reopen rather than share them across processes.
        if self._pid != os.getpid():
            self._reset_process_state()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_pid", "_handles", "_coords_cache", "_coords_cache_used"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def _cached_handle(self, key: tuple[int, str], make: Callable[[], Any]) -> Any:
        handle = self._handles.get(key)
        if handle is None:
            handle = self._handles[key] = make()
            if len(self._handles) > MAX_OPEN_ARRAYS:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(key)
        return handle

    def _slide_path(self, slide_index: int) -> Path:
        return ts.slide_dir(self.stores[int(self._slide_store[slide_index])], self.slide_ids[slide_index])

    def _array(self, slide_index: int, name: str) -> zarr.Array:
        return self._cached_handle(
            (slide_index, name), lambda: zarr.open_array(str(self._slide_path(slide_index) / name), mode="r")
        )

    def _tiles(self, slide_index: int) -> _TileReader:
        def make() -> _TileReader:
            path = self._slide_path(slide_index) / "tiles"
            direct = _ShardFileTiles.open(path) if self.reader == "auto" else None
            return direct or _ZarrTiles(zarr.open_array(str(path), mode="r"))

        return self._cached_handle((slide_index, "tiles-reader"), make)

    def _slide_coords_block(self, slide_index: int) -> np.ndarray:
        """All stored coords of a slide (indexed by store row), from the per-process LRU cache."""
        block = self._coords_cache.get(slide_index)
        if block is not None:
            self._coords_cache.move_to_end(slide_index)
            return block
        block = np.asarray(self._array(slide_index, "coords")[...])
        self._coords_cache[slide_index] = block
        self._coords_cache_used += block.nbytes
        while self._coords_cache_used > self.coords_cache_bytes and len(self._coords_cache) > 1:
            self._coords_cache_used -= self._coords_cache.popitem(last=False)[1].nbytes
        return block

    # ----------------------------------------------------------------------------------------------- lookup

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def _normalize(self, index: Any) -> int:
        i = operator.index(index)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"tile index {index} out of range for a dataset of {n} tiles")
        return i

    def _normalize_many(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise TypeError(f"indices must be a 1-d sequence of integers, got {idx.dtype} of shape {idx.shape}")
        idx = idx.astype(np.int64, copy=True)
        n = len(self)
        idx[idx < 0] += n
        bad = (idx < 0) | (idx >= n)
        if bad.any():
            raise IndexError(f"tile index {np.asarray(indices)[bad][0]} out of range for {n} tiles")
        return idx

    def _check_slide(self, slide_index: int) -> int:
        s = operator.index(slide_index)
        if not 0 <= s < len(self.slide_ids):
            raise IndexError(f"slide index {slide_index} out of range for {len(self.slide_ids)} slides")
        return s

    def locate(self, index: int) -> tuple[int, int]:
        """(slide_index, tile_index) of a global index; tile_index is the row in the slide's store arrays."""
        i = self._normalize(index)
        s = int(np.searchsorted(self._offsets, i, side="right")) - 1
        row = i - int(self._offsets[s]) if self._rows is None else int(self._rows[i])
        return s, row

    def locate_many(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised `locate`: (slide_index, tile_index) int64 arrays."""
        idx = self._normalize_many(indices)
        slides = np.searchsorted(self._offsets, idx, side="right") - 1
        rows = idx - self._offsets[slides] if self._rows is None else self._rows[idx].astype(np.int64)
        return slides, rows

    def global_index(self, slide_index: int, tile_index: int) -> int:
        """Inverse of `locate`. Raises KeyError for a tile that `min_tissue_fraction` left out."""
        s = self._check_slide(slide_index)
        a, b = int(self._offsets[s]), int(self._offsets[s + 1])
        if self._rows is None:
            if not 0 <= tile_index < b - a:
                raise IndexError(f"slide {self.slide_ids[s]} has {b - a} tiles; no tile {tile_index}")
            return a + int(tile_index)
        kept = self._rows[a:b]  # ascending, so the row is found by bisection
        k = int(np.searchsorted(kept, tile_index))
        if k == len(kept) or kept[k] != tile_index:
            raise KeyError(f"tile {tile_index} of slide {self.slide_ids[s]} is not in the dataset (filtered)")
        return a + k

    def slide_store(self, slide_index: int) -> Path:
        """The tile store the slide comes from."""
        return self.stores[int(self._slide_store[self._check_slide(slide_index)])]

    def slide_attrs(self, slide_index: int) -> dict[str, Any]:
        """The slide's `wsidino` attributes (docs/tile-store.md), read from the store."""
        s = self._check_slide(slide_index)
        return ts.read_slide_attrs(self.slide_store(s), self.slide_ids[s])

    def slide_coords(self, slide_index: int) -> np.ndarray:
        """(tile_counts[s], 2) int64 level-0 (x, y) of the slide's tiles in this dataset, in index order."""
        s = self._check_slide(slide_index)
        a, b = int(self._offsets[s]), int(self._offsets[s + 1])
        if self._coords is not None:
            return self._coords[a:b].astype(np.int64)
        self._check_process()
        block = self._slide_coords_block(s)
        return block.copy() if self._rows is None else block[self._rows[a:b]]

    @property
    def index_nbytes(self) -> int:
        """Bytes held by the index arrays (per-slide and per-tile numpy arrays; not the slide-id strings)."""
        arrays = [self._offsets, self.tile_counts, self._slide_store, self._rows, self._coords]
        return sum(a.nbytes for a in arrays if a is not None)

    # ---------------------------------------------------------------------------------------------- reading

    def __getitem__(self, index: int) -> TileSample:
        self._check_process()
        i = self._normalize(index)
        s, row = self.locate(i)
        return self._sample(i, s, row, self._tiles(s).read(row))

    def __getitems__(self, indices: Sequence[int]) -> list[TileSample]:
        """Batched fetch, used by torch's DataLoader for each batch of a map-style dataset."""
        self._check_process()
        idx = self._normalize_many(indices)
        slides, rows = self.locate_many(idx)
        images = self._read(slides, rows)
        return [
            self._sample(int(i), int(s), int(r), images[k])
            for k, (i, s, r) in enumerate(zip(idx, slides, rows, strict=True))
        ]

    def _sample(self, i: int, s: int, row: int, image: np.ndarray) -> TileSample:
        if self._coords is not None:
            x, y = (int(v) for v in self._coords[i])
        else:
            x, y = (int(v) for v in self._slide_coords_block(s)[row])
        out: Any = torch.from_numpy(image) if self.image_format == "torch" else image
        if self.transform is not None:
            out = self.transform(out)
        return TileSample(out, i, s, self.slide_ids[s], row, x, y)

    def read_batch(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Tiles (N, T, T, 3) uint8 of global indices (any order, repeats allowed), read slide by slide.

        Indices are sorted by (slide, row), so tiles that share a shard file are read together (one open, one
        index read) and each decoded tile is written straight into its place in the output; a repeated index
        is read once and copied.
        """
        self._check_process()
        return self._read(*self.locate_many(indices))

    def _read(self, slides: np.ndarray, rows: np.ndarray) -> np.ndarray:
        out = np.empty((len(slides), self.tile_size, self.tile_size, 3), dtype=np.uint8)
        if len(slides) == 0:
            return out
        order = np.lexsort((rows, slides))
        s_sorted, r_sorted = slides[order], rows[order]
        first = np.r_[True, (np.diff(s_sorted) != 0) | (np.diff(r_sorted) != 0)]
        unique_at = np.flatnonzero(first)
        new_slide = np.flatnonzero(np.diff(s_sorted[unique_at])) + 1
        for group in np.split(unique_at, new_slide):
            self._tiles(int(s_sorted[group[0]])).read_rows(r_sorted[group], out, order[group])
        if len(unique_at) < len(order):
            source = order[np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))]
            out[order[~first]] = out[source[~first]]
        return out

    def __repr__(self) -> str:
        where = f"{len(self)} tiles of {self.tile_size} px, {len(self.slide_ids)} slides, {_names(self.stores)}"
        if self.min_tissue_fraction is not None:
            where += f", min_tissue_fraction={self.min_tissue_fraction}"
        return f"TileDataset({where})"


# ----------------------------------------------------------------------------------------------- tile readers


class _TileReader(Protocol):
    def read(self, row: int) -> np.ndarray: ...

    def read_rows(self, rows: np.ndarray, out: np.ndarray, dest: np.ndarray) -> None:
        """Write tile `rows[k]` to `out[dest[k]]`; `rows` ascending and distinct."""
        ...


class _ZarrTiles:
    """Tiles through zarr: any layout zarr can read."""

    def __init__(self, array: zarr.Array) -> None:
        self.array = array

    def read(self, row: int) -> np.ndarray:
        return np.asarray(self.array[row])

    def read_rows(self, rows: np.ndarray, out: np.ndarray, dest: np.ndarray) -> None:
        # Runs of consecutive rows are read as one slice each: zarr 3.1 turns an integer-array selection on a
        # sharded array into a per-element coordinate selection inside the shard (~50 ms per 224 px tile).
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        for run, where in zip(np.split(rows, breaks), np.split(dest, breaks), strict=True):
            out[where] = self.array[int(run[0]) : int(run[-1]) + 1]


@dataclass(frozen=True)
class _ShardFileTiles:
    """Tiles read straight from shard files laid out exactly as the tile writer lays them out.

    zarr v3 sharding (spec: zarr-specs codecs/sharding-indexed): shard k of `tiles` holds rows k·S … k·S+S-1,
    one (1, T, T, 3) chunk each; the file ends with the index, S little-endian uint64 (offset, nbytes) pairs
    followed by their crc32c. A chunk that holds only the fill value is not stored ((2⁶⁴-1, 2⁶⁴-1)), and a
    shard with no stored chunk has no file: both read as the fill value, as with zarr.
    """

    path: Path
    tiles_per_shard: int
    tile_size: int
    separator: str
    codec: Literal["zstd", "none", "jpeg"]
    fill_value: int

    @classmethod
    def open(cls, path: Path) -> _ShardFileTiles | None:
        """The reader for the array at `path`, or None when its layout is not the one this reader knows."""
        try:
            meta = json.loads((path / "zarr.json").read_text())
            shape = [int(n) for n in meta["shape"]]
            shard = [int(n) for n in meta["chunk_grid"]["configuration"]["chunk_shape"]]
            key_encoding = meta["chunk_key_encoding"]
            (sharding,) = meta["codecs"]
            config = sharding["configuration"]
            inner = [c["name"] for c in config["codecs"]]
            index_codecs = config["index_codecs"]
            fill_value = int(meta["fill_value"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        t = shape[1] if len(shape) == 4 else -1
        codec = {("bytes", "zstd"): "zstd", ("bytes",): "none", ("wsidino.jpeg",): "jpeg"}.get(tuple(inner))
        known = (
            meta.get("data_type") == "uint8"
            and shape[1:] == [t, t, 3]
            and shard[1:] == [t, t, 3]
            and sharding.get("name") == "sharding_indexed"
            and [int(n) for n in config["chunk_shape"]] == [1, t, t, 3]
            and config.get("index_location", "end") == "end"
            and [c["name"] for c in index_codecs] == ["bytes", "crc32c"]
            and index_codecs[0].get("configuration", {}).get("endian", "little") == "little"
            and key_encoding.get("name") == "default"
            and not meta.get("storage_transformers")
            and codec is not None
        )
        if not known:
            return None
        separator = key_encoding.get("configuration", {}).get("separator", "/")
        return cls(path, shard[0], t, separator, codec, fill_value)  # type: ignore[arg-type]

    def _shard_file(self, shard: int) -> Path:
        return self.path / self.separator.join(("c", str(shard), "0", "0", "0"))

    def read(self, row: int) -> np.ndarray:
        out = np.empty((1, self.tile_size, self.tile_size, 3), dtype=np.uint8)
        self.read_rows(np.array([row]), out, np.zeros(1, dtype=np.int64))
        return out[0]

    def read_rows(self, rows: np.ndarray, out: np.ndarray, dest: np.ndarray) -> None:
        # Rows come sorted, so each shard file is opened once and its index read once.
        shards = rows // self.tiles_per_shard
        breaks = np.flatnonzero(np.diff(shards)) + 1
        for run, where in zip(np.split(rows, breaks), np.split(dest, breaks), strict=True):
            shard = int(run[0]) // self.tiles_per_shard
            path = self._shard_file(shard)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                out[where] = self.fill_value
                continue
            try:
                index = self._read_index(fd, path)
                for row, d in zip(run.tolist(), where.tolist(), strict=True):
                    offset, nbytes = index[row - shard * self.tiles_per_shard].tolist()
                    if offset == EMPTY_CHUNK and nbytes == EMPTY_CHUNK:
                        out[d] = self.fill_value
                    else:
                        out[d] = self._decode(os.pread(fd, nbytes, offset), path, row)
            finally:
                os.close(fd)

    def _read_index(self, fd: int, path: Path) -> np.ndarray:
        size = self.tiles_per_shard * 16
        end = os.fstat(fd).st_size
        raw = os.pread(fd, size + 4, end - size - 4) if end >= size + 4 else b""
        if len(raw) != size + 4 or google_crc32c.value(raw[:size]).to_bytes(4, "little") != raw[size:]:
            raise ts.TileStoreError(
                f"corrupt shard {path}: its chunk index is truncated or fails its checksum; re-tile the slide"
            )
        return np.frombuffer(raw[:size], dtype="<u8").reshape(-1, 2)

    def _decode(self, data: bytes, path: Path, row: int) -> np.ndarray:
        t = self.tile_size
        if self.codec == "jpeg":
            tile = imagecodecs.jpeg_decode(data)
        elif self.codec == "zstd":
            tile = np.frombuffer(_ZSTD.decode(data), dtype=np.uint8)
        else:
            tile = np.frombuffer(data, dtype=np.uint8)
        if tile.size != t * t * 3:
            raise ts.TileStoreError(f"corrupt tile {row} in {path}: it decodes to {tile.size} bytes, not {t}×{t}×3")
        return tile.reshape(t, t, 3)


# -------------------------------------------------------------------------------------------- store scanning


def _names(stores: Sequence[Path]) -> str:
    return ", ".join(str(s) for s in stores)


def _store_paths(stores: StorePaths) -> tuple[Path, ...]:
    items = [stores] if isinstance(stores, str | os.PathLike) else list(stores)
    if not items:
        raise ValueError("no tile store given")
    paths = tuple(Path(p).expanduser() for p in items)
    seen: set[Path] = set()
    for p in paths:
        if p.resolve() in seen:
            raise ValueError(f"tile store {p} is given twice; its tiles would be counted twice")
        seen.add(p.resolve())
    return paths


def _open_array(root: Path, slide_id: str, name: str) -> zarr.Array:
    return zarr.open_array(str(ts.slide_dir(root, slide_id) / name), mode="r")


def _array_shape(root: Path, slide_id: str, name: str) -> tuple[int, ...]:
    """Shape from the zarr v3 array metadata, without creating zarr objects (fast for 10⁴ slides)."""
    path = ts.slide_dir(root, slide_id) / name / "zarr.json"
    try:
        meta = json.loads(path.read_text())
        return tuple(int(n) for n in meta["shape"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ts.TileStoreError(
            f"slide {slide_id!r} in tile store {root} is corrupt: cannot read {path} ({err}); "
            "delete the slide's folder and re-run `wsidino tile`"
        ) from None


def _scan_store(store_index: int, root: Path) -> list[_SlideEntry]:
    """The committed slides of a store and their tile counts; raises for a missing, corrupt or empty store."""
    if not root.exists():
        raise ts.TileStoreError(f"tile store {root} does not exist; run `wsidino tile` to create it")
    ts.check_store(root)
    entries = []
    for slide_id in ts.complete_slide_ids(root):  # lists slides/ only: .incoming/ is never looked at
        try:
            attrs = ts.read_slide_attrs(root, slide_id)
        except (OSError, ValueError) as err:
            raise ts.TileStoreError(
                f"slide {slide_id!r} in tile store {root} has unreadable metadata ({err}); "
                "delete the slide's folder and re-run `wsidino tile`"
            ) from None
        shape = _array_shape(root, slide_id, "tiles")
        # A slide without tiles is skipped whatever its columns look like (it may have none at all).
        n_coords = _array_shape(root, slide_id, "coords")[0] if shape and shape[0] else 0
        problem = None
        if not attrs.get("complete"):
            problem = "is not marked complete"
        elif len(shape) != 4 or shape[1] != shape[2] or shape[3] != 3:
            problem = f"has a tiles array of shape {shape}, expected (N, T, T, 3)"
        elif n_coords != shape[0] or attrs.get("tile_count", shape[0]) != shape[0]:
            problem = f"has {shape[0]} tiles but {n_coords} coords and tile_count {attrs.get('tile_count')}"
        if problem:
            raise ts.TileStoreError(
                f"slide {slide_id!r} in tile store {root} {problem}; delete the slide's folder and re-run "
                "`wsidino tile`"
            )
        entries.append(_SlideEntry(store_index, slide_id, shape[0], shape[1]))
    if sum(e.n_tiles for e in entries) == 0:
        raise ts.TileStoreError(f"empty tile store {root}: {_empty_reason(root, len(entries))}")
    return entries


def _empty_reason(root: Path, n_slides: int) -> str:
    manifest = ts.read_manifest(root).get("slides", [])
    failed = sum(1 for e in manifest if e.get("status") == "failed")
    if not manifest and n_slides == 0:
        return "no slides; run `wsidino tile` first"
    parts = [f"{n_slides} slide(s) with 0 tiles"] if n_slides else ["no slides"]
    if failed:
        parts.append(f"{failed} failed")
    return (
        f"{', '.join(parts)}. All slides failed or had no tissue — see {root / ts.MANIFEST}; "
        "run `wsidino tile` again after fixing the inputs"
    )


def _common_tile_size(entries: list[_SlideEntry], stores: Sequence[Path]) -> int:
    sizes: dict[int, str] = {}
    for e in entries:
        sizes.setdefault(e.tile_size, f"{stores[e.store]} (slide {e.slide_id})")
    if len(sizes) > 1:
        listed = "; ".join(f"{size} px in {where}" for size, where in sorted(sizes.items()))
        raise ts.TileStoreError(
            f"tile stores mix tile sizes ({listed}); one dataset needs one tile size: re-tile, or use one "
            "TileDataset per tile size (or slide_ids to pick slides of one size)"
        )
    return next(iter(sizes), 0)  # 0: no slide selected, reported as "no tiles left" by the caller


def _select_slides(
    entries: list[_SlideEntry], slide_ids: Iterable[str] | None, stores: Sequence[Path]
) -> list[_SlideEntry]:
    if slide_ids is None:
        return entries
    wanted = {slide_ids} if isinstance(slide_ids, str) else set(slide_ids)
    missing = sorted(wanted - {e.slide_id for e in entries})
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"slide id(s) not in the tile store(s) {_names(stores)}: {shown}")
    return [e for e in entries if e.slide_id in wanted]
