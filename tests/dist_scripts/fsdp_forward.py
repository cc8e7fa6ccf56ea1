"""FSDP2 parity on CPU/gloo (run by tests/test_models_fsdp.py under torchrun, 2 processes).

Each rank builds the same seeded `vit_test` backbone, keeps an unsharded copy as the reference, shards the
other with `fully_shard` per block + root on `init_device_mesh("cpu", (world,))`, and checks on its half of
the batch that forward outputs and (all-reduced) gradients equal the single-process ones. Then it checks the
meta-device flow (build on meta → shard → to_empty → init_weights) and released-layout saving from shards.
Prints one JSON line `{"rank", "max_out_diff", "max_grad_diff", ...}` per rank.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dinov3_core.models import (
    HUB_SETTINGS,
    apply_activation_checkpointing,
    apply_fsdp,
    build_backbone,
    save_backbone,
)
from dinov3_core.models.released import load_released_backbone


def loss_fn(outputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    # Per-sample means, so that the average of the ranks' losses is the full-batch loss.
    return sum(o["x_norm_clstoken"].square().mean() + o["x_norm_patchtokens"].sin().mean() for o in outputs)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    # Layer scale 1: the blocks, not only the embeddings, shape outputs and gradients. No RoPE rescaling:
    # train mode must be deterministic to compare processes.
    kwargs = {**HUB_SETTINGS, "layerscale_init": 1.0, "pos_embed_rope_rescale_coords": None}

    torch.manual_seed(0)
    reference = build_backbone("vit_test", **kwargs).train()
    sharded = copy.deepcopy(reference)
    apply_activation_checkpointing(sharded)  # AC under FSDP2 must not change numbers either
    apply_fsdp(sharded, mesh)

    gen = torch.Generator().manual_seed(1)
    per_rank = 2
    images = [
        torch.randn(world * per_rank, 3, 64, 48, generator=gen),
        torch.randn(world * per_rank, 3, 32, 32, generator=gen),
    ]
    mine = slice(rank * per_rank, (rank + 1) * per_rank)

    ref_out = reference(images, is_training=True)
    loss_fn(ref_out).backward()  # full batch, one process
    out = sharded([x[mine] for x in images], is_training=True)
    loss_fn(out).backward()  # FSDP reduce-scatter averages the two halves' gradients

    max_out = max(
        (o[key] - r[key][mine]).abs().max().item()
        for o, r in zip(out, ref_out, strict=True)
        for key in ("x_norm_clstoken", "x_norm_patchtokens", "x_prenorm")
    )
    ref_params = dict(reference.named_parameters())
    max_grad = max(
        (p.grad.full_tensor() - ref_params[name].grad).abs().max().item() for name, p in sharded.named_parameters()
    )
    sharded_types = {type(p).__name__ for p in sharded.parameters()}

    # Meta-device construction: nothing allocated until to_empty, then the official init.
    with torch.device("meta"):
        big = build_backbone("vit_test", **HUB_SETTINGS)
    apply_fsdp(big, mesh)
    big.to_empty(device="cpu")
    big.init_weights()
    meta_ok = bool(torch.isfinite(big(images[0][mine])).all())

    # Released-layout saving from sharded parameters: all ranks gather, rank 0 writes.
    path = os.path.join(sys.argv[1], "fsdp_backbone.pth")
    save_backbone(sharded, path)
    dist.barrier()
    reloaded = load_released_backbone(path).state_dict()
    save_ok = all(torch.equal(v, reloaded[k]) for k, v in reference.state_dict().items())

    result = {
        "rank": rank,
        "max_out_diff": max_out,
        "max_grad_diff": max_grad,
        "param_types": sorted(sharded_types),
        "meta_init_ok": meta_ok,
        "save_ok": save_ok,
    }
    # One write per line: both ranks share torchrun's stdout, and print() writes the text and its newline
    # separately, so two ranks' lines could interleave into one ("Extra data" in the test's json.loads).
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
