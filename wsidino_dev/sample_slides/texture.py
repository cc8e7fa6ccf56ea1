"""Tissue textures: seamless periodic atlases, one per tissue class, quilted from scikit-image's IHC image.

The IHC image (DAB brown + hematoxylin blue) shows DAB-positive tumour epithelium and hematoxylin-stained stroma.
Colour deconvolution (`skimage.color.rgb2hed`) separates the two: smoothed DAB optical density marks the
epithelium, the rest (less the bright lumen) is stroma. Each class atlas is quilted only from patches lying inside
its own part of the image, so a region filled from it shows that tissue and nothing else:

* ``Tumor (DAB+)``: epithelium patches as scanned (membranous brown DAB, blue nuclei);
* ``Tumor (DAB-)``: the *same* patches re-stained without DAB (hematoxylin only, a trace of DAB), so DAB+ and
  DAB- tumour differ in staining, not in morphology, and blend into each other without a seam;
* ``Stroma``: stroma patches (sparse spindle nuclei in pale fibrous tissue), re-stained the same way (no DAB).

Nothing is downloaded: the IHC image ships inside scikit-image.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image
from scipy import ndimage

# µm/px at which the 512×512 IHC texture is treated as scanned. Its nuclei are ~10×20 px, i.e. 5×10 µm at
# 0.5 µm/px, a plausible size; a canvas at 0.25 µm/px therefore shows the texture upsampled ×2.
TEXTURE_MPP = 0.5
# Side of every class atlas at TEXTURE_MPP (px): the texture repeats every 512 µm, hardly noticeable: it is quilted
# from small random patches, each class fills only part of a piece, and every piece reads it from its own place.
ATLAS_SIZE = 1024
# Distinct atlas sets (cached per process); slides pick one, and every tissue piece adds its own colour.
ATLAS_VARIANTS = 3

# The tissue classes, in the order of the atlas channels (3 per class) and of `canvas.CLASS_*` indices.
CLASS_NAMES: tuple[str, ...] = ("Tumor (DAB+)", "Tumor (DAB-)", "Stroma")
# Display colours in QuPath's `classification.color` ([r, g, b]).
CLASS_COLORS: dict[str, tuple[int, int, int]] = {
    "Tumor (DAB+)": (200, 0, 0),
    "Tumor (DAB-)": (112, 112, 225),
    "Stroma": (150, 200, 150),
}
# Re-staining of DAB- tumour and stroma: hematoxylin and DAB optical density relative to the scanned image.
RESTAIN_HEMATOXYLIN = {"Tumor (DAB-)": 1.3, "Stroma": 1.0}
RESTAIN_DAB = 0.08
# Quilting per class: (step, overlap) of the patches in px. Stroma lies in narrow bands of the IHC image, so its
# patches are smaller; both divide ATLAS_SIZE.
QUILT = {"epithelium": (128, 64), "stroma": (64, 32)}
# A patch is taken only where at least this fraction of it is its class.
PURE_FRACTION = 0.97


@functools.lru_cache(maxsize=1)
def _base_texture() -> np.ndarray:
    """scikit-image's 512×512 IHC image (read-only, loaded once per process)."""
    from skimage import data  # deferred: only texture building needs scikit-image's sample data

    image = np.ascontiguousarray(data.immunohistochemistry())
    image.setflags(write=False)
    return image


@functools.lru_cache(maxsize=1)
def class_sources() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The IHC image split by tissue class: (epithelium RGB | its DAB- re-staining, 6 channels), epithelium mask,
    stroma re-stained (3 channels), stroma mask. Images float32, masks bool; all read-only."""
    from skimage import color, filters

    base = _base_texture()
    hed = color.rgb2hed(base)
    dab = ndimage.gaussian_filter(hed[..., 2], 6)
    epithelium = dab > filters.threshold_otsu(dab)
    lumen = ndimage.gaussian_filter(base.mean(-1), 6) > 228  # bright glass/lumen: neither class
    stroma = ~epithelium & ~lumen

    def restain(hematoxylin: float) -> np.ndarray:
        stains = hed.copy()
        stains[..., 0] *= hematoxylin
        stains[..., 2] *= RESTAIN_DAB
        return np.clip(color.hed2rgb(stains) * 255, 0, 255).astype(np.float32)

    epithelium_rgb = np.concatenate([base.astype(np.float32), restain(RESTAIN_HEMATOXYLIN["Tumor (DAB-)"])], -1)
    out = (epithelium_rgb, epithelium, restain(RESTAIN_HEMATOXYLIN["Stroma"]), stroma)
    for a in out:
        a.setflags(write=False)
    return out


def _dihedral(image: np.ndarray, k: int) -> np.ndarray:
    """One of the 8 rotations/reflections of a square image."""
    return np.rot90(image[:, ::-1] if k >= 4 else image, k=k % 4)


@functools.lru_cache(maxsize=4)
def _pure_positions(tissue: str, patch: int) -> list[np.ndarray]:
    """Per dihedral transform k: top-left corners of the patch×patch windows of the IHC image that are at least
    PURE_FRACTION `tissue` ("epithelium" or "stroma")."""
    _, epithelium, _, stroma = class_sources()
    mask = epithelium if tissue == "epithelium" else stroma
    out = []
    for k in range(8):
        m = _dihedral(mask, k).astype(np.float64)
        c = np.pad(m.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
        box = c[patch:, patch:] - c[:-patch, patch:] - c[patch:, :-patch] + c[:-patch, :-patch]
        out.append(np.argwhere(box >= PURE_FRACTION * patch * patch))
    return out


def _quilt(source: np.ndarray, tissue: str, rng: np.random.Generator) -> np.ndarray:
    """A seamless periodic ATLAS_SIZE² texture quilted from the `tissue` part of `source` (float32, C channels).

    Patches (random rotation/flip and position among the pure ones) are placed on a torus and cross-faded with
    sin/cos ramps whose squares sum to 1. Blending *deviations from the class's mean colour* with such weights
    keeps local contrast in the overlaps (variance-preserving blending), so joins look like tissue rather than
    ghosting, and the atlas repeats without the kaleidoscope symmetry of mirror tiling.
    """
    step, overlap = QUILT[tissue]
    patch, n = step + overlap, ATLAS_SIZE // step
    _, epithelium, _, stroma = class_sources()
    mean = source[epithelium if tissue == "epithelium" else stroma].mean(axis=0)
    theta = (np.arange(overlap, dtype=np.float32) + 0.5) * (math.pi / 2 / overlap)
    window = np.ones(patch, np.float32)
    window[:overlap] = np.sin(theta)
    window[-overlap:] = np.cos(theta)
    weights = (window[:, None] * window[None, :])[..., None]
    positions = _pure_positions(tissue, patch)
    acc = np.zeros((ATLAS_SIZE + overlap, ATLAS_SIZE + overlap, source.shape[-1]), np.float32)
    for i in range(n):
        for j in range(n):
            k = int(rng.integers(8))
            py, px = positions[k][int(rng.integers(len(positions[k])))]
            deviation = _dihedral(source, k)[py : py + patch, px : px + patch] - mean
            acc[i * step : i * step + patch, j * step : j * step + patch] += weights * deviation
    # Fold the overhang back onto the start: the atlas is periodic, so it tiles without seams.
    acc[:overlap] += acc[ATLAS_SIZE:]
    acc[:, :overlap] += acc[:, ATLAS_SIZE:]
    atlas = acc[:ATLAS_SIZE, :ATLAS_SIZE]
    atlas += mean + 0.5
    np.clip(atlas, 0, 255, out=atlas)
    return atlas.astype(np.uint8)


def _resize(atlas: np.ndarray, scale: float) -> np.ndarray:
    """Bicubic resampling by `scale` of a periodic RGB atlas, on a wrap-padded copy so it stays periodic."""
    size = atlas.shape[0]
    out_size = max(64, round(size * scale))
    pad = 16
    padded = np.pad(atlas, ((pad, pad), (pad, pad), (0, 0)), mode="wrap")
    box = (pad, pad, pad + size, pad + size)  # resample only the core, reading the wrapped margin
    return np.asarray(Image.fromarray(padded).resize((out_size, out_size), Image.Resampling.BICUBIC, box=box))


@functools.lru_cache(maxsize=4)
def tissue_atlas(variant: int, scale: float) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The class atlases of one variant, resampled by `scale`, and the mean colour of the tissue (3,) float32.

    One (S, S, 3) uint8 read-only atlas per class, in the order of `CLASS_NAMES` (separate contiguous arrays:
    gathering 3-byte pixels is ~10× faster than 3 of 9 bytes). DAB+ and DAB- tumour are the same quilt, stained
    two ways. Upsampling comes last (bicubic): at 0.25 µm/px the tissue looks slightly soft, as scanned tissue
    does, not pixelated. Cached (a few per process): building one set costs about a second at ×2; colour
    variation is applied per tissue piece at render time instead.
    """
    rng = np.random.default_rng([0xA71A5, variant])
    epithelium_rgb, _, stroma_rgb, _ = class_sources()
    tumour = _quilt(epithelium_rgb, "epithelium", rng)
    fibrous = _quilt(stroma_rgb, "stroma", rng)
    parts = [np.ascontiguousarray(tumour[..., :3]), np.ascontiguousarray(tumour[..., 3:]), fibrous]
    ones = np.full(ATLAS_SIZE * ATLAS_SIZE, 1 / ATLAS_SIZE**2, np.float32)
    mean = np.mean([ones @ p.reshape(-1, 3).astype(np.float32) for p in parts], axis=0)  # BLAS: fast
    if abs(scale - 1.0) > 1e-3:
        parts = [_resize(p, scale) for p in parts]
    for p in parts:
        p.setflags(write=False)
    return tuple(parts), mean.astype(np.float32)
