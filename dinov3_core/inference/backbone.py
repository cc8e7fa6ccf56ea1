"""A converted / released backbone for inference: loaded from its weights file (`backbone.pth` or
`.safetensors`, architecture from the `config.yaml` convert writes beside it) and wrapped to return features."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn

from dinov3_core.errors import WsidinoError
from dinov3_core.models import DinoVisionTransformer, ReleasedWeightsError, load_released_backbone
from dinov3_core.models.state_dict_check import UnreadableWeights

__all__ = ["ARCH_FILE", "INFERENCE_OVERRIDES", "BackboneFeatures", "WeightsError", "load_backbone", "read_arch_config"]

ARCH_FILE = "config.yaml"  # beside a converted backbone: {"arch": ..., "backbone_kwargs": {...}}
INFERENCE_OVERRIDES = {"pos_embed_rope_dtype": "fp32"}


class WeightsError(WsidinoError):
    """A backbone weights file that is missing or does not fit its architecture."""


class BackboneFeatures(nn.Module):
    """forward(x) → (cls [B, D], patch tokens [B, N, D]), or pooled [B, 2D] = concat(cls, mean patch)."""

    def __init__(self, backbone: DinoVisionTransformer, pooled: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.pooled = pooled

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        out = self.backbone.forward_features(x)
        cls, patch = out["x_norm_clstoken"], out["x_norm_patchtokens"]
        if self.pooled:
            return torch.cat([cls, patch.mean(dim=1)], dim=-1)
        return cls, patch


def load_backbone(weights: str | os.PathLike[str], device: str = "cpu") -> DinoVisionTransformer:
    """The backbone of a converted / released weights file: arch from the adjacent `config.yaml` (written by
    convert), else inferred from the tensors. Eval mode, RoPE in fp32 (inference setting: bf16 Sin/Cos is not
    valid ONNX for ONNX Runtime; the RoPE periods are stored values, only the compute dtype changes)."""
    path = Path(weights)
    if not path.is_file():
        raise WeightsError(f"weights file {path} not found; give a backbone.pth written by `wsidino convert`")
    try:
        return load_released_backbone(path, read_arch_config(path), overrides=INFERENCE_OVERRIDES, device=device)
    except UnreadableWeights:
        raise
    except ReleasedWeightsError as err:
        raise WeightsError(
            f"weights file {path} does not fit its architecture ({path.parent / 'config.yaml'}):\n{err}"
        ) from None


def read_arch_config(weights: str | os.PathLike[str]) -> dict[str, Any] | None:
    """`backbone_kwargs` from the `config.yaml` beside a converted backbone, or None."""
    path = Path(weights).parent / ARCH_FILE
    if not path.is_file():
        return None
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise WeightsError(f"{path} is not valid YAML ({err}); delete it to infer the architecture") from None
    kwargs = doc.get("backbone_kwargs") if isinstance(doc, dict) else None
    return dict(kwargs) if isinstance(kwargs, dict) else None
