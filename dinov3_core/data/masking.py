"""iBOT block masking (official DINOv3 scheme, docs/reference/dinov3.md#ibot-masking) and the per-batch mask bundle
the losses consume.

Per batch of S_g·B global crops: n = int(S_g·B·mask_probability) crops are masked, the i-th with ratio
linspace(min_ratio, max_ratio, n+1)[i+1], i.e. exactly int(ratio·N) of its N patches; the rest are unmasked;
the crop order is shuffled. Each masked crop is built from rectangular blocks (≥ `min_block_patches` target
area, aspect in [0.3, 1/0.3], ≤ `max_block_patches` new patches each) and, as in DINOv3 (not DINOv2), topped
up with random single patches when blocks stop fitting, so the count is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

RandomSource = np.random.Generator | torch.Generator | int | None


def as_numpy_rng(source: RandomSource) -> np.random.Generator:
    """A numpy Generator from a numpy Generator (used as is), a torch.Generator (one draw seeds it), a seed,
    or None (fresh OS entropy)."""
    if isinstance(source, np.random.Generator):
        return source
    if isinstance(source, torch.Generator):
        seed = torch.randint(0, 2**63 - 1, (1,), generator=source, device=source.device).item()
        return np.random.default_rng(seed)
    return np.random.default_rng(source)


class MaskingGenerator:
    """Block masks on an H×W patch grid (BEiT/iBOT style, as in dinov3/data/masking.py)."""

    def __init__(
        self,
        grid: int | tuple[int, int],
        *,
        max_block_patches: int | None = None,
        min_block_patches: int = 4,
        min_aspect: float = 0.3,
        max_aspect: float | None = None,
    ) -> None:
        """Args:
        grid: patch grid (H, W) or its side (224 px / 16 = 14).
        max_block_patches: most NEW patches one block may add; official 0.5·H·W (the default).
        min_block_patches: smallest target block area (official 4; rounding can yield 3).
        min_aspect, max_aspect: block aspect-ratio range; max defaults to 1/min_aspect.
        """
        self.height, self.width = (grid, grid) if isinstance(grid, int) else grid
        self.num_patches = self.height * self.width
        self.max_block_patches = int(0.5 * self.num_patches) if max_block_patches is None else max_block_patches
        self.min_block_patches = min_block_patches
        max_aspect = max_aspect or 1.0 / min_aspect
        self.log_aspect = (math.log(min_aspect), math.log(max_aspect))

    def add_block(self, mask: np.ndarray, max_new: int, rng: np.random.Generator) -> int:
        """Try (10 attempts) to add one rectangle adding 1…`max_new` new patches to `mask` in place.

        Returns:
            Patches newly masked (0 if no attempt fitted).
        """
        for _ in range(10):
            # Python's random.uniform(4, max_new) upstream also covers max_new < 4 (then [max_new, 4]).
            target_area = rng.uniform(*sorted((self.min_block_patches, max_new)))
            aspect = math.exp(rng.uniform(*self.log_aspect))
            h = round(math.sqrt(target_area / aspect))
            w = round(math.sqrt(target_area * aspect))
            if w < self.width and h < self.height:  # strict, as upstream: a block never spans the grid
                top = int(rng.integers(0, self.height - h + 1))
                left = int(rng.integers(0, self.width - w + 1))
                window = mask[top : top + h, left : left + w]
                new = h * w - int(window.sum())
                if 0 < new <= max_new:
                    window[...] = True
                    return new
        return 0

    def __call__(self, n_masked: int, rng: np.random.Generator) -> np.ndarray:
        """Mask of exactly `n_masked` patches: blocks first, then random single patches to top up.

        Returns:
            bool [H, W].
        """
        if not 0 <= n_masked <= self.num_patches:
            raise ValueError(f"cannot mask {n_masked} of {self.num_patches} patches")
        mask = np.zeros((self.height, self.width), dtype=bool)
        count = 0
        while count < n_masked:
            added = self.add_block(mask, min(n_masked - count, self.max_block_patches), rng)
            if added == 0:
                break
            count += added
        if count < n_masked:
            free = np.flatnonzero(~mask)
            mask.flat[rng.choice(free, size=n_masked - count, replace=False)] = True
        return mask


@dataclass(frozen=True)
class IBOTMasks:
    """The masks of one batch of global crops plus what iBOT needs from them, computed once on the host.

    Crops are crop-major, matching `torch.cat(global_crops)`: row c·B + b is global crop c of image b.
    Flat patch index i·N + p addresses `patch_tokens.flatten(0, 1)` of the stacked [S_g·B, N, D] output.
    """

    masks: Tensor  # bool [S_g·B, N]
    mask_indices: Tensor  # int64 [M]: flat indices of masked patches, ascending
    masks_weight: Tensor  # fp32 [M]: 1/(#masked patches in the crop of each masked patch)
    n_global_crops: int

    @classmethod
    def from_masks(cls, masks: Tensor, n_global_crops: int) -> IBOTMasks:
        """Bundle a bool [S_g·B, N] mask tensor."""
        if masks.ndim != 2 or masks.dtype != torch.bool or masks.shape[0] % n_global_crops:
            raise ValueError(f"masks must be bool [S_g·B, N], got {masks.dtype} {tuple(masks.shape)}")
        per_crop = masks.sum(dim=1, keepdim=True).clamp_min(1).float()  # [S_g·B, 1]
        return cls(
            masks=masks,
            mask_indices=masks.flatten().nonzero().flatten(),
            masks_weight=(1.0 / per_crop).expand_as(masks)[masks],
            n_global_crops=n_global_crops,
        )

    @property
    def n_crops(self) -> int:
        """S_g·B: the iBOT loss normaliser."""
        return self.masks.shape[0]

    @property
    def batch_size(self) -> int:
        return self.masks.shape[0] // self.n_global_crops

    @property
    def n_masked_patches(self) -> int:
        """M (from the shape: no device sync)."""
        return self.mask_indices.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> IBOTMasks:
        move = {"device": device, "non_blocking": non_blocking}
        return IBOTMasks(
            self.masks.to(**move),
            self.mask_indices.to(**move),
            self.masks_weight.to(**move),
            self.n_global_crops,
        )

    def microbatch(self, index: int, n_microbatches: int) -> tuple[IBOTMasks, Tensor]:
        """Masks of images [index·b, (index+1)·b) with b = B/n_microbatches, for gradient accumulation.

        Returns:
            (micro-batch masks, int64 [M_micro] positions of its masked patches within this step's M masked
            patches) — use the latter to slice step-level iBOT teacher targets: `targets[positions]`.
        """
        if self.batch_size % n_microbatches or not 0 <= index < n_microbatches:
            raise ValueError(f"cannot take micro-batch {index} of {n_microbatches} from batch {self.batch_size}")
        if n_microbatches == 1:  # the whole step: no data-dependent indexing (a graph break under torch.compile)
            return self, torch.arange(self.n_masked_patches, device=self.mask_indices.device)
        b = self.batch_size // n_microbatches
        grid = self.masks.view(self.n_global_crops, self.batch_size, -1)
        # Rank of every masked patch in the step's flattened order; crops keep their relative order.
        rank = torch.cumsum(self.masks.flatten(), 0).view_as(grid) - 1
        micro = grid[:, index * b : (index + 1) * b]
        positions = rank[:, index * b : (index + 1) * b][micro]
        return IBOTMasks.from_masks(micro.reshape(-1, grid.shape[-1]), self.n_global_crops), positions


class IBOTMaskSampler:
    """Draws the per-batch iBOT masks (official defaults: ratios 0.1–0.5, half of the crops masked)."""

    def __init__(
        self,
        grid: int | tuple[int, int],
        *,
        mask_ratio: tuple[float, float] = (0.1, 0.5),
        mask_probability: float = 0.5,
        generator: MaskingGenerator | None = None,
    ) -> None:
        if not 0.0 <= mask_ratio[0] < mask_ratio[1] <= 1.0:
            raise ValueError(f"mask_ratio must satisfy 0 <= min < max <= 1, got {mask_ratio}")
        if not 0.0 <= mask_probability <= 1.0:
            raise ValueError(f"mask_probability must be in [0, 1], got {mask_probability}")
        self.block_masks = generator or MaskingGenerator(grid)
        self.mask_ratio = mask_ratio
        self.mask_probability = mask_probability

    def __call__(self, batch_size: int, n_global_crops: int = 2, rng: RandomSource = None) -> IBOTMasks:
        """Masks for `n_global_crops`·`batch_size` crops (crop-major), deterministic given `rng`."""
        rng = as_numpy_rng(rng)
        n_crops = n_global_crops * batch_size
        n_patches = self.block_masks.num_patches
        n_masked_crops = int(n_crops * self.mask_probability)
        ratios = np.linspace(*self.mask_ratio, n_masked_crops + 1)[1:]
        masks = np.zeros((n_crops, n_patches), dtype=bool)
        for row, ratio in enumerate(ratios):
            masks[row] = self.block_masks(int(n_patches * ratio), rng).ravel()
        masks = masks[rng.permutation(n_crops)]
        return IBOTMasks.from_masks(torch.from_numpy(masks), n_global_crops)
