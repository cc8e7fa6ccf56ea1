"""Scale-out wrappers for the backbone and heads: activation checkpointing, per-block compile, FSDP2.

Apply in upstream's order: activation checkpointing → compile each block → `fully_shard` each block →
`fully_shard` the root. None of them changes state_dict keys. Meta-device flow:

    with torch.device("meta"):
        model = build_backbone("vit_large", n_storage_tokens=4, mask_k_bias=True, layerscale_init=1e-5)
    apply_activation_checkpointing(model)
    compile_blocks(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    apply_fsdp(model, init_device_mesh("cuda", (world_size,)), mp_policy=mp)
    model.to_empty(device="cuda")
    model.init_weights()
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_activation_checkpointing(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Recompute every transformer block in backward (a flag on each block; no wrapper modules)."""
    for block in getattr(model, "blocks", ()):
        block.activation_checkpointing = enabled
    return model


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """`torch.compile` each block in place (`Module.compile`, so keys keep no `_orig_mod.` prefix).

    Per-block compilation is upstream's choice: one small graph reused `depth` times compiles fast, and
    list inputs (global + local crops) only recompile per distinct crop-shape combination.
    """
    for block in getattr(model, "blocks", ()):
        block.compile(**compile_kwargs)
    return model


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2: `fully_shard` each block (its own all-gather unit), then the root for the remaining parameters.

    Pass an explicit mesh, also on CPU (`init_device_mesh("cpu", (world,))`): with a default process group
    on a GPU host, FSDP2 would otherwise move parameters to CUDA. Call once per model (backbone, each head).
    """
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in getattr(model, "blocks", ()):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model
