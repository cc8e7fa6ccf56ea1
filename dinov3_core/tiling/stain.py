"""Stain statistics of a slide, recorded while its tiles are written: CIELAB mean and std per channel.

The tile stage records them in the slide group's attributes (`stain_lab_mean`, `stain_lab_std`,
`stain_lab_tile_std`: docs/tile-store.md) so that training can re-target tiles to the cohort's stain distribution
(RandStainNA, `dinov3_core.data.stain`) without a second pass over the tiles. Numpy only: tiling processes never
import torch.

Cost: a fixed pixel subsample of every tile (every `STEP`-th pixel in each direction), the sRGB linearisation as a
256-entry table and one 3×3 product, accumulated in float64 per write unit. Each unit leaves its sums as a small
file in the slide's `.incoming/` folder (units run in other processes, possibly on other hosts); the commit adds
them up and removes the files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

STEP = 8  # every 8th pixel in each direction: 1/64 of a tile, 784 pixels of a 224-px tile (cheap beside encoding it)
SUMS_PREFIX = ".stain-sums-"  # + the unit's first tile index + ".npy", in the slide's .incoming/ folder

# skimage.color: sRGB primaries to XYZ (D65) and the D65 2° white point, so that our LAB is skimage's rgb2lab.
XYZ_FROM_RGB = np.array(
    [[0.412453, 0.357580, 0.180423], [0.212671, 0.715160, 0.072169], [0.019334, 0.119193, 0.950227]]
)
WHITE_D65 = np.array([0.95047, 1.0, 1.08883])
# Per-row layout of a unit's sums (float64): what `slide_stain_attrs` needs to pool units exactly.
_N_PIXELS, _N_TILES, _SUM, _SUMSQ, _TILE_STD = 0, 1, slice(2, 5), slice(5, 8), slice(8, 11)
_SUMS_LEN = 11


def srgb_to_linear(c: np.ndarray) -> np.ndarray:
    """sRGB in [0, 1] → linear RGB (IEC 61966-2-1, as skimage)."""
    return np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)


# uint8 pixels take one of 256 values: the linearisation of a tile is a table lookup.
_LINEAR_LUT = srgb_to_linear(np.arange(256) / 255.0)


def _lab_from_linear(linear: np.ndarray) -> np.ndarray:
    """(..., 3) linear RGB → (..., 3) CIELAB (D65, 2° observer), skimage's formulas."""
    xyz = (linear @ (XYZ_FROM_RGB.T / WHITE_D65[:, None].T)).astype(linear.dtype, copy=False)
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16.0 / 116.0)
    lab = np.empty_like(f)
    lab[..., 0] = 116.0 * f[..., 1] - 16.0
    lab[..., 1] = 500.0 * (f[..., 0] - f[..., 1])
    lab[..., 2] = 200.0 * (f[..., 1] - f[..., 2])
    return lab


def rgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """(..., 3) sRGB, uint8 or float in [0, 1] → (..., 3) CIELAB float64 (skimage.color.rgb2lab)."""
    linear = _LINEAR_LUT[rgb] if rgb.dtype == np.uint8 else srgb_to_linear(np.asarray(rgb, dtype=np.float64))
    return _lab_from_linear(linear)


def tile_lab_sums(tiles: np.ndarray, step: int = STEP) -> np.ndarray:
    """Sums over a pixel subsample of (n, T, T, 3) uint8 tiles: [pixels, tiles, Σx (3), Σx² (3), Σ tile std (3)].

    float32 for the conversion (its error, ~1e-4 in L, is far below what a stain statistic needs), float64 for the
    sums, which cover millions of pixels per slide."""
    out = np.zeros(_SUMS_LEN)
    if len(tiles) == 0:
        return out
    sub = tiles[:, ::step, ::step]
    lab = _lab_from_linear(_LINEAR_LUT.astype(np.float32)[sub]).reshape(len(tiles), -1, 3)
    per_tile = lab.sum(axis=1, dtype=np.float64)  # (n, 3)
    per_tile_sq = np.einsum("npc,npc->nc", lab, lab, dtype=np.float64)
    m = lab.shape[1]
    tile_var = np.maximum(per_tile_sq / m - (per_tile / m) ** 2, 0.0)
    out[_N_PIXELS], out[_N_TILES] = len(tiles) * m, len(tiles)
    out[_SUM], out[_SUMSQ] = per_tile.sum(0), per_tile_sq.sum(0)
    out[_TILE_STD] = np.sqrt(tile_var).sum(0)
    return out


def save_unit_sums(slide_dir: Path, start: int, sums: np.ndarray) -> None:
    """A write unit's sums, next to its tiles in the slide's `.incoming/` folder (one file per unit)."""
    np.save(slide_dir / f"{SUMS_PREFIX}{start}.npy", sums)


def pop_slide_sums(slide_dir: Path) -> np.ndarray | None:
    """The slide's pooled sums from its units' files, which are removed; None if no unit left any (an empty slide,
    or a slide begun by a wsidino that did not record stains)."""
    files = sorted(slide_dir.glob(f"{SUMS_PREFIX}*.npy"))
    if not files:
        return None
    total = np.sum([np.load(f) for f in files], axis=0)
    for f in files:
        f.unlink()
    return total


def slide_stain_attrs(sums: np.ndarray | None) -> dict[str, list[float]]:
    """Slide attributes from pooled sums: `stain_lab_mean` and `stain_lab_std` over the sampled pixels of all its
    tiles, and `stain_lab_tile_std`, the mean of the per-tile stds (what one tile's contrast looks like; the pooled
    std also holds the spread between tiles). Empty without sums."""
    if sums is None or sums[_N_PIXELS] == 0:
        return {}
    n = sums[_N_PIXELS]
    mean = sums[_SUM] / n
    std = np.sqrt(np.maximum(sums[_SUMSQ] / n - mean**2, 0.0))
    tile_std = sums[_TILE_STD] / sums[_N_TILES]
    return {
        "stain_lab_mean": [round(float(v), 4) for v in mean],
        "stain_lab_std": [round(float(v), 4) for v in std],
        "stain_lab_tile_std": [round(float(v), 4) for v in tile_std],
    }
