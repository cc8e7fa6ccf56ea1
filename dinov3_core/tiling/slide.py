"""Opening slides with OpenSlide, resolving their µm/px, and planning µm/px-exact reads."""

from __future__ import annotations

import csv
import errno
import hashlib
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openslide
from PIL import Image

from dinov3_core.errors import WsidinoError

# Decoded-tile cache per open slide: neighbouring reads share JPEG tiles, so a larger cache saves re-decoding.
SLIDE_CACHE_BYTES = 64 * 1024 * 1024
# Longest side, in px at the read level, of one region read when building low-resolution images.
BLOCK_PX = 4096


class SlideError(WsidinoError, RuntimeError):
    """A problem with one slide; the message names the file and says what to do."""


@dataclass(frozen=True)
class SlideInfo:
    path: str
    vendor: str
    width: int
    height: int
    level_count: int
    level_dimensions: tuple[tuple[int, int], ...]
    level_downsamples: tuple[float, ...]
    mpp: float  # level-0 µm/px actually used
    mpp_source: str  # metadata | override | default
    objective_power: str | None
    openslide_version: str
    openslide_python_version: str

    def level_mpp(self, level: int) -> float:
        return self.mpp * self.level_downsamples[level]


@dataclass(frozen=True)
class ReadPlan:
    """How to read every tile of a slide at the target µm/px."""

    level: int  # pyramid level read
    level_mpp: float
    read_size: int  # px read at `level` per tile
    tile_size: int  # px stored per tile
    stride: int  # px at the target µm/px between tile origins
    tile_size_level0: int
    stride_level0: int
    mpp_requested: float
    mpp_effective: float

    @property
    def needs_resize(self) -> bool:
        return self.read_size != self.tile_size

    @property
    def whole_reduction(self) -> int:
        """The whole factor by which tiles are reduced from the level read (1: none, or not a whole factor)."""
        return self.read_size // self.tile_size if self.read_size % self.tile_size == 0 else 1

    @property
    def downsample(self) -> float:
        return self.tile_size_level0 / self.read_size


def open_slide(path: str | os.PathLike[str]) -> openslide.OpenSlide:
    """Open with OpenSlide only (no silent ImageSlide fallback: a plain image has no µm/px or pyramid)."""
    path = Path(path)
    check_readable(path)
    try:
        slide = openslide.OpenSlide(str(path))
    except openslide.OpenSlideUnsupportedFormatError:
        raise SlideError(
            f"{path}: not a whole-slide image OpenSlide can read (unsupported or unrecognised format); "
            "remove it from the input or convert it to a pyramidal TIFF"
        ) from None
    except openslide.OpenSlideError as err:
        raise SlideError(
            f"{path}: OpenSlide cannot open this slide ({err}); the file may be corrupt or truncated"
        ) from None
    slide.set_cache(openslide.OpenSlideCache(SLIDE_CACHE_BYTES))
    return slide


def check_readable(path: Path) -> None:
    """Raise a SlideError naming `path` and what is wrong when it is not a regular file this process can read.

    OpenSlide reports an unreadable file as an unsupported format, and `Path.exists()` calls a symlink loop
    missing: here each gets its own cause and fix.
    """
    try:
        st = path.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise SlideError(f"{path}: a symbolic link loop; point the link at the slide file or remove it") from None
        if err.errno == errno.ENOENT and path.is_symlink():
            target = os.readlink(path)
            raise SlideError(
                f"{path}: a broken symbolic link (to {target}, which does not exist); fix or remove it"
            ) from None
        if err.errno == errno.ENOENT:
            raise SlideError(f"{path}: file not found; check the input path") from None
        raise SlideError(f"{path}: cannot access it ({err.strerror}); check its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        try:  # a folder of the input that could not be searched for slides is listed as an input of its own
            os.listdir(path)
        except OSError as err:
            raise SlideError(
                f"{path}: a folder that cannot be listed ({err.strerror}), so its slides are not tiled; "
                "check its permissions"
            ) from None
        raise SlideError(f"{path}: a folder, not a slide file")
    if not stat.S_ISREG(st.st_mode):
        raise SlideError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as err:
        raise SlideError(f"{path}: cannot read it ({err.strerror}); check its permissions") from None


def file_fingerprint(path: str | os.PathLike[str], block: int = 1 << 20) -> tuple[int, str]:
    """(size, sha256 of size + first and last MiB): catches replaced and truncated files without reading GBs."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(block))
        if size > block:
            handle.seek(max(block, size - block))
            digest.update(handle.read(block))
    return size, digest.hexdigest()


def load_mpp_overrides(csv_path: str | os.PathLike[str] | None) -> dict[str, float]:
    """CSV with columns `slide,mpp`; `slide` is a file name, a stem or a path."""
    if not csv_path:
        return {}
    path = Path(csv_path)
    if not path.is_file():
        raise SlideError(f"µm/px override file {path} not found; fix tile.mpp_overrides or remove it")
    out: dict[str, float] = {}
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames or {"slide", "mpp"} - {f.strip() for f in reader.fieldnames}:
            raise SlideError(f"µm/px override file {path} needs the header 'slide,mpp' (got {reader.fieldnames})")
        for line_no, row in enumerate(reader, start=2):
            try:
                mpp = float(row["mpp"])
            except (TypeError, ValueError):
                raise SlideError(f"{path}, line {line_no}: mpp {row['mpp']!r} is not a number") from None
            if not mpp > 0:
                raise SlideError(f"{path}, line {line_no}: mpp must be positive, got {mpp}")
            out[row["slide"].strip()] = mpp
    return out


def override_for(path: Path, overrides: Mapping[str, float]) -> float | None:
    """The µm/px override of a slide: by full path, else file name, else stem (the one lookup everywhere, so the
    override hashed into the tiling parameters is the one applied)."""
    for key in (str(path), path.name, path.stem):
        if key in overrides:
            return overrides[key]
    return None


def describe_slide(
    slide: openslide.OpenSlide,
    path: str | os.PathLike[str],
    overrides: Mapping[str, float] | None = None,
    default_mpp: float | None = None,
) -> SlideInfo:
    """Geometry, provenance and the level-0 µm/px (override > metadata > default, else a per-slide error)."""
    path = Path(path)
    props = slide.properties
    override = override_for(path, overrides or {})
    mpp: float | None = None
    source = ""
    if override is not None:
        mpp, source = override, "override"
    else:
        try:
            mpp_x = float(props[openslide.PROPERTY_NAME_MPP_X])
            mpp_y = float(props.get(openslide.PROPERTY_NAME_MPP_Y, mpp_x))
        except (KeyError, ValueError):
            mpp_x = mpp_y = float("nan")
        if math.isfinite(mpp_x) and mpp_x > 0:
            if not math.isclose(mpp_x, mpp_y, rel_tol=0.02):
                raise SlideError(
                    f"{path}: non-square pixels (mpp-x {mpp_x}, mpp-y {mpp_y}); give its µm/px in tile.mpp_overrides"
                )
            mpp, source = (mpp_x + mpp_y) / 2, "metadata"
        elif default_mpp is not None:
            mpp, source = default_mpp, "default"
    if mpp is None:
        raise SlideError(
            f"{path}: the slide carries no µm/px (no openslide.mpp-x property); add a row "
            f"'{path.name},<mpp>' to a CSV passed as tile.mpp_overrides, or set tile.default_mpp"
        )
    return SlideInfo(
        path=str(path.resolve()),
        vendor=props.get(openslide.PROPERTY_NAME_VENDOR) or "unknown",
        width=int(slide.dimensions[0]),
        height=int(slide.dimensions[1]),
        level_count=int(slide.level_count),
        level_dimensions=tuple((int(w), int(h)) for w, h in slide.level_dimensions),
        level_downsamples=tuple(float(d) for d in slide.level_downsamples),
        mpp=float(mpp),
        mpp_source=source,
        objective_power=props.get(openslide.PROPERTY_NAME_OBJECTIVE_POWER),
        openslide_version=openslide.__library_version__,
        openslide_python_version=openslide.__version__,
    )


def plan_read(info: SlideInfo, mpp: float, tile_size: int, stride: int | None, tolerance: float) -> ReadPlan:
    """Pick the coarsest level not coarser than the target (within tolerance), and the px to read there.

    Tiles are read natively when a level is within `tolerance` (relative) of the target, else read at the finer
    level and area-resized; the effective µm/px is recorded exactly.
    """
    stride = stride or tile_size
    if tile_size <= 0 or stride <= 0:
        raise SlideError(f"tile_size and stride must be positive (got {tile_size}, {stride})")
    candidates = [lvl for lvl in range(info.level_count) if info.level_mpp(lvl) <= mpp * (1 + tolerance)]
    if not candidates:
        raise SlideError(
            f"{info.path}: level 0 is {info.mpp:.4f} µm/px, coarser than the requested {mpp} µm/px "
            f"(tolerance {tolerance:.0%}); lower tile.mpp or check the slide's µm/px"
        )
    level = max(candidates, key=info.level_mpp)
    level_mpp = info.level_mpp(level)
    native = abs(level_mpp - mpp) <= tolerance * mpp
    read_size = tile_size if native else round(tile_size * mpp / level_mpp)
    scale = read_size / tile_size  # level px per stored px
    downsample = info.level_downsamples[level]
    stride_level0 = max(1, round(stride * scale * downsample))
    tile_size_level0 = round(read_size * downsample)
    return ReadPlan(
        level=level,
        level_mpp=level_mpp,
        read_size=read_size,
        tile_size=tile_size,
        stride=stride,
        tile_size_level0=tile_size_level0,
        stride_level0=stride_level0,
        mpp_requested=mpp,
        mpp_effective=read_size * level_mpp / tile_size,
    )


def read_rgb(slide: openslide.OpenSlide, location: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
    """RGB uint8 (H, W, 3); OpenSlide returns premultiplied RGBA and transparent areas as (0, 0, 0, 0)."""
    rgba = np.asarray(slide.read_region(location, level, size))
    rgb = rgba[..., :3]
    alpha = rgba[..., 3]
    if alpha.min() < 255:  # outside the scanned area: paint it glass-white like the background
        rgb = rgb.copy()
        rgb[alpha == 0] = 255
    return np.ascontiguousarray(rgb)


def read_downsampled(slide: openslide.OpenSlide, info: SlideInfo, target_mpp: float) -> tuple[np.ndarray, float]:
    """The whole slide at about `target_mpp` (never finer than level 0), read in blocks to bound memory.

    Returns the image and the exact level-0 px per output px.
    """
    factor = max(1.0, target_mpp / info.mpp)  # level-0 px per output px
    level = slide.get_best_level_for_downsample(factor)
    level_ds = info.level_downsamples[level]
    out_w = max(1, round(info.width / factor))
    out_h = max(1, round(info.height / factor))
    out = np.empty((out_h, out_w, 3), dtype=np.uint8)
    lw, lh = info.level_dimensions[level]
    step = BLOCK_PX
    for ly in range(0, lh, step):
        for lx in range(0, lw, step):
            bw, bh = min(step, lw - lx), min(step, lh - ly)
            block = read_rgb(slide, (round(lx * level_ds), round(ly * level_ds)), level, (bw, bh))
            # Output pixels whose centres fall in this block.
            ox0 = math.ceil(lx * level_ds / factor - 0.5)
            oy0 = math.ceil(ly * level_ds / factor - 0.5)
            ox1 = min(out_w, math.ceil((lx + bw) * level_ds / factor - 0.5))
            oy1 = min(out_h, math.ceil((ly + bh) * level_ds / factor - 0.5))
            if ox1 <= ox0 or oy1 <= oy0:
                continue
            # Resample the block so output px (ox0..ox1) map onto it exactly.
            box = (
                ox0 * factor / level_ds - lx,
                oy0 * factor / level_ds - ly,
                ox1 * factor / level_ds - lx,
                oy1 * factor / level_ds - ly,
            )
            box = (max(0.0, box[0]), max(0.0, box[1]), min(float(bw), box[2]), min(float(bh), box[3]))
            img = Image.fromarray(block).resize((ox1 - ox0, oy1 - oy0), Image.Resampling.BOX, box=box)
            out[oy0:oy1, ox0:ox1] = np.asarray(img)
    return out, info.width / out_w
