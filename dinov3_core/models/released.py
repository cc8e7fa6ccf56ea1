"""Released DINOv3 weights in and out: strict loading with readable errors, arch inference, atomic saving.

A released backbone file (`dinov3_vits16_pretrain_lvd1689m-08c60483.pth`, ...) is a plain dict of tensors with
the keys of `DinoVisionTransformer.state_dict()`. We read it, or the `{"teacher": {"backbone.*": ...}}` eval
checkpoint, or a `{"model": ...}` wrapper; and we write exactly that plain layout, so our backbones load
wherever released ones do (`torch.hub.load(..., weights=path)` included).
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .heads import DINOHead
from .vision_transformer import RELEASED, DinoVisionTransformer

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")
_SHOW = 10  # keys listed per category in error messages


class ReleasedWeightsError(ValueError):
    """A weights file does not match the backbone it is loaded into; the message says which flag differs."""


# --- reading -----------------------------------------------------------------------------------------------


def read_backbone_state_dict(path: PathLike) -> dict[str, Tensor]:
    """The backbone tensors of a `.pth` / `.safetensors` file, unwrapped and with prefixes stripped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ImportError(f"{path}: reading .safetensors needs the `safetensors` package") from e
        obj: Any = load_file(str(path), device="cpu")
    else:
        try:
            # weights_only: a checkpoint is data, never code.
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling errors come in many types; all mean "not a plain tensor file"
            raise ReleasedWeightsError(f"{path}: cannot be read as a weights file ({type(e).__name__}: {e})") from e
    return unwrap_backbone_state_dict(obj, source=str(path))


def unwrap_backbone_state_dict(obj: Any, source: str = "state_dict") -> dict[str, Tensor]:
    """Plain backbone dict from a released file, an eval checkpoint `{"teacher": {"backbone.*"}}`,
    a `{"model": ...}` wrapper, or a DDP/`backbone.`-prefixed dict. Head keys are dropped."""
    for wrapper in ("teacher", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
    if not isinstance(obj, Mapping) or not obj:
        raise ReleasedWeightsError(f"{source}: expected a dict of tensors, got {type(obj).__name__}")
    sd = dict(obj)
    for prefix in ("module.", "teacher.backbone.", "backbone."):
        if any(k.startswith(prefix) for k in sd):
            sd = {k.removeprefix(prefix): v for k, v in sd.items() if k.startswith(prefix)}
    bad = [k for k, v in sd.items() if not isinstance(v, Tensor)]
    if bad:
        raise ReleasedWeightsError(f"{source}: non-tensor entries {bad[:_SHOW]} (not a backbone state_dict)")
    if "cls_token" not in sd:
        raise ReleasedWeightsError(
            f"{source}: no `cls_token` key, so not a DINOv3 backbone; first keys: {list(sd)[:_SHOW]}"
        )
    return sd


# --- architecture inference ----------------------------------------------------------------------------


def _shapes(sd: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in sd.items()}


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
        depth = 1 + max(int(m.group(1)) for k in sd if (m := _BLOCK_KEY.match(k)))
        n_periods = sd["rope_embed.periods"].shape[0]
    except (KeyError, ValueError) as e:
        raise ReleasedWeightsError(f"{source}: cannot infer the architecture ({type(e).__name__}: {e})") from e
    head_dim = 4 * n_periods
    if dim % head_dim:
        raise ReleasedWeightsError(f"{source}: rope_embed.periods [{n_periods}] does not divide embed_dim {dim}")

    shapes = _shapes(sd)
    for name, kwargs in RELEASED.items():
        if (kwargs["embed_dim"], kwargs["depth"]) != (dim, depth):
            continue
        candidate = DinoVisionTransformer(**kwargs, device="meta")
        if _shapes(candidate.state_dict()) == shapes:
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


# --- compatibility check with flag hints ---------------------------------------------------------------


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

    file_blocks = {int(m.group(1)) for k in found if (m := _BLOCK_KEY.match(k))}
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
        more = f", … (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
        return f"  {title} ({len(items)}): {', '.join(items[:_SHOW])}{more}" if items else f"  {title}: none"

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
    expected = _shapes(DinoVisionTransformer(**{**model_kwargs, "device": "meta"}).state_dict())
    found = _shapes(sd)
    d = _diff(expected, found)
    if d:
        raise ReleasedWeightsError(
            _format_error(source, arch_label or "given kwargs", d, _flag_hints(d, model_kwargs, found))
        )


# --- public loading API --------------------------------------------------------------------------------


def resolve_arch(
    sd: Mapping[str, Tensor], arch: str | Mapping[str, Any] | None, source: str = "state_dict"
) -> tuple[str, dict[str, Any]]:
    """(label, constructor kwargs) for `arch`: a preset / released name, a kwargs mapping, or None (infer)."""
    from .vision_transformer import backbone_kwargs

    if arch is None:
        name, kwargs = infer_backbone_kwargs(sd, source)
        return (name or "inferred from the file"), kwargs
    if isinstance(arch, str):
        return arch, backbone_kwargs(arch)
    return "given kwargs", dict(arch)


def load_released_backbone(
    path: PathLike,
    arch: str | Mapping[str, Any] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> DinoVisionTransformer:
    """Build the backbone a weights file was written for and load it strictly. Returned in eval mode.

    arch: None infers the architecture from keys and shapes; a name (`"vits16"`, `"vit_large"`) or a kwargs
    mapping pins it. `overrides` change settings that do not affect the layout (e.g. `drop_path_rate`,
    RoPE augmentations for training); layout-changing overrides are checked like everything else.
    """
    sd = read_backbone_state_dict(path)
    label, kwargs = resolve_arch(sd, arch, str(path))
    return _build_and_load(sd, {**kwargs, **(overrides or {})}, str(path), label, device)


def _build_and_load(
    sd: Mapping[str, Tensor], kwargs: Mapping[str, Any], source: str, label: str, device: torch.device | str
) -> DinoVisionTransformer:
    check_backbone_state_dict(kwargs, sd, source, label)
    # Meta build + to_empty: no time spent on an initialisation the file overwrites anyway.
    model = DinoVisionTransformer(**{**kwargs, "device": "meta"})
    model.to_empty(device=device)
    model.load_state_dict(sd, strict=True)
    logger.info("loaded backbone (%s) from %s", label, source)
    return model.eval()


# --- saving ------------------------------------------------------------------------------------------------


_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def backbone_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Full CPU state_dict in the released layout, also from compiled / checkpoint-wrapped / FSDP2 models.

    With FSDP2 (DTensor parameters) this all-gathers, so every rank must call it.
    """
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        for part in _WRAPPER_PARTS:
            key = key.replace(part, "")
        key = key.removeprefix("module.")
        if hasattr(value, "full_tensor"):  # DTensor
            value = value.full_tensor()
        # clone: no shared storage (safetensors refuses it) and no views pinning a larger buffer.
        out[key] = value.detach().to("cpu").clone().contiguous()
    unwrap_backbone_state_dict(out, source=type(model).__name__)  # sanity: it must look like a backbone
    return out


def save_backbone(model: nn.Module, path: PathLike) -> Path:
    """Write the backbone in the released layout (plain dict of CPU tensors, `bias_mask` included).

    Atomic: written to a temporary name in the same directory, then renamed, so a crash never leaves a
    truncated file under the final name. `.safetensors` paths need the `safetensors` package. Under
    torch.distributed, every rank gathers and rank 0 writes.
    """
    path = Path(path)
    sd = backbone_state_dict(model)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if path.suffix == ".safetensors":
            try:
                from safetensors.torch import save_file
            except ImportError as e:
                raise ImportError(f"{path}: writing .safetensors needs the `safetensors` package") from e
            save_file(sd, str(tmp))
        else:
            torch.save(sd, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# --- warm start for SSL training -----------------------------------------------------------------------

# The official `dino:` / `ibot:` config sections name head settings `head_*`.
_OFFICIAL_HEAD_KEYS = {
    "head_n_prototypes": "out_dim",
    "head_bottleneck_dim": "bottleneck_dim",
    "head_nlayers": "nlayers",
    "head_hidden_dim": "hidden_dim",
}


def head_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """DINOHead kwargs from DINOHead-style keys, or from an official `dino:` / `ibot:` section (`head_*`)."""
    if not any(k.startswith("head_") for k in cfg):
        return dict(cfg)
    if cfg.get("head_norm_last_layer"):
        logger.warning("head_norm_last_layer is ignored: the DINOv3 head has no weight-normalised last layer")
    return {new: cfg[old] for old, new in _OFFICIAL_HEAD_KEYS.items() if old in cfg}


@dataclass
class WarmStart:
    """Student and teacher as `ModuleDict(backbone=, dino_head=, ibot_head=)`, the official key layout."""

    student: nn.ModuleDict
    teacher: nn.ModuleDict
    backbone_kwargs: dict[str, Any]
    arch: str


def build_student_teacher_from_released(
    path: PathLike,
    dino_head_cfg: Mapping[str, Any],
    ibot_head_cfg: Mapping[str, Any],
    *,
    arch: str | Mapping[str, Any] | None = None,
    student_overrides: Mapping[str, Any] | None = None,
) -> WarmStart:
    """Continue SSL training from a released backbone: pretrained backbone + fresh DINO and iBOT heads.

    Released files have no heads, so both heads are initialised (upstream scheme) and the teacher is an
    exact copy of the student: frozen (requires_grad False), eval mode, no drop path. `student_overrides`
    go to the student backbone only (e.g. `drop_path_rate=0.3`, RoPE augmentations).
    """
    sd = read_backbone_state_dict(path)
    label, kwargs = resolve_arch(sd, arch, str(path))
    student_kwargs = {**kwargs, **(student_overrides or {})}
    student_backbone = _build_and_load(sd, student_kwargs, str(path), label, "cpu")
    dim = student_backbone.embed_dim
    student = nn.ModuleDict(
        {
            "backbone": student_backbone,
            "dino_head": DINOHead(dim, **head_kwargs(dino_head_cfg)),
            "ibot_head": DINOHead(dim, **head_kwargs(ibot_head_cfg)),
        }
    ).train()
    teacher = copy.deepcopy(student).eval().requires_grad_(False)
    for block in teacher["backbone"].blocks:
        block.sample_drop_ratio = 0.0
    return WarmStart(student=student, teacher=teacher, backbone_kwargs=kwargs, arch=label)
