"""Typed config of the export stage (load with `dinov3_core.config.load_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omegaconf import MISSING

from dinov3_core.tracking import TrackingConfig


@dataclass
class ExportConfig:
    """Released-layout backbone → ONNX returning (cls [B, D], patch tokens [B, N, D]) or pooled [B, 2D]."""

    weights: str = MISSING  # backbone.pth / .safetensors (arch from the adjacent config.yaml, else inferred)
    output: str = MISSING  # model.onnx path (external data beside it as <name>.data when needed)
    pooled: bool = False  # one output: concat(cls, mean patch token)
    fp16: bool = False  # also write <stem>_fp16.onnx (half weights and activations; no strict parity check)
    opset: int | None = None  # null → the exporter's default (20)
    max_side: int = 4096  # upper bound for the dynamic height / width (pixels)
    example_size: int = 64  # image side of the tracing example (a multiple of the patch size)
    external_data: Literal["auto", "always", "never"] = "auto"  # auto: when the model is > 1.8 GB
    timeout_s: float = 1800.0  # the export runs in a spawned process, killed after this
    parity_sizes: list[int] = field(default_factory=lambda: [32, 64])  # image sides checked against PyTorch
    parity_batches: list[int] = field(default_factory=lambda: [1, 3])
    # fp32 parity gate, per output: max abs error ≤ parity_tolerance + parity_rtol × the output's scale (max |PyTorch
    # output|), so it means the same for a random model (|x| ~ 1) and a trained one (LayerNorm'd tokens ~ 10).
    parity_tolerance: float = 1e-4
    parity_rtol: float = 1e-5
    # also write the backbone as a Hugging Face transformers model directory, `hf/` beside the ONNX file
    # (DINOv3ViTModel / AutoModel.from_pretrained, offline; needs the `hf` extra), checked like the ONNX model
    huggingface: bool = False
    register_name: str = "wsidino-backbone"  # MLflow registered model name (when tracking.enabled)
    register_alias: str = "candidate"
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
