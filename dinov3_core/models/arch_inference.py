"""Which `DinoVisionTransformer` constructor kwargs a weights file was written for, read off its keys and shapes.

`infer_backbone_kwargs` returns a released variant's full settings when the file's keys and shapes equal that
variant's, and otherwise derives each setting from the layout (FFN type and ratio from the ``mlp`` weights,
RoPE base or period range from ``rope_embed.periods``, bias / layer-scale / storage-token / untied-norm flags
from which keys exist). `resolve_arch` turns a user's ``arch`` argument (a name, a kwargs mapping, or None to
infer) into the (label, kwargs) every loader builds from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .state_dict_check import BLOCK_KEY, ReleasedWeightsError, key_shapes
from .vision_transformer import RELEASED, DinoVisionTransformer, backbone_kwargs

__all__ = ["infer_backbone_kwargs", "resolve_arch"]


def _swiglu_hidden(dim: int, ratio: float, align: int) -> int:
    d = int(int(dim * ratio) * 2 / 3)
    return d + (-d % align)


def _ffn_settings(sd: Mapping[str, Tensor], dim: int) -> dict[str, Any]:
    if "blocks.0.mlp.fc1.weight" in sd:
        hidden = sd["blocks.0.mlp.fc1.weight"].shape[0]
        ratio = hidden / dim
        while int(dim * ratio) < hidden:  # ratio·dim may round just below the integer
            ratio = math.nextafter(ratio, math.inf)
        return {"ffn_layer": "mlp", "ffn_ratio": ratio, "ffn_bias": "blocks.0.mlp.fc1.bias" in sd}
    if "blocks.0.mlp.w1.weight" in sd:
        hidden = sd["blocks.0.mlp.w1.weight"].shape[0]
        exact = hidden * 1.5 / dim
        ratios = [6.0, 3.0, 4.0, 2.0, 8.0, exact, math.nextafter(exact, math.inf)]
        for layer, align in (("swiglu", 8), ("swiglu32", 32), ("swiglu64", 64), ("swiglu128", 128)):
            for ratio in ratios:
                if _swiglu_hidden(dim, ratio, align) == hidden:
                    return {"ffn_layer": layer, "ffn_ratio": ratio, "ffn_bias": "blocks.0.mlp.w1.bias" in sd}
        raise ReleasedWeightsError(f"cannot express a SwiGLU hidden size of {hidden} for dim {dim}")
    raise ReleasedWeightsError("no blocks.0.mlp.fc1 or blocks.0.mlp.w1 weights: unknown FFN type")


def _rope_settings(periods: Tensor, head_dim: int) -> dict[str, Any]:
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(periods.dtype, "fp32")
    p = periods.float()
    n = p.numel()
    if n > 1 and abs(p[0].item() - 1.0) < 1e-3:  # base parametrisation: periods[i] = base^(2i / (head_dim/2))
        base = p[-1].item() ** ((head_dim // 2) / (2 * (n - 1)))
        base = 100.0 if abs(base / 100.0 - 1) < 0.02 else float(f"{base:.4g}")  # bf16 periods are coarse
        return {"pos_embed_rope_base": base, "pos_embed_rope_dtype": dtype}
    if n > 1:
        return {
            "pos_embed_rope_base": None,
            "pos_embed_rope_min_period": float(f"{p[0].item():.4g}"),
            "pos_embed_rope_max_period": float(f"{p[-1].item():.4g}"),
            "pos_embed_rope_dtype": dtype,
        }
    return {"pos_embed_rope_base": 100.0, "pos_embed_rope_dtype": dtype}


def infer_backbone_kwargs(sd: Mapping[str, Tensor], source: str = "state_dict") -> tuple[str | None, dict[str, Any]]:
    """Constructor kwargs that reproduce the file's keys and shapes: `(released name or None, kwargs)`.

    A file whose keys and shapes equal a released variant's gets that variant's full settings (rope
    rescale, norm eps, ...). Otherwise the settings come from the keys and shapes alone; what they cannot
    show is filled with the hub conventions when the file looks hub-like (storage tokens + layer scale:
    `layernormbf16` i.e. eps 1e-5, rope rescale 2) and with the constructor defaults otherwise.
    """
    try:
        dim = sd["cls_token"].shape[-1]
        _, in_chans, patch, _ = sd["patch_embed.proj.weight"].shape
        depth = 1 + max(int(m.group(1)) for k in sd if (m := BLOCK_KEY.match(k)))
        n_periods = sd["rope_embed.periods"].shape[0]
    except (KeyError, ValueError) as e:
        raise ReleasedWeightsError(f"{source}: cannot infer the architecture ({type(e).__name__}: {e})") from e
    head_dim = 4 * n_periods
    if dim % head_dim:
        raise ReleasedWeightsError(f"{source}: rope_embed.periods [{n_periods}] does not divide embed_dim {dim}")

    shapes = key_shapes(sd)
    for name, kwargs in RELEASED.items():
        if (kwargs["embed_dim"], kwargs["depth"]) != (dim, depth):
            continue
        candidate = DinoVisionTransformer(**kwargs, device="meta")
        if key_shapes(candidate.state_dict()) == shapes:
            return name, dict(kwargs)

    # Storage tokens + layer scale: trained like the released models (the official from-scratch default
    # config has layer scale but no storage tokens, and plain `layernorm`).
    hub_like = "storage_tokens" in sd and "blocks.0.ls1.gamma" in sd
    kwargs: dict[str, Any] = {
        "patch_size": patch,
        "in_chans": in_chans,
        "embed_dim": dim,
        "depth": depth,
        "num_heads": dim // head_dim,
        **_ffn_settings(sd, dim),
        **_rope_settings(sd["rope_embed.periods"], head_dim),
        "pos_embed_rope_rescale_coords": 2.0 if hub_like else None,
        "qkv_bias": "blocks.0.attn.qkv.bias" in sd,
        "proj_bias": "blocks.0.attn.proj.bias" in sd,
        "mask_k_bias": "blocks.0.attn.qkv.bias_mask" in sd,
        "layerscale_init": 1e-5 if "blocks.0.ls1.gamma" in sd else None,
        "n_storage_tokens": sd["storage_tokens"].shape[1] if "storage_tokens" in sd else 0,
        "norm_layer": "rmsnorm" if "norm.bias" not in sd else ("layernormbf16" if hub_like else "layernorm"),
        "untie_cls_and_patch_norms": "cls_norm.weight" in sd,
        "untie_global_and_local_cls_norm": "local_cls_norm.weight" in sd,
    }
    return None, kwargs


def resolve_arch(
    sd: Mapping[str, Tensor], arch: str | Mapping[str, Any] | None, source: str = "state_dict"
) -> tuple[str, dict[str, Any]]:
    """(label, constructor kwargs) for `arch`: a preset / released name, a kwargs mapping, or None (infer)."""
    if arch is None:
        name, kwargs = infer_backbone_kwargs(sd, source)
        return (name or "inferred from the file"), kwargs
    if isinstance(arch, str):
        return arch, backbone_kwargs(arch)
    return "given kwargs", dict(arch)
