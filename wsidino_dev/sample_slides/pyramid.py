"""Pyramid writing shared by both formats (level 0 streamed tile by tile, box-filtered reduced levels) and the
generic tiled TIFF writer (``write_generic_tiff``): ×2 reduced levels marked ``subfiletype=1`` and resolution tags in
centimetres, which OpenSlide opens as ``generic-tiff`` with ``openslide.mpp-x/y``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tifffile

from wsidino_dev.sample_slides.canvas import ImageSource, strip_rows

# Raw tile bytes tifffile may collect before encoding them in threads. Its default (512 MiB) would pull that
# much of the streamed level 0 into memory at once; 32 MiB keeps both cores busy at a fraction of the RSS.
ENCODE_BUFFER_BYTES = 32 * 2**20


def row_reader(image: np.ndarray | ImageSource) -> tuple[int, int, Callable[[int, int], np.ndarray]]:
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"image must be (H, W, 3) uint8, got {image.shape} {image.dtype}")
        return image.shape[0], image.shape[1], lambda y0, y1: image[y0:y1]
    height, width, channels = image.shape
    if channels != 3:
        raise ValueError(f"image source must be RGB, got {channels} channels")
    return height, width, image.rows


def _downsample_area(image: np.ndarray, factor: int) -> np.ndarray:
    """Box-filter reduction by an integer factor (as scanners build pyramids), dropping the ragged edge.

    Sums rows, then columns, in uint16 with plain adds: much faster than a float mean over two strided axes.
    Rounds half up, exactly like mean + 0.5.
    """
    h, w = image.shape[0] // factor, image.shape[1] // factor
    rows = image[: h * factor, : w * factor].reshape(h, factor, w * factor * 3)
    acc = rows[:, 0].astype(np.uint16)
    for k in range(1, factor):
        acc += rows[:, k]
    cols = acc.reshape(h, w, factor, 3)
    total = cols[:, :, 0].copy()
    for k in range(1, factor):
        total += cols[:, :, k]
    total += factor * factor // 2
    total //= factor * factor
    return total.astype(np.uint8)


def iter_tiles(strip: np.ndarray, tile: int) -> Iterator[np.ndarray]:
    """Row-major tiles of a strip whose height is a multiple of `tile` (or the image's last strip).

    Edge tiles are padded by replicating the border instead of tifffile's zero padding: a black pad inside a
    JPEG block rings into the visible pixels next to it.
    """
    height, width = strip.shape[:2]
    for y in range(0, height, tile):
        for x in range(0, width, tile):
            block = strip[y : y + tile, x : x + tile]
            if block.shape[0] != tile or block.shape[1] != tile:
                pad = ((0, tile - block.shape[0]), (0, tile - block.shape[1]), (0, 0))
                block = np.pad(block, pad, mode="edge")
            yield block


def stream_level0(
    read: Callable[[int, int], np.ndarray],
    height: int,
    width: int,
    tile: int,
    factor: int,
    reduced: np.ndarray | None,
) -> Iterator[np.ndarray]:
    """Yield level-0 tiles strip by strip, filling `reduced` (level 1) as a side effect.

    This is what keeps memory flat: level 0 is never held in full, and level 1 (1/factor² of it) is built
    from the same strips while tifffile encodes their tiles.
    """
    step = strip_rows(width, tile)
    for y0 in range(0, height, step):
        strip = read(y0, min(y0 + step, height))
        if reduced is not None:
            small = _downsample_area(strip, factor)
            start = y0 // factor
            rows = min(small.shape[0], reduced.shape[0] - start)
            reduced[start : start + rows] = small[:rows, : reduced.shape[1]]
        yield from iter_tiles(strip, tile)


def needs_bigtiff(height: int, width: int) -> bool:
    """BigTIFF only when the raw RGB size nears classic TIFF's 4 GiB offsets (compressed output is far smaller), as
    scanners do: OpenSlide and other readers open classic TIFF everywhere."""
    return height * width * 3 > 3 * 2**30


def check_pyramid_args(height: int, width: int, tile: int, levels: int, factor: int) -> None:
    if tile % 16 or tile <= 0:
        raise ValueError(f"tile must be a positive multiple of 16 (JPEG 4:2:0 blocks), got {tile}")
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    smallest = min(height, width) // factor ** (levels - 1)
    if smallest < 1:
        raise ValueError(f"{levels} levels at ×{factor} do not fit a {width}×{height} image")


def reduced_levels(level1: np.ndarray, levels: int, factor: int) -> list[np.ndarray]:
    """Levels 1 … levels-1, each `factor` times smaller than the one before."""
    pyramid = [level1] if levels > 1 else []
    while len(pyramid) < levels - 1:
        pyramid.append(_downsample_area(pyramid[-1], factor))
    return pyramid


def write_generic_tiff(
    path: str | Path,
    image: np.ndarray | ImageSource,
    *,
    mpp: float | None,
    tile: int = 256,
    levels: int = 3,
    compression: Literal["jpeg", "zlib"] = "jpeg",
    jpeg_quality: int = 90,
) -> list[tuple[int, int]]:
    """Write a tiled pyramidal TIFF that OpenSlide opens as ``generic-tiff``; returns level (width, height)s.

    Reduced levels halve the size each step and carry ``subfiletype=1``. With `mpp`, every level gets
    resolution tags in centimetres (1e4 / level µm/px) and OpenSlide exposes ``openslide.mpp-x/y``; with
    ``mpp=None`` no resolution is written (unit "none"), so OpenSlide has no MPP. zlib is lossless (with the
    horizontal predictor); JPEG is YCbCr 4:2:0.
    """
    path = Path(path)
    height, width, read = row_reader(image)
    factor = 2
    check_pyramid_args(height, width, tile, levels, factor)
    if compression == "jpeg":
        codec: dict[str, Any] = {
            "compression": "jpeg",
            "compressionargs": {"level": jpeg_quality},
            "subsampling": (2, 2),
        }
    elif compression == "zlib":
        # Level 1: much faster than the default 6 on tissue with sensor noise, for slightly larger files.
        codec = {"compression": "zlib", "compressionargs": {"level": 1}, "predictor": True}
    else:
        raise ValueError(f"compression must be 'jpeg' or 'zlib', got {compression!r}")

    def resolution(downsample: int) -> dict[str, Any]:
        if mpp is None:
            return {}
        per_cm = 1e4 / (mpp * downsample)
        return {"resolution": (per_cm, per_cm), "resolutionunit": "CENTIMETER"}

    common: dict[str, Any] = {
        "photometric": "rgb",
        "metadata": None,
        "tile": (tile, tile),
        "dtype": np.uint8,
        "buffersize": ENCODE_BUFFER_BYTES,
    }
    level1 = np.empty((height // factor, width // factor, 3), np.uint8) if levels > 1 else None
    dims = [(width, height)]
    with tifffile.TiffWriter(path, bigtiff=needs_bigtiff(height, width)) as tif:
        tif.write(
            stream_level0(read, height, width, tile, factor, level1),
            shape=(height, width, 3),
            description="wsidino synthetic sample slide",
            software="wsidino",
            **resolution(1),
            **codec,
            **common,
        )
        pyramid = reduced_levels(level1, levels, factor) if level1 is not None else []
        for index, level in enumerate(pyramid, start=1):
            dims.append((level.shape[1], level.shape[0]))
            tif.write(
                iter_tiles(level, tile),
                shape=level.shape,
                subfiletype=1,
                software=False,
                **resolution(factor**index),
                **codec,
                **common,
            )
    return dims
