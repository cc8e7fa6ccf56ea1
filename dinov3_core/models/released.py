"""Released DINOv3 weights in and out: read and unwrap, strict loading, atomic saving, SSL warm start.

A released backbone file (`dinov3_vits16_pretrain_lvd1689m-08c60483.pth`, ...) is a plain dict of tensors with
the keys of `DinoVisionTransformer.state_dict()`. We read it, or the `{"teacher": {"backbone.*": ...}}` eval
checkpoint, or a `{"model": ...}` wrapper; and we write exactly that plain layout, so our backbones load
wherever released ones do (`torch.hub.load(..., weights=path)` included). Which architecture a file was
written for is `arch_inference`; the strict key/shape check with named mismatches is `state_dict_check`.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .arch_inference import infer_backbone_kwargs, resolve_arch
from .heads import DINOHead
from .state_dict_check import SHOW_KEYS, ReleasedWeightsError, UnreadableWeights, check_backbone_state_dict
from .vision_transformer import DinoVisionTransformer

__all__ = [
    "ReleasedWeightsError",
    "WarmStart",
    "backbone_state_dict",
    "build_student_teacher_from_released",
    "check_backbone_state_dict",
    "head_kwargs",
    "infer_backbone_kwargs",
    "load_released_backbone",
    "read_backbone_state_dict",
    "resolve_arch",
    "save_backbone",
    "unwrap_backbone_state_dict",
]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


# --- reading -----------------------------------------------------------------------------------------------


def read_backbone_state_dict(path: PathLike) -> dict[str, Tensor]:
    """The backbone tensors of a `.pth` / `.safetensors` file, unwrapped and with prefixes stripped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        try:
            # deferred: a readable error if safetensors is missing
            from safetensors.torch import load_file
        except ImportError as e:
            raise ImportError(f"{path}: reading .safetensors needs the `safetensors` package") from e
        obj: Any = load_file(str(path), device="cpu")
    else:
        try:
            # weights_only: a checkpoint is data, never code.
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling errors come in many types; all mean "not a plain tensor file"
            # torch's own text is a page of advice on unsafe loading; a user's file is loaded as data only.
            raise UnreadableWeights(
                f"{path}: cannot be read as a weights file (torch.load with weights_only=True: {type(e).__name__}); "
                "give a backbone .pth (released DINOv3, `wsidino convert` output) or .safetensors"
            ) from e
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
        raise ReleasedWeightsError(f"{source}: non-tensor entries {bad[:SHOW_KEYS]} (not a backbone state_dict)")
    if "cls_token" not in sd:
        raise ReleasedWeightsError(
            f"{source}: no `cls_token` key, so not a DINOv3 backbone; first keys: {list(sd)[:SHOW_KEYS]}"
        )
    return sd


# --- public loading API --------------------------------------------------------------------------------


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
    millions = sum(t.numel() for t in sd.values()) / 1e6
    logger.info(
        "loaded backbone (%s, %.2fM parameters) from %s: all %d tensors matched their keys (strict: none "
        "missing, none unexpected)",
        label,
        millions,
        source,
        len(sd),
    )
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
                # deferred: a readable error if safetensors is missing
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
