"""Reading a shard-aligned range of a slide's tiles and writing it to the store."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openslide
from PIL import Image

from dinov3_core.tiling import slide as slide_io
from dinov3_core.tiling.store import IncomingSlide

# One region read covers a run of neighbouring tiles in a row, at most this wide (px at the read level): reading
# runs decodes each JPEG tile of the slide about once instead of once per overlapping tile.
MAX_RUN_PX = 4096
_OPEN_SLIDES: OrderedDict[str, openslide.OpenSlide] = OrderedDict()
_MAX_OPEN = 2


@dataclass(frozen=True)
class WriteUnit:
    incoming: IncomingSlide
    source: Path
    read: slide_io.ReadPlan
    start: int
    coords: np.ndarray  # (n, 2) level-0 coords of tiles start … start + n


def _slide(path: Path) -> openslide.OpenSlide:
    """Keep recently used slides open per process so their decoded-tile cache carries across units."""
    key = str(path)
    if key in _OPEN_SLIDES:
        _OPEN_SLIDES.move_to_end(key)
        return _OPEN_SLIDES[key]
    handle = slide_io.open_slide(path)
    _OPEN_SLIDES[key] = handle
    while len(_OPEN_SLIDES) > _MAX_OPEN:
        _OPEN_SLIDES.popitem(last=False)[1].close()
    return handle


def close_cached_slides() -> None:
    while _OPEN_SLIDES:
        _OPEN_SLIDES.popitem()[1].close()


def _runs(coords: np.ndarray, stride_level0: int, max_tiles: int) -> list[tuple[int, int]]:
    """[i, j) index runs of tiles on one row, each `stride_level0` right of the previous."""
    if len(coords) == 0:
        return []
    same_row = coords[1:, 1] == coords[:-1, 1]
    adjacent = (coords[1:, 0] - coords[:-1, 0]) == stride_level0
    breaks = np.flatnonzero(~(same_row & adjacent)) + 1
    bounds = np.concatenate([[0], breaks, [len(coords)]])
    runs: list[tuple[int, int]] = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        for s in range(int(a), int(b), max_tiles):
            runs.append((s, min(s + max_tiles, int(b))))
    return runs


def read_tiles(slide: openslide.OpenSlide, read: slide_io.ReadPlan, coords: np.ndarray) -> np.ndarray:
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
        region = slide_io.read_rgb(slide, (x0, y0), read.level, (width, read.read_size))
        for k, off in enumerate(offsets):
            tile = region[:, off : off + read.read_size]
            if read.needs_resize:
                img = Image.fromarray(tile)
                img = img.reduce(factor) if integer_factor else img.resize(
                    (read.tile_size, read.tile_size), Image.Resampling.BOX
                )
                tile = np.asarray(img)
            out[a + k] = tile
    return out


def write_unit(unit: WriteUnit) -> tuple[str, int, float]:
    """Read and write one shard-aligned range; returns (slide_id, tiles written, seconds)."""
    start = time.perf_counter()
    slide = _slide(unit.source)
    tiles = read_tiles(slide, unit.read, unit.coords)
    unit.incoming.write_tiles(unit.start, tiles)
    return unit.incoming.slide_id, len(tiles), time.perf_counter() - start
