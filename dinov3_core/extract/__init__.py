"""Stage extract: per-tile features of a tile store → feature store."""

from dinov3_core.extract.config import ExtractConfig

__all__ = ["ExtractConfig"]
