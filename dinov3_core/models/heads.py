"""DINO / iBOT projection head, as in facebookresearch/dinov3 (keys `mlp.{0,2,4}.*`, `last_layer.weight`).

in_dim → hidden → ... → bottleneck MLP with GELU, L2-normalised, then a bias-free linear onto the prototypes.
DINOv3 dropped DINOv2's weight-normalised last layer: `last_layer` is a plain Linear.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _build_mlp(nlayers: int, in_dim: int, bottleneck_dim: int, hidden_dim: int, use_bn: bool, bias: bool) -> nn.Module:
    if nlayers == 1:
        return nn.Linear(in_dim, bottleneck_dim, bias=bias)
    layers: list[nn.Module] = []
    dims = [in_dim] + [hidden_dim] * (nlayers - 1)
    for d_in, d_out in itertools.pairwise(dims):
        layers.append(nn.Linear(d_in, d_out, bias=bias))
        if use_bn:
            layers.append(nn.BatchNorm1d(d_out))
        layers.append(nn.GELU())
    layers.append(nn.Linear(hidden_dim, bottleneck_dim, bias=bias))
    return nn.Sequential(*layers)


class DINOHead(nn.Module):
    def __init__(
        self,
        in_dim: int,
        out_dim: int = 65536,
        use_bn: bool = False,
        nlayers: int = 3,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        mlp_bias: bool = True,
    ) -> None:
        super().__init__()
        nlayers = max(nlayers, 1)
        self.in_dim, self.out_dim = in_dim, out_dim
        self.mlp = _build_mlp(nlayers, in_dim, bottleneck_dim, hidden_dim, use_bn, mlp_bias)
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)
        if not self.last_layer.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Upstream: trunc_normal(std 0.02) for every Linear (prototypes included), zero biases."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm1d):
                m.reset_parameters()

    def forward(self, x: Tensor, no_last_layer: bool = False, only_last_layer: bool = False) -> Tensor:
        if not only_last_layer:
            x = self.mlp(x)
            eps = 1e-6 if x.dtype == torch.float16 else 1e-12  # 1e-12 underflows in fp16
            x = F.normalize(x, dim=-1, p=2, eps=eps)
        if not no_last_layer:
            x = self.last_layer(x)
        return x
