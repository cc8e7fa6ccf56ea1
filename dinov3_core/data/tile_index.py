"""Which tiles one or more tile stores (docs/tile-store.md) hold, and where each one lives, by a global index.

`TileIndex` scans the stores once (slide metadata and array shapes only, never pixels) and maps a global tile
index to (slide, row in the slide's store arrays) and back. Slides are concatenated in store order, then
slide-id order. The index is a handful of numpy arrays, never one Python object per tile, so forked DataLoader
workers do not copy it page by page through reference-count writes (docs/reference/distributed.md#dataloader-memory):

* per slide: ``offsets`` (int64, n_slides + 1 cumulative tile counts), ``tile_counts`` (int64), the store each
  slide comes from (int32) and its id string: ~100 bytes per slide;
* per tile: **0 bytes** without ``min_tissue_fraction``: global index → slide by ``np.searchsorted`` on
  ``offsets``, and the tile's row in the slide's ``tiles`` array is ``index - offsets[slide]``;
* per tile with ``min_tissue_fraction``: **4 bytes** (int32 row of each kept tile in its slide's arrays).

The scan raises `TileStoreError` with the fix for a missing, corrupt or empty store, and ``.incoming/`` (slides
being written, crash debris) is never looked at.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from dinov3_core.tiling import store as ts

__all__ = ["StorePaths", "TileIndex"]

StorePaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass(frozen=True)
class SlideEntry:
    store: int
    slide_id: str
    n_tiles: int
    tile_size: int
    path: str = ""  # the level's group inside the slide's ("": the first µm/px level, the slide's own arrays)


class TileIndex:
    """Global tile index ↔ (slide_index, row) over the committed slides of `stores`.

    Slides without tiles (none stored, or none left after ``min_tissue_fraction``) are left out, so every
    slide index has at least one tile; an index with no tile at all is an error. See `TileDataset` for the
    arguments.
    """

    def __init__(
        self,
        stores: StorePaths,
        *,
        slide_ids: Iterable[str] | None = None,
        min_tissue_fraction: float | None = None,
        mpp: float | None = None,
    ) -> None:
        self.stores: tuple[Path, ...] = store_paths(stores)
        self.mpp = mpp  # the µm/px level read (None: each slide's first level, the only one of most stores)
        entries = [e for i, root in enumerate(self.stores) for e in scan_store(i, root, mpp)]
        entries = select_slides(entries, slide_ids, self.stores)
        self.tile_size: int = common_tile_size(entries, self.stores)

        rows: np.ndarray | None = None
        counts = np.array([e.n_tiles for e in entries], dtype=np.int64)
        if min_tissue_fraction is not None:
            rows, counts = kept_rows(entries, self.stores, min_tissue_fraction)
        keep = counts > 0
        entries = [e for e, k in zip(entries, keep, strict=True) if k]
        counts = counts[keep]

        self.slide_ids: list[str] = [e.slide_id for e in entries]
        self.level_paths: list[str] = [e.path for e in entries]  # per slide: "" or "levels/<k>"
        self.tile_counts: np.ndarray = counts
        self.slide_store = np.array([e.store for e in entries], dtype=np.int32)
        self.offsets = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        self.rows = rows  # int32 row of each indexed tile in its slide's arrays, or None: row = local index
        if len(self) == 0:
            why = "slide_ids" if min_tissue_fraction is None else "slide_ids / min_tissue_fraction"
            raise ValueError(f"no tiles left in {store_names(self.stores)} after selecting by {why}")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the index arrays (per-slide and per-tile numpy arrays; not the slide-id strings)."""
        arrays = [self.offsets, self.tile_counts, self.slide_store, self.rows]
        return sum(a.nbytes for a in arrays if a is not None)

    def normalize(self, index: Any) -> int:
        i = operator.index(index)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"tile index {index} out of range for a dataset of {n} tiles")
        return i

    def normalize_many(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
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

    def check_slide(self, slide_index: int) -> int:
        s = operator.index(slide_index)
        if not 0 <= s < len(self.slide_ids):
            raise IndexError(f"slide index {slide_index} out of range for {len(self.slide_ids)} slides")
        return s

    def slide_span(self, slide_index: int) -> tuple[int, int]:
        """[start, stop) of the slide's tiles in the global index."""
        return int(self.offsets[slide_index]), int(self.offsets[slide_index + 1])

    def slide_path(self, slide_index: int) -> Path:
        """The group holding the slide's arrays at this index's µm/px level."""
        root = ts.slide_dir(self.stores[int(self.slide_store[slide_index])], self.slide_ids[slide_index])
        return root / self.level_paths[slide_index] if self.level_paths[slide_index] else root

    def locate(self, index: int) -> tuple[int, int]:
        """(slide_index, tile_index) of a global index; tile_index is the row in the slide's store arrays."""
        i = self.normalize(index)
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        row = i - int(self.offsets[s]) if self.rows is None else int(self.rows[i])
        return s, row

    def locate_many(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised `locate`: (slide_index, tile_index) int64 arrays."""
        idx = self.normalize_many(indices)
        slides = np.searchsorted(self.offsets, idx, side="right") - 1
        rows = idx - self.offsets[slides] if self.rows is None else self.rows[idx].astype(np.int64)
        return slides, rows

    def global_index(self, slide_index: int, tile_index: int) -> int:
        """Inverse of `locate`. Raises KeyError for a tile that `min_tissue_fraction` left out."""
        s = self.check_slide(slide_index)
        a, b = self.slide_span(s)
        if self.rows is None:
            if not 0 <= tile_index < b - a:
                raise IndexError(f"slide {self.slide_ids[s]} has {b - a} tiles; no tile {tile_index}")
            return a + int(tile_index)
        kept = self.rows[a:b]  # ascending, so the row is found by bisection
        k = int(np.searchsorted(kept, tile_index))
        if k == len(kept) or kept[k] != tile_index:
            raise KeyError(f"tile {tile_index} of slide {self.slide_ids[s]} is not in the dataset (filtered)")
        return a + k


# -------------------------------------------------------------------------------------------- store scanning


def store_names(stores: Sequence[Path]) -> str:
    return ", ".join(str(s) for s in stores)


def store_paths(stores: StorePaths) -> tuple[Path, ...]:
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


def kept_rows(entries: list[SlideEntry], stores: Sequence[Path], threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows with tissue_fraction ≥ threshold, concatenated over slides (int32: < 2³¹ tiles per slide)."""
    parts: list[np.ndarray] = []
    for e in entries:
        if e.n_tiles == 0:
            parts.append(np.empty(0, dtype=np.int32))
            continue
        try:
            path = ts.slide_dir(stores[e.store], e.slide_id) / e.path / "tissue_fraction"
            fraction = zarr.open_array(str(path), mode="r")[...]
        except FileNotFoundError:
            raise ts.TileStoreError(
                f"slide {e.slide_id!r} in tile store {stores[e.store]} has no tissue_fraction "
                "array, so min_tissue_fraction cannot apply; re-tile it or unset min_tissue_fraction"
            ) from None
        parts.append(np.flatnonzero(np.asarray(fraction) >= threshold).astype(np.int32))
    counts = np.array([len(p) for p in parts], dtype=np.int64)
    rows = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
    return rows, counts


def array_shape(root: Path, slide_id: str, name: str) -> tuple[int, ...]:
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


def scan_store(store_index: int, root: Path, mpp: float | None = None) -> list[SlideEntry]:
    """The committed slides of a store and their tile counts (at the `mpp` µm/px level; None: the first); raises
    for a missing, corrupt or empty store, and for a slide without that level."""
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
        sub, expected = "", attrs.get("tile_count")
        if mpp is not None:
            level = ts.find_level(attrs, mpp)
            if level is None:
                raise ts.missing_level(root, slide_id, attrs, mpp, "mpp")
            sub, expected = level.get("path") or "", level.get("tile_count")
            if sub and not (ts.slide_dir(root, slide_id) / sub).is_dir():  # listed in the attributes, gone on disk
                raise ts.TileStoreError(
                    f"slide {slide_id!r} in tile store {root} lacks its level at {mpp:g} µm/px "
                    f"({ts.slide_dir(root, slide_id) / sub} is missing); delete the slide's folder and re-run "
                    "`wsidino tile` to tile it again at every level"
                )
        prefix = f"{sub}/" if sub else ""
        shape = array_shape(root, slide_id, f"{prefix}tiles")
        # A slide without tiles is skipped whatever its columns look like (it may have none at all).
        n_coords = array_shape(root, slide_id, f"{prefix}coords")[0] if shape and shape[0] else 0
        problem = None
        if not attrs.get("complete"):
            problem = "is not marked complete"
        elif len(shape) != 4 or shape[1] != shape[2] or shape[3] != 3:
            problem = f"has a tiles array of shape {shape}, expected (N, T, T, 3)"
        elif n_coords != shape[0] or (expected if expected is not None else shape[0]) != shape[0]:
            problem = f"has {shape[0]} tiles but {n_coords} coords and tile_count {expected}"
        if problem:
            raise ts.TileStoreError(
                f"slide {slide_id!r} in tile store {root} {problem}; delete the slide's folder and re-run "
                "`wsidino tile`"
            )
        entries.append(SlideEntry(store_index, slide_id, shape[0], shape[1], sub))
    if sum(e.n_tiles for e in entries) == 0:
        raise ts.TileStoreError(f"empty tile store {root}: {empty_reason(root, len(entries))}")
    return entries


def empty_reason(root: Path, n_slides: int) -> str:
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


def common_tile_size(entries: list[SlideEntry], stores: Sequence[Path]) -> int:
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


def select_slides(
    entries: list[SlideEntry], slide_ids: Iterable[str] | None, stores: Sequence[Path]
) -> list[SlideEntry]:
    if slide_ids is None:
        return entries
    wanted = {slide_ids} if isinstance(slide_ids, str) else set(slide_ids)
    missing = sorted(wanted - {e.slide_id for e in entries})
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"slide id(s) not in the tile store(s) {store_names(stores)}: {shown}")
    return [e for e in entries if e.slide_id in wanted]
