"""Cohort stain statistics and RandStainNA-style stain re-targeting (Shen et al. 2022), batched on tensors.

The tile stage records every slide's CIELAB mean and std (`dinov3_core.tiling.stain`, docs/tile-store.md).
`CohortStain.from_dataset` fits one Gaussian per channel over the slides the run trains on, for the mean and for the
(per-tile) std; the augmentation then draws a target per image and re-targets its LAB statistics:

    x_lab' = (x_lab − μ_image) / σ_image · σ_target + μ_target

with μ_image, σ_image of the image itself (step 2a of `dinov3_core.data.photometric`, before the HED jitter:
normalise to a cohort-typical stain, then jitter around it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dinov3_core.data.augment_config import AugmentationConfig
from dinov3_core.data.augment_random import Random
from dinov3_core.tiling.stain import WHITE_D65, XYZ_FROM_RGB

logger = logging.getLogger(__name__)

_XYZ_FROM_RGB = torch.tensor(XYZ_FROM_RGB, dtype=torch.float64)
_RGB_FROM_XYZ = torch.linalg.inv(_XYZ_FROM_RGB)  # once, on CPU: no linalg solver initialisation on the GPU
_WHITE = torch.tensor(WHITE_D65, dtype=torch.float64)
_EPS_STD = 1e-3  # LAB units: a flat image (σ≈0) keeps its pixels instead of being divided by ~0


@dataclass(frozen=True)
class CohortStain:
    """Per-channel (L, a, b) Gaussians of the slides' recorded stain statistics: the distribution targets are drawn
    from. `*_spread` is the std over slides (0 for a one-slide cohort: the target is then that slide's)."""

    mean_center: tuple[float, float, float]
    mean_spread: tuple[float, float, float]
    std_center: tuple[float, float, float]
    std_spread: tuple[float, float, float]
    n_slides: int

    @classmethod
    def from_slide_stats(cls, means: list[list[float]], stds: list[list[float]]) -> CohortStain:
        m, s = torch.tensor(means, dtype=torch.float64), torch.tensor(stds, dtype=torch.float64)
        spread = (lambda t: t.std(0, unbiased=False)) if len(m) > 1 else torch.zeros_like

        def t3(t: Tensor) -> tuple[float, float, float]:
            return (float(t[0]), float(t[1]), float(t[2]))

        return cls(t3(m.mean(0)), t3(spread(m)), t3(s.mean(0)), t3(spread(s)), len(m))

    @classmethod
    def from_dataset(cls, dataset: Any) -> CohortStain | None:
        """The cohort of a `TileDataset`'s slides, from their recorded attributes. None — with one log line — when
        no slide has them (stores tiled before the tile stage recorded stains): the step is then skipped. Slides
        without stats among others that have them are left out of the fit (logged as well)."""
        means, stds, missing = [], [], []
        for s, slide_id in enumerate(dataset.slide_ids):
            attrs = dataset.slide_attrs(s)
            if "stain_lab_mean" in attrs and "stain_lab_tile_std" in attrs:
                means.append(attrs["stain_lab_mean"])
                stds.append(attrs["stain_lab_tile_std"])
            else:
                missing.append(slide_id)
        if not means:
            logger.warning(
                "crops.stain_norm_p: no slide of %s has stain statistics (tiled before wsidino recorded them); "
                "stain re-targeting is off for this run — re-tile the stores to turn it on",
                ", ".join(str(p) for p in dataset.stores),
            )
            return None
        if missing:
            logger.warning(
                "crops.stain_norm_p: %d of %d slides have no stain statistics (e.g. %s) and are left out of the "
                "cohort's stain distribution — re-tile them to include them",
                len(missing),
                len(dataset.slide_ids),
                missing[0],
            )
        return cls.from_slide_stats(means, stds)


# ------------------------------------------------------------------------------------------- colour space


def rgb_to_lab(x: Tensor) -> Tensor:
    """[n, 3, h, w] sRGB in [0, 1] → CIELAB (D65, 2°), skimage.color.rgb2lab's formulas, in x's dtype."""
    linear = torch.where(x > 0.04045, ((x + 0.055) / 1.055).pow(2.4), x / 12.92)
    matrix = (_XYZ_FROM_RGB / _WHITE.unsqueeze(1)).to(x.device, x.dtype)  # rows scaled by the white point
    xyz = torch.einsum("ij,njhw->nihw", matrix, linear)
    f = torch.where(xyz > 0.008856, xyz.clamp_min(0).pow(1 / 3), 7.787 * xyz + 16 / 116)
    fx, fy, fz = f.unbind(1)
    return torch.stack([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)], 1)


def lab_to_rgb(lab: Tensor) -> Tensor:
    """CIELAB → [n, 3, h, w] sRGB clipped to [0, 1] (skimage.color.lab2rgb's formulas; out-of-gamut colours clip)."""
    L, a, b = lab.unbind(1)
    fy = (L + 16) / 116
    f = torch.stack([fy + a / 500, fy, (fy - b / 200).clamp_min(0)], 1)
    xyz = torch.where(f > 0.2068966, f.pow(3), (f - 16 / 116) / 7.787)
    matrix = (_RGB_FROM_XYZ * _WHITE.unsqueeze(0)).to(lab.device, lab.dtype)  # columns scaled by the white point
    linear = torch.einsum("ij,njhw->nihw", matrix, xyz).clamp_(0, 1)
    return torch.where(linear > 0.0031308, 1.055 * linear.pow(1 / 2.4) - 0.055, 12.92 * linear).clamp_(0, 1)


def retarget(x: Tensor, target_mean: Tensor, target_std: Tensor) -> Tensor:
    """Give each RGB image the LAB mean/std of its target: x_lab' = (x_lab − μ)/σ · σ_target + μ_target.

    Args:
        x: [n, 3, h, w] RGB in [0, 1].
        target_mean, target_std: [n, 3] per image, LAB units.
    Returns:
        [n, 3, h, w] RGB in [0, 1] (new tensor); exact in LAB up to the gamut clip.
    """
    lab = rgb_to_lab(x)
    mean = lab.mean(dim=(2, 3), keepdim=True)
    std = lab.std(dim=(2, 3), keepdim=True, unbiased=False).clamp_min(_EPS_STD)
    lab = (lab - mean) * (target_std.view(-1, 3, 1, 1) / std) + target_mean.view(-1, 3, 1, 1)
    return lab_to_rgb(lab)


def stain_norm(x: Tensor, cfg: AugmentationConfig, cohort: CohortStain | None, rand: Random) -> None:
    """In place: `retarget` with probability `stain_norm_p` to a target ~ the cohort's Gaussians widened by
    `stain_norm_sigma_scale`. Draws nothing when the step is off (p = 0 or no cohort), so the rest of the
    pipeline's draws — and its output — are those of a run without it."""
    if cohort is None or cfg.stain_norm_p == 0.0:
        return
    n = x.shape[0]
    apply = rand.bernoulli(cfg.stain_norm_p, n)
    z_mean, z_std = rand.normal(n, 3), rand.normal(n, 3)
    device = x.device
    k = cfg.stain_norm_sigma_scale
    target_mean = (
        torch.tensor(cohort.mean_center, device=device) + k * torch.tensor(cohort.mean_spread, device=device) * z_mean
    )
    std_center = torch.tensor(cohort.std_center, device=device)
    target_std = std_center + k * torch.tensor(cohort.std_spread, device=device) * z_std
    # A wide draw can reach σ ≤ 0 (flat or inverted images): keep at least a tenth of the cohort's typical σ.
    target_std = torch.maximum(target_std, 0.1 * std_center)
    index = apply.nonzero().squeeze(1)
    if index.numel():
        x.index_copy_(0, index, retarget(x[index], target_mean[index], target_std[index]))
