"""Data loading: the tile-store dataset."""

from dinov3_core.data.tile_dataset import TileDataset, TileSample

__all__ = ["TileDataset", "TileSample"]
