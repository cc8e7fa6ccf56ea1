"""The tissue texture: a seamless periodic atlas quilted from scikit-image's IHC image (nothing is downloaded)."""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image

# µm/px at which the 512×512 IHC texture is treated as scanned. Its nuclei are ~10×20 px, i.e. 5×10 µm at
# 0.5 µm/px, a plausible size; a canvas at 0.25 µm/px therefore shows the texture upsampled ×2.
TEXTURE_MPP = 0.5
# Patches per side of the quilted texture atlas (each half the IHC image wide): 6 → the texture repeats every
# 1536 px at 0.5 µm/px (768 µm), rarely noticeable within one tissue piece.
PATCHES = 6
# Distinct texture atlases (cached per process); slides pick one, and every tissue piece adds its own colour.
ATLAS_VARIANTS = 3


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
def tissue_atlas(variant: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
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
