"""Aperio SVS writer (``write_svs``): what OpenSlide's aperio driver reads, with a label and a macro image.

Tiled JPEG (YCbCr 4:2:0, as scanners write it) level 0, a stripped thumbnail as the second IFD, ×4 reduced levels,
optional label and macro images, and an ImageDescription in Aperio's ``Aperio Image Library …|AppMag = 40|MPP =
0.2500`` format, so OpenSlide reports vendor ``aperio`` with ``openslide.mpp-x/y`` and ``openslide.objective-power``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
from PIL import Image

from wsidino_dev.sample_slides.canvas import ImageSource
from wsidino_dev.sample_slides.pyramid import (
    ENCODE_BUFFER_BYTES,
    check_pyramid_args,
    iter_tiles,
    needs_bigtiff,
    reduced_levels,
    row_reader,
    stream_level0,
)

APERIO_HEADER = "Aperio Image Library v12.0.15"


def _resize(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Resize to (width, height) with an antialiasing filter."""
    return np.asarray(Image.fromarray(image).resize(size, Image.Resampling.LANCZOS))


def _fit(width: int, height: int, longest: int, multiple: int = 16) -> tuple[int, int]:
    """Size with the given longest side and the same aspect, rounded to `multiple` (JPEG MCU size)."""
    ratio = longest / max(width, height)
    w = max(multiple, round(width * ratio / multiple) * multiple)
    h = max(multiple, round(height * ratio / multiple) * multiple)
    return w, h


def _label_image(rng: np.random.Generator, text: str) -> np.ndarray:
    """A slide label: white paper, a 2-D barcode and a few dark 'text' lines (Aperio labels are ~387×463)."""
    label = np.full((464, 384, 3), 250, np.uint8)
    cells = rng.random((18, 18)) < 0.5
    cells[:, 0] = cells[-1, :] = True  # finder pattern, as on a DataMatrix code
    barcode = np.kron(cells, np.ones((10, 10), bool))
    label[40:220, 100:280][barcode] = 20
    for i, ch in enumerate(text[:24]):  # deterministic glyph-like bars standing in for printed text
        x = 40 + 12 * i
        label[270 : 270 + 8 + (ord(ch) % 14), x : x + 8] = 30
    label[330:338, 40:340] = 60
    return label


def _macro_image(thumbnail: np.ndarray, label: np.ndarray) -> np.ndarray:
    """A macro photo: the whole glass slide (75×25 mm → 1280×432 px) with the label and the tissue area."""
    macro = np.full((432, 1280, 3), 205, np.uint8)
    macro[:, :300] = _resize(label, (300, 432))[:, :, :]
    th, tw = thumbnail.shape[:2]
    ratio = min(900 / tw, 400 / th)
    small = _resize(thumbnail, (max(1, round(tw * ratio)), max(1, round(th * ratio))))
    y, x = (432 - small.shape[0]) // 2, 340 + (900 - small.shape[1]) // 2
    macro[y : y + small.shape[0], x : x + small.shape[1]] = small
    return macro


def write_svs(
    path: str | Path,
    image: np.ndarray | ImageSource,
    *,
    mpp: float | None,
    app_mag: int | None = None,
    tile: int = 256,
    levels: int = 3,
    jpeg_quality: int = 90,
    description_extra: Mapping[str, str | int | float] | None = None,
    associated: bool = True,
    name: str | None = None,
    label_rng: np.random.Generator | None = None,
) -> list[tuple[int, int]]:
    """Write a real Aperio SVS: JPEG-tiled level 0, stripped thumbnail, ×4 reduced levels, label and macro.

    Layout follows Aperio's "Digital Slides and Third-party data interchange" note (the part OpenSlide's
    aperio driver relies on): IFD 0 is the tiled baseline whose ImageDescription starts with "Aperio" and
    carries ``|key = value`` properties (``MPP`` → ``openslide.mpp-x/y``, ``AppMag`` →
    ``openslide.objective-power``); IFD 1 is a stripped thumbnail; then tiled reduced levels; then stripped
    label (LZW) and macro (JPEG) images whose descriptions' second line starts with their name. Tiles are JPEG
    in YCbCr with 4:2:0 subsampling, as most SVS files are. `mpp=None` omits MPP (OpenSlide then has no
    ``openslide.mpp-x``). `app_mag` defaults to 10/mpp rounded (0.25 → 40). `name` (default: the file's stem)
    goes into the ``Filename`` property and the label; `label_rng` draws the label's barcode. Returns the
    level (width, height)s.
    """
    path = Path(path)
    name = name or path.stem
    height, width, read = row_reader(image)
    factor = 4  # Aperio's pyramid step
    check_pyramid_args(height, width, tile, levels, factor)
    if app_mag is None and mpp is not None:
        app_mag = round(10 / mpp)
    jpeg = {"compression": "jpeg", "compressionargs": {"level": jpeg_quality}, "subsampling": (2, 2)}
    common: dict[str, Any] = {"photometric": "rgb", "metadata": None, "software": False}
    size_line = f"{width}x{height} [0,0 {width}x{height}] ({tile}x{tile})"

    properties: dict[str, str | int | float] = {"AppMag": app_mag} if app_mag is not None else {}
    properties |= {
        "StripeWidth": 2032,
        "ScanScope ID": "WSIDINO-SYNTHETIC",
        "Filename": name,
        "Date": "01/02/25",
        "Time": "10:00:00",
        "Time Zone": "GMT+0000",
        "User": "wsidino",
    }
    if mpp is not None:
        properties["MPP"] = f"{mpp:.4f}"
    properties |= {"Left": "25.000000", "Top": "18.000000", "OriginalWidth": width, "OriginalHeight": height}
    properties |= dict(description_extra or {})
    props = "".join(f"|{key} = {value}" for key, value in properties.items())
    # "\r\n" after the header as Aperio writes it; OpenSlide ignores everything before the first "|".
    description0 = f"{APERIO_HEADER}\r\n{size_line} JPEG/RGB Q={jpeg_quality}{props}"

    level1 = np.empty((height // factor, width // factor, 3), np.uint8)  # also the thumbnail's source
    dims = [(width, height)]
    with tifffile.TiffWriter(path, bigtiff=needs_bigtiff(height, width)) as tif:
        tif.write(
            stream_level0(read, height, width, tile, factor, level1),
            shape=(height, width, 3),
            dtype=np.uint8,
            tile=(tile, tile),
            buffersize=ENCODE_BUFFER_BYTES,
            description=description0,
            **jpeg,
            **common,
        )
        pyramid = reduced_levels(level1, levels, factor)
        # Thumbnail (always IFD 1, stripped): ~1024 px like Aperio's, but at most a quarter of the slide's
        # size so small slides keep the usual proportions (level 0 holds most of the bytes). Resampled from
        # the smallest pyramid level that is still larger.
        longest = max(16, min(1024, max(width, height) // 4))
        source = next((lv for lv in reversed(pyramid) if max(lv.shape[:2]) >= longest), level1)
        thumb = _resize(source, _fit(width, height, longest))
        tif.write(
            thumb,
            rowsperstrip=16,
            description=f"{APERIO_HEADER}\r\n{size_line} -> {thumb.shape[1]}x{thumb.shape[0]} "
            f"JPEG/RGB Q={jpeg_quality}",
            **jpeg,
            **common,
        )
        for level in pyramid:
            lh, lw = level.shape[:2]
            dims.append((lw, lh))
            tif.write(
                iter_tiles(level, tile),
                shape=level.shape,
                dtype=np.uint8,
                tile=(tile, tile),
                buffersize=ENCODE_BUFFER_BYTES,
                description=f"{APERIO_HEADER}\r\n{size_line} -> {lw}x{lh} JPEG/RGB Q={jpeg_quality}",
                **jpeg,
                **common,
            )
        if associated:
            # Associated images are named by the first word of the description's second line ("\n" only).
            label = _label_image(label_rng or np.random.default_rng(0), name)
            tif.write(
                label,
                compression="lzw",
                subfiletype=1,
                description=f"{APERIO_HEADER}\nlabel {label.shape[1]}x{label.shape[0]}",
                **common,
            )
            macro = _macro_image(thumb, label)
            tif.write(
                macro,
                rowsperstrip=16,
                subfiletype=9,
                description=f"{APERIO_HEADER}\nmacro {macro.shape[1]}x{macro.shape[0]}",
                **jpeg,
                **common,
            )
    return dims
