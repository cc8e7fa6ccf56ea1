"""Two processes on one device (run by tests/test_gpu.py under torchrun --nproc-per-node 2): an all_reduce, then
our FSDP2 wrapping (`apply_fsdp`: per block + root) of a seeded `vit_test` backbone with one forward/backward.

CUDA: NCCL, both ranks on cuda:0 (the test skips when NCCL refuses two ranks on one GPU, "Duplicate GPU detected").
CPU: gloo. Each rank checks on its half of the batch that forward outputs and (reduce-scattered) gradients equal the
single-process full-batch ones, and prints one JSON line `{"rank", "all_reduce", "max_out_diff", ...}`.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dinov3_core.models import HUB_SETTINGS, apply_fsdp, build_backbone


def loss_fn(outputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    # Per-sample means: the average of the ranks' losses is the full-batch loss.
    return sum(o["x_norm_clstoken"].square().mean() + o["x_norm_patchtokens"].sin().mean() for o in outputs)


def main() -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)

    mesh = init_device_mesh(device.type, (world,))
    # No RoPE rescaling: train mode must be deterministic to compare processes; layer scale 1 so blocks matter.
    kwargs = {**HUB_SETTINGS, "layerscale_init": 1.0, "pos_embed_rope_rescale_coords": None}
    torch.manual_seed(0)
    reference = build_backbone("vit_test", **kwargs).train().to(device)
    sharded = copy.deepcopy(reference)
    apply_fsdp(sharded, mesh)

    gen = torch.Generator().manual_seed(1)
    per_rank = 2
    images = [
        torch.randn(world * per_rank, 3, 64, 48, generator=gen).to(device),
        torch.randn(world * per_rank, 3, 32, 32, generator=gen).to(device),
    ]
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    ref_out = reference(images, is_training=True)
    loss_fn(ref_out).backward()
    out = sharded([x[mine] for x in images], is_training=True)
    loss_fn(out).backward()

    max_out = max(
        (o[key] - r[key][mine]).abs().max().item()
        for o, r in zip(out, ref_out, strict=True)
        for key in ("x_norm_clstoken", "x_norm_patchtokens")
    )
    ref_params = dict(reference.named_parameters())
    max_grad = max(
        (p.grad.full_tensor() - ref_params[name].grad).abs().max().item() for name, p in sharded.named_parameters()
    )
    result = {
        "rank": rank,
        "device": str(device),
        "backend": dist.get_backend(),
        "all_reduce": value.item(),
        "max_out_diff": max_out,
        "max_grad_diff": max_grad,
        "param_types": sorted({type(p).__name__ for p in sharded.parameters()}),
    }
    sys.stdout.write(json.dumps(result) + "\n")  # one write: the ranks share torchrun's stdout
    sys.stdout.flush()
    dist.barrier()  # no rank tears its group down while the other still talks to it (seen: SIGABRT at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
