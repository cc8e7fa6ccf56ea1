"""Parameter-efficient adaptation of a backbone: LoRA adapters (peft) and frozen leading blocks.

    apply_adaptation(backbone, freeze_blocks=4, freeze_patch_embed=True, lora=LoRASettings(rank=8))
    ...train...
    merge_lora(backbone)  # W ← W + (alpha/r)·B@A in place, peft wrappers removed: the released key layout again

With LoRA (rank > 0), peft wraps the Linear layers named by `targets` in blocks ≥ freeze_blocks and freezes every
other backbone parameter (patch embedding, tokens, norms, layer scales, the base weights). Without it, blocks
< freeze_blocks (and, with `freeze_patch_embed`, the patch embedding and learned tokens) get requires_grad False.
Either way, when nothing before block K needs a gradient, autograd saves no activations for blocks < K.

State dict keys under LoRA are peft's: `blocks.1.attn.qkv.base_layer.weight`, `….lora_A.default.weight`,
`….lora_B.default.weight`. `merge_lora_state_dict` folds them back into released keys without a module (eval
teacher files, convert, the gram teacher refresh).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dinov3_core.config import ConfigError

# target name → module paths inside a block (fc1/fc2: the GELU MLP; ffn: every Linear of the FFN, SwiGLU w1/w2/w3)
TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("attn.qkv",),
    "proj": ("attn.proj",),
    "fc1": ("mlp.fc1",),
    "fc2": ("mlp.fc2",),
    "ffn": ("mlp.",),  # prefix: every nn.Linear below the block's `mlp`
}
ADAPTER = "default"  # peft's adapter name (in every LoRA key)
LORA_KEY = ".lora_"  # in `….lora_A.default.weight`, `….lora_B.default.weight`
BASE_KEY = ".base_layer."
# Parameters before the first block: frozen with the leading blocks so backward stops at block K.
EMBEDDINGS = ("patch_embed", "cls_token", "storage_tokens", "mask_token")


@dataclass(frozen=True)
class LoRASettings:
    """The subset of `student.lora` that shapes the model (duck-typed: the config dataclass fits too)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: Sequence[str] = field(default_factory=lambda: ("qkv", "proj"))


def lora_target_names(backbone: nn.Module, targets: Sequence[str], first_block: int = 0) -> list[str]:
    """Full names of the Linear modules LoRA wraps: `targets` in blocks ≥ `first_block`, in module order."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ConfigError(f"student.lora.targets: unknown {unknown}; valid: {sorted(TARGETS)}")
    names = []
    for i, block in enumerate(backbone.blocks):
        if i < first_block:
            continue
        for sub, module in block.named_modules():
            if isinstance(module, nn.Linear) and any(
                sub == path or (path.endswith(".") and sub.startswith(path)) for t in targets for path in TARGETS[t]
            ):
                names.append(f"blocks.{i}.{sub}")
    missing = [t for t in targets if not any(_matches(n, t) for n in names)]
    if missing:
        ffn = type(backbone.blocks[0].mlp).__name__ if len(backbone.blocks) else "?"
        raise ConfigError(
            f"student.lora.targets: {missing} match no Linear layer of this backbone (FFN {ffn}, blocks "
            f"{first_block}..{len(backbone.blocks) - 1}); valid: {sorted(TARGETS)} (fc1/fc2 are the GELU MLP's, "
            "ffn is every FFN linear incl. SwiGLU w1/w2/w3)"
        )
    return names


def _matches(name: str, target: str) -> bool:
    return any(f".{p}" in name if p.endswith(".") else name.endswith(f".{p}") for p in TARGETS[target])


def apply_adaptation(backbone: nn.Module, *, freeze_blocks: int, freeze_patch_embed: bool, lora: LoRASettings) -> None:
    """Freeze and/or add LoRA adapters in place (see the module docstring). Heads are never touched."""
    depth = len(backbone.blocks)
    if freeze_blocks > depth:
        raise ConfigError(
            f"student.freeze_blocks={freeze_blocks} but the backbone has only {depth} blocks: set it to at most "
            f"{depth} (0 trains every block)"
        )
    if lora.rank > 0:
        if freeze_blocks == depth:
            raise ConfigError(
                f"student.freeze_blocks={freeze_blocks} leaves no block for LoRA (depth {depth}); lower it"
            )
        # Imported here: peft costs seconds to import and runs without LoRA never need it.
        from peft import LoraConfig, inject_adapter_in_model

        names = lora_target_names(backbone, lora.targets, freeze_blocks)
        config = LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=names, bias="none"
        )
        inject_adapter_in_model(config, backbone, adapter_name=ADAPTER)  # also freezes every non-LoRA parameter
        return
    if freeze_blocks == 0:
        return
    for block in backbone.blocks[:freeze_blocks]:
        block.requires_grad_(False)
    if freeze_patch_embed:
        for name in EMBEDDINGS:
            part = getattr(backbone, name, None)  # a module (patch_embed) or a parameter (the tokens)
            if part is not None:
                part.requires_grad_(False)


@torch.no_grad()
def share_frozen_weights(student: nn.Module, teacher: nn.Module) -> int:
    """Point the teacher at the student's frozen parameters (LoRA base weights, frozen blocks) instead of its own
    copies; returns the bytes freed. Safe because frozen weights never change and the EMA skips them, so both copies
    are equal forever (checked here); one process only: FSDP shards the two modules separately."""
    theirs = dict(teacher.named_parameters())
    freed = 0
    for name, param in student.named_parameters():
        twin = theirs.get(name)
        if param.requires_grad or twin is None or twin is param or twin.shape != param.shape:
            continue
        if twin.dtype != param.dtype or twin.device != param.device or not torch.equal(twin, param):
            continue  # not the same weight (a teacher loaded from elsewhere): keep both
        owner, _, leaf = name.rpartition(".")
        setattr(teacher.get_submodule(owner) if owner else teacher, leaf, param)
        freed += twin.numel() * twin.element_size()
    return freed


def has_lora(module: nn.Module) -> bool:
    return any(LORA_KEY in name for name, _ in module.named_parameters())


def lora_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """Only the adapter tensors (`….lora_A.default.weight`, `….lora_B.default.weight`) of `module`."""
    return {k: v for k, v in module.state_dict().items() if LORA_KEY in k}


def lora_scalings(module: nn.Module) -> dict[str, float]:
    """{LoRA module name: alpha / r} below `module` (names relative to it; works on FSDP-wrapped modules)."""
    # deferred: peft is slow to import (it pulls transformers), only with LoRA
    from peft.tuners.lora import LoraLayer

    return {name: layer.scaling[ADAPTER] for name, layer in module.named_modules() if isinstance(layer, LoraLayer)}


def merge_lora(backbone: nn.Module) -> nn.Module:
    """peft's own merge (W += B@A·scaling, bias untouched), then each LoRA layer replaced by its base layer:
    the state dict has exactly the released key layout again. In place; returns `backbone`."""
    if not has_lora(backbone):
        return backbone
    # deferred: peft is slow to import (it pulls transformers), only with LoRA
    from peft.tuners.lora import LoraLayer

    layers = [(name, m) for name, m in backbone.named_modules() if isinstance(m, LoraLayer)]
    for name, layer in layers:
        layer.merge(safe_merge=True)  # safe: raises on a non-finite merged weight instead of writing it
        parent_name, _, child = name.rpartition(".")
        setattr(backbone.get_submodule(parent_name) if parent_name else backbone, child, layer.get_base_layer())
    return backbone


@torch.no_grad()
def merge_lora_state_dict(sd: Mapping[str, Tensor], scaling: float | Mapping[str, float]) -> dict[str, Tensor]:
    """A LoRA state dict folded into released keys, without a module: for every LoRA module `m`,
    `m.weight = m.base_layer.weight + scaling·(B @ A)` in fp32 (peft's delta for fan_in_fan_out false, the only
    case for nn.Linear), `m.base_layer.*` → `m.*`, adapter tensors dropped. `scaling`: alpha / r for every module,
    or per module name (`lora_scalings`). A state dict without LoRA keys comes back unchanged (a copy)."""
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        if LORA_KEY in key:
            continue
        if BASE_KEY not in key:
            out[key] = value
            continue
        module, _, leaf = key.partition(BASE_KEY)
        if leaf == "weight":
            a, b = sd[f"{module}.lora_A.{ADAPTER}.weight"], sd[f"{module}.lora_B.{ADAPTER}.weight"]
            s = scaling if isinstance(scaling, float | int) else scaling[module]
            value = (value.float() + s * (b.float() @ a.float())).to(value.dtype)
        out[f"{module}.{leaf}"] = value
    return out
