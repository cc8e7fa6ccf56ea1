"""Tissue, pen-ink and blur measures on low-resolution slide images, and per-tile scores from them."""

from __future__ import annotations

import numpy as np
from scipy import ndimage
from skimage import filters, morphology

from dinov3_core.tiling.config import TissueConfig

# Marker ink vs stain, in optical density (OD, −ln of transmitted light per channel). Hematoxylin and eosin both
# absorb green more than blue, and hematoxylin absorbs blue at over a third of its red absorption: H&E is violet to
# pink, never green, and never a blue that passes blue light. Blue ink absorbs red (and green) but little blue, green
# ink passes green, black ink absorbs everything. Ink over tissue adds the stain's OD to the ink's.
PEN_BLUE_MAX_BLUE_RED = 0.34  # blue ink: OD blue ≤ this × OD red (hematoxylin ≥ ~0.36, over tissue the ink ≤ ~0.31)
PEN_BLUE_MIN_OD = 1.0  # ... and a total OD (sum over channels) of at least this: not a faint bluish tint
PEN_GREEN_MARGIN = 0.04  # green ink: green brighter than both red and blue by this much (of full scale) ...
PEN_GREEN_MIN_OD = 0.8  # ... at a total OD of at least this ...
PEN_GREEN_MIN_SATURATION = 0.3  # ... and saturated (hematoxylin over DAB can be a dull olive)
PEN_BLACK_MAX_VALUE = 0.14  # black ink, alone or over tissue: darker than the darkest stained nucleus
PEN_DARK_MAX_VALUE = 0.2  # dark and absorbing red at least as much as green: ink over tissue (nuclei absorb green most)
PEN_GREY_MAX_VALUE = 0.4  # dark grey: streaky black ink over glass ...
PEN_GREY_MAX_SATURATION = 0.15  # ... nearly neutral (stained tissue is coloured)
# Black ink over tissue keeps the stain's hue and is only as dark as the densest nuclei, pixel by pixel; it is told
# apart by its extent: a marker stroke is far wider than any cluster of nuclei.
PEN_WIDE_DARK_MAX_VALUE = 0.25
PEN_WIDE_DARK_MIN_WIDTH_UM = 12.0


def channel_max_min(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-pixel max and min over the 3 channels of (..., 3): the same values as `.max(-1)` / `.min(-1)`, far
    cheaper (numpy reduces a last axis of 3 element by element; this is two whole-array passes each)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return np.maximum(np.maximum(r, g), b), np.minimum(np.minimum(r, g), b)


def hsv_saturation_value(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HSV saturation in [0, 255] and value in [0, 255], without a full colour conversion."""
    rgb = rgb.astype(np.float32)
    vmax, vmin = channel_max_min(rgb)
    saturation = np.where(vmax > 0, (vmax - vmin) / np.maximum(vmax, 1e-6), 0.0) * 255.0
    return saturation, vmax


def _otsu(values: np.ndarray, min_gap: float) -> float | None:
    """Otsu threshold, or None when the two classes are too close to be tissue vs glass (a blank slide)."""
    try:
        threshold = float(filters.threshold_otsu(values))
    except ValueError:
        return None
    low, high = values[values < threshold], values[values >= threshold]
    if low.size == 0 or high.size == 0 or float(high.mean() - low.mean()) < min_gap:
        return None
    return threshold


def tissue_mask(
    thumb: np.ndarray, thumb_mpp: float, cfg: TissueConfig, pen: np.ndarray | None = None
) -> tuple[np.ndarray, dict[str, float]]:
    """Boolean tissue mask of an RGB thumbnail, and the thresholds used.

    A pixel is tissue when it is coloured (HSV saturation above Otsu's threshold when that split is real, never
    below `min_saturation`), clearly darker than the slide's glass (median grey of unsaturated pixels minus
    `glass_margin`), or textured (local grey contrast well above the glass's): pale stroma passes the last test,
    blank glass passes none. Pen ink is never tissue. Fragments are closed over ~`close_um`, small holes filled and
    small specks removed, with areas in µm² so the result does not depend on the thumbnail's resolution.
    """
    # Box means rather than medians: much cheaper on large thumbnails, and closing/area filters remove speckle anyway.
    saturation, value = hsv_saturation_value(thumb)
    saturation = ndimage.uniform_filter(saturation, size=5)
    gray = thumb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    mean = ndimage.uniform_filter(gray, size=5)
    contrast = np.sqrt(np.maximum(ndimage.uniform_filter(gray * gray, size=5) - mean * mean, 0.0))
    gray = mean
    sat_thr = cfg.saturation_threshold
    if sat_thr is None:
        sat_thr = max(_otsu(saturation, min_gap=10.0) or cfg.min_saturation, cfg.min_saturation)
    mask = saturation >= sat_thr
    used = {"saturation": float(sat_thr), "gray": -1.0, "contrast": -1.0}
    glass = (saturation < cfg.min_saturation) & (value > np.percentile(value, 50))
    gray_thr = cfg.brightness_threshold
    if glass.sum() > 0.05 * glass.size:
        # Glass is the bright unsaturated majority of a slide; pale tissue is darker or more textured than it.
        if gray_thr is None:
            gray_thr = float(np.median(gray[glass])) - cfg.glass_margin
        contrast_thr = max(cfg.min_contrast, 3.0 * float(np.median(contrast[glass])))
        mask |= ndimage.uniform_filter(contrast, size=5) >= contrast_thr
        used["contrast"] = contrast_thr
    if gray_thr is not None:
        mask |= gray < gray_thr
        used["gray"] = float(gray_thr)
    mask &= value <= cfg.max_brightness
    close_px = max(1, round(cfg.close_um / thumb_mpp))
    mask = ndimage.binary_closing(mask, structure=morphology.disk(close_px), border_value=0)
    px_area = thumb_mpp * thumb_mpp
    if cfg.fill_holes:
        mask = morphology.remove_small_holes(mask, max_size=max(1, int(cfg.max_hole_area_um2 / px_area)))
    # Last, so that closing cannot bridge an ink stroke back in through its high-contrast edges.
    mask &= ~ndimage.binary_dilation(pen_mask(thumb, thumb_mpp) if pen is None else pen, iterations=2)
    # Ink edges blend into the glass and leave thin rims of "tissue" behind; opening removes anything thinner.
    open_px = max(1, round(cfg.open_um / thumb_mpp))
    mask = ndimage.binary_opening(mask, structure=morphology.disk(open_px), border_value=0)
    mask = morphology.remove_small_objects(mask, max_size=max(1, int(cfg.min_region_area_um2 / px_area)))
    return mask.astype(bool), used


def mask_mpp(width_um: float, height_um: float, cfg: TissueConfig) -> float:
    """Mask resolution: `thumbnail_mpp`, or finer so that small slides still get ~1024 px on their long side."""
    return min(cfg.thumbnail_mpp, max(width_um, height_um) / cfg.min_thumbnail_px)


def pen_mask(thumb: np.ndarray, mpp: float | None = None) -> np.ndarray:
    """Pixels that look like marker ink (blue, green or black), not stain: see the PEN_* constants.

    Dense violet nuclei (blue ≈ red ≫ green) absorb green most and blue strongly, so neither the blue nor the dark
    test takes them; an older saturation test did, and cut holes into the tissue mask. With the thumbnail's µm/px
    `mpp`, dark or dark-grey areas count only when wider than PEN_WIDE_DARK_MIN_WIDTH_UM (black ink over tissue is
    found, dark nuclei and immunostain patches are not); without it, every dark-grey pixel does."""
    rgb = thumb.astype(np.float32) * (1 / 255)
    od = -np.log(rgb + 1 / 256)  # optical density, finite at 0
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    od_r, od_g, od_b = od[..., 0], od[..., 1], od[..., 2]
    density = od_r + od_g + od_b
    blue = (od_b <= PEN_BLUE_MAX_BLUE_RED * od_r) & (od_g <= od_r) & (density >= PEN_BLUE_MIN_OD)
    vmax, vmin = channel_max_min(rgb)
    green = (g >= r + PEN_GREEN_MARGIN) & (g >= b + PEN_GREEN_MARGIN) & (density >= PEN_GREEN_MIN_OD)
    green &= vmax - vmin >= PEN_GREEN_MIN_SATURATION * vmax
    black = vmax <= PEN_BLACK_MAX_VALUE
    black |= (vmax <= PEN_DARK_MAX_VALUE) & (od_g <= od_r)
    grey = (vmax <= PEN_GREY_MAX_VALUE) & (vmax - vmin <= PEN_GREY_MAX_SATURATION * vmax)
    if mpp is None:
        return ndimage.binary_opening(blue | green | black | grey, structure=np.ones((2, 2), bool))
    # Hematoxylin over DAB (immunostains) is dark grey too, in small patches: only wide dark areas are black ink.
    ink = ndimage.binary_opening(blue | green | black, structure=np.ones((2, 2), bool))
    radius = max(1, round(PEN_WIDE_DARK_MIN_WIDTH_UM / 2 / mpp))
    ink |= ndimage.binary_opening((vmax <= PEN_WIDE_DARK_MAX_VALUE) | grey, structure=morphology.disk(radius))
    return ink


def grid_coords(width: int, height: int, tile_level0: int, stride_level0: int) -> np.ndarray:
    """Level-0 (x, y) of every tile fully inside the slide, in row-major order; int64 (N, 2)."""
    if width < tile_level0 or height < tile_level0:
        return np.zeros((0, 2), dtype=np.int64)
    xs = np.arange(0, width - tile_level0 + 1, stride_level0, dtype=np.int64)
    ys = np.arange(0, height - tile_level0 + 1, stride_level0, dtype=np.int64)
    yy, xx = np.meshgrid(ys, xs, indexing="ij")
    return np.stack([xx.ravel(), yy.ravel()], axis=1)


def _box_means(values: np.ndarray, coords: np.ndarray, tile_level0: int, scale: float) -> np.ndarray:
    """Mean of `values` (a low-res map, `scale` level-0 px per px) over each tile's footprint."""
    if len(coords) == 0:
        return np.zeros(0, dtype=np.float32)
    integral = np.zeros((values.shape[0] + 1, values.shape[1] + 1), dtype=np.float64)
    integral[1:, 1:] = values.astype(np.float64).cumsum(0).cumsum(1)
    h, w = values.shape
    x0 = np.clip(np.floor(coords[:, 0] / scale + 0.5).astype(np.int64), 0, w - 1)
    y0 = np.clip(np.floor(coords[:, 1] / scale + 0.5).astype(np.int64), 0, h - 1)
    x1 = np.clip(np.floor((coords[:, 0] + tile_level0) / scale + 0.5).astype(np.int64), x0 + 1, w)
    y1 = np.clip(np.floor((coords[:, 1] + tile_level0) / scale + 0.5).astype(np.int64), y0 + 1, h)
    sums = integral[y1, x1] - integral[y0, x1] - integral[y1, x0] + integral[y0, x0]
    return (sums / ((x1 - x0) * (y1 - y0))).astype(np.float32)


def fraction_per_tile(mask: np.ndarray, coords: np.ndarray, tile_level0: int, scale: float) -> np.ndarray:
    """Share of each tile covered by `mask` (a boolean map with `scale` level-0 px per px)."""
    return _box_means(mask, coords, tile_level0, scale)


def blur_scores(rgb: np.ndarray, coords: np.ndarray, tile_level0: int, scale: float) -> np.ndarray:
    """Variance of the Laplacian of the grey image over each tile: low means out of focus."""
    gray = rgb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    lap = ndimage.laplace(gray)
    mean = _box_means(lap, coords, tile_level0, scale)
    mean_sq = _box_means(lap * lap, coords, tile_level0, scale)
    return np.maximum(mean_sq - mean.astype(np.float64) ** 2, 0.0).astype(np.float32)
