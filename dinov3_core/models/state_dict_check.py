"""Does a state_dict load strictly into `DinoVisionTransformer(**kwargs)`? If not, say which keys and which flag.

`check_backbone_state_dict` compares key sets and shapes against a meta-built model (no memory, no init) and
raises `ReleasedWeightsError` listing the missing, unexpected and mis-shaped keys, followed by the constructor
flags that most likely differ (a lone ``bias_mask`` → ``mask_k_bias``, SwiGLU ``w1/w2/w3`` vs ``fc1/fc2`` →
``ffn_layer``, norms without bias → ``rmsnorm``, ...). A user loading someone's checkpoint then reads
"set n_storage_tokens=4", not a wall of 300 key names. The shared key helpers used by `arch_inference` live
here too.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from dinov3_core.errors import WsidinoError

from .vision_transformer import DinoVisionTransformer

__all__ = ["ReleasedWeightsError", "check_backbone_state_dict"]

BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")
SHOW_KEYS = 10  # keys listed per category in error messages


class ReleasedWeightsError(WsidinoError, ValueError):
    """A weights file does not match the backbone it is loaded into; the message says which flag differs."""


class UnreadableWeights(ReleasedWeightsError):
    """The file is not a tensor file at all (not a mismatch of flags)."""


def key_shapes(sd: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in sd.items()}


@dataclass
class _Diff:
    missing: list[str] = field(default_factory=list)  # in the model, not in the file
    unexpected: list[str] = field(default_factory=list)  # in the file, not in the model
    misshaped: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # key, file, model

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.misshaped)


def _diff(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> _Diff:
    return _Diff(
        missing=[k for k in expected if k not in found],
        unexpected=[k for k in found if k not in expected],
        misshaped=[(k, found[k], expected[k]) for k in expected if k in found and found[k] != expected[k]],
    )


def _any(keys: Iterable[str], pattern: str) -> bool:
    return any(re.search(pattern, k) for k in keys)


def _orphans(keys: list[str]) -> list[str]:
    """Keys whose sibling `.weight` is not in the same list: a lone bias / mask means a toggled flag,
    while a bias that goes with a missing weight belongs to a different layer type altogether."""
    listed = set(keys)
    return [k for k in keys if not k.endswith(".weight") and k.rsplit(".", 1)[0] + ".weight" not in listed]


def _constructor_defaults() -> dict[str, Any]:
    params = inspect.signature(DinoVisionTransformer).parameters.items()
    return {k: p.default for k, p in params if p.default is not inspect.Parameter.empty}


def _flag_hints(d: _Diff, model_kwargs: Mapping[str, Any], found: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Which constructor flags most likely differ between the file and the model."""
    model = {**_constructor_defaults(), **model_kwargs}
    hints: list[str] = []

    def flag(name: str, file_value: Any, why: str) -> None:
        hints.append(f"{name}={file_value!r} ({why}; the model has {name}={model.get(name)!r})")

    # Toggle-style flags: a key family present on one side only.
    toggles = [
        ("mask_k_bias", r"\.attn\.qkv\.bias_mask$", True, "blocks.*.attn.qkv.bias_mask"),
        ("qkv_bias", r"\.attn\.qkv\.bias$", True, "blocks.*.attn.qkv.bias"),
        ("proj_bias", r"\.attn\.proj\.bias$", True, "blocks.*.attn.proj.bias"),
        ("ffn_bias", r"\.mlp\.(fc\d|w\d)\.bias$", True, "blocks.*.mlp.*.bias"),
        ("layerscale_init", r"\.ls[12]\.gamma$", 1e-5, "blocks.*.ls1/ls2.gamma"),
        ("untie_cls_and_patch_norms", r"^cls_norm\.", True, "cls_norm.*"),
        ("untie_global_and_local_cls_norm", r"^local_cls_norm\.", True, "local_cls_norm.*"),
    ]
    unexpected, missing = _orphans(d.unexpected), _orphans(d.missing)
    for name, pattern, on, what in toggles:
        if _any(unexpected, pattern):
            flag(name, on, f"the file has {what}")
        elif _any(missing, pattern):
            flag(name, None if name == "layerscale_init" else False, f"the file has no {what}")

    if _any(d.unexpected, r"\.mlp\.w1\.") and _any(d.missing, r"\.mlp\.fc1\."):
        flag("ffn_layer", "swiglu", "the file has SwiGLU mlp.w1/w2/w3 weights")
    elif _any(d.unexpected, r"\.mlp\.fc1\.") and _any(d.missing, r"\.mlp\.w1\."):
        flag("ffn_layer", "mlp", "the file has mlp.fc1/fc2 weights")

    if _any(d.missing, r"norm\d?\.bias$") and not _any(d.unexpected, r"norm\d?\.bias$"):
        flag("norm_layer", "rmsnorm", "the file's norms have no bias")
    elif _any(d.unexpected, r"norm\d?\.bias$") and not _any(d.missing, r"norm\d?\.bias$"):
        flag(
            "norm_layer",
            "layernormbf16",
            "the file's norms have a bias: layernorm (eps 1e-6) or layernormbf16",
        )

    if "storage_tokens" in d.unexpected:
        flag(
            "n_storage_tokens",
            found["storage_tokens"][1],
            f"file storage_tokens {list(found['storage_tokens'])}",
        )
    elif "storage_tokens" in d.missing:
        flag("n_storage_tokens", 0, "the file has no storage_tokens")

    file_blocks = {int(m.group(1)) for k in found if (m := BLOCK_KEY.match(k))}
    if file_blocks and 1 + max(file_blocks) != model.get("depth"):
        flag("depth", 1 + max(file_blocks), "number of blocks.N in the file")

    shaped = {k: (f, m) for k, f, m in d.misshaped}
    if "cls_token" in shaped:  # a different width mis-shapes everything; the other shape hints are noise
        flag("embed_dim", shaped["cls_token"][0][-1], "file cls_token shape")
        return hints
    if "storage_tokens" in shaped:
        flag(
            "n_storage_tokens",
            shaped["storage_tokens"][0][1],
            f"file storage_tokens {list(shaped['storage_tokens'][0])}",
        )
    ffn = [(f[0], m[0]) for k, (f, m) in shaped.items() if re.search(r"\.mlp\.(fc1|w1)\.weight$", k)]
    if ffn:
        hints.append(
            f"ffn_ratio / ffn_layer alignment (FFN hidden size: file {ffn[0][0]}, model {ffn[0][1]}; "
            f"the model has ffn_ratio={model.get('ffn_ratio')!r}, ffn_layer={model.get('ffn_layer')!r})"
        )
    if "rope_embed.periods" in shaped:
        n = shaped["rope_embed.periods"][0][0]
        flag("num_heads", model.get("embed_dim", 0) // (4 * n), f"file rope_embed.periods has {n} entries")
    if "patch_embed.proj.weight" in shaped:
        _, c, p, _ = shaped["patch_embed.proj.weight"][0]
        hints.append(f"patch_size={p}, in_chans={c} (file patch_embed.proj.weight shape)")
    return hints


def _format_error(source: str, arch_label: str, d: _Diff, hints: list[str]) -> str:
    def listing(title: str, items: list[str]) -> str:
        more = f", … (+{len(items) - SHOW_KEYS} more)" if len(items) > SHOW_KEYS else ""
        return f"  {title} ({len(items)}): {', '.join(items[:SHOW_KEYS])}{more}" if items else f"  {title}: none"

    lines = [
        f"{source}: weights do not match the backbone ({arch_label})",
        listing("missing keys, in the model but not the file", d.missing),
        listing("unexpected keys, in the file but not the model", d.unexpected),
        listing("mis-shaped keys", [f"{k} file {list(f)} vs model {list(m)}" for k, f, m in d.misshaped]),
    ]
    if hints:
        lines.append("  most likely differing constructor flag(s): " + "; ".join(hints))
    return "\n".join(lines)


def check_backbone_state_dict(
    model_kwargs: Mapping[str, Any],
    sd: Mapping[str, Tensor],
    source: str = "state_dict",
    arch_label: str = "",
) -> None:
    """Raise ReleasedWeightsError unless `sd` loads strictly into DinoVisionTransformer(**model_kwargs)."""
    expected = key_shapes(DinoVisionTransformer(**{**model_kwargs, "device": "meta"}).state_dict())
    found = key_shapes(sd)
    d = _diff(expected, found)
    if d:
        raise ReleasedWeightsError(
            _format_error(source, arch_label or "given kwargs", d, _flag_hints(d, model_kwargs, found))
        )
