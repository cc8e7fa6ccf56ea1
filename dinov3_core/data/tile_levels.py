"""Several µm/px levels of the same tile stores as one dataset: the levels' tiles concatenated, level by level.

Training's level mix (`data.mpp_weights`, `dinov3_core.train.sampler.LevelMix`) draws indices into this
concatenation; `read_batch` reads each level's share from its own `TileDataset` and keeps the batch order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dinov3_core.data.tile_dataset import TileDataset

__all__ = ["LevelTiles"]


class LevelTiles:
    """`datasets[k]` (one µm/px level each, the same tile size) as one index space: level k's tiles are
    `offsets[k]` … `offsets[k + 1]`."""

    def __init__(self, datasets: Sequence[TileDataset], mpps: Sequence[float]) -> None:
        if not datasets or len(datasets) != len(mpps):
            raise ValueError(f"one µm/px per level dataset: {len(datasets)} dataset(s), {len(mpps)} µm/px")
        sizes = {ds.tile_size for ds in datasets}
        if len(sizes) > 1:
            raise ValueError(f"the levels have different tile sizes {sorted(sizes)}; one batch needs one tile size")
        self.datasets = list(datasets)
        self.mpps = [float(m) for m in mpps]
        self.sizes = [len(ds) for ds in self.datasets]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def tile_size(self) -> int:
        return self.datasets[0].tile_size

    def level_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, np.asarray(indices, dtype=np.int64), side="right") - 1

    def read_batch(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """uint8 (B, T, T, 3) tiles in `indices` order, each read from its level's dataset."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"tile index out of range for {len(self)} tiles over {len(self.datasets)} levels")
        level = self.level_of(idx)
        out = np.empty((len(idx), self.tile_size, self.tile_size, 3), dtype=np.uint8)
        for k in np.unique(level):
            where = np.flatnonzero(level == k)
            out[where] = self.datasets[int(k)].read_batch(idx[where] - self.offsets[k])
        return out
