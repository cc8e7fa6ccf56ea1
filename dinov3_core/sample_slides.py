"""Realistic sample whole-slide images built from a real tissue image, for demos and tests.

Nothing is downloaded: the tissue texture is scikit-image's ``immunohistochemistry()`` image (a 512×512 IHC
crop shipped inside the package). Slides are synthesised as "glass + tissue sections + a pen mark" and written
as real pyramidal files that OpenSlide opens with its normal vendor drivers:

* Aperio SVS (``write_svs``): tiled JPEG (YCbCr 4:2:0, as scanners write it) level 0, a stripped thumbnail as
  the second IFD, ×4 reduced levels, optional label and macro images, and an ImageDescription in Aperio's
  ``Aperio Image Library …|AppMag = 40|MPP = 0.2500`` format, so OpenSlide reports vendor ``aperio`` with
  ``openslide.mpp-x/y`` and ``openslide.objective-power``.
* Generic tiled TIFF (``write_generic_tiff``): ×2 reduced levels marked ``subfiletype=1`` and resolution
  tags in centimetres, which OpenSlide opens as ``generic-tiff`` with ``openslide.mpp-x/y``.

Slides of any size are rendered strip by strip (``TissueCanvas.rows``) and written tile by tile, so peak
memory is a few strips plus the first reduced level, never a full-resolution copy. ``make_sample_slides``
writes a preset set of good slides plus negative examples (no MPP, truncated, not a slide, no tissue) and is
idempotent.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import tifffile
from PIL import Image
from scipy import ndimage

__all__ = [
    "PRESETS",
    "ImageSource",
    "SampleSet",
    "SlideSpec",
    "TissueCanvas",
    "make_sample_slides",
    "sample_canvas",
    "synthesize_background",
    "synthesize_tissue_canvas",
    "write_generic_tiff",
    "write_svs",
]

# µm/px at which the 512×512 IHC texture is treated as scanned. Its nuclei are ~10×20 px, i.e. 5×10 µm at
# 0.5 µm/px, a plausible size; a canvas at 0.25 µm/px therefore shows the texture upsampled ×2.
TEXTURE_MPP = 0.5
# Coarse grid (longest side, px) on which tissue shapes, stain density and the pen stroke are planned. Fields
# are bilinearly upsampled per strip, so shapes stay smooth at any slide size while planning stays cheap.
PLAN_GRID_PX = 1024
# Budget for the float32 work buffer of one rendered strip (rows × width × 3 × 4 bytes): bounds peak memory
# whatever the slide width. Strips are a whole number of tiles high (hence of every pyramid factor used).
STRIP_BYTES = 48 * 2**20
# Raw tile bytes tifffile may collect before encoding them in threads. Its default (512 MiB) would pull that
# much of the streamed level 0 into memory at once; 32 MiB keeps both cores busy at a fraction of the RSS.
ENCODE_BUFFER_BYTES = 32 * 2**20
# Patches per side of the quilted texture atlas (each half the IHC image wide): 6 → the texture repeats every
# 1536 px at 0.5 µm/px (768 µm), rarely noticeable within one tissue piece.
PATCHES = 6
# Distinct texture atlases (cached per process); slides pick one, and every tissue piece adds its own colour.
ATLAS_VARIANTS = 3

# Width (full-resolution px) over which marker ink fades out at the stroke's edge.
PEN_EDGE_PX = 6.0

GLASS_RGB = (242.0, 240.0, 244.0)  # clean glass + mounting medium as bright-field scanners render it
INK_RGB: dict[str, tuple[int, int, int]] = {
    "blue": (30, 60, 185),
    "green": (25, 125, 70),
    "black": (35, 35, 42),
}
APERIO_HEADER = "Aperio Image Library v12.0.15"
# Bumped whenever generated pixels or file layout change: markers written by older code are not trusted.
GENERATOR_VERSION = 1
MARKER_NAME = "sample_slides.json"


class ImageSource(Protocol):
    """Anything that can hand out full-width row strips of an RGB uint8 image (a `TissueCanvas`)."""

    @property
    def shape(self) -> tuple[int, int, int]: ...

    def rows(self, y0: int, y1: int) -> np.ndarray: ...


# ----------------------------------------------------------------------------------------------------
# Texture
# ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _base_texture() -> np.ndarray:
    """scikit-image's 512×512 IHC image (read-only, loaded once per process)."""
    from skimage import data  # deferred: only texture building needs scikit-image's sample data

    image = np.ascontiguousarray(data.immunohistochemistry())
    image.setflags(write=False)
    return image


def _dihedral(image: np.ndarray, k: int) -> np.ndarray:
    """One of the 8 rotations/reflections of a square image."""
    return np.rot90(image[:, ::-1] if k >= 4 else image, k=k % 4)


@functools.lru_cache(maxsize=2 * ATLAS_VARIANTS)
def _tissue_atlas(variant: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """A seamless periodic tissue texture quilted from the IHC image and resampled by `scale` (read-only).

    6×6 patches of the 512×512 image (random rotation/flip and crop position, fixed per `variant`) are placed
    on a torus and cross-faded with sin/cos ramps whose squares sum to 1. Blending *deviations from the mean
    colour* with such weights keeps local contrast in the overlaps (variance-preserving blending), so joins
    look like tissue rather than ghosting, and the 1536×1536 atlas repeats without the kaleidoscope symmetry
    of mirror tiling. Upsampling comes last (bicubic, on a wrap-padded copy so the atlas stays periodic): at
    0.25 µm/px the tissue looks slightly soft, as scanned tissue does, not pixelated. Cached: building one
    costs ~0.4 s; colour variation is applied per tissue piece at render time instead. Returns the atlas and
    its mean colour.
    """
    rng = np.random.default_rng([0xA71A5, variant])
    base = _base_texture().astype(np.float32)
    t = base.shape[0]
    step, overlap = t // 2, t // 8
    patch, size = step + overlap, PATCHES * step
    mean = np.full(t * t, 1 / (t * t), np.float32) @ base.reshape(-1, 3)  # BLAS; a strided mean is 10× slower
    theta = (np.arange(overlap, dtype=np.float32) + 0.5) * (math.pi / 2 / overlap)
    window = np.ones(patch, np.float32)
    window[:overlap] = np.sin(theta)
    window[-overlap:] = np.cos(theta)
    weights = (window[:, None] * window[None, :])[..., None]
    acc = np.zeros((size + overlap, size + overlap, 3), np.float32)
    for i in range(PATCHES):
        for j in range(PATCHES):
            source = _dihedral(base, int(rng.integers(8)))
            py, px = (int(v) for v in rng.integers(0, t - patch + 1, 2))
            deviation = source[py : py + patch, px : px + patch] - mean
            acc[i * step : i * step + patch, j * step : j * step + patch] += weights * deviation
    # Fold the overhang back onto the start: the atlas is periodic, so it tiles without seams.
    acc[:overlap] += acc[size:]
    acc[:, :overlap] += acc[:, size:]
    atlas = acc[:size, :size]
    atlas += mean + 0.5
    np.clip(atlas, 0, 255, out=atlas)
    atlas = atlas.astype(np.uint8)
    if abs(scale - 1.0) > 1e-3:
        out_size = max(64, round(size * scale))
        pad = 16
        padded = np.pad(atlas, ((pad, pad), (pad, pad), (0, 0)), mode="wrap")
        box = (pad, pad, pad + size, pad + size)  # resample only the core, reading the wrapped margin
        resized = Image.fromarray(padded).resize((out_size, out_size), Image.Resampling.BICUBIC, box=box)
        atlas = np.asarray(resized)
    atlas = np.ascontiguousarray(atlas)
    atlas.setflags(write=False)
    return atlas, mean


# ----------------------------------------------------------------------------------------------------
# Coarse planning fields
# ----------------------------------------------------------------------------------------------------


def _smooth_noise(shape: tuple[int, int], sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian random field with unit standard deviation and correlation length ~`sigma` px.

    Large sigmas are filtered on a grid reduced so that sigma is ~4 cells there, then zoomed back: the same
    kind of field at a fraction of the cost of a wide Gaussian kernel on the full grid.
    """
    reduce = max(1, int(sigma // 4))
    small = (max(2, math.ceil(shape[0] / reduce)), max(2, math.ceil(shape[1] / reduce)))
    noise = ndimage.gaussian_filter(rng.standard_normal(small).astype(np.float32), max(sigma / reduce, 0.5))
    if reduce > 1:
        zoom = (shape[0] / small[0], shape[1] / small[1])
        noise = ndimage.zoom(noise, zoom, order=1, grid_mode=True, mode="nearest")[: shape[0], : shape[1]]
    return noise / max(float(noise.std()), 1e-6)


def _interp_axis(start: int, stop: int, scale: float, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear sample positions on a coarse axis of length `n` for full-resolution pixels [start, stop)."""
    c = (np.arange(start, stop, dtype=np.float32) + 0.5) / scale - 0.5
    np.clip(c, 0, n - 1, out=c)
    i0 = c.astype(np.intp)
    i1 = np.minimum(i0 + 1, n - 1)
    return i0, i1, c - i0


def _upsample(coarse: np.ndarray, scale: float, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """Bilinear upsampling of a coarse field to the full-resolution window rows × cols (separable, cheap)."""
    r0, r1, wr = _interp_axis(*rows, scale, coarse.shape[0])
    c0, c1, wc = _interp_axis(*cols, scale, coarse.shape[1])
    along_rows = coarse.take(r0, axis=0) * (1 - wr)[:, None] + coarse.take(r1, axis=0) * wr[:, None]
    return along_rows.take(c0, axis=1) * (1 - wc) + along_rows.take(c1, axis=1) * wc


@dataclass(frozen=True)
class _Region:
    """One tissue section: coarse shape field (> 0 inside) and stain density over a full-res bounding box."""

    y0: int
    x0: int
    y1: int
    x1: int
    shape_field: np.ndarray  # coarse, float32
    density: np.ndarray  # coarse, float32, multiplies stain opacity
    gain: np.ndarray  # (3,) per-channel texture gain  } affine tone change of this piece: brightness, tint
    bias: np.ndarray  # (3,) per-channel texture bias  } and saturation about the mean colour
    layers: tuple[_Layer, _Layer]  # two differently placed readings of the atlas …
    mix: np.ndarray  # coarse, float32 in [0, 1]: … and where the second one shows (breaks the repeat)


@dataclass(frozen=True)
class _Layer:
    """How a tissue piece reads the periodic atlas: mirrored or not along y / x, and from which phase."""

    flip_y: bool
    flip_x: bool
    offset_y: int
    offset_x: int

    def sample(self, atlas: np.ndarray, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        size = atlas.shape[0]
        ty = (np.arange(*rows) + self.offset_y) % size
        tx = (np.arange(*cols) + self.offset_x) % size
        if self.flip_y:
            ty = size - 1 - ty
        if self.flip_x:
            tx = size - 1 - tx
        return atlas.take(ty, axis=0).take(tx, axis=1)


@dataclass(frozen=True)
class _PenStroke:
    """One marker stroke, planned on the coarse grid over the whole canvas."""

    distance: np.ndarray  # coarse signed distance to the stroke outline (coarse px, < 0 inside), float32
    opacity: np.ndarray  # coarse ink opacity (streaks), float32
    ink: tuple[float, float, float]  # transmittance per channel (ink RGB / 255)
    rows: tuple[int, int]  # full-res bounding box of the stroke
    cols: tuple[int, int]


def _layout_cells(hc: int, wc: int, rng: np.random.Generator) -> list[tuple[int, int, int, int]]:
    """Split the coarse canvas into 2–6 jittered cells, like several sections/fragments laid on one slide."""
    n_rows = int(rng.integers(1, 3))
    n_cols = int(rng.integers(2, 4)) if wc >= hc else int(rng.integers(1, 3))
    if n_rows * n_cols < 2:
        n_rows = 2

    def cuts(n: int, length: int) -> list[int]:
        inner = [(i + rng.uniform(-0.15, 0.15)) * length / n for i in range(1, n)]
        return [0, *(round(c) for c in inner), length]

    ys, xs = cuts(n_rows, hc), cuts(n_cols, wc)
    cells = [(ys[i], xs[j], ys[i + 1], xs[j + 1]) for i in range(n_rows) for j in range(n_cols)]
    # An empty spot now and then, but never so many that the tissue target becomes unreachable.
    empty = [rng.random() < 0.2 for _ in cells]
    keep = [c for c, e in zip(cells, empty, strict=True) if not e]
    area = sum((y1 - y0) * (x1 - x0) for y0, x0, y1, x1 in keep)
    return keep if len(keep) >= 2 and area >= 0.7 * hc * wc else cells


def _edge_penalty(ch: int, cw: int) -> np.ndarray:
    """Amount subtracted from a blob field near its box border, so outlines curve away from the box.

    Zero in the interior, rising smoothly (cubically) over the outer 20 % of the box to 3 at the border,
    more than the noise terms reach: tissue stays inside its box and is never cut along a straight line.
    """
    margin = max(2.0, 0.2 * min(ch, cw))
    dy = np.minimum(np.arange(ch), np.arange(ch)[::-1]).astype(np.float32)
    dx = np.minimum(np.arange(cw), np.arange(cw)[::-1]).astype(np.float32)
    closeness = np.clip(1 - np.minimum(dy[:, None], dx[None, :]) / margin, 0, 1)
    return 3 * closeness**3


def _region_field(ch: int, cw: int, rng: np.random.Generator) -> np.ndarray:
    """An irregular blob over a (ch, cw) coarse box: a noisy rotated ellipse, > 0 inside, maybe with holes."""
    yy, xx = np.mgrid[0:ch, 0:cw].astype(np.float32)
    cy = ch / 2 + rng.uniform(-0.05, 0.05) * ch
    cx = cw / 2 + rng.uniform(-0.05, 0.05) * cw
    a = rng.uniform(0.6, 0.8) * cw / 2
    b = rng.uniform(0.6, 0.8) * ch / 2
    angle = rng.uniform(-0.4, 0.4)
    u = ((xx - cx) * math.cos(angle) + (yy - cy) * math.sin(angle)) / a
    v = (-(xx - cx) * math.sin(angle) + (yy - cy) * math.cos(angle)) / b
    small = min(ch, cw)
    shape = 1 - (u**2 + v**2) - _edge_penalty(ch, cw)
    shape += 0.4 * _smooth_noise((ch, cw), small / 7, rng)  # lobes
    shape += 0.12 * _smooth_noise((ch, cw), small / 40, rng)  # ragged edges
    if rng.random() < 0.7:  # lumens / tears: elongated, with outlines roughened by their own noise
        roughness = 1 + 0.6 * _smooth_noise((ch, cw), small / 30, rng)
        for _ in range(int(rng.integers(1, 5))):
            r, phi, tilt = rng.uniform(0, 0.55), rng.uniform(0, 2 * math.pi), rng.uniform(0, math.pi)
            hy, hx = cy + r * b * math.sin(phi), cx + r * a * math.cos(phi)
            sigma = rng.uniform(0.03, 0.07) * small
            elongation = rng.uniform(1.0, 2.5)
            p = ((xx - hx) * math.cos(tilt) + (yy - hy) * math.sin(tilt)) / elongation
            q = -(xx - hx) * math.sin(tilt) + (yy - hy) * math.cos(tilt)
            shape -= 1.3 * np.exp(-(p**2 + q**2) / (2 * sigma**2)) * roughness
    return shape


def _random_layer(rng: np.random.Generator) -> _Layer:
    flip_y, flip_x = (bool(v) for v in rng.random(2) < 0.5)
    offset_y, offset_x = (int(v) for v in rng.integers(0, 1 << 16, 2))
    return _Layer(flip_y=flip_y, flip_x=flip_x, offset_y=offset_y, offset_x=offset_x)


def _bezier(points: np.ndarray, n: int) -> np.ndarray:
    t = np.linspace(0, 1, n)[:, None]
    p0, p1, p2, p3 = points
    return (1 - t) ** 3 * p0 + 3 * (1 - t) ** 2 * t * p1 + 3 * (1 - t) * t**2 * p2 + t**3 * p3


# ----------------------------------------------------------------------------------------------------
# Canvas
# ----------------------------------------------------------------------------------------------------


class TissueCanvas:
    """A synthetic slide image planned up front and rendered lazily, strip by strip.

    All randomness is drawn in `plan`, so rendering is deterministic and strips can be produced in any order.
    Use `rows(y0, y1)` to stream (it satisfies `ImageSource`), `to_array()` for a materialised image.
    """

    def __init__(
        self,
        height: int,
        width: int,
        *,
        scale: int,
        glass_row: np.ndarray,
        vignette_y: np.ndarray,
        noise: np.ndarray,
        atlas: np.ndarray,
        regions: list[_Region],
        pen: _PenStroke | None,
    ) -> None:
        self.height, self.width = height, width
        self._scale = scale  # full-res px per coarse planning cell
        self._glass_row = glass_row  # (width * 3,) glass colour × horizontal vignetting, interleaved RGB
        self._vignette_y = vignette_y  # (height,) vertical vignetting factor
        self._noise = noise  # (P, width * 3) sensor-noise rows, reused with period P
        self._atlas = atlas  # (S, S, 3) uint8 periodic tissue texture shared by all pieces
        self._regions = regions
        self._pen = pen

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)

    @classmethod
    def plan(
        cls,
        height: int,
        width: int,
        *,
        rng: np.random.Generator,
        mpp: float = 0.25,
        tissue: bool = True,
        pen_mark: bool = True,
        pen_color: Literal["blue", "green", "black"] | None = None,
        tissue_fraction: tuple[float, float] = (0.25, 0.4),
    ) -> TissueCanvas:
        """Draw the layout: glass tint and vignetting, tissue sections, stain density, one pen stroke.

        `mpp` sets the texture scale (the IHC image is taken as `TEXTURE_MPP` µm/px), so slides at different
        µm/px show cells of the same physical size. `tissue_fraction` is the target range of tissue area.
        """
        if height < 64 or width < 64:
            raise ValueError(f"canvas must be at least 64×64 px, got {height}×{width}")
        scale = max(1, math.ceil(max(height, width) / PLAN_GRID_PX))
        hc, wc = math.ceil(height / scale), math.ceil(width / scale)

        # Glass: slightly tinted white, darker towards the corners (uneven illumination), fine sensor noise.
        # Vignetting is separable (vy × vx), so a strip costs one outer product. Noise comes from a (prime)
        # 127-row table reused down the slide: drawing 10^9 normals would dominate generation time, and a
        # repeat period of 127 px at an amplitude of ~1 grey level is invisible.
        glass = np.array(GLASS_RGB, np.float32) + rng.uniform(-3, 3, 3).astype(np.float32)
        strength = rng.uniform(0.015, 0.03)
        vy = 1 - strength * np.linspace(-1, 1, height, dtype=np.float32) ** 2
        vx = 1 - strength * np.linspace(-1, 1, width, dtype=np.float32) ** 2
        glass_row = (vx[:, None] * glass[None, :]).ravel()
        noise = np.round(rng.normal(0, 1.0, (127, width * 3))).astype(np.float32)

        regions: list[_Region] = []
        atlas = np.zeros((1, 1, 3), np.uint8)  # blank glass needs no texture
        if tissue:
            atlas, atlas_mean = _tissue_atlas(int(rng.integers(ATLAS_VARIANTS)), TEXTURE_MPP / mpp)
            # This slide's staining: overall stain strength and a colour cast shared by all its pieces.
            slide_tint = rng.uniform(0.96, 1.04, 3) * rng.uniform(0.95, 1.03)
            fields = []
            for y0, x0, y1, x1 in _layout_cells(hc, wc, rng):
                # Gaps between sections: shrink each cell by a random margin.
                gy = round((y1 - y0) * rng.uniform(0.03, 0.08))
                gx = round((x1 - x0) * rng.uniform(0.03, 0.08))
                box = (y0 + gy, x0 + gx, y1 - gy, x1 - gx)
                fields.append((box, _region_field(box[2] - box[0], box[3] - box[1], rng)))
            # Shift the shared threshold so the tissue area lands in the requested fraction of the canvas;
            # bounded, so blobs keep their character when the target cannot be met.
            target = rng.uniform(*tissue_fraction) * hc * wc
            values = np.sort(np.concatenate([f.ravel() for _, f in fields]))[::-1]
            threshold = float(np.clip(values[int(min(target, values.size - 1))], -0.25, 0.5))
            for (cy0, cx0, cy1, cx1), shape_field in fields:
                ch, cw = shape_field.shape
                # Stain density varies at the scale of the whole piece (denser and paler areas), and a second
                # reading of the atlas shows through in large patches: no regular repeat at low power.
                density = np.clip(0.85 + 0.15 * _smooth_noise((ch, cw), min(ch, cw) / 4, rng), 0.55, 1.0)
                t = np.clip(0.5 + 1.5 * _smooth_noise((ch, cw), min(ch, cw) / 5, rng), 0, 1)
                mix = t * t * (3 - 2 * t)
                # Per-piece colour variation (hue via per-channel tint, brightness, saturation), cheap enough
                # to apply while rendering: tex·gain + bias = tint·(mean + saturation·(tex − mean)).
                tint = slide_tint * rng.uniform(0.96, 1.04, 3) * rng.uniform(0.95, 1.03)
                saturation = rng.uniform(0.85, 1.15)
                regions.append(
                    _Region(
                        y0=cy0 * scale,
                        x0=cx0 * scale,
                        y1=min(cy1 * scale, height),
                        x1=min(cx1 * scale, width),
                        shape_field=(shape_field - threshold).astype(np.float32),
                        density=density.astype(np.float32),
                        gain=(tint * saturation).astype(np.float32),
                        bias=(tint * (1 - saturation) * atlas_mean).astype(np.float32),
                        layers=(_random_layer(rng), _random_layer(rng)),
                        mix=mix.astype(np.float32),
                    )
                )

        pen = None
        if pen_mark:
            pen = cls._plan_pen(hc, wc, scale, height, width, regions, rng, pen_color)
        return cls(
            height,
            width,
            scale=scale,
            glass_row=glass_row,
            vignette_y=vy,
            noise=noise,
            atlas=atlas,
            regions=regions,
            pen=pen,
        )

    @staticmethod
    def _plan_pen(
        hc: int,
        wc: int,
        scale: int,
        height: int,
        width: int,
        regions: list[_Region],
        rng: np.random.Generator,
        pen_color: str | None,
    ) -> _PenStroke:
        """A thick, slightly wavy marker stroke entering from one edge and crossing part of a tissue piece."""
        from skimage.draw import disk

        colour = pen_color or str(rng.choice(list(INK_RGB)))
        if colour not in INK_RGB:
            raise ValueError(f"pen_color must be one of {sorted(INK_RGB)}, got {pen_color!r}")
        if regions:
            target_region = regions[int(rng.integers(len(regions)))]
            ty = (target_region.y0 + target_region.y1) / 2 / scale
            tx = (target_region.x0 + target_region.x1) / 2 / scale
        else:
            ty, tx = hc / 2, wc / 2
        # Start just outside the left or top edge, end 55–75 % of the way across, passing over the target.
        if rng.random() < 0.5:
            start = np.array([rng.uniform(0.15, 0.85) * hc, -0.02 * wc])
            end = np.array([rng.uniform(0.2, 0.8) * hc, rng.uniform(0.55, 0.75) * wc])
        else:
            start = np.array([-0.02 * hc, rng.uniform(0.15, 0.85) * wc])
            end = np.array([rng.uniform(0.55, 0.75) * hc, rng.uniform(0.2, 0.8) * wc])
        through = np.array([ty, tx]) + rng.uniform(-0.1, 0.1, 2) * (hc, wc)
        wobble = rng.uniform(-0.15, 0.15, 2) * (hc, wc)
        path = _bezier(np.stack([start, through + wobble, through - wobble, end]), 600)
        # Marker strokes are ~0.5 mm wide on a 20 mm slide; on these small fields, 2.5–4 % of the short side.
        radius = rng.uniform(0.012, 0.02) * min(hc, wc)
        widths = radius * (1 + 0.15 * np.sin(np.linspace(0, rng.uniform(6, 12), len(path))))
        mask = np.zeros((hc, wc), bool)
        for (py, px), r in zip(path, widths, strict=True):
            rr, cc = disk((py, px), max(r, 1.0), shape=(hc, wc))
            mask[rr, cc] = True
        # The outline is kept as a signed distance field (slightly smoothed), not as a mask: upsampled per
        # strip and thresholded at full resolution it gives crisp, smooth edges at any coarse-grid scale.
        distance = ndimage.distance_transform_edt(~mask) - ndimage.distance_transform_edt(mask)
        distance = ndimage.gaussian_filter(distance.astype(np.float32), 1.0)
        # Marker ink is streaky: opacity varies along and across the stroke.
        opacity = np.clip(0.85 + 0.06 * _smooth_noise((hc, wc), max(radius / 3, 1), rng), 0.6, 0.95)
        ys, xs = np.nonzero(distance * scale < PEN_EDGE_PX / 2 + scale)  # where ink can be (+1 cell for lerp)
        rows = (max(0, (int(ys.min()) - 1) * scale), min(height, (int(ys.max()) + 2) * scale))
        cols = (max(0, (int(xs.min()) - 1) * scale), min(width, (int(xs.max()) + 2) * scale))
        ink = (INK_RGB[colour][0] / 255, INK_RGB[colour][1] / 255, INK_RGB[colour][2] / 255)
        return _PenStroke(distance=distance, opacity=opacity.astype(np.float32), ink=ink, rows=rows, cols=cols)

    def rows(self, y0: int, y1: int) -> np.ndarray:
        """Render full-width rows [y0, y1) as a (rows, width, 3) uint8 RGB array."""
        y0, y1 = max(0, y0), min(self.height, y1)
        flat = np.multiply(self._vignette_y[y0:y1, None], self._glass_row[None, :])
        period = len(self._noise)
        for i, y in enumerate(range(y0, y1)):  # contiguous row adds beat a gathered (rows, width*3) temporary
            flat[i] += self._noise[y % period]
        out = flat.reshape(y1 - y0, self.width, 3)  # float32 work buffer, modified in place below

        for region in self._regions:
            top, bottom = max(y0, region.y0), min(y1, region.y1)
            if top >= bottom:
                continue
            local_rows = (top - region.y0, bottom - region.y0)
            local_cols = (0, region.x1 - region.x0)
            shape = _upsample(region.shape_field, self._scale, local_rows, local_cols)
            # Opacity ramps from 0 to 1 over a short band inside the outline: thin section edges look faint.
            t = np.clip(shape * 12.5, 0, 1)
            alpha = t * t * (3 - 2 * t) * _upsample(region.density, self._scale, local_rows, local_cols)
            first, second = region.layers
            texture = first.sample(self._atlas, (top, bottom), (region.x0, region.x1)).astype(np.float32)
            other = second.sample(self._atlas, (top, bottom), (region.x0, region.x1)).astype(np.float32)
            other -= texture
            other *= _upsample(region.mix, self._scale, local_rows, local_cols)[..., None]
            texture += other
            del other
            texture *= region.gain
            texture += region.bias
            window = out[top - y0 : bottom - y0, region.x0 : region.x1]
            texture -= window
            texture *= alpha[..., None]
            window += texture

        pen = self._pen
        if pen is not None:
            top, bottom = max(y0, pen.rows[0]), min(y1, pen.rows[1])
            if top < bottom:
                distance = _upsample(pen.distance, self._scale, (top, bottom), pen.cols) * self._scale
                alpha = np.clip(0.5 - distance / PEN_EDGE_PX, 0, 1)
                alpha *= _upsample(pen.opacity, self._scale, (top, bottom), pen.cols)
                window = out[top - y0 : bottom - y0, pen.cols[0] : pen.cols[1]]
                # Ink absorbs light (multiplicative), so tissue under the stroke stays visible but tinted.
                # Per channel: a (rows, cols, 3) temporary would double the strip's memory for wide strokes.
                for channel, transmittance in enumerate(pen.ink):
                    window[..., channel] *= 1 - alpha * (1 - transmittance)

        np.clip(out, 0, 255, out=out)
        out += 0.5
        return out.astype(np.uint8)

    def to_array(self) -> np.ndarray:
        """The whole image (height × width × 3 uint8), rendered strip by strip into one array."""
        image = np.empty(self.shape, np.uint8)
        step = _strip_rows(self.width, 16)
        for y in range(0, self.height, step):
            image[y : y + step] = self.rows(y, y + step)
        return image


def synthesize_tissue_canvas(
    height: int,
    width: int,
    *,
    rng: np.random.Generator,
    pen_mark: bool = True,
    pen_color: Literal["blue", "green", "black"] | None = None,
    mpp: float = 0.25,
) -> np.ndarray:
    """A slide-like RGB uint8 image: glass background, several IHC-textured tissue sections, one pen stroke.

    Tissue covers roughly 25–40 % of the area (a little less counts as stained: lumens are bright); sections
    have irregular outlines and some have holes. `pen_color` defaults to a random choice of blue, green or
    black; `mpp` sets the texture scale (cells have the same physical size at any µm/px).
    """
    canvas = TissueCanvas.plan(height, width, rng=rng, mpp=mpp, pen_mark=pen_mark, pen_color=pen_color)
    return canvas.to_array()


def synthesize_background(height: int, width: int, *, rng: np.random.Generator) -> np.ndarray:
    """Blank glass only (no tissue, no pen): what a scanner records for an empty slide area."""
    return TissueCanvas.plan(height, width, rng=rng, tissue=False, pen_mark=False).to_array()


# ----------------------------------------------------------------------------------------------------
# Pyramid writing
# ----------------------------------------------------------------------------------------------------


def _row_reader(image: np.ndarray | ImageSource) -> tuple[int, int, Callable[[int, int], np.ndarray]]:
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

    Sums rows, then columns, in uint16 with plain adds: ~8× faster than a float mean over two strided axes.
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


def _iter_tiles(strip: np.ndarray, tile: int) -> Iterator[np.ndarray]:
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


def _strip_rows(width: int, multiple: int) -> int:
    """Rows per rendered strip: within `STRIP_BYTES` of float32 work buffer, a multiple of `multiple`."""
    return max(multiple, STRIP_BYTES // (width * 3 * 4) // multiple * multiple)


def _stream_level0(
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
    strip_rows = _strip_rows(width, tile)
    for y0 in range(0, height, strip_rows):
        strip = read(y0, min(y0 + strip_rows, height))
        if reduced is not None:
            small = _downsample_area(strip, factor)
            start = y0 // factor
            rows = min(small.shape[0], reduced.shape[0] - start)
            reduced[start : start + rows] = small[:rows, : reduced.shape[1]]
        yield from _iter_tiles(strip, tile)


def _check_pyramid_args(height: int, width: int, tile: int, levels: int, factor: int) -> None:
    if tile % 16 or tile <= 0:
        raise ValueError(f"tile must be a positive multiple of 16 (JPEG 4:2:0 blocks), got {tile}")
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    smallest = min(height, width) // factor ** (levels - 1)
    if smallest < 1:
        raise ValueError(f"{levels} levels at ×{factor} do not fit a {width}×{height} image")


def _reduced_levels(level1: np.ndarray, levels: int, factor: int) -> list[np.ndarray]:
    """Levels 1 … levels-1, each `factor` times smaller than the one before."""
    pyramid = [level1] if levels > 1 else []
    while len(pyramid) < levels - 1:
        pyramid.append(_downsample_area(pyramid[-1], factor))
    return pyramid


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
    height, width, read = _row_reader(image)
    factor = 4  # Aperio's pyramid step
    _check_pyramid_args(height, width, tile, levels, factor)
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
    # Classic TIFF unless the raw size nears 4 GiB (JPEG output is far smaller), as Aperio scanners do.
    bigtiff = height * width * 3 > 3 * 2**30
    dims = [(width, height)]
    with tifffile.TiffWriter(path, bigtiff=bigtiff) as tif:
        tif.write(
            _stream_level0(read, height, width, tile, factor, level1),
            shape=(height, width, 3),
            dtype=np.uint8,
            tile=(tile, tile),
            buffersize=ENCODE_BUFFER_BYTES,
            description=description0,
            **jpeg,
            **common,
        )
        pyramid = _reduced_levels(level1, levels, factor)
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
                _iter_tiles(level, tile),
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
    height, width, read = _row_reader(image)
    factor = 2
    _check_pyramid_args(height, width, tile, levels, factor)
    if compression == "jpeg":
        codec: dict[str, Any] = {
            "compression": "jpeg",
            "compressionargs": {"level": jpeg_quality},
            "subsampling": (2, 2),
        }
    elif compression == "zlib":
        # Level 1: ~9× faster than the default 6 on tissue with sensor noise, for ~10 % larger files.
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
    bigtiff = height * width * 3 > 3 * 2**30
    dims = [(width, height)]
    with tifffile.TiffWriter(path, bigtiff=bigtiff) as tif:
        tif.write(
            _stream_level0(read, height, width, tile, factor, level1),
            shape=(height, width, 3),
            description="wsidino synthetic sample slide",
            software="wsidino",
            **resolution(1),
            **codec,
            **common,
        )
        pyramid = _reduced_levels(level1, levels, factor) if level1 is not None else []
        for index, level in enumerate(pyramid, start=1):
            dims.append((level.shape[1], level.shape[0]))
            tif.write(
                _iter_tiles(level, tile),
                shape=level.shape,
                subfiletype=1,
                software=False,
                **resolution(factor**index),
                **codec,
                **common,
            )
    return dims


# ----------------------------------------------------------------------------------------------------
# Sample sets
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlideSpec:
    """One file of a preset. `kind`: svs | tiff | truncated | text; `content`: tissue | blank."""

    name: str  # path relative to the output directory
    kind: Literal["svs", "tiff", "truncated", "text"]
    width: int = 0
    height: int = 0
    mpp: float | None = None
    app_mag: int | None = None
    levels: int = 3
    compression: Literal["jpeg", "zlib"] = "jpeg"
    content: Literal["tissue", "blank"] = "tissue"
    pen_color: Literal["blue", "green", "black"] | None = None
    negative: str | None = None  # key in SampleSet.negatives
    expect: str = ""  # how readers should behave, recorded in the marker for humans


def _preset(big: bool) -> list[SlideSpec]:
    # The test preset is the demo at a quarter of the size per side (the same layout, ~3k×4k px, still
    # ≥ 3 levels), so tests exercise exactly the code paths a demo run uses.
    if big:
        svs40, svs20, generic, negative = (16384, 16384, 4), (8192, 6144, 3), (6144, 8192, 5), (4096, 3072)
    else:
        svs40, svs20, generic, negative = (4096, 3072, 3), (2048, 1536, 3), (2048, 3072, 4), (2048, 1536)
    nw, nh = negative
    return [
        SlideSpec("tissue_40x.svs", "svs", svs40[0], svs40[1], 0.25, 40, levels=svs40[2], pen_color="blue"),
        SlideSpec("tissue_20x.svs", "svs", svs20[0], svs20[1], 0.5, 20, levels=svs20[2], pen_color="green"),
        SlideSpec("tissue_generic.tiff", "tiff", generic[0], generic[1], 0.25, levels=generic[2],
                  compression="zlib", pen_color="black"),
        SlideSpec("negatives/no_mpp.tiff", "tiff", nw, nh, None, levels=3, pen_color="blue",
                  negative="no_mpp", expect="opens as generic-tiff; no openslide.mpp-x/y"),
        SlideSpec("negatives/truncated.svs", "truncated", nw, nh, 0.25, 40, levels=3,
                  negative="truncated", expect="valid SVS cut to 60 % of its bytes; see _truncate"),
        SlideSpec("negatives/not_a_slide.svs", "text", negative="not_a_slide",
                  expect="text with a slide extension; OpenSlideUnsupportedFormatError"),
        SlideSpec("negatives/no_tissue.svs", "svs", nw, nh, 0.25, 40, levels=3, content="blank",
                  negative="no_tissue", expect="opens with MPP; blank glass only"),
    ]  # fmt: skip


PRESETS: dict[str, list[SlideSpec]] = {"demo": _preset(big=True), "test": _preset(big=False)}


@dataclass(frozen=True)
class SampleSet:
    """Files written by `make_sample_slides`.

    `slides`: the good slides; `negatives`: ``no_mpp``, ``truncated``, ``not_a_slide``, ``no_tissue`` (empty
    when not requested); `info`: per file, keyed by path relative to `root`: ``format``, ``size`` (level-0
    width, height), ``mpp``, ``levels`` (width, height per level), ``bytes``, ``expect`` and more.
    """

    slides: list[Path]
    negatives: dict[str, Path]
    info: dict[str, dict[str, Any]]
    root: Path = field(default=Path())
    preset: str = "demo"
    seed: int = 0


@contextmanager
def _atomic(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling path and rename it onto `final` only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _spec_rng(seed: int, index: int) -> np.random.Generator:
    # One independent stream per file: changing one spec does not change the others' pixels.
    return np.random.default_rng([seed, index])


def _canvas(spec: SlideSpec, rng: np.random.Generator) -> TissueCanvas:
    return TissueCanvas.plan(
        spec.height,
        spec.width,
        rng=rng,
        mpp=spec.mpp or 0.25,
        tissue=spec.content == "tissue",
        pen_mark=spec.content == "tissue",
        pen_color=spec.pen_color,
    )


def sample_canvas(preset: Literal["demo", "test"], name: str, *, seed: int = 0) -> TissueCanvas:
    """The canvas behind a preset's image file, for comparing what a reader returns with the source pixels."""
    for index, spec in enumerate(PRESETS[preset]):
        if spec.name == name and spec.kind != "text":
            return _canvas(spec, _spec_rng(seed, index))
    raise KeyError(f"preset {preset!r} has no image named {name!r}")


def _truncate(path: Path, fraction: float = 0.6) -> None:
    """Cut a file to `fraction` of its bytes, like an interrupted copy or download.

    tifffile writes each IFD just before its image data and level 0 holds most of the bytes, so a 60 % cut
    lands inside level 0's tiles: IFD 0 survives but points to a next IFD past the end of the file. OpenSlide
    4.0.1 walks the whole IFD chain when it opens a TIFF, so ``OpenSlide(path)`` raises
    ``OpenSlideUnsupportedFormatError`` (an ``OpenSlideError``); it never gets as far as reading tiles.
    Beware ``openslide.open_slide(path)``: it then falls back to PIL's ``ImageSlide``, which opens IFD 0
    lazily and only fails (or returns garbage) when it reaches the missing tiles. Readers should call
    ``OpenSlide`` directly and treat the error as a per-slide failure.
    """
    size = path.stat().st_size
    with path.open("r+b") as fh:
        fh.truncate(int(size * fraction))


def _write_spec(spec: SlideSpec, target: Path, rng: np.random.Generator) -> dict[str, Any]:
    info: dict[str, Any] = {"size": [spec.width, spec.height], "mpp": spec.mpp}
    if spec.kind == "text":
        target.write_text(
            "This is not a slide. It is a plain-text file with a slide file extension, used to check that\n"
            "readers reject it with a clear error instead of crashing.\n"
        )
        return {"format": "text", "size": None, "mpp": None, "levels": []}
    canvas = _canvas(spec, rng)
    if spec.kind in ("svs", "truncated"):
        # `name` explicitly: `target` is a temporary path, and the output must not depend on it.
        name = Path(spec.name).stem
        dims = write_svs(
            target, canvas, mpp=spec.mpp, app_mag=spec.app_mag, levels=spec.levels, name=name, label_rng=rng
        )
        info |= {"format": "aperio-svs", "app_mag": spec.app_mag, "compression": "jpeg"}
        if spec.kind == "truncated":
            _truncate(target)
            info["format"] = "aperio-svs (truncated)"
    else:
        dims = write_generic_tiff(target, canvas, mpp=spec.mpp, levels=spec.levels, compression=spec.compression)
        info |= {"format": "generic-tiff", "compression": spec.compression}
    return info | {"levels": [list(d) for d in dims], "content": spec.content, "pen_color": spec.pen_color}


def _reusable_files(root: Path, preset: str, seed: int) -> dict[str, dict[str, Any]]:
    """Marker entries, for this generator version, preset and seed, whose file is there with its size."""
    try:
        marker = json.loads((root / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return {}
    wanted = {"version": GENERATOR_VERSION, "preset": preset, "seed": seed}
    if not isinstance(marker, dict) or any(marker.get(key) != value for key, value in wanted.items()):
        return {}
    files: dict[str, dict[str, Any]] = marker.get("files", {})
    return {
        name: meta
        for name, meta in files.items()
        if (root / name).is_file() and (root / name).stat().st_size == meta.get("bytes")
    }


def _sample_set(root: Path, preset: str, seed: int, files: dict[str, dict[str, Any]]) -> SampleSet:
    slides = [root / name for name, meta in files.items() if meta.get("negative") is None]
    negs = {meta["negative"]: root / name for name, meta in files.items() if meta.get("negative") is not None}
    return SampleSet(slides=slides, negatives=negs, info=files, root=root, preset=preset, seed=seed)


def make_sample_slides(
    out_dir: str | Path,
    preset: Literal["demo", "test"] = "demo",
    *,
    seed: int = 0,
    negatives: bool = True,
) -> SampleSet:
    """Write a preset set of sample slides into `out_dir` (negatives under ``negatives/``) and describe them.

    "demo": a 16384×16384 SVS at 0.25 µm/px (AppMag 40, 4 levels), an 8192×6144 SVS at 0.5 µm/px
    (AppMag 20), a 6144×8192 zlib generic TIFF at 0.25 µm/px (5 levels). "test": the same slides at a
    quarter of the size per side (≥ 3 levels each). Negatives: ``no_mpp.tiff``, ``truncated.svs``,
    ``not_a_slide.svs``, ``no_tissue.svs``. Files are byte-for-byte deterministic for a seed.

    Idempotent: ``sample_slides.json`` (written last, after every file was written under a temporary name
    and renamed) records what was generated. Files it lists for the same preset and seed that are still
    there with their recorded size are reused; if that covers the request, nothing at all is written.
    Otherwise only the missing or damaged files are regenerated.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    root = Path(out_dir)
    wanted = [(i, spec) for i, spec in enumerate(PRESETS[preset]) if negatives or spec.negative is None]
    reusable = _reusable_files(root, preset, seed)
    if all(spec.name in reusable for _, spec in wanted):
        return _sample_set(root, preset, seed, {spec.name: reusable[spec.name] for _, spec in wanted})

    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER_NAME).unlink(missing_ok=True)  # a half-rewritten set must not look complete
    files: dict[str, dict[str, Any]] = {}
    for index, spec in wanted:
        if spec.name in reusable:
            files[spec.name] = reusable[spec.name]
            continue
        final = root / spec.name
        started = time.perf_counter()
        with _atomic(final) as tmp:
            meta = _write_spec(spec, tmp, _spec_rng(seed, index))
        meta |= {
            "bytes": final.stat().st_size,
            "negative": spec.negative,
            "expect": spec.expect,
            "seconds": round(time.perf_counter() - started, 2),
        }
        files[spec.name] = meta

    marker = {
        "generator": "dinov3_core.sample_slides",
        "version": GENERATOR_VERSION,
        "preset": preset,
        "seed": seed,
        "files": files,
    }
    with _atomic(root / MARKER_NAME) as tmp:
        tmp.write_text(json.dumps(marker, indent=2) + "\n")
    return _sample_set(root, preset, seed, files)
