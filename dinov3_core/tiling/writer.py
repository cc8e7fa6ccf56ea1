"""Reading a shard-aligned range of a slide's tiles and writing it to the store."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from dinov3_core import events
from dinov3_core.tiling import slide as slide_io
from dinov3_core.tiling import stain
from dinov3_core.tiling.store import IncomingSlide
from dinov3_core.tiling.tiff_reader import TiffLevelReader

# One region read covers a run of neighbouring tiles in a row, at most this wide (px at the read level): reading
# runs decodes each JPEG tile of the slide about once instead of once per overlapping tile.
MAX_RUN_PX = 4096
_MAX_OPEN = 1  # units of one slide run back to back; keeping more open only holds memory
# Per thread: a Prefect thread runner may tile two slides in one process, and readers are not thread-safe.
_LOCAL = threading.local()


def _open_readers() -> OrderedDict[tuple[str, str, int, int], RegionReader]:
    if not hasattr(_LOCAL, "readers"):
        _LOCAL.readers = OrderedDict()
    return _LOCAL.readers


class RegionReader(Protocol):
    def read_rgb(self, location: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
        """RGB (h, w, 3) of `size` px at the reader's level, from level-0 `location`."""
        ...

    def read_reduced(self, location: tuple[int, int], size: tuple[int, int], factor: int) -> np.ndarray | None:
        """`read_rgb` reduced `factor`× by the decoder itself, or None where this reader cannot."""
        ...

    def close(self) -> None: ...


class OpenSlideRegions:
    def __init__(self, path: Path, level: int) -> None:
        self._slide = slide_io.open_slide(path)
        self._level = level

    def read_rgb(self, location: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
        return slide_io.read_rgb(self._slide, location, self._level, size)

    def read_reduced(self, location: tuple[int, int], size: tuple[int, int], factor: int) -> np.ndarray | None:
        return None

    def close(self) -> None:
        self._slide.close()


class TiffRegions:
    def __init__(self, path: Path, level_size: tuple[int, int], downsample: float, reduce: int = 1) -> None:
        self._reader = TiffLevelReader(path, level_size, reduce)
        self._full = self._reader if reduce == 1 else None  # opened only if a read falls off the reduced grid
        self._args = (path, level_size)
        self._downsample = downsample

    def read_rgb(self, location: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
        if self._full is None:
            self._full = TiffLevelReader(*self._args)
        x, y = (round(v / self._downsample) for v in location)
        return self._full.read(x, y, size[0], size[1])

    def read_reduced(self, location: tuple[int, int], size: tuple[int, int], factor: int) -> np.ndarray | None:
        r = self._reader.reduce
        x, y = (round(v / self._downsample) for v in location)
        if r != factor or (x | y | size[0] | size[1]) % r:
            return None  # not a reduced reader, or not on its pixel grid
        return self._reader.read(x // r, y // r, size[0] // r, size[1] // r)

    def close(self) -> None:
        self._reader.close()
        if self._full is not None and self._full is not self._reader:
            self._full.close()


@dataclass(frozen=True)
class WriteUnit:
    incoming: IncomingSlide
    source: Path
    read: slide_io.ReadPlan
    reader: str  # tifffile | tifffile-dct (JPEG decoded at reduced scale) | openslide
    level_size: tuple[int, int]
    level_downsample: float
    start: int
    coords: np.ndarray  # (n, 2) level-0 coords of tiles start … start + n
    record_stain: bool = True  # record stain sums (the first µm/px level only: the slide's stain statistics)


def _region_reader(unit: WriteUnit) -> RegionReader:
    """Keep recently used readers open per process so their decoded-tile caches carry across units."""
    key = (str(unit.source), unit.reader, unit.read.level, unit.read.whole_reduction)
    readers = _open_readers()
    if key in readers:
        readers.move_to_end(key)
        return readers[key]
    if unit.reader in ("tifffile", "tifffile-dct"):
        reduce = unit.read.whole_reduction if unit.reader == "tifffile-dct" else 1
        reader: RegionReader = TiffRegions(unit.source, unit.level_size, unit.level_downsample, reduce)
    else:
        reader = OpenSlideRegions(unit.source, unit.read.level)
    readers[key] = reader
    while len(readers) > _MAX_OPEN:
        readers.popitem(last=False)[1].close()
    return reader


def close_cached_readers() -> None:
    """Close this thread's readers."""
    readers = _open_readers()
    while readers:
        readers.popitem()[1].close()


def _runs(coords: np.ndarray, stride_level0: int, max_tiles: int) -> list[tuple[int, int]]:
    """[i, j) index runs of tiles on one row, each `stride_level0` right of the previous."""
    if len(coords) == 0:
        return []
    same_row = coords[1:, 1] == coords[:-1, 1]
    adjacent = (coords[1:, 0] - coords[:-1, 0]) == stride_level0
    breaks = np.flatnonzero(~(same_row & adjacent)) + 1
    bounds = np.concatenate([[0], breaks, [len(coords)]])
    runs: list[tuple[int, int]] = []
    for a, b in itertools.pairwise(bounds):
        for s in range(int(a), int(b), max_tiles):
            runs.append((s, min(s + max_tiles, int(b))))
    return runs


def read_tiles(reader: RegionReader, read: slide_io.ReadPlan, coords: np.ndarray) -> np.ndarray:
    """Tiles (n, T, T, 3) uint8 at the target µm/px for the given level-0 coords."""
    out = np.empty((len(coords), read.tile_size, read.tile_size, 3), dtype=np.uint8)
    ds = read.tile_size_level0 / read.read_size  # level-0 px per read-level px
    stride_level = read.stride_level0 / ds
    max_tiles = max(1, int((MAX_RUN_PX - read.read_size) // max(stride_level, 1)) + 1)
    integer_factor = read.read_size % read.tile_size == 0
    factor = read.read_size // read.tile_size
    for a, b in _runs(coords, read.stride_level0, max_tiles):
        x0, y0 = int(coords[a, 0]), int(coords[a, 1])
        offsets = np.rint((coords[a:b, 0] - x0) / ds).astype(np.int64)
        width = int(offsets[-1]) + read.read_size
        if integer_factor and factor > 1 and not (offsets % factor).any():
            # Reduced in the decoder (reader=tifffile-dct), or one box reduction of the whole run: identical
            # pixels to reducing each tile (boundaries fall on multiples of the factor), without two array
            # conversions per tile.
            reduced = reader.read_reduced((x0, y0), (width, read.read_size), factor)
            if reduced is None:
                reduced = np.asarray(Image.fromarray(reader.read_rgb((x0, y0), (width, read.read_size))).reduce(factor))
            for k, off in enumerate(offsets // factor):
                out[a + k] = reduced[:, off : off + read.tile_size]
            continue
        region = reader.read_rgb((x0, y0), (width, read.read_size))
        for k, off in enumerate(offsets):
            tile = region[:, off : off + read.read_size]
            if read.needs_resize:
                img = Image.fromarray(tile)
                img = (
                    img.reduce(factor)
                    if integer_factor
                    else img.resize((read.tile_size, read.tile_size), Image.Resampling.BOX)
                )
                tile = np.asarray(img)
            out[a + k] = tile
    return out


def write_unit(unit: WriteUnit) -> tuple[str, int, float, int]:
    """Read and write one shard-aligned range; returns (slide_id, tiles written, seconds, this process's pid)."""
    start = time.perf_counter()
    tiles = read_tiles(_region_reader(unit), unit.read, unit.coords)
    unit.incoming.write_tiles(unit.start, tiles)
    # The slide's stain statistics come from the tiles in hand: no second read at commit (docs/tile-store.md).
    if unit.record_stain:
        stain.save_unit_sums(unit.incoming.path, unit.start, stain.tile_lab_sums(tiles))
    slide_id = unit.incoming.slide_id
    events.emit(
        "tile.shard_written", store=str(unit.incoming.root), slide_id=slide_id, start=unit.start, tiles=len(tiles)
    )
    return slide_id, len(tiles), time.perf_counter() - start, os.getpid()
