"""timm reads the converted backbone (released DINOv3 layout) through its own checkpoint filter and gives the same
features. timm needs torchvision, and no CPU torchvision wheel matches this project's CPU torch pin on the build
machine's index: the test skips there and runs wherever timm imports (e.g. a GPU worker with CUDA torchvision)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dinov3_core.inference.backbone import INFERENCE_OVERRIDES, BackboneFeatures
from dinov3_core.models import build_backbone, save_backbone

timm = pytest.importorskip("timm", reason="timm needs torchvision (no CPU wheel beside the CPU torch pin here)")


def test_timm_loads_the_released_layout_and_gives_the_same_features(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ours = build_backbone("vits16", **INFERENCE_OVERRIDES).eval()
    with torch.no_grad():  # layer scale 1: every block changes the output, so a wrong mapping cannot hide
        for block in ours.blocks:
            block.ls1.gamma.fill_(1.0)
            block.ls2.gamma.fill_(1.0)
    weights = save_backbone(ours, tmp_path / "backbone.pth")
    model = timm.create_model(
        "vit_small_patch16_dinov3_qkvb",
        pretrained=True,
        num_classes=0,
        global_pool="token",
        pretrained_cfg_overlay={"file": str(weights)},
    ).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = model.forward_features(x)  # [B, 1 + 4 registers + patches, D], after the final norm
        cls, patch = BackboneFeatures(ours)(x)
    assert float((tokens[:, 0] - cls).abs().max()) < 1e-4 + 1e-5 * float(cls.abs().max())
    assert float((tokens[:, 5:] - patch).abs().max()) < 1e-4 + 1e-5 * float(patch.abs().max())
