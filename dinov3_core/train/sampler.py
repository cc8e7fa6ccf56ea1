"""Which tiles each rank trains on at each iteration: one global sample stream, cut into step batches.

The stream is the concatenation of per-epoch permutations of the dataset, epoch e drawn by
`np.random.default_rng([seed, e]).permutation(n)` (vectorised, no per-element Python). Optimizer step t takes
the next `global_batch` positions of the stream; rank r takes the r-th contiguous block of them. Because the
stream does not depend on the number of ranks, a run resumes on another world size at exactly the next
sample: the whole state is the number of samples consumed (reported as epoch + position).

With several µm/px levels (`data.mpp_weights`), the dataset is the levels' tiles concatenated and the stream is
still a pure function of position: it is cut into blocks of `LEVEL_BLOCK` positions; each block holds every level's
fixed quota (its weight × the block, largest remainder), in an order drawn by `default_rng([seed, LEVEL_SALT,
block])`; the j-th draw of level k overall takes position j of that level's own stream of per-epoch permutations
(`default_rng([seed, LEVEL_SALT, k, epoch])`). The draws of level k before a block are `block × quota`, so any
position maps to its tile without looking at the positions before it (`LevelMix`).

The sampler yields `StepKey`s (what to load for one step on this rank) to a DataLoader with
`batch_size=None`; the dataset (`step_batches.StepTileSource`) turns a key into a step batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Sampler

from dinov3_core.errors import WsidinoError


@dataclass(frozen=True)
class StepKey:
    """One optimizer step's worth of samples for one rank."""

    iteration: int
    first_sample: int  # stream position of the step's first image (over all ranks)
    rank_offset: int  # position of this rank's first image within the step batch
    global_batch: int
    indices: np.ndarray  # int64 [rank batch] dataset indices, in step-batch order


@dataclass(frozen=True)
class SamplerState:
    """Samples consumed so far; epoch and position are derived, for humans and for the checkpoint."""

    consumed_samples: int
    dataset_size: int
    seed: int

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.dataset_size

    @property
    def position(self) -> int:
        return self.consumed_samples % self.dataset_size

    def to_dict(self) -> dict[str, int]:
        return {
            "consumed_samples": self.consumed_samples,
            "epoch": self.epoch,
            "position": self.position,
            "dataset_size": self.dataset_size,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, state: dict[str, int], dataset_size: int) -> SamplerState:
        """Resume state for a dataset of `dataset_size` tiles. If the dataset changed size since the checkpoint,
        the run continues at the same epoch and (clamped) position: exact resumption is then impossible."""
        if int(state["dataset_size"]) == dataset_size:
            return cls(int(state["consumed_samples"]), dataset_size, int(state["seed"]))
        position = min(int(state["position"]), dataset_size - 1)
        return cls(int(state["epoch"]) * dataset_size + position, dataset_size, int(state["seed"]))


class StepSampler(Sampler[StepKey]):
    """Infinite-stream step sampler, sharded over ranks and resumable at any step.

    Args:
        dataset_size: tiles in the dataset.
        global_batch: images per optimizer step over all ranks (a multiple of `world_size`).
        rank, world_size: this rank's block of each step batch.
        seed: stream seed (the same on every rank).
        start_iteration, start_sample: the first step to yield and its stream position (resume state).
        stop_iteration: yield steps up to, not including, this iteration.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        start_iteration: int = 0,
        start_sample: int = 0,
        stop_iteration: int,
        levels: LevelMix | None = None,
    ) -> None:
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not a multiple of the world size {world_size}")
        check_dataset_size(dataset_size, global_batch)
        self.dataset_size = dataset_size
        self.global_batch = global_batch
        self.rank_batch = global_batch // world_size
        self.rank = rank
        self.seed = seed
        self.start_iteration = start_iteration
        self.start_sample = start_sample
        self.stop_iteration = stop_iteration
        self._perm_cache: dict[int, np.ndarray] = {}
        self.levels = levels  # several µm/px levels: the stream draws from them by weight (indices into their concat)

    def __len__(self) -> int:
        return max(0, self.stop_iteration - self.start_iteration)

    def __iter__(self) -> Iterator[StepKey]:
        for iteration in range(self.start_iteration, self.stop_iteration):
            first = self.start_sample + (iteration - self.start_iteration) * self.global_batch
            offset = self.rank * self.rank_batch
            yield StepKey(iteration, first, offset, self.global_batch, self.stream(first + offset, self.rank_batch))

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            dtype = np.int32 if self.dataset_size < 2**31 else np.int64
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size).astype(dtype)
            # Two epochs suffice: a step batch never spans more (check_dataset_size).
            self._perm_cache = {k: v for k, v in self._perm_cache.items() if k == epoch - 1}
            self._perm_cache[epoch] = perm
        return perm

    def stream(self, start: int, count: int) -> np.ndarray:
        """Dataset indices at stream positions [start, start + count), int64."""
        if self.levels is not None:
            return self.levels.stream(start, count)
        parts = []
        while count > 0:
            epoch, position = divmod(start, self.dataset_size)
            take = min(count, self.dataset_size - position)
            parts.append(self.epoch_permutation(epoch)[position : position + take])
            start += take
            count -= take
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)

    def state_after(self, iteration: int) -> SamplerState:
        """State once step `iteration` has been trained (what a checkpoint written after it records)."""
        consumed = self.start_sample + (iteration + 1 - self.start_iteration) * self.global_batch
        return SamplerState(consumed, self.dataset_size, self.seed)


def check_dataset_size(dataset_size: int, global_batch: int) -> None:
    if dataset_size < global_batch:
        raise WsidinoError(
            f"the tile store(s) hold {dataset_size} tiles, fewer than one global batch of {global_batch}: "
            "add slides to data.stores, or lower train.global_batch_size / train.batch_size_per_gpu"
        )


LEVEL_BLOCK = 1024  # stream positions per block of the level mix: weights hold exactly to 1/1024 in every block
LEVEL_SALT = 0x4D5050  # "MPP": keeps the level streams apart from the single-level stream's seeds


class LevelMix:
    """The sample stream over several µm/px levels: level k (`sizes[k]` tiles, indices `offsets[k]` … in the
    concatenated dataset) takes `quotas[k]` of every `LEVEL_BLOCK` positions. A pure function of stream position."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int = 0) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"one weight per level: {len(sizes)} level(s), {len(weights)} weight(s)")
        if min(sizes) <= 0 or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(
                f"levels need tiles and weights >= 0 with a positive sum (sizes {sizes}, weights {weights})"
            )
        self.sizes = [int(n) for n in sizes]
        self.seed = seed
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.quotas = level_quotas(weights, LEVEL_BLOCK)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def block_levels(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(level of each position of the block, its rank among the block's positions of that level)."""
        pattern = np.repeat(np.arange(len(self.quotas)), self.quotas)
        pattern = np.random.default_rng([self.seed, LEVEL_SALT, block]).permutation(pattern)
        rank = np.empty(LEVEL_BLOCK, dtype=np.int64)
        for k in range(len(self.quotas)):
            where = np.flatnonzero(pattern == k)
            rank[where] = np.arange(len(where))
        return pattern, rank

    def _level_perm(self, level: int, epoch: int) -> np.ndarray:
        key = (level, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = np.random.default_rng([self.seed, LEVEL_SALT, level, epoch]).permutation(self.sizes[level])
            self._perms = {k: v for k, v in self._perms.items() if k[0] != level or k[1] == epoch - 1}
            self._perms[key] = perm
        return perm

    def stream(self, start: int, count: int) -> np.ndarray:
        """Indices into the concatenated levels at stream positions [start, start + count), int64."""
        positions = np.arange(start, start + count, dtype=np.int64)
        out = np.empty(count, dtype=np.int64)
        blocks = positions // LEVEL_BLOCK
        for block in np.unique(blocks):
            sel = np.flatnonzero(blocks == block)
            pattern, rank = self.block_levels(int(block))
            slots = positions[sel] - int(block) * LEVEL_BLOCK
            level = pattern[slots]
            draw = int(block) * self.quotas[level] + rank[slots]  # the level's own stream position
            for k in np.unique(level):
                mine = level == k
                epoch, pos = np.divmod(draw[mine], self.sizes[k])
                local = np.empty(len(pos), dtype=np.int64)
                for e in np.unique(epoch):
                    local[epoch == e] = self._level_perm(int(k), int(e))[pos[epoch == e]]
                out[sel[mine]] = self.offsets[k] + local
        return out

    def level_of(self, indices: np.ndarray) -> np.ndarray:
        """The level of each concatenated-dataset index."""
        return np.searchsorted(self.offsets, np.asarray(indices), side="right") - 1


def level_quotas(weights: Sequence[float], block: int) -> np.ndarray:
    """Integer shares of `block` proportional to `weights` (largest remainder; ties to the earlier level)."""
    w = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    exact = w * block
    quotas = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - quotas), kind="stable")
    quotas[order[: block - int(quotas.sum())]] += 1
    return quotas
