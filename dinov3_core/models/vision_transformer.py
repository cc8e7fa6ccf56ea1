"""The DINOv3 vision transformer: same constructor, state_dict and numbers as facebookresearch/dinov3.

Token layout: [CLS, storage_1..R, patch_1..HW]. There is no absolute position embedding; patch tokens get
2-D RoPE inside attention, computed from the actual patch grid, so any H, W multiple of the patch size works.

    model = build_backbone("vits16")                     # a released architecture, freshly initialised
    with torch.device("meta"):
        big = build_backbone("vit_7b", n_storage_tokens=4)  # no memory; fully_shard, to_empty, init_weights
"""

from __future__ import annotations

import contextlib
import difflib
import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .layers import (
    DTYPES,
    FFN_LAYERS,
    NORM_LAYERS,
    LayerScale,
    LinearKMaskedBias,
    PatchEmbed,
    RMSNorm,
    Rope,
    RopePositionEmbedding,
    SelfAttentionBlock,
)

logger = logging.getLogger(__name__)


def init_weights_vit(module: nn.Module) -> None:
    """Upstream's per-module initialisation (applied to every submodule by `init_weights`)."""
    if isinstance(module, nn.Linear):
        # a=-2, b=2 are absolute bounds: with std 0.02 this is a normal in practice, exactly as upstream.
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, LinearKMaskedBias):
            module.reset_bias_mask()
    elif isinstance(module, (nn.LayerNorm, LayerScale, PatchEmbed, RMSNorm)):
        module.reset_parameters()


class DinoVisionTransformer(nn.Module):
    def __init__(
        self,
        *,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        pos_embed_rope_base: float | None = 100.0,
        pos_embed_rope_min_period: float | None = None,
        pos_embed_rope_max_period: float | None = None,
        pos_embed_rope_normalize_coords: Literal["min", "max", "separate"] = "separate",
        pos_embed_rope_shift_coords: float | None = None,
        pos_embed_rope_jitter_coords: float | None = None,
        pos_embed_rope_rescale_coords: float | None = None,
        pos_embed_rope_dtype: str = "bf16",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        ffn_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        layerscale_init: float | None = None,
        norm_layer: str = "layernorm",
        ffn_layer: str = "mlp",
        ffn_bias: bool = True,
        proj_bias: bool = True,
        n_storage_tokens: int = 0,
        mask_k_bias: bool = False,
        untie_cls_and_patch_norms: bool = False,
        untie_global_and_local_cls_norm: bool = False,
        device: Any | None = None,
        **ignored_kwargs: Any,
    ) -> None:
        super().__init__()
        if ignored_kwargs:  # upstream accepts and ignores unknown keywords; we at least say so
            logger.warning("DinoVisionTransformer ignored kwargs: %s", sorted(ignored_kwargs))
        for kind, value, table in (
            ("norm_layer", norm_layer, NORM_LAYERS),
            ("ffn_layer", ffn_layer, FFN_LAYERS),
            ("pos_embed_rope_dtype", pos_embed_rope_dtype, DTYPES),
        ):
            if value not in table:
                raise ValueError(f"unknown {kind} {value!r}; expected one of {sorted(table)}")
        norm_cls = NORM_LAYERS[norm_layer]

        self.num_features = self.embed_dim = embed_dim
        self.n_blocks = depth
        self.num_heads = num_heads
        self.patch_size = patch_size
        self.img_size = img_size  # only recorded: any multiple of patch_size is accepted at run time
        self.n_storage_tokens = n_storage_tokens
        self.untie_cls_and_patch_norms = untie_cls_and_patch_norms
        self.untie_global_and_local_cls_norm = untie_global_and_local_cls_norm

        # `device` is honoured for every submodule (upstream forgets the norms); "meta" allocates nothing.
        with torch.device(device) if device is not None else contextlib.nullcontext():
            # Registration order below fixes the state_dict key order of the released files.
            self.patch_embed = PatchEmbed(patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
            if n_storage_tokens > 0:
                self.storage_tokens = nn.Parameter(torch.zeros(1, n_storage_tokens, embed_dim))
            self.rope_embed = RopePositionEmbedding(
                embed_dim,
                num_heads=num_heads,
                base=pos_embed_rope_base,
                min_period=pos_embed_rope_min_period,
                max_period=pos_embed_rope_max_period,
                normalize_coords=pos_embed_rope_normalize_coords,
                shift_coords=pos_embed_rope_shift_coords,
                jitter_coords=pos_embed_rope_jitter_coords,
                rescale_coords=pos_embed_rope_rescale_coords,
                dtype=DTYPES[pos_embed_rope_dtype],
            )
            self.blocks = nn.ModuleList(
                SelfAttentionBlock(
                    embed_dim,
                    num_heads,
                    ffn_ratio=ffn_ratio,
                    qkv_bias=qkv_bias,
                    proj_bias=proj_bias,
                    ffn_bias=ffn_bias,
                    drop_path=drop_path_rate,
                    init_values=layerscale_init,
                    norm_layer=norm_cls,
                    ffn_layer=FFN_LAYERS[ffn_layer],
                    mask_k_bias=mask_k_bias,
                )
                for _ in range(depth)
            )
            # `norm` covers all tokens, or only patch tokens when untied; `cls_norm` then covers CLS +
            # storage tokens, and `local_cls_norm` those of local crops (training only).
            self.norm = norm_cls(embed_dim)
            self.cls_norm = norm_cls(embed_dim) if untie_cls_and_patch_norms else None
            self.local_cls_norm = norm_cls(embed_dim) if untie_global_and_local_cls_norm else None
            self.head = nn.Identity()
            self.mask_token = nn.Parameter(torch.zeros(1, embed_dim))

        if not self.cls_token.is_meta:
            self.init_weights()  # upstream leaves torch.empty() garbage until init_weights(); we do not

    # --- initialisation and training helpers -----------------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """Upstream's scheme; call after `to_empty()` when the model was built on the meta device."""
        self.rope_embed.reset_parameters()
        nn.init.normal_(self.cls_token, std=0.02)
        if self.n_storage_tokens > 0:
            nn.init.normal_(self.storage_tokens, std=0.02)
        nn.init.zeros_(self.mask_token)
        for module in self.modules():
            init_weights_vit(module)

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block in backward instead of storing its activations (keys are unchanged)."""
        for block in self.blocks:
            block.activation_checkpointing = enabled

    # --- forward -----------------------------------------------------------------------------------------

    def prepare_tokens_with_masks(self, x: Tensor, masks: Tensor | None = None) -> tuple[Tensor, tuple[int, int]]:
        """Image [B, C, H, W] → tokens [B, 1 + R + HW, D] and the patch grid (HW); masks: [B, HW] bool."""
        x = self.patch_embed(x)
        B, H, W, _ = x.shape
        x = x.flatten(1, 2)
        if masks is not None:
            x = torch.where(masks.unsqueeze(-1), self.mask_token.to(x.dtype).unsqueeze(0), x)
            cls_token = self.cls_token
        else:
            # `+ 0 * mask_token` keeps mask_token in the graph so it always receives a (zero) gradient:
            # FSDP / DDP need every parameter to take part in every step.
            cls_token = self.cls_token + 0 * self.mask_token
        prefix = [cls_token.expand(B, -1, -1)]
        if self.n_storage_tokens > 0:
            prefix.append(self.storage_tokens.expand(B, -1, -1))
        return torch.cat([*prefix, x], dim=1), (H, W)

    def forward_features_list(
        self, x_list: Sequence[Tensor], masks_list: Sequence[Tensor | None]
    ) -> list[dict[str, Tensor | None]]:
        xs, grids = [], []
        for x, masks in zip(x_list, masks_list, strict=True):
            tokens, grid = self.prepare_tokens_with_masks(x, masks)
            xs.append(tokens)
            grids.append(grid)
        xs = self.run_blocks(xs, grids, self.blocks)
        return self.norm_outputs(xs, masks_list)

    def run_blocks(self, xs: list[Tensor], grids: Sequence[tuple[int, int]], blocks: Any) -> list[Tensor]:
        """The token lists through `blocks` (all of them, or one pipeline stage's), RoPE from each crop's grid."""
        ropes: list[Rope | None] | None = None
        for block in blocks:
            # Upstream draws fresh RoPE coordinate augmentations for every block; without augmentation
            # the tables are identical, so compute them once.
            if ropes is None or self.rope_embed.augments:
                ropes = [self.rope_embed(H=H, W=W) for H, W in grids]
            xs = block(xs, ropes)
        return xs

    def norm_outputs(self, xs: Sequence[Tensor], masks_list: Sequence[Tensor | None]) -> list[dict[str, Tensor | None]]:
        """The final norm(s) on each crop list entry → the feature dicts of `forward_features`."""
        n_prefix = self.n_storage_tokens + 1
        outputs = []
        for idx, (x, masks) in enumerate(zip(xs, masks_list, strict=True)):
            if self.untie_cls_and_patch_norms or self.untie_global_and_local_cls_norm:
                if self.untie_global_and_local_cls_norm and self.training and idx == 1:
                    # Upstream's convention: the second list entry holds the local crops.
                    x_norm_prefix = self.local_cls_norm(x[:, :n_prefix])
                elif self.untie_cls_and_patch_norms:
                    x_norm_prefix = self.cls_norm(x[:, :n_prefix])
                else:
                    x_norm_prefix = self.norm(x[:, :n_prefix])
                x_norm_patch = self.norm(x[:, n_prefix:])
            else:
                x_norm = self.norm(x)
                x_norm_prefix, x_norm_patch = x_norm[:, :n_prefix], x_norm[:, n_prefix:]
            outputs.append(
                {
                    "x_norm_clstoken": x_norm_prefix[:, 0],
                    "x_storage_tokens": x_norm_prefix[:, 1:],
                    "x_norm_patchtokens": x_norm_patch,
                    "x_prenorm": x,
                    "masks": masks,
                }
            )
        return outputs

    def forward_features(
        self, x: Tensor | Sequence[Tensor], masks: Tensor | Sequence[Tensor | None] | None = None
    ) -> dict[str, Tensor | None] | list[dict[str, Tensor | None]]:
        """One batch → one dict; a list of batches (e.g. [global crops, local crops]) → a list of dicts."""
        if isinstance(x, Tensor):
            return self.forward_features_list([x], [masks])[0]  # type: ignore[list-item]
        masks_list = list(masks) if masks is not None else [None] * len(x)
        return self.forward_features_list(x, masks_list)

    def _get_intermediate_layers_not_chunked(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        x, (H, W) = self.prepare_tokens_with_masks(x)
        total = len(self.blocks)
        take = set(range(total - n, total)) if isinstance(n, int) else set(n)
        rope = self.rope_embed(H=H, W=W)
        outputs = []
        for i, block in enumerate(self.blocks):
            if self.rope_embed.augments and i > 0:
                rope = self.rope_embed(H=H, W=W)
            x = block(x, rope)
            if i in take:
                outputs.append(x)
        if len(outputs) != len(take):
            raise ValueError(f"only {len(outputs)} / {len(take)} requested blocks exist (depth {total})")
        return outputs

    def get_intermediate_layers(
        self,
        x: Tensor,
        n: int | Sequence[int] = 1,
        *,
        reshape: bool = False,
        return_class_token: bool = False,
        return_extra_tokens: bool = False,
        norm: bool = True,
    ) -> tuple[Any, ...]:
        """Outputs of the last `n` blocks (or of the block indices in `n`), as upstream.

        Each entry is the patch tokens [B, HW, D] (or [B, D, h, w] with reshape), optionally zipped with the
        CLS token [B, D] and/or the storage tokens [B, R, D].
        """
        outputs = self._get_intermediate_layers_not_chunked(x, n)
        n_prefix = self.n_storage_tokens + 1
        if norm:
            if self.untie_cls_and_patch_norms:
                outputs = [torch.cat([self.cls_norm(o[:, :n_prefix]), self.norm(o[:, n_prefix:])], 1) for o in outputs]
            else:
                outputs = [self.norm(o) for o in outputs]
        class_tokens = [o[:, 0] for o in outputs]
        extra_tokens = [o[:, 1:n_prefix] for o in outputs]
        patches = [o[:, n_prefix:] for o in outputs]
        if reshape:
            B, _, h, w = x.shape
            p = self.patch_size
            patches = [o.reshape(B, h // p, w // p, -1).permute(0, 3, 1, 2).contiguous() for o in patches]
        if return_class_token and return_extra_tokens:
            return tuple(zip(patches, class_tokens, extra_tokens, strict=True))
        if return_class_token:
            return tuple(zip(patches, class_tokens, strict=True))
        if return_extra_tokens:
            return tuple(zip(patches, extra_tokens, strict=True))
        return tuple(patches)

    def forward(self, *args: Any, is_training: bool = False, **kwargs: Any):
        """Normed CLS token [B, D] (via `head`, an Identity); with is_training=True, the feature dict(s)."""
        ret = self.forward_features(*args, **kwargs)
        if is_training:
            return ret
        return self.head(ret["x_norm_clstoken"])


# --- presets -----------------------------------------------------------------------------------------------

# Architecture only, like upstream's vit_small(), vit_base(), ...: everything else keeps the constructor
# defaults (mlp FFN, no layer scale, no storage tokens, bf16 RoPE) unless overridden.
PRESETS: dict[str, dict[str, Any]] = {
    # Tiny model for unit tests and the CI demo: 64-d, 2 blocks, 4 heads of 16 (4 RoPE periods per axis).
    "vit_test": dict(patch_size=16, embed_dim=64, depth=2, num_heads=4, ffn_ratio=4.0),
    "vit_small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, ffn_ratio=4.0),
    "vit_base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, ffn_ratio=4.0),
    "vit_large": dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16, ffn_ratio=4.0),
    "vit_so400m": dict(patch_size=16, embed_dim=1152, depth=27, num_heads=18, ffn_ratio=3.777777778),
    "vit_huge2": dict(patch_size=16, embed_dim=1280, depth=32, num_heads=20, ffn_ratio=4.0),
    "vit_giant2": dict(patch_size=16, embed_dim=1536, depth=40, num_heads=24, ffn_ratio=4.0),
    "vit_7b": dict(patch_size=16, embed_dim=4096, depth=40, num_heads=32, ffn_ratio=3.0),
}

# Settings shared by every released (torch.hub) backbone.
HUB_SETTINGS: dict[str, Any] = dict(
    img_size=224,
    pos_embed_rope_base=100.0,
    pos_embed_rope_normalize_coords="separate",
    pos_embed_rope_rescale_coords=2.0,
    pos_embed_rope_dtype="fp32",
    qkv_bias=True,
    layerscale_init=1e-5,
    norm_layer="layernormbf16",
    ffn_layer="mlp",
    ffn_bias=True,
    proj_bias=True,
    n_storage_tokens=4,
    mask_k_bias=True,
)

RELEASED: dict[str, dict[str, Any]] = {
    "vits16": {**PRESETS["vit_small"], **HUB_SETTINGS},
    "vits16plus": {**PRESETS["vit_small"], **HUB_SETTINGS, "ffn_ratio": 6.0, "ffn_layer": "swiglu"},
    "vitb16": {**PRESETS["vit_base"], **HUB_SETTINGS},
    "vitl16": {**PRESETS["vit_large"], **HUB_SETTINGS},
    # The SAT-493M ViT-L (hash eadcf0ff) was trained with a separate local-crop CLS norm.
    "vitl16_sat": {**PRESETS["vit_large"], **HUB_SETTINGS, "untie_global_and_local_cls_norm": True},
    "vitl16plus": {**PRESETS["vit_large"], **HUB_SETTINGS, "ffn_ratio": 6.0, "ffn_layer": "swiglu"},
    "vith16plus": {**PRESETS["vit_huge2"], **HUB_SETTINGS, "ffn_ratio": 6.0, "ffn_layer": "swiglu"},
    "vit7b16": {
        **PRESETS["vit_7b"],
        **HUB_SETTINGS,
        "ffn_layer": "swiglu64",
        "qkv_bias": False,
        "untie_global_and_local_cls_norm": True,
    },
}


def backbone_kwargs(name: str, **overrides: Any) -> dict[str, Any]:
    """Constructor kwargs of a preset or released variant (`dinov3_` prefix optional), with overrides."""
    key = name.removeprefix("dinov3_")
    table = PRESETS.get(key) or RELEASED.get(key)
    if table is None:
        known = [*PRESETS, *RELEASED]
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown backbone {name!r}{hint}; known: {', '.join(known)}")
    return {**table, **overrides}


def build_backbone(name: str, **overrides: Any) -> DinoVisionTransformer:
    """`build_backbone("vit_large", n_storage_tokens=4)`, `build_backbone("vits16")`, ...

    Any constructor keyword can be overridden, including `device="meta"` for allocation-free construction.
    """
    return DinoVisionTransformer(**backbone_kwargs(name, **overrides))
