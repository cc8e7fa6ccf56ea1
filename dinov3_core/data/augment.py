"""Batched DINOv3 multi-crop augmentation for H&E tiles, on tensors, on the training device.

One call turns a batch of tiles into S_g global and S_l local crops per tile (official recipe,
docs/reference/dinov3.md#augmentation) with
every random choice made per image from one `torch.Generator`:

1. random-resized crop (one `grid_sample` per crop set, geometry from an affine grid per crop) composed
   with a random element of the dihedral group D4 — horizontal/vertical flips and 90° rotations, because
   tissue has no canonical orientation (upstream: horizontal flip only);
2. stain: re-targeting of the image's LAB statistics to a draw from the cohort's stain distribution (ours,
   RandStainNA, Shen et al. 2022; `dinov3_core.data.stain`, off by default), then HED stain jitter (ours;
   Ruifrok-Johnston colour deconvolution, per-image stain scale and shift);
3. colour jitter (brightness, contrast, saturation, hue in random per-image order, p=0.8), grayscale (p=0.2);
4. Gaussian blur with the INTENDED probabilities 1.0 / 0.1 / 0.5 (upstream passes 1−p to RandomApply and
   effectively blurs 0.0 / 0.9 / 0.5 — dinov3 #286);
5. solarize (global crop 2, p=0.2), then ImageNet normalisation.

Step 1 (crop geometry) lives here, steps 2–5 (colour and stain) in `dinov3_core.data.photometric`.

Deviations from torchvision's per-image pipeline, chosen for batched speed and documented here once:

* Resampling is `grid_sample` (bicubic by default, like upstream) at the output resolution, without
  antialiasing. For 224-px tiles the worst downscale is local crops, ×1.33, where aliasing is negligible.
  Larger tiles are first shrunk (antialiased) so that no crop is downscaled by more than `max_downscale`.
  Crop boxes are integer pixel boxes drawn exactly like `RandomResizedCrop.get_params`.
* Hue is a rotation of the chroma plane in YIQ space (a per-image 3×3 matrix) instead of an HSV round trip;
  same parameter range, similar effect, far cheaper. Each jitter op is still applied in its own random order
  slot and clamped to [0, 1] after it, as torchvision does.
* Work happens in float32 without the uint8 quantisation between PIL ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dinov3_core.data.augment_config import AugmentationConfig
from dinov3_core.data.augment_random import GroupedRandom, Random
from dinov3_core.data.photometric import photometric
from dinov3_core.data.stain import CohortStain


@dataclass(frozen=True)
class MultiCrops:
    """Augmented crops, crop-major: `global_stack[c, b]` is global crop c of image b."""

    global_stack: Tensor  # [S_g, B, 3, g, g]
    local_stack: Tensor  # [S_l, B, 3, l, l]

    @property
    def global_crops(self) -> list[Tensor]:
        """S_g tensors [B, 3, g, g] (views)."""
        return list(self.global_stack.unbind(0))

    @property
    def local_crops(self) -> list[Tensor]:
        """S_l tensors [B, 3, l, l] (views)."""
        return list(self.local_stack.unbind(0))


class MultiCropAugmentation:
    """Callable: tiles → `MultiCrops`. Stateless apart from its config and cohort; safe to share across threads.

    `stain`: the cohort's stain distribution (`CohortStain.from_dataset` of the training tiles) that
    `crops.stain_norm_p` re-targets to; None skips that step.
    """

    def __init__(self, config: AugmentationConfig | None = None, stain: CohortStain | None = None) -> None:
        self.config = config or AugmentationConfig()
        self.stain = stain

    def __call__(
        self, images: Tensor, generator: torch.Generator | Sequence[torch.Generator] | None = None
    ) -> MultiCrops:
        """Augment a batch.

        Args:
            images: uint8 [B, H, W, 3] (tile-store layout) or float [B, 3, H, W] in [0, 1], on any device.
            generator: source of all randomness (on CPU or on the images' device); None = torch's default.
                Same generator state, input and device → identical output. A sequence of G generators splits
                the batch into G equal groups of consecutive images, each drawn from its own generator: the
                same crops as G calls on the groups, in one call's time.
        Returns:
            `MultiCrops` in float32 on the images' device, normalised with `config.mean`/`config.std`.
        """
        # Pixels stay fp32 also when a caller embeds them under bf16 autocast (the health probe renders its views
        # inside the training step's autocast): autocast would move the stain matrices to bf16.
        with torch.autocast(images.device.type, enabled=False):
            if isinstance(generator, torch.Generator) or generator is None:
                return self._augment(images, Random(generator, images.device))
            return self._augment(images, GroupedRandom(list(generator), images.shape[0], images.device))

    def _augment(self, images: Tensor, rand: Random) -> MultiCrops:
        cfg = self.config
        x = _prescale(_to_float_bchw(images), cfg.global_size * cfg.max_downscale)

        globals_ = _random_resized_crops(x, cfg.n_global_crops, cfg.global_size, cfg.global_scale, cfg, rand)
        globals_ = photometric(
            globals_, torch.tensor(cfg.blur_p_global), torch.tensor(cfg.solarize_p_global), cfg, rand, self.stain
        )
        if cfg.n_local_crops:
            locals_ = _random_resized_crops(x, cfg.n_local_crops, cfg.local_size, cfg.local_scale, cfg, rand)
            blur_p = torch.full((cfg.n_local_crops,), cfg.blur_p_local)
            locals_ = photometric(locals_, blur_p, None, cfg, rand, self.stain)
        else:
            locals_ = x.new_empty(0, x.shape[0], 3, cfg.local_size, cfg.local_size)
        return MultiCrops(globals_, locals_)


# ---------------------------------------------------------------------------------------------- geometry


def _to_float_bchw(images: Tensor) -> Tensor:
    if images.ndim != 4:
        raise ValueError(f"expected a batch of images, got shape {tuple(images.shape)}")
    if images.dtype == torch.uint8:
        if images.shape[-1] != 3:
            raise ValueError(f"uint8 images must be [B, H, W, 3], got {tuple(images.shape)}")
        return images.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format).div_(255.0)
    if not images.is_floating_point() or images.shape[1] != 3:
        raise ValueError(f"float images must be [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
    return images.to(torch.float32, memory_format=torch.contiguous_format)


def _prescale(x: Tensor, max_side: float) -> Tensor:
    """Shrink tiles larger than `max_side` once, with antialiasing, since `grid_sample` does not antialias."""
    h, w = x.shape[-2:]
    factor = max(h, w) / max_side
    if factor <= 1.0:
        return x
    size = (max(1, round(h / factor)), max(1, round(w / factor)))
    return F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False).clamp_(0.0, 1.0)


def _crop_boxes(
    n: int, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float], rand: Random
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`RandomResizedCrop.get_params` for n crops at once: 10 attempts each, first valid one wins, else the
    centre crop with the aspect ratio clamped. Returns (top, left, h, w), float [n] in pixels."""
    attempts = 10
    area = height * width
    target = area * rand.uniform(*scale, n, attempts)
    aspect = torch.exp(rand.uniform(math.log(ratio[0]), math.log(ratio[1]), n, attempts))
    w = torch.round(torch.sqrt(target * aspect))
    h = torch.round(torch.sqrt(target / aspect))
    u_top, u_left = rand.uniform(0.0, 1.0, n, attempts), rand.uniform(0.0, 1.0, n, attempts)
    valid = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = valid.float().argmax(dim=1, keepdim=True)  # index of the first valid attempt (0 if none)
    w, h, u_top, u_left = (t.gather(1, first).squeeze(1) for t in (w, h, u_top, u_left))
    top = torch.floor(u_top * (height - h + 1))
    left = torch.floor(u_left * (width - w + 1))

    # Fallback (no valid attempt): whole image with the aspect ratio clamped into range, centred.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        fw, fh = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        fw, fh = round(height * ratio[1]), height
    else:
        fw, fh = width, height
    ok = valid.any(dim=1)
    top = torch.where(ok, top, torch.full_like(top, (height - fh) // 2))
    left = torch.where(ok, left, torch.full_like(left, (width - fw) // 2))
    h = torch.where(ok, h, torch.full_like(h, fh))
    w = torch.where(ok, w, torch.full_like(w, fw))
    return top, left, h, w


def _dihedral_matrices(n: int, enabled: bool, rand: Random) -> Tensor:
    """[n, 2, 2] random elements of D4 acting on output (x, y): rotation by k·90° after an optional
    horizontal flip. Uniform over the 8 elements; with `enabled=False` only identity or horizontal flip."""
    flip = rand.bernoulli(0.5, n)
    k = rand.integers(4, n) if enabled else torch.zeros(n, dtype=torch.long, device=flip.device)
    flip_m = torch.diag_embed(torch.stack([torch.where(flip, -1.0, 1.0), torch.ones(n, device=flip.device)], 1))
    rot90 = torch.tensor([[0.0, -1.0], [1.0, 0.0]], device=flip.device)
    rotations = torch.stack([torch.linalg.matrix_power(rot90, i) for i in range(4)])  # [4, 2, 2], exact ±1/0
    return rotations[k] @ flip_m


def _random_resized_crops(
    x: Tensor, n_crops: int, size: int, scale: tuple[float, float], cfg: AugmentationConfig, rand: Random
) -> Tensor:
    """[B, 3, H, W] → [n_crops, B, 3, size, size] random-resized, flipped/rotated crops in [0, 1].

    One affine grid per crop maps output pixel centres into the crop box (align_corners=False convention,
    exactly like resizing the cropped box). All crops of an image are sampled by ONE `grid_sample` call by
    stacking their grids vertically, so the source batch is never repeated in memory.
    """
    b, _, height, width = x.shape
    n = n_crops * b  # parameters are drawn crop-major: row c·B + i is crop c of image i
    top, left, h, w = _crop_boxes(n, height, width, scale, cfg.aspect_ratio, rand)
    rotation = _dihedral_matrices(n, cfg.dihedral, rand)
    # Input normalised coords = diag(w/W, h/H) · R · output coords + box centre.
    theta = torch.empty(n, 2, 3, device=x.device)
    theta[:, :, :2] = torch.stack([w / width, h / height], 1).unsqueeze(-1) * rotation
    theta[:, 0, 2] = (2 * left + w) / width - 1
    theta[:, 1, 2] = (2 * top + h) / height - 1
    grid = F.affine_grid(theta, [n, 3, size, size], align_corners=False)  # [n, size, size, 2]
    grid = grid.view(n_crops, b, size, size, 2).transpose(0, 1).reshape(b, n_crops * size, size, 2)
    out = F.grid_sample(x, grid, mode=cfg.interpolation, padding_mode="border", align_corners=False)
    out = out.view(b, 3, n_crops, size, size).permute(2, 0, 1, 3, 4).contiguous()
    return out.clamp_(0.0, 1.0) if cfg.interpolation == "bicubic" else out  # bicubic overshoots


# ------------------------------------------------------------------------------------------- photometry
