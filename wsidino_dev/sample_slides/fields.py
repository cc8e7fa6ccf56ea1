"""Coarse planning fields: tissue sections, stain density, atlas readings and the pen stroke, on a small grid.

Everything random about a slide is drawn on a grid of at most `canvas.PLAN_GRID_PX` cells per side and bilinearly
upsampled per rendered strip (`upsample`), so shapes stay smooth at any slide size while planning stays cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import ndimage


def smooth_noise(shape: tuple[int, int], sigma: float, rng: np.random.Generator) -> np.ndarray:
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


def upsample(coarse: np.ndarray, scale: float, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """Bilinear upsampling of a coarse field to the full-resolution window rows × cols (separable, cheap)."""
    r0, r1, wr = _interp_axis(*rows, scale, coarse.shape[0])
    c0, c1, wc = _interp_axis(*cols, scale, coarse.shape[1])
    along_rows = coarse.take(r0, axis=0) * (1 - wr)[:, None] + coarse.take(r1, axis=0) * wr[:, None]
    return along_rows.take(c0, axis=1) * (1 - wc) + along_rows.take(c1, axis=1) * wc


@dataclass(frozen=True)
class Region:
    """One tissue section: coarse shape field (> 0 inside) and stain density over a full-res bounding box."""

    y0: int
    x0: int
    y1: int
    x1: int
    shape_field: np.ndarray  # coarse, float32
    density: np.ndarray  # coarse, float32, multiplies stain opacity
    gain: np.ndarray  # (3,) per-channel texture gain  } affine tone change of this piece: brightness, tint
    bias: np.ndarray  # (3,) per-channel texture bias  } and saturation about the mean colour
    layer: Layer  # where (and how flipped) the piece reads the class atlases
    epithelium: np.ndarray  # coarse, float32: ~signed distance (coarse px) to the epithelium/stroma boundary, > 0 in
    tumour: np.ndarray  # coarse, float32: ~signed distance to tumour/squamous boundary within epithelium, > 0 tumour


@dataclass(frozen=True)
class Layer:
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
class PenStroke:
    """One marker stroke, planned on the coarse grid over the whole canvas."""

    distance: np.ndarray  # coarse signed distance to the stroke outline (coarse px, < 0 inside), float32
    opacity: np.ndarray  # coarse ink opacity (streaks), float32
    ink: tuple[float, float, float]  # transmittance per channel (ink RGB / 255)
    rows: tuple[int, int]  # full-res bounding box of the stroke
    cols: tuple[int, int]


def layout_cells(hc: int, wc: int, rng: np.random.Generator) -> list[tuple[int, int, int, int]]:
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


def region_field(ch: int, cw: int, rng: np.random.Generator) -> np.ndarray:
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
    shape += 0.4 * smooth_noise((ch, cw), small / 7, rng)  # lobes
    shape += 0.12 * smooth_noise((ch, cw), small / 40, rng)  # ragged edges
    if rng.random() < 0.7:  # lumens / tears: elongated, with outlines roughened by their own noise
        roughness = 1 + 0.6 * smooth_noise((ch, cw), small / 30, rng)
        for _ in range(int(rng.integers(1, 5))):
            r, phi, tilt = rng.uniform(0, 0.55), rng.uniform(0, 2 * math.pi), rng.uniform(0, math.pi)
            hy, hx = cy + r * b * math.sin(phi), cx + r * a * math.cos(phi)
            sigma = rng.uniform(0.03, 0.07) * small
            elongation = rng.uniform(1.0, 2.5)
            p = ((xx - hx) * math.cos(tilt) + (yy - hy) * math.sin(tilt)) / elongation
            q = -(xx - hx) * math.sin(tilt) + (yy - hy) * math.cos(tilt)
            shape -= 1.3 * np.exp(-(p**2 + q**2) / (2 * sigma**2)) * roughness
    return shape


def distance_like(field: np.ndarray) -> np.ndarray:
    """`field / |∇field|`: near its zero level, the signed distance (in cells) to that level, for smooth fields.

    The gradient is floored at a quarter of its median, so saddle points do not blow up; the zero level and the
    sign are the field's own.
    """
    gy, gx = np.gradient(field)
    slope = np.hypot(gy, gx)
    return (field / np.maximum(slope, 0.25 * float(np.median(slope)) + 1e-12)).astype(np.float32)


def random_layer(rng: np.random.Generator) -> Layer:
    flip_y, flip_x = (bool(v) for v in rng.random(2) < 0.5)
    offset_y, offset_x = (int(v) for v in rng.integers(0, 1 << 16, 2))
    return Layer(flip_y=flip_y, flip_x=flip_x, offset_y=offset_y, offset_x=offset_x)


def bezier(points: np.ndarray, n: int) -> np.ndarray:
    t = np.linspace(0, 1, n)[:, None]
    p0, p1, p2, p3 = points
    return (1 - t) ** 3 * p0 + 3 * (1 - t) ** 2 * t * p1 + 3 * (1 - t) * t**2 * p2 + t**3 * p3
