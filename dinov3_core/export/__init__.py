"""Model hand-off stages: convert (DCP → released backbone), export (→ ONNX) and extract (tile features)."""

from dinov3_core.export.config import ConvertConfig, ExportConfig, ExtractConfig

__all__ = ["ConvertConfig", "ExportConfig", "ExtractConfig"]
