"""Optimizer parameter groups with layer-wise learning-rate decay and the no-weight-decay rule
(docs/reference/dinov3.md#parameter-groups).

Works on any module whose parameter names follow DINOv3 (`backbone.blocks.3.attn.qkv.weight`,
`backbone.patch_embed.proj.weight`, `dino_head.mlp.0.weight`, …), including names wrapped by FSDP,
activation checkpointing, torch.compile or DDP.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import nn

# Wrapper tokens inserted into parameter names by FSDP1, checkpoint_wrapper and torch.compile.
_WRAPPER_TOKENS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
# Parameters before the first block: layer 0, decayed the most.
_EMBEDDING = re.compile(r"(?:^|\.)(patch_embed|cls_token|storage_tokens|register_tokens|mask_token|pos_embed)(?:\.|$)")


def clean_param_name(name: str) -> str:
    """Parameter name without wrapper prefixes (FSDP1, activation checkpointing, compile, DDP `module.`)."""
    for token in _WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name.removeprefix("module.")


def count_blocks(names: Iterable[str]) -> int:
    """Number of transformer blocks: 1 + the largest `blocks.<i>.` index (0 if none)."""
    indices = [int(m.group(1)) for name in names if (m := _BLOCK.search(name))]
    return max(indices) + 1 if indices else 0


def layer_id(name: str, n_blocks: int) -> int:
    """0 for patch embedding and learned tokens, i+1 for `blocks.i`, n_blocks+1 for everything else (final
    norms, heads)."""
    if _EMBEDDING.search(name):
        return 0
    if match := _BLOCK.search(name):
        return int(match.group(1)) + 1
    return n_blocks + 1


def lr_multiplier(name: str, n_blocks: int, layer_decay: float, patch_embed_lr_mult: float) -> float:
    """layer_decay^(n_blocks + 1 − layer_id), times `patch_embed_lr_mult` for the patch embedding."""
    mult = layer_decay ** (n_blocks + 1 - layer_id(name, n_blocks))
    return mult * patch_embed_lr_mult if "patch_embed" in name else mult


def wd_multiplier(name: str) -> float:
    """0 for biases, norm parameters and layer-scale gammas; learned tokens ARE decayed (as upstream)."""
    return 0.0 if name.endswith("bias") or "norm" in name or "gamma" in name else 1.0


def build_param_groups(
    model: nn.Module,
    *,
    layer_decay: float = 0.9,
    patch_embed_lr_mult: float = 0.2,
    n_blocks: int | None = None,
) -> list[dict[str, Any]]:
    """Parameter groups for `torch.optim.AdamW`, one per distinct (lr, wd, last-layer) setting.

    The trainer multiplies the scheduled lr / weight decay by each group's `lr_multiplier` /
    `wd_multiplier` every iteration, and may freeze groups with `is_last_layer` (the heads' `last_layer`)
    during the first epoch.

    Args:
        model: e.g. the student `ModuleDict(backbone=…, dino_head=…, ibot_head=…)` or a bare backbone.
        layer_decay: per-block lr decay (official 0.9; 1.0 disables it).
        patch_embed_lr_mult: extra factor for `patch_embed` (official 0.2).
        n_blocks: number of transformer blocks; inferred from the names if None.
    Returns:
        Groups in first-appearance order: {"params": [Parameter], "names": [str], "lr_multiplier": float,
        "wd_multiplier": float, "is_last_layer": bool}. Frozen parameters (requires_grad False) are left out.
    """
    named = [(clean_param_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    if n_blocks is None:
        n_blocks = count_blocks(name for name, _ in named)
    groups: dict[tuple[float, float, bool], dict[str, Any]] = {}
    for name, param in named:
        key = (
            lr_multiplier(name, n_blocks, layer_decay, patch_embed_lr_mult),
            wd_multiplier(name),
            "last_layer" in name,
        )
        group = groups.setdefault(
            key,
            {
                "params": [],
                "names": [],
                "lr_multiplier": key[0],
                "wd_multiplier": key[1],
                "is_last_layer": key[2],
            },
        )
        group["params"].append(param)
        group["names"].append(name)
    return list(groups.values())
