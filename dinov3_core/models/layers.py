"""Building blocks of the DINOv3 ViT, numerically and key-for-key identical to facebookresearch/dinov3.

Module and attribute names are part of the contract: they produce the `state_dict` keys of the released
checkpoints (`attn.qkv.bias_mask`, `ls1.gamma`, `mlp.fc1` / `mlp.w1`, `rope_embed.periods`, ...).

Blocks take a *list* of token tensors, one per crop size (e.g. global and local crops). Token-wise ops
(norms, linears, layer scale) run once on all crops concatenated, attention runs per crop. This is what the
official code does, and it means one call per block per step, which FSDP2 and torch.compile both like.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

Rope = tuple[Tensor, Tensor]  # (sin, cos), each [H*W, head_dim]
Branch = Callable[[list[Tensor], list[Rope | None]], list[Tensor]]  # a residual branch over all crops

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def tokenwise(fn: Callable[[Tensor], Tensor], xs: Sequence[Tensor]) -> list[Tensor]:
    """Apply a per-token op to every [B, N, D] tensor of `xs` in one call (one matmul for all crops)."""
    if len(xs) == 1:
        return [fn(xs[0])]
    sizes = [x.shape[0] * x.shape[1] for x in xs]
    out = fn(torch.cat([x.flatten(0, 1) for x in xs]))
    return [o.unflatten(0, x.shape[:2]) for o, x in zip(out.split(sizes), xs, strict=True)]


# --- normalisation, layer scale, patch embedding -------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics whatever the input dtype, as upstream.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


NORM_LAYERS: dict[str, Callable[[int], nn.Module]] = {
    "layernorm": partial(nn.LayerNorm, eps=1e-6),
    # Despite the name this is a plain fp32 LayerNorm; only eps differs. The released weights use it.
    "layernormbf16": partial(nn.LayerNorm, eps=1e-5),
    "rmsnorm": RMSNorm,
}


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))
        self.init_values = init_values

    def reset_parameters(self) -> None:
        nn.init.constant_(self.gamma, self.init_values)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class PatchEmbed(nn.Module):
    """[B, C, H, W] image → [B, H/p, W/p, D] grid (kept 2-D so the caller knows the grid for RoPE)."""

    def __init__(self, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def reset_parameters(self) -> None:
        bound = math.sqrt(1 / (self.in_chans * self.patch_size**2))
        nn.init.uniform_(self.proj.weight, -bound, bound)
        if self.proj.bias is not None:
            nn.init.uniform_(self.proj.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).permute(0, 2, 3, 1)


# --- rotary position embedding -------------------------------------------------------------------------


class RopePositionEmbedding(nn.Module):
    """Axial 2-D RoPE: half of each head's rotary pairs encode the row, half the column.

    Coordinates are patch centres normalised to [-1, 1]; during training they can be shifted, jittered
    (per axis) and rescaled (both axes), which is what lets DINOv3 generalise across resolutions.
    Everything is computed from (H, W) with arange/expand/cat so that an ONNX export with dynamic image
    size is a straight-line graph (no If, no Tile).
    """

    def __init__(
        self,
        embed_dim: int,
        *,
        num_heads: int,
        base: float | None = 100.0,
        min_period: float | None = None,
        max_period: float | None = None,
        normalize_coords: Literal["min", "max", "separate"] = "separate",
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if embed_dim % (4 * num_heads) != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by 4 * num_heads ({4 * num_heads})")
        both_periods = min_period is not None and max_period is not None
        if (base is None and not both_periods) or (base is not None and both_periods):
            raise ValueError("give either pos_embed_rope_base or both pos_embed_rope_{min,max}_period")
        if normalize_coords not in ("min", "max", "separate"):
            raise ValueError(f"unknown pos_embed_rope_normalize_coords: {normalize_coords!r}")
        self.head_dim = embed_dim // num_heads
        self.base, self.min_period, self.max_period = base, min_period, max_period
        self.normalize_coords = normalize_coords
        self.shift_coords, self.jitter_coords, self.rescale_coords = (
            shift_coords,
            jitter_coords,
            rescale_coords,
        )
        self.dtype = dtype  # the computation dtype; do not rely on periods.dtype (model.to() may change it)
        # Persistent: released checkpoints contain it, and the teacher is initialised from the student's
        # state_dict.
        self.register_buffer("periods", torch.empty(self.head_dim // 4, dtype=dtype), persistent=True)
        self.reset_parameters()

    @property
    def augments(self) -> bool:
        """True when forward() is random (training with any coordinate augmentation)."""
        return self.training and any(
            a is not None for a in (self.shift_coords, self.jitter_coords, self.rescale_coords)
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.periods.is_meta:
            return
        n, dd = self.head_dim // 4, {"device": self.periods.device, "dtype": self.dtype}
        if self.base is not None:
            periods = self.base ** (2 * torch.arange(n, **dd) / (self.head_dim // 2))
        else:
            ratio = self.max_period / self.min_period
            periods = ratio ** torch.linspace(0, 1, n, **dd) / ratio * self.max_period
        self.periods.copy_(periods)

    def forward(self, *, H: int, W: int) -> Rope:
        dd = {"device": self.periods.device, "dtype": self.dtype}
        if self.normalize_coords == "separate":
            coords_h = torch.arange(0.5, H, **dd) / H
            coords_w = torch.arange(0.5, W, **dd) / W
        else:
            # sym_max/sym_min keep H and W symbolic under export instead of specialising on a branch.
            denom = torch.sym_max(H, W) if self.normalize_coords == "max" else torch.sym_min(H, W)
            coords_h = torch.arange(0.5, H, **dd) / denom
            coords_w = torch.arange(0.5, W, **dd) / denom
        coords = torch.stack([coords_h[:, None].expand(H, W), coords_w[None, :].expand(H, W)], dim=-1).flatten(
            0, 1
        )  # [HW, 2], row-major like the patch tokens
        coords = 2.0 * coords - 1.0

        if self.training and self.shift_coords is not None:
            coords = coords + torch.empty(2, **dd).uniform_(-self.shift_coords, self.shift_coords)
        if self.training and self.jitter_coords is not None:
            log_j = math.log(self.jitter_coords)
            coords = coords * torch.empty(2, **dd).uniform_(-log_j, log_j).exp()
        if self.training and self.rescale_coords is not None:
            log_r = math.log(self.rescale_coords)
            coords = coords * torch.empty(1, **dd).uniform_(-log_r, log_r).exp()

        angles = 2 * math.pi * coords[:, :, None] / self.periods[None, None, :]  # [HW, 2, head_dim/4]
        angles = angles.flatten(1, 2)  # [HW, head_dim/2]: all row angles, then all column angles
        angles = torch.cat([angles, angles], dim=-1)  # [HW, head_dim]; cat rather than tile (ONNX Tile)
        return torch.sin(angles), torch.cos(angles)


def rope_rotate_half(x: Tensor) -> Tensor:
    # [x0 x1 x2 x3 x4 x5] → [-x3 -x4 -x5 x0 x1 x2]: pairs (i, i + d/2) rotate together (not interleaved).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_apply(x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    return x * cos + rope_rotate_half(x) * sin


# --- attention and feed-forward ------------------------------------------------------------------------


class LinearKMaskedBias(nn.Linear):
    """qkv projection whose K bias is forced to zero by a stored mask (K bias is a no-op under softmax,
    and letting it train only drifts). The mask is a persistent buffer because released files contain it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if out_features % 3 != 0:
            raise ValueError("LinearKMaskedBias is a qkv projection: out_features must be divisible by 3")
        if self.bias is not None:
            self.register_buffer("bias_mask", torch.empty_like(self.bias))
            self.reset_bias_mask()

    @torch.no_grad()
    def reset_bias_mask(self) -> None:
        if self.bias is None or self.bias_mask.is_meta:
            return
        o = self.out_features
        self.bias_mask.fill_(1)
        self.bias_mask[o // 3 : 2 * o // 3].fill_(0)

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias * self.bias_mask.to(self.bias.dtype) if self.bias is not None else None
        return F.linear(x, self.weight, bias)


class SelfAttention(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        mask_k_bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = (LinearKMaskedBias if mask_k_bias else nn.Linear)(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    def forward(self, xs: Sequence[Tensor], ropes: Sequence[Rope | None]) -> list[Tensor]:
        qkvs = tokenwise(self.qkv, xs)
        out = [self._attend(qkv, rope) for qkv, rope in zip(qkvs, ropes, strict=True)]
        return tokenwise(self.proj, out)

    def _attend(self, qkv: Tensor, rope: Rope | None) -> Tensor:
        B, N, C3 = qkv.shape
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, C3 // (3 * self.num_heads)).permute(2, 0, 3, 1, 4)
        if rope is not None:
            q, k = apply_rope(q, k, rope)
        x = attention(q, k, v)  # [B, heads, N, head_dim]
        return x.transpose(1, 2).reshape(B, N, C3 // 3)


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Softmax attention, the fastest exact kernel for the device and dtype.

    On CPU, PyTorch's fused bf16 attention is slower than its fp32 one at ViT crop lengths, forward and
    backward (docs/benchmarks.md, hot paths).
    bf16 pays in the matrix products, not here, so on CPU q, k and v go up to fp32 for this op (also more exact)
    and the result comes back down to the input dtype. Autocast is off inside, or it would cast them back.
    """
    if q.device.type != "cpu" or q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, k, v)
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(q.dtype)


def apply_rope(q: Tensor, k: Tensor, rope: Rope) -> tuple[Tensor, Tensor]:
    """Rotate the patch tokens of q and k; the prefix (CLS + storage tokens) has no position.

    Computed in the RoPE dtype (fp32 for the released models, bf16 by default for training), then cast back.
    """
    sin, cos = rope
    prefix = q.shape[-2] - sin.shape[-2]
    if prefix:
        # The prefix rows rotate by angle 0 (sin 0, cos 1: x·1 + rot(x)·0 = x, exactly), so q and k are rotated
        # whole: padding the [N, head_dim] tables is cheap, where slicing the patches out and joining the prefix
        # back copied all of q and k in every block (and again in backward).
        sin = F.pad(sin, (0, 0, prefix, 0), value=0.0)
        cos = F.pad(cos, (0, 0, prefix, 0), value=1.0)

    def rotate(t: Tensor) -> Tensor:
        return rope_apply(t.to(sin.dtype), sin, cos).to(t.dtype)

    return rotate(q), rotate(k)


class Mlp(nn.Module):
    def __init__(self, in_features: int, hidden_features: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwiGLUFFN(nn.Module):
    def __init__(self, in_features: int, hidden_features: int, bias: bool = True, align_to: int = 8) -> None:
        super().__init__()
        # 2/3 keeps the parameter count of a 2-matrix MLP with the same hidden size; rounding up to
        # `align_to` keeps matmuls tensor-core friendly (64 for the 7B).
        d = int(hidden_features * 2 / 3)
        hidden = d + (-d % align_to)
        self.w1 = nn.Linear(in_features, hidden, bias=bias)
        self.w2 = nn.Linear(in_features, hidden, bias=bias)
        self.w3 = nn.Linear(hidden, in_features, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


FFN_LAYERS: dict[str, Callable[..., nn.Module]] = {
    "mlp": Mlp,
    "swiglu": SwiGLUFFN,
    "swiglu32": partial(SwiGLUFFN, align_to=32),
    "swiglu64": partial(SwiGLUFFN, align_to=64),
    "swiglu128": partial(SwiGLUFFN, align_to=128),
}


# --- transformer block ---------------------------------------------------------------------------------


class SelfAttentionBlock(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        ffn_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        drop_path: float = 0.0,
        init_values: float | None = None,
        norm_layer: Callable[[int], nn.Module] = NORM_LAYERS["layernorm"],
        ffn_layer: Callable[..., nn.Module] = Mlp,
        mask_k_bias: bool = False,
    ) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = SelfAttention(dim, num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias, mask_k_bias=mask_k_bias)
        # No LayerScale means no `ls*.gamma` keys, exactly as upstream (`if init_values` → 0.0 is "off").
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = ffn_layer(in_features=dim, hidden_features=int(dim * ffn_ratio), bias=ffn_bias)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.sample_drop_ratio = drop_path
        self.activation_checkpointing = False

    def forward(self, x: Tensor | list[Tensor], rope: Rope | list[Rope | None] | None = None) -> Tensor | list[Tensor]:
        """x: [B, N, D] or a list of them (one per crop size); rope: matching (sin, cos) or list of them."""
        if isinstance(x, Tensor):
            return self.forward([x], [rope])[0]  # type: ignore[list-item]
        ropes = list(rope) if isinstance(rope, list) else [rope] * len(x)
        if self.activation_checkpointing and torch.is_grad_enabled():
            # Non-reentrant checkpointing restores the RNG state, so drop-path picks the same samples on
            # recomputation.
            return checkpoint(self._forward, x, ropes, use_reentrant=False)
        return self._forward(x, ropes)

    def _attn_branch(self, xs: list[Tensor], ropes: list[Rope | None]) -> list[Tensor]:
        return [self.ls1(a) for a in self.attn(tokenwise(self.norm1, xs), ropes)]

    def _ffn_branch(self, xs: list[Tensor], ropes: list[Rope | None]) -> list[Tensor]:
        return tokenwise(lambda t: self.ls2(self.mlp(self.norm2(t))), xs)

    def _forward(self, xs: list[Tensor], ropes: list[Rope | None]) -> list[Tensor]:
        for branch in (self._attn_branch, self._ffn_branch):
            if self.training and self.sample_drop_ratio > 0.0:
                xs = self._drop_path_residual(branch, xs, ropes)
            else:
                xs = [x + r for x, r in zip(xs, branch(xs, ropes), strict=True)]
        return xs

    def _drop_path_residual(self, branch: Branch, xs: list[Tensor], ropes: list[Rope | None]) -> list[Tensor]:
        # DINOv3's stochastic depth: the branch runs on a random subset of each batch and is added back
        # scaled by B/subset. Unlike per-sample masking this saves the compute of the dropped samples.
        # RoPE tables have no batch dimension, so they are shared by the subset unchanged.
        keep = [max(int(x.shape[0] * (1 - self.sample_drop_ratio)), 1) for x in xs]
        idx = [torch.randperm(x.shape[0], device=x.device)[:k] for x, k in zip(xs, keep, strict=True)]
        res = branch([x[i] for x, i in zip(xs, idx, strict=True)], ropes)
        return [
            torch.index_add(x, 0, i, r.to(x.dtype), alpha=x.shape[0] / k)
            for x, i, r, k in zip(xs, idx, res, keep, strict=True)
        ]
