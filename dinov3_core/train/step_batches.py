"""Step batches: tiles and iBOT masks on the host (DataLoader workers), crops on the training device.

Every random choice is a pure function of (seed, stream position), never of how the step batch is split over
ranks or micro-batches:

* masks: which global crops of the step are masked, and with which ratio, follows one permutation of the
  step's S_g·B_global crops seeded by the step's first stream position (the official scheme,
  docs/reference/dinov3.md#ibot-masking); the
  mask of each crop has its own generator seeded by (step, crop row). A rank builds only its own crops' masks.
* crops: images are augmented in groups of `crops.rng_group_size` consecutive step positions, each group
  from a generator seeded by the stream position of its first image.
* drop path / RoPE jitter (the global torch RNG): reseeded per (iteration, rank) by the train loop.

So 1 process × 2B images, 1 process × 2 micro-batches of B, and 2 processes × 2 micro-batches of B/2 see the
same crops and masks, and a resumed run sees what an uninterrupted one would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from dinov3_core.data import TileDataset
from dinov3_core.data.augment import MultiCropAugmentation, MultiCrops
from dinov3_core.data.masking import IBOTMaskSampler, MaskingGenerator
from dinov3_core.data.tile_levels import LevelTiles
from dinov3_core.train.sampler import StepKey, StepSampler

# Independent random streams derived from the one configured seed.
MASK_STREAM, AUGMENT_STREAM, TORCH_STREAM = 1, 2, 3


def derive_seed(*words: int) -> int:
    """A 63-bit seed from integers (SeedSequence hashing: nearby inputs give unrelated seeds)."""
    state = np.random.SeedSequence([int(w) for w in words]).generate_state(2, np.uint64)
    return int((int(state[0]) << 32 ^ int(state[1])) & (2**63 - 1))


@dataclass(frozen=True)
class StepBatch:
    """One rank's share of one optimizer step, as read on the host."""

    iteration: int
    first_sample: int
    rank_offset: int
    images: Tensor  # uint8 [B_rank, T, T, 3]
    masks: Tensor  # bool [S_g·B_rank, N] crop-major (row c·B_rank + i: global crop c of image i)
    indices: Tensor  # int64 [B_rank] dataset indices

    def pin_memory(self) -> StepBatch:  # called by DataLoader(pin_memory=True)
        return StepBatch(
            self.iteration,
            self.first_sample,
            self.rank_offset,
            self.images.pin_memory(),
            self.masks.pin_memory(),
            self.indices,
        )


def rank_masks(
    sampler: IBOTMaskSampler, key: StepKey, *, seed: int, n_global_crops: int, count: int | None = None
) -> np.ndarray:
    """iBOT masks of this rank's global crops, bool [S_g·B_rank, N] crop-major, split-invariant.

    Equivalent to `IBOTMaskSampler(S_g·B_global crops)` followed by taking this rank's rows: the i-th row of
    the step is masked iff perm[i] < n_masked, with ratio linspace(min, max, n_masked+1)[1 + perm[i]].
    """
    count = len(key.indices) if count is None else count
    generator: MaskingGenerator = sampler.block_masks
    n_patches = generator.num_patches
    n_crops = n_global_crops * key.global_batch
    n_masked = int(n_crops * sampler.mask_probability)
    ratios = np.linspace(*sampler.mask_ratio, n_masked + 1)[1:]
    perm = np.random.default_rng([seed, MASK_STREAM, key.first_sample]).permutation(n_crops)
    rows = (np.arange(n_global_crops)[:, None] * key.global_batch + key.rank_offset + np.arange(count)).ravel()
    out = np.zeros((len(rows), n_patches), dtype=bool)
    for k in np.flatnonzero(perm[rows] < n_masked):  # Python loop over masked crops only: one mask each
        row = int(rows[k])
        rng = np.random.default_rng([seed, MASK_STREAM, key.first_sample, row])
        out[k] = generator(int(n_patches * ratios[perm[row]]), rng).ravel()
    return out


class StepTileSource(Dataset[StepBatch]):
    """`dataset[step_key]` → `StepBatch`: batched tile reads plus the step's masks (runs in loader workers)."""

    def __init__(
        self, tiles: TileDataset | LevelTiles, masks: IBOTMaskSampler, *, seed: int, n_global_crops: int
    ) -> None:
        self.tiles = tiles
        self.masks = masks
        self.seed = seed
        self.n_global_crops = n_global_crops

    def __len__(self) -> int:  # keys are not integers; the sampler defines the length
        return len(self.tiles)

    def __getitem__(self, key: StepKey) -> StepBatch:  # type: ignore[override]
        images = torch.from_numpy(self.tiles.read_batch(key.indices))
        masks = torch.from_numpy(rank_masks(self.masks, key, seed=self.seed, n_global_crops=self.n_global_crops))
        return StepBatch(key.iteration, key.first_sample, key.rank_offset, images, masks, torch.from_numpy(key.indices))


def build_loader(
    source: StepTileSource,
    sampler: StepSampler,
    *,
    num_workers: int,
    prefetch_factor: int,
    pin_memory: bool,
    multiprocessing_context: str | None,
) -> DataLoader[Any]:
    """A DataLoader yielding one `StepBatch` per step (no collation: each key is a whole batch already)."""
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs = {"prefetch_factor": prefetch_factor, "multiprocessing_context": multiprocessing_context}
    return DataLoader(
        source,  # type: ignore[arg-type]
        batch_size=None,
        sampler=sampler,  # type: ignore[arg-type]
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=_identity,
        persistent_workers=False,
        **kwargs,
    )


def _identity(batch: StepBatch) -> StepBatch:
    return batch


def augment_step(
    augmentation: MultiCropAugmentation,
    images: Tensor,
    *,
    seed: int,
    first_sample: int,
    rank_offset: int,
    group_size: int,
) -> MultiCrops:
    """Crops of a rank's step batch, group by group (see module docstring), on the images' device.

    Args:
        images: uint8 [B_rank, T, T, 3] on the training device.
    Returns:
        `MultiCrops` with global [S_g, B_rank, 3, g, g] and local [S_l, B_rank, 3, l, l].
    """
    if images.shape[0] % group_size or rank_offset % group_size:
        raise ValueError(f"rng group size {group_size} must divide the rank batch {images.shape[0]}")
    first = first_sample + rank_offset
    generators = [
        torch.Generator(device=images.device).manual_seed(derive_seed(seed, AUGMENT_STREAM, first + start))
        for start in range(0, images.shape[0], group_size)
    ]
    # One call for every group: each group's draws come from its own generator, the pixel work is batched.
    return augmentation(images, generators)
