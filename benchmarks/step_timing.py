"""Timing, FLOP counting and the result rows that `benchmarks/machine_limits.py` and `benchmarks/upstream_step.py`
share (both import this module; neither imports the other's helpers), and our SSL training step as both run it."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

Step = Callable[[], None]


def environment(**extra: Any) -> dict[str, Any]:
    """What a timing depends on: torch, Python, the machine, its threads and CPU capability (and `extra`)."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **extra,
    }


def load_average() -> float:
    return os.getloadavg()[0]


# ----------------------------------------------------------------------------------------------------- peak


def matmul_peak(n: int, dtype: torch.dtype, repeats: int) -> float:
    """Best GFLOP/s of n×n×n matrix products (2n³ FLOPs each)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # first call: BLAS set-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


# -------------------------------------------------------------------------------------------------- timing


def interleaved(steps: dict[str, Step], rounds: int, per_round: int) -> dict[str, list[float]]:
    """Seconds per call of each step, `per_round` calls per round, the steps alternating round after round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # lazy set-up (oneDNN primitives, allocator) stays out of the timed rounds
        step()
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(per_round):
                step()
            times[name].append((time.perf_counter() - start) / per_round)
    return times


def fresh_dynamo() -> None:
    """Forget earlier sections' compiled code. All blocks share one `forward`, and Dynamo keeps at most
    `recompile_limit` (8) graphs per code object: past it, it falls back to eager *silently*, so a later section's
    "compiled" rows would time eager code (seen: compiled = eager, 1 s warm-up)."""
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64


def top_ops(step: Step, calls: int = 2, n: int = 8) -> list[dict[str, Any]]:
    """The operators taking the most CPU self time over `calls` calls of `step`."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
    events = list(prof.key_averages())
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"op": e.key[:60], "share": e.self_cpu_time_total / total, "calls": e.count // calls} for e in top]


def counted_flops(step: Step) -> float:
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return float(counter.get_total_flops())


def row(
    path: str, variant: str, seconds: list[float], flops: float, peak: float, items: int, unit: str, **extra: Any
) -> dict[str, Any]:
    median = statistics.median(seconds)
    gflops = flops / median / 1e9
    return {
        "path": path,
        "variant": variant,
        "items_per_s": items / median,
        "unit": unit,
        "spread": [items / max(seconds), items / min(seconds)],
        "gflops": gflops,
        "percent_of_peak": 100 * gflops / peak,
        "seconds": seconds,
        **extra,
    }


# ViT-S/16 at the shapes of the upstream comparison, on top of the `cpu` recipe (benchmarks/upstream_step.py).
VITS_UPSTREAM_SHAPES = {
    "student.arch": "vit_small",
    "student.pretrained_weights": None,
    "crops.global_size": 112,
    "crops.local_size": 48,
    "crops.n_local_crops": 8,
    "heads.dino.n_prototypes": 4096,
    "heads.ibot.n_prototypes": 4096,
}


def build_ours(cfg: Any, compiled: bool) -> tuple[Any, torch.optim.Optimizer]:
    """Our SSL model (seed 0: the same weights every call) and its AdamW, blocks compiled if asked."""
    from dinov3_core.models.parallel import compile_blocks
    from dinov3_core.train.optim import build_optimizer
    from dinov3_core.train.ssl_model import build_ssl_model

    torch.manual_seed(0)
    model = build_ssl_model(cfg).model.train()
    if compiled:
        compile_blocks(model.student["backbone"])
        compile_blocks(model.teacher["backbone"])
    return model, build_optimizer(model.student, cfg)
