"""The `crops` section of the pretrain config: `AugmentationConfig`, the multi-crop recipe that
`dinov3_core.data.augment` (geometry), `photometric` and `stain` (colour) read, and ImageNet's normalisation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dinov3_core.config import require

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class AugmentationConfig:
    """Multi-crop augmentation; defaults are the official DINOv3 recipe plus H&E-specific extras.

    This is the `crops` section of the pretrain config (`dinov3_core.train.config.CropsConfig` adds the iBOT
    mask and rng-group keys), checked on construction. Per-crop probabilities are tuples with one entry per
    global crop (the official recipe treats crop 1 and crop 2 differently); local crops share one value.
    """

    n_global_crops: int = 2
    n_local_crops: int = 8
    global_size: int = 224  # px
    local_size: int = 96  # px
    global_scale: tuple[float, float] = (0.32, 1.0)  # crop area as a share of the tile area
    local_scale: tuple[float, float] = (0.05, 0.32)
    aspect_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    interpolation: Literal["bilinear", "bicubic"] = "bicubic"
    max_downscale: float = 1.5  # larger tiles are pre-shrunk (antialiased) so no crop is downscaled more
    dihedral: bool = True  # D4 flips and rotations (tissue has no orientation); false: horizontal flip only
    # RandStainNA: with this probability an image's LAB mean/std are re-targeted to a draw from the cohort's
    # recorded stain statistics (needs stores tiled with stain statistics; without, the step is skipped).
    stain_norm_p: float = 0.0
    stain_norm_sigma_scale: float = 1.0  # widens (>1) or narrows (<1) the cohort's spread the targets are drawn from
    hed_p: float = 0.5
    hed_scale_sigma: float = 0.05  # stain multiplied by U(1−σ, 1+σ)
    hed_shift_sigma: float = 0.01  # stain shifted by U(−σ, σ), skimage rgb2hed units
    color_jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.2
    hue: float = 0.1
    grayscale_p: float = 0.2
    blur_p_global: tuple[float, ...] = (1.0, 0.1)
    blur_p_local: float = 0.5
    blur_kernel_size: int = 9
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    solarize_p_global: tuple[float, ...] = (0.0, 0.2)
    solarize_threshold: float = 128 / 255
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        require(self.n_global_crops >= 1, "n_global_crops", f"must be >= 1, got {self.n_global_crops}")
        require(self.n_local_crops >= 0, "n_local_crops", f"must be >= 0, got {self.n_local_crops}")
        for key in ("global_scale", "local_scale"):
            lo, hi = getattr(self, key)
            require(0.0 < lo <= hi <= 1.0, key, f"must satisfy 0 < min <= max <= 1, got {[lo, hi]}")
        lo, hi = self.aspect_ratio
        require(0.0 < lo <= hi, "aspect_ratio", f"must satisfy 0 < min <= max, got {[lo, hi]}")
        for key in ("blur_p_global", "solarize_p_global"):
            values = getattr(self, key)
            require(
                len(values) == self.n_global_crops,
                key,
                f"needs one probability per global crop ({self.n_global_crops}), got {list(values)}",
            )
            require(all(0.0 <= p <= 1.0 for p in values), key, f"must be probabilities in [0, 1], got {list(values)}")
        for key in ("stain_norm_p", "hed_p", "color_jitter_p", "grayscale_p", "blur_p_local"):
            require(0.0 <= getattr(self, key) <= 1.0, key, f"must be in [0, 1], got {getattr(self, key)}")
        require(
            self.stain_norm_sigma_scale >= 0.0,
            "stain_norm_sigma_scale",
            f"must be >= 0 (0 = always the cohort's centre), got {self.stain_norm_sigma_scale}",
        )
        require(self.blur_kernel_size % 2 == 1, "blur_kernel_size", f"must be odd, got {self.blur_kernel_size}")
        for key in ("global_size", "local_size"):
            require(
                getattr(self, key) > self.blur_kernel_size // 2,
                key,
                f"must be larger than half the blur kernel (reflect padding), got {getattr(self, key)}",
            )
        require(self.max_downscale >= 1.0, "max_downscale", f"must be >= 1, got {self.max_downscale}")


__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "AugmentationConfig"]
