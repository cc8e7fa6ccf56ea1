"""Stage convert: DCP training checkpoint → released-layout backbone."""

from dinov3_core.convert.config import ConvertConfig

__all__ = ["ConvertConfig"]
