"""The backbone as a Hugging Face `transformers` model directory: `config.json` + `model.safetensors` (+ the model
card as `README.md`), loadable offline with `DINOv3ViTModel.from_pretrained(dir)` or `AutoModel.from_pretrained(dir)`.

    result = write_hf_model(Path("model/backbone.pth"), Path("model/hf"), card="# Model card …")

transformers ships no converter in its wheel (its `convert_dinov3_vit_to_hf.py` stays in its repository), so the
released-layout → `DINOv3ViTModel` key mapping is kept here, in `hf_state_dict`, and proven by the check that
follows every write: the saved directory is loaded back with transformers and must give the CLS and patch
features of this project's backbone within the ONNX parity tolerance, or the export fails naming the first layer
whose output differs. Needs the `hf` extra (`pip install -e ".[hf]"`).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor

from dinov3_core.errors import WsidinoError
from dinov3_core.export.onnx_export import within_tolerance
from dinov3_core.inference.backbone import BackboneFeatures, load_backbone, read_arch_config
from dinov3_core.models.arch_inference import resolve_arch
from dinov3_core.models.released import read_backbone_state_dict

HF_DTYPE = torch.float32


class HFExportError(WsidinoError):
    """The backbone cannot be written as, or does not survive the round trip through, a transformers model."""


@dataclass
class HFResult:
    path: Path
    # transformers (RoPE frequencies set from the stored periods) vs this project's backbone, worst over CLS and
    # patch tokens, absolute and relative to the outputs' scale: the gate
    max_abs_error: float
    max_rel_error: float
    # as `from_pretrained` leaves it: transformers recomputes the RoPE frequencies exactly from rope_theta, while a
    # model trained with bf16 RoPE (the released ones) stores bf16-rounded periods
    as_loaded_rel_error: float


def hf_config(kwargs: dict[str, Any], sd: dict[str, Tensor]) -> dict[str, Any]:
    """`DINOv3ViTConfig` fields for a backbone built with these constructor kwargs, whose tensors are `sd`."""
    unsupported = {
        "norm_layer": kwargs.get("norm_layer", "layernorm") not in ("layernorm", "layernormbf16"),
        "untie_cls_and_patch_norms": bool(kwargs.get("untie_cls_and_patch_norms")),
        "ffn_layer": not str(kwargs.get("ffn_layer", "mlp")).startswith(("mlp", "swiglu")),
        "pos_embed_rope_min_period": kwargs.get("pos_embed_rope_min_period") is not None,
        "pos_embed_rope_normalize_coords": kwargs.get("pos_embed_rope_normalize_coords", "separate") != "separate",
    }
    bad = [k for k, is_bad in unsupported.items() if is_bad]
    if bad:
        said = ", ".join(f"{k}={kwargs.get(k)!r}" for k in bad)
        raise HFExportError(f"transformers' DINOv3ViTModel has no equivalent of {said}; export ONNX only")
    dim = int(kwargs.get("embed_dim", 768))
    gated = str(kwargs.get("ffn_layer", "mlp")).startswith("swiglu")
    hidden = int(sd["blocks.0.mlp.w1.weight" if gated else "blocks.0.mlp.fc1.weight"].shape[0])  # as trained
    return {
        "hidden_size": dim,
        "intermediate_size": hidden,
        "num_hidden_layers": int(kwargs.get("depth", 12)),
        "num_attention_heads": int(kwargs.get("num_heads", 12)),
        "patch_size": int(kwargs.get("patch_size", 16)),
        "num_channels": int(kwargs.get("in_chans", 3)),
        "num_register_tokens": int(kwargs.get("n_storage_tokens", 0)),
        "layer_norm_eps": 1e-5 if kwargs.get("norm_layer") == "layernormbf16" else 1e-6,
        "rope_theta": float(kwargs.get("pos_embed_rope_base") or 100.0),
        "query_bias": bool(kwargs.get("qkv_bias", True)),
        "key_bias": bool(kwargs.get("qkv_bias", True)) and not kwargs.get("mask_k_bias", False),
        "value_bias": bool(kwargs.get("qkv_bias", True)),
        "proj_bias": bool(kwargs.get("proj_bias", True)),
        "mlp_bias": bool(kwargs.get("ffn_bias", True)),
        "use_gated_mlp": gated,
        "hidden_act": "silu" if gated else "gelu",
        "layerscale_value": float(kwargs.get("layerscale_init") or 1.0),
        "pos_embed_rescale": kwargs.get("pos_embed_rope_rescale_coords"),  # training-time augmentation only
        "image_size": int(kwargs.get("img_size", 224)),
    }


_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_RENAMES = {
    "norm1.weight": "norm1.weight",
    "norm1.bias": "norm1.bias",
    "norm2.weight": "norm2.weight",
    "norm2.bias": "norm2.bias",
    "attn.proj.weight": "attention.o_proj.weight",
    "attn.proj.bias": "attention.o_proj.bias",
    "ls1.gamma": "layer_scale1.lambda1",
    "ls2.gamma": "layer_scale2.lambda1",
    "mlp.fc1.weight": "mlp.up_proj.weight",
    "mlp.fc1.bias": "mlp.up_proj.bias",
    "mlp.fc2.weight": "mlp.down_proj.weight",
    "mlp.fc2.bias": "mlp.down_proj.bias",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w1.bias": "mlp.gate_proj.bias",
    "mlp.w2.weight": "mlp.up_proj.weight",
    "mlp.w2.bias": "mlp.up_proj.bias",
    "mlp.w3.weight": "mlp.down_proj.weight",
    "mlp.w3.bias": "mlp.down_proj.bias",
}


def hf_state_dict(sd: dict[str, Tensor], config: dict[str, Any]) -> dict[str, Tensor]:
    """Released-layout tensors → `DINOv3ViTModel` keys. The fused qkv is split; a masked K bias (the released
    models' `bias_mask`, all zero on K) is dropped, as `key_bias=False` says; RoPE periods are recomputed by
    transformers from `rope_theta`; a backbone without layer scale gets lambda = 1."""
    dim = config["hidden_size"]
    out: dict[str, Tensor] = {
        "embeddings.cls_token": sd["cls_token"].reshape(1, 1, dim),
        "embeddings.mask_token": sd["mask_token"].reshape(1, 1, dim),
        "embeddings.patch_embeddings.weight": sd["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.bias": sd["patch_embed.proj.bias"],
        "norm.weight": sd["norm.weight"],
        "norm.bias": sd["norm.bias"],
    }
    registers = config["num_register_tokens"]
    out["embeddings.register_tokens"] = sd["storage_tokens"] if registers else torch.zeros(1, 0, dim)
    unused = []
    for key, value in sd.items():
        match = _BLOCK.fullmatch(key)
        if not match:
            continue
        i, rest = match.groups()
        prefix = f"model.layer.{i}."
        if rest == "attn.qkv.weight":
            for name, part in zip(("q", "k", "v"), value.chunk(3, dim=0), strict=True):
                out[f"{prefix}attention.{name}_proj.weight"] = part
        elif rest == "attn.qkv.bias":
            q, k, v = value.chunk(3, dim=0)
            out[f"{prefix}attention.q_proj.bias"], out[f"{prefix}attention.v_proj.bias"] = q, v
            if config["key_bias"]:
                out[f"{prefix}attention.k_proj.bias"] = k
        elif rest in _RENAMES:
            out[prefix + _RENAMES[rest]] = value
        elif rest != "attn.qkv.bias_mask":
            unused.append(key)
    if unused:
        raise HFExportError(f"no transformers key for {unused[:5]}; export ONNX only")
    for i in range(config["num_hidden_layers"]):
        for n in (1, 2):
            out.setdefault(f"model.layer.{i}.layer_scale{n}.lambda1", torch.ones(dim))
    return {k: v.detach().to(HF_DTYPE).contiguous() for k, v in out.items()}


def write_hf_model(
    weights: Path, out_dir: Path, *, card: str | None = None, atol: float = 1e-4, rtol: float = 1e-5
) -> HFResult:
    """Write `out_dir` (replacing it only once the new one is complete and checked) and return its parity."""
    try:
        # deferred: transformers, the optional `hf` extra
        from transformers import DINOv3ViTConfig, DINOv3ViTModel
    except ImportError as err:
        raise HFExportError(
            f"writing a Hugging Face model needs transformers ({err}); pip install -e '.[hf]'"
        ) from None

    sd = read_backbone_state_dict(weights)
    _, kwargs = resolve_arch(sd, read_arch_config(weights), source=str(weights))
    fields = hf_config(kwargs, sd)
    tensors = hf_state_dict(sd, fields)
    staging = out_dir.with_name(f".{out_dir.name}.incoming")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # transformers recomputes RoPE frequencies from rope_theta and cannot load these: kept in config.json, so that
    # `model.rope_embeddings.inv_freq = 1 / torch.tensor(model.config.wsidino_rope_periods)` gives exact features
    periods = [float(p) for p in sd["rope_embed.periods"].float()]
    config = DINOv3ViTConfig(**fields, architectures=["DINOv3ViTModel"], wsidino_rope_periods=periods)
    config.save_pretrained(staging)
    safetensors.torch.save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    if card:
        (staging / "README.md").write_text(card)
    hf = DINOv3ViTModel.from_pretrained(staging, local_files_only=True).eval()
    ours = BackboneFeatures(load_backbone(weights)).eval()
    _, as_loaded_rel, _ = _differences(hf, ours, fields)
    hf.rope_embeddings.inv_freq = 1 / torch.tensor(periods, dtype=torch.float32)
    worst_abs, worst_rel = _compare(hf, ours, fields, atol, rtol)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    figures = {"max_abs_error": worst_abs, "max_rel_error": worst_rel, "as_loaded_rel_error": as_loaded_rel}
    (out_dir / "wsidino_parity.json").write_text(json.dumps(figures, indent=1) + "\n")
    return HFResult(out_dir, worst_abs, worst_rel, as_loaded_rel)


def _differences(hf: Any, ours: Any, fields: dict[str, Any]) -> tuple[float, float, list[tuple[float, float]]]:
    """CLS and patch tokens of both models on the same random tiles: worst abs, worst relative, (abs, scale) each."""
    x = _tiles(fields)
    first_patch = 1 + fields["num_register_tokens"]
    with torch.no_grad():
        out = hf(pixel_values=x)
        cls, patch = ours(x)
    pairs = []
    for theirs, mine in ((out.last_hidden_state[:, 0], cls), (out.last_hidden_state[:, first_patch:], patch)):
        pairs.append((float((theirs - mine).abs().max()), float(mine.abs().max())))
    return max(a for a, _ in pairs), max(a / max(s, 1e-12) for a, s in pairs), pairs


def _tiles(fields: dict[str, Any]) -> Tensor:
    return torch.randn(2, fields["num_channels"], 64, 96, generator=torch.Generator().manual_seed(0))


def _compare(hf: Any, ours: Any, fields: dict[str, Any], atol: float, rtol: float) -> tuple[float, float]:
    """Within atol + rtol × scale on CLS and patch tokens, or an error naming the first differing layer."""
    worst_abs, worst_rel, pairs = _differences(hf, ours, fields)
    if not all(within_tolerance(err, scale, atol, rtol) for err, scale in pairs):
        x = _tiles(fields)
        with torch.no_grad():
            out = hf(pixel_values=x, output_hidden_states=True)
        layer = _first_differing_layer(out.hidden_states, ours, x, atol, rtol)
        raise HFExportError(
            f"the transformers model differs from the backbone by {worst_abs:.3g} (relative {worst_rel:.3g}); "
            f"first differing output: {layer}"
        )
    return worst_abs, worst_rel


def _first_differing_layer(hidden_states: Any, ours: Any, x: Tensor, atol: float, rtol: float) -> str:
    outputs: list[Tensor] = []

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        outputs.append(output[0] if isinstance(output, list) else output)

    handles = [block.register_forward_hook(keep) for block in ours.backbone.blocks]
    try:
        with torch.no_grad():
            ours(x)
    finally:
        for handle in handles:
            handle.remove()
    for i, (theirs, mine) in enumerate(zip(hidden_states[1:], outputs, strict=False)):
        err, scale = float((theirs - mine).abs().max()), float(mine.abs().max())
        if not within_tolerance(err, scale, atol, rtol):
            return f"layer {i} (model.layer.{i} vs blocks.{i}: max abs difference {err:.3g})"
    return "the final norm (every layer matched)"


__all__ = ["HFExportError", "HFResult", "hf_config", "hf_state_dict", "write_hf_model"]
