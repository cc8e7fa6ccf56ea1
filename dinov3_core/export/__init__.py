"""Stage export: released-layout backbone → ONNX (and optionally a Hugging Face model directory)."""

from dinov3_core.export.config import ExportConfig

__all__ = ["ExportConfig"]
