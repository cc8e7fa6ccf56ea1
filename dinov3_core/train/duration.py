"""How long a training run will take on this machine, estimated before it starts: the matrix products of one step
(the model's shape on the meta device, the configured crops and batch), divided by what this machine's matrix unit
delivers (a short measurement) at the share of it a training step reaches (`EFFICIENCY`).

It is a floor, not a forecast: data loading, element-wise work and (on small models) Python overhead come on top,
so a run is rarely faster than this. The point is to say before the first step that a ViT-L recipe on a CPU box
would take weeks (`dinov3_core.chain.check_duration` asks for `--yes` past a day).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dinov3_core.train import config as C
from dinov3_core.train.memory import model_shape
from dinov3_core.train.memory_terms import masked_patches_per_image, tokens_per_image

# The share of the measured matrix-multiply rate a whole training step reaches (attention, normalisation and the
# optimizer run below peak); docs/benchmarks.md ("Training step: ours vs upstream") has the measured steps.
EFFICIENCY = {"cpu": 0.35, "cuda": 0.35}
PROBE_SECONDS = 0.2  # how long the matrix-multiply rate is measured


@dataclass(frozen=True)
class Duration:
    seconds: float
    iterations: int
    step_flops: float
    device: str

    def describe(self) -> str:
        return f"≥ {human(self.seconds)} for {self.iterations} iterations on {self.device}"


def human(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def step_flops(cfg: C.PretrainConfig, global_batch: int, extra_teacher_passes: int = 0) -> float:
    """Matrix-product FLOPs of one optimizer step: the student forward and backward on every crop, the EMA teacher
    forward on the global crops (`extra_teacher_passes`: more such passes, gram's frozen teacher), both heads."""
    shape = model_shape(cfg)
    d, depth = shape.embed_dim, shape.depth
    global_tokens, local_tokens = tokens_per_image(cfg, shape)
    crops = cfg.crops
    per_global = global_tokens / max(1, crops.n_global_crops)
    per_local = local_tokens / max(1, crops.n_local_crops) if crops.n_local_crops else 0.0

    def backbone(tokens: float) -> float:  # one crop's forward: the linear layers and attention of every block
        return depth * (24 * tokens * d * d + 4 * tokens * tokens * d)

    def head(rows: float, prototypes: int) -> float:  # the MLP head and the prototype layer, forward
        h, b = shape.head_hidden, shape.head_bottleneck
        return 2 * rows * (d * h + h * h + h * b + b * prototypes)

    global_fwd = crops.n_global_crops * backbone(per_global)
    local_fwd = crops.n_local_crops * backbone(per_local)
    cls_rows = crops.n_global_crops + crops.n_local_crops
    heads = head(cls_rows, shape.dino_prototypes) + head(masked_patches_per_image(cfg, shape), shape.ibot_prototypes)
    student = 3 * (global_fwd + local_fwd + heads)  # forward + backward (twice the forward)
    teacher = (1 + extra_teacher_passes) * (global_fwd + head(crops.n_global_crops, shape.dino_prototypes))
    return (student + teacher) * global_batch


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of square matrix products on `device` (bf16 on CUDA, fp32 on CPU), measured for `PROBE_SECONDS`."""
    n = 2048 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < PROBE_SECONDS:
        a @ b
        done += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return 2 * n**3 * done / (time.perf_counter() - start)


def global_batch(cfg: C.PretrainConfig, world_size: int) -> int | None:
    """The step's images (None while `batch_size_per_gpu=auto` leaves it to the memory plan at start)."""
    if cfg.train.global_batch_size is not None:
        return int(cfg.train.global_batch_size)
    micro = cfg.train.batch_size_per_gpu
    return micro * cfg.train.accumulation_steps * world_size if isinstance(micro, int) else None


def estimate(cfg: Any, world_size: int, extra_teacher_passes: int = 0) -> Duration | None:
    """The run's duration floor on this machine's device (`train.device`), for `world_size` processes sharing it
    (CPU) or one GPU each; None when the batch is left to the memory plan."""
    batch = global_batch(cfg, world_size)
    if batch is None or cfg.student.arch == "auto":  # the batch or the architecture is only known at start
        return None
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    iterations = C.total_iterations(cfg)
    if cfg.train.stop_at is not None:
        iterations = min(iterations, cfg.train.stop_at)
    flops = step_flops(cfg, batch, extra_teacher_passes)
    rate = matmul_rate(device) * EFFICIENCY[device.type] * (world_size if cuda else 1)  # CPU ranks share the cores
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({torch.get_num_threads()} threads)"
    return Duration(iterations * flops / rate, iterations, flops, name)


__all__ = ["Duration", "estimate", "global_batch", "human", "matmul_rate", "step_flops"]
