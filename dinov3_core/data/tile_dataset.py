"""The torch map-style Dataset over every tile of one or more tile stores (docs/tile-store.md), by a global index.

Which tiles exist and where they live is `tile_index.TileIndex` (a few numpy arrays, no per-tile Python
objects); how one slide's pixels are read is `tile_readers` (straight from the writer's shard files, or through
zarr). This module ties them together: per-process handles and caches, level-0 coordinates, batched reads in
shard order, and the `TileSample` that torch's ``default_collate`` batches field by field.

Coordinates
-----------
With ``preload_coords=True`` every tile's level-0 (x, y) is loaded up front as int32 (8 bytes per tile, shared
by forked workers). Otherwise coordinates are read per process on first use of a slide, one int64 block per
slide kept in an LRU cache of ``coords_cache_mb``. The block is the unit because the store writes each slide's
``coords`` as a single chunk: reading one row would decompress the whole chunk anyway, every time. For cohorts
whose coords exceed the cache (16 bytes per tile), uniform random sampling re-reads a slide's block on most
accesses; use ``preload_coords=True`` there.

Processes
---------
zarr arrays are opened lazily in the process that reads them and remembered with that process's PID; a forked
DataLoader worker sees a different PID and reopens (zarr itself resets its IO event loop after fork). No file
stays open between reads. Pickling drops every handle and cache, so the dataset also works with ``spawn``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import zarr
from torch.utils.data import Dataset

from dinov3_core.data.tile_index import StorePaths, TileIndex, store_names
from dinov3_core.data.tile_readers import ShardFileTiles, TileReader, ZarrTiles
from dinov3_core.tiling import store as ts

__all__ = ["TileDataset", "TileSample"]

ImageFormat = Literal["torch", "numpy"]
ReaderMode = Literal["auto", "zarr"]

DEFAULT_COORDS_CACHE_MB = 64.0
MAX_OPEN_ARRAYS = 512  # per-process handles (parsed metadata, a few KiB each); least recently used are dropped


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
        mpp: the µm/px level to read of a store tiled at several (`tile.mpp` a list; matched against the µm/px
            each level was asked for); None: every slide's first level (the only one of a single-level store).
            A slide without that level raises `TileStoreError` naming the levels it has.

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
        mpp: float | None = None,
    ) -> None:
        if image_format not in ("torch", "numpy"):
            raise ValueError(f"image_format must be 'torch' or 'numpy', got {image_format!r}")
        if reader not in ("auto", "zarr"):
            raise ValueError(f"reader must be 'auto' or 'zarr', got {reader!r}")
        if min_tissue_fraction is not None and not 0.0 <= min_tissue_fraction <= 1.0:
            raise ValueError(f"min_tissue_fraction must be in [0, 1], got {min_tissue_fraction}")
        self.transform = transform
        self.image_format: ImageFormat = image_format
        self.reader: ReaderMode = reader
        self.min_tissue_fraction = min_tissue_fraction
        self.coords_cache_bytes = int(coords_cache_mb * 2**20)
        self._index = TileIndex(stores, slide_ids=slide_ids, min_tissue_fraction=min_tissue_fraction, mpp=mpp)
        self._reset_process_state()
        self._coords: np.ndarray | None = self._load_all_coords() if preload_coords else None

    @property
    def stores(self) -> tuple[Path, ...]:
        return self._index.stores

    @property
    def slide_ids(self) -> list[str]:
        return self._index.slide_ids

    @property
    def tile_counts(self) -> np.ndarray:
        """int64 number of tiles of each slide in this dataset."""
        return self._index.tile_counts

    @property
    def tile_size(self) -> int:
        return self._index.tile_size

    # ------------------------------------------------------------------------------------------ construction

    def _load_all_coords(self) -> np.ndarray:
        """(len, 2) int32 level-0 coords aligned with the global index; level-0 px always fit in int32."""
        out = np.empty((len(self), 2), dtype=np.int32)
        for s in range(len(self.slide_ids)):
            a, b = self._index.slide_span(s)
            block = np.asarray(self._array(s, "coords")[...])
            if block.size and block.max() > np.iinfo(np.int32).max:  # cannot happen for a real slide
                raise ts.TileStoreError(f"slide {self.slide_ids[s]} has coords beyond int32; use preload_coords=False")
            rows = self._index.rows
            out[a:b] = block if rows is None else block[rows[a:b]]
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

    def _array(self, slide_index: int, name: str) -> zarr.Array:
        return self._cached_handle(
            (slide_index, name), lambda: zarr.open_array(str(self._index.slide_path(slide_index) / name), mode="r")
        )

    def _tiles(self, slide_index: int) -> TileReader:
        def make() -> TileReader:
            path = self._index.slide_path(slide_index) / "tiles"
            direct = ShardFileTiles.open(path) if self.reader == "auto" else None
            return direct or ZarrTiles(zarr.open_array(str(path), mode="r"))

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
        return len(self._index)

    def locate(self, index: int) -> tuple[int, int]:
        """(slide_index, tile_index) of a global index; tile_index is the row in the slide's store arrays."""
        return self._index.locate(index)

    def locate_many(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised `locate`: (slide_index, tile_index) int64 arrays."""
        return self._index.locate_many(indices)

    def global_index(self, slide_index: int, tile_index: int) -> int:
        """Inverse of `locate`. Raises KeyError for a tile that `min_tissue_fraction` left out."""
        return self._index.global_index(slide_index, tile_index)

    def slide_store(self, slide_index: int) -> Path:
        """The tile store the slide comes from."""
        return self.stores[int(self._index.slide_store[self._index.check_slide(slide_index)])]

    def slide_attrs(self, slide_index: int) -> dict[str, Any]:
        """The slide's `wsidino` attributes (docs/tile-store.md), read from the store; for a further µm/px level
        (`mpp`), with that level's provenance (`mpp_effective`, `tile_size_level0`, `tile_count` …) over the first's."""
        s = self._index.check_slide(slide_index)
        attrs = ts.read_slide_attrs(self.slide_store(s), self.slide_ids[s])
        level = ts.find_level(attrs, self.mpp) if self.mpp is not None else None
        if level is not None:
            attrs.update({k: v for k, v in level.items() if k != "path"})  # `index`: which level
        return attrs

    @property
    def mpp(self) -> float | None:
        """The µm/px level this dataset reads (None: each slide's first)."""
        return self._index.mpp

    def slide_coords(self, slide_index: int) -> np.ndarray:
        """(tile_counts[s], 2) int64 level-0 (x, y) of the slide's tiles in this dataset, in index order."""
        s = self._index.check_slide(slide_index)
        a, b = self._index.slide_span(s)
        if self._coords is not None:
            return self._coords[a:b].astype(np.int64)
        self._check_process()
        block = self._slide_coords_block(s)
        rows = self._index.rows
        return block.copy() if rows is None else block[rows[a:b]]

    @property
    def index_nbytes(self) -> int:
        """Bytes held by the index arrays (per-slide and per-tile numpy arrays; not the slide-id strings)."""
        return self._index.nbytes + (self._coords.nbytes if self._coords is not None else 0)

    # ---------------------------------------------------------------------------------------------- reading

    def __getitem__(self, index: int) -> TileSample:
        self._check_process()
        i = self._index.normalize(index)
        s, row = self.locate(i)
        return self._sample(i, s, row, self._tiles(s).read(row))

    def __getitems__(self, indices: Sequence[int]) -> list[TileSample]:
        """Batched fetch, used by torch's DataLoader for each batch of a map-style dataset."""
        self._check_process()
        idx = self._index.normalize_many(indices)
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
        where = f"{len(self)} tiles of {self.tile_size} px, {len(self.slide_ids)} slides, {store_names(self.stores)}"
        if self.min_tissue_fraction is not None:
            where += f", min_tissue_fraction={self.min_tissue_fraction}"
        return f"TileDataset({where})"
