"""Fast region reads straight from the tiled TIFF pages of SVS and generic pyramidal TIFF slides.

OpenSlide composites every region through cairo and converts premultiplied ARGB; decoding the TIFF tiles with
tifffile/imagecodecs (libjpeg-turbo, the same decoder) and copying them into place is much faster
(docs/benchmarks.md, tile stage). Used only where OpenSlide itself reads a plain tiled TIFF page; everything else, and
all low-resolution planning reads, go through OpenSlide. Tests check the pixels against OpenSlide's.

With `reduce` = 2, 4 or 8, JPEG tiles are decoded straight to 1/reduce scale inside the inverse DCT (libjpeg-turbo's
DCT scaling, through simplejpeg): a target µm/px 2× coarser than the level read then costs a fraction of a full
decode followed by a 2× box average, and differs from it by less than a grey level on average (measured in
docs/benchmarks.md, tile storage). Regions are then read in reduced pixels.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import numpy as np
import simplejpeg
import tifffile

TIFF_VENDORS = frozenset({"aperio", "generic-tiff"})
DCT_SCALES = (2, 4, 8)  # the reductions libjpeg-turbo's scaled IDCT gives exactly (whole 8×8 blocks)
_JPEG, _YCBCR = 7, 6  # TIFF compression and photometric codes
CACHE_BYTES = 64 * 1024 * 1024  # a row band of 256-px tiles across a 100k-px-wide slide


class UnsupportedTiff(Exception):
    """This slide level cannot be read directly; fall back to OpenSlide."""


class TiffLevelReader:
    """RGB regions of one pyramid level, decoded tile by tile with an LRU cache of decoded tiles."""

    def __init__(self, path: str | os.PathLike[str], level_size: tuple[int, int], reduce: int = 1) -> None:
        self._tif = tifffile.TiffFile(path)
        try:
            self._page = self._find_page(level_size)
            if reduce != 1:
                self._check_dct_scaling(reduce)
        except Exception:
            self._tif.close()
            raise
        page = self._page
        self.reduce = reduce
        self.level_width, self.level_height = level_size
        # Everything below is in output pixels: level pixels / reduce.
        self.width, self.height = math.ceil(level_size[0] / reduce), math.ceil(level_size[1] / reduce)
        self._tile_w, self._tile_h = int(page.tilewidth) // reduce, int(page.tilelength) // reduce
        self._across = math.ceil(level_size[0] / int(page.tilewidth))
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_limit = max(4, CACHE_BYTES // (self._tile_w * self._tile_h * 3))

    def _find_page(self, level_size: tuple[int, int]) -> tifffile.TiffPage:
        for page in self._tif.pages:
            page = page.keyframe if hasattr(page, "keyframe") else page
            if (int(page.imagewidth), int(page.imagelength)) != tuple(level_size) or not page.is_tiled:
                continue
            if page.dtype != np.uint8 or page.samplesperpixel not in (3, 4) or page.planarconfig != 1:
                raise UnsupportedTiff(f"level {level_size} is not 8-bit interleaved RGB")
            if page.imagedepth > 1:
                raise UnsupportedTiff("volumetric TIFF tiles")
            return page
        raise UnsupportedTiff(f"no tiled page of size {level_size}")

    def _check_dct_scaling(self, reduce: int) -> None:
        page = self._page
        if reduce not in DCT_SCALES:
            raise UnsupportedTiff(f"DCT scaling reduces by {DCT_SCALES}, not {reduce}")
        if page.compression != _JPEG or page.photometric != _YCBCR:
            # RGB-coded JPEG tiles (some Aperio files) need a colour-space override simplejpeg does not take.
            raise UnsupportedTiff("DCT scaling needs YCbCr JPEG tiles")
        if page.tilewidth % (8 * reduce) or page.tilelength % (8 * reduce):
            raise UnsupportedTiff(f"tile size {page.tilewidth}×{page.tilelength} is not a multiple of 8 × {reduce}")
        try:
            import simplejpeg  # noqa: F401
        except ImportError as err:  # a broken install: fall back to full decoding rather than fail the slide
            raise UnsupportedTiff(f"simplejpeg is not importable ({err})") from None

    def close(self) -> None:
        self._cache.clear()
        self._tif.close()

    def _tile(self, index: int) -> np.ndarray | None:
        tile = self._cache.get(index)
        if tile is not None:
            self._cache.move_to_end(index)
            return tile
        offset, count = self._page.dataoffsets[index], self._page.databytecounts[index]
        if count == 0:  # sparse TIFF: a tile never written is blank glass
            return None
        handle = self._tif.filehandle
        handle.seek(offset)
        data = handle.read(count)
        if len(data) != count:
            raise OSError(f"{self._tif.filename}: tile {index} is cut short (truncated file?)")
        if self.reduce == 1:
            decoded, _, _ = self._page.decode(data, index, jpegtables=self._page.jpegtables)
            tile = np.asarray(decoded).reshape(self._tile_h, self._tile_w, -1)[..., :3]
        else:
            tile = self._decode_scaled(data, index)
        self._cache[index] = tile
        if len(self._cache) > self._cache_limit:
            self._cache.popitem(last=False)
        return tile

    def _decode_scaled(self, data: bytes, index: int) -> np.ndarray:
        tables = self._page.jpegtables
        if tables:  # an abbreviated stream: splice the shared tables in (tables without EOI + tile without SOI)
            data = bytes(tables[:-2]) + data[2:]
        try:
            tile = simplejpeg.decode_jpeg(
                data, colorspace="RGB", min_width=self._tile_w, min_height=self._tile_h, fastdct=False
            )
        except ValueError as err:
            raise OSError(f"{self._tif.filename}: JPEG tile {index} cannot be decoded ({err})") from None
        if tile.shape[:2] != (self._tile_h, self._tile_w):
            raise OSError(
                f"{self._tif.filename}: JPEG tile {index} decoded to {tile.shape[:2]}, expected "
                f"{(self._tile_h, self._tile_w)}"
            )
        return tile

    def read(self, x: int, y: int, width: int, height: int) -> np.ndarray:
        """RGB uint8 (height, width, 3) at output px (x, y) (level px / reduce); outside the image is white."""
        out = np.full((height, width, 3), 255, dtype=np.uint8)
        x0, y0 = max(x, 0), max(y, 0)
        x1, y1 = min(x + width, self.width), min(y + height, self.height)
        if x1 <= x0 or y1 <= y0:
            return out
        tw, th = self._tile_w, self._tile_h
        for ty in range(y0 // th, (y1 - 1) // th + 1):
            for tx in range(x0 // tw, (x1 - 1) // tw + 1):
                tile = self._tile(ty * self._across + tx)
                if tile is None:
                    continue
                # Overlap of this tile with the request, in image coordinates.
                ix0, iy0 = max(x0, tx * tw), max(y0, ty * th)
                ix1, iy1 = min(x1, (tx + 1) * tw), min(y1, (ty + 1) * th)
                out[iy0 - y : iy1 - y, ix0 - x : ix1 - x] = tile[
                    iy0 - ty * th : iy1 - ty * th, ix0 - tx * tw : ix1 - tx * tw
                ]
        return out
