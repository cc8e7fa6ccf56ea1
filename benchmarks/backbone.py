"""Backbone throughput and memory: forward and forward+backward images/s, peak memory, and MFU on CUDA.

    python benchmarks/backbone.py --output bench-output            # full CPU run, a few minutes on 2 cores
    python benchmarks/backbone.py --quick --output bench-output    # smoke run, well under a minute

CPU: ViT-S/16 and ViT-B/16 (`vit_small`, `vit_base` presets) at 224², fp32 and bf16 autocast. Every
measurement runs in a fresh subprocess so that its peak RSS (`ru_maxrss`, the whole process including the
torch runtime, ~0.3 GB) belongs to that measurement alone.

CUDA (when available): ViT-B/16 and ViT-L/16 at 224², bf16 autocast, plus MFU against a *measured* bf16
matmul rate (8192³ matmuls), not a datasheet peak.

FLOPs per image (multiply-add = 2 FLOPs; norms, softmax, GELU, RoPE ignored, < 1%):
    T = 1 + n_storage_tokens + (H/p)(W/p)                        tokens
    patch embed  = 2 · (H/p)(W/p) · (3·p²) · D
    per block    = 2 · T · P_lin + 4 · T² · D                    P_lin = weights of qkv, proj and FFN linears;
                                                                  4·T²·D = QKᵀ and attention·V
    forward      = patch embed + depth · per block
    fwd+bwd      = 3 · forward                                   (backward = 2 × forward)
    MFU          = FLOPs/img · img/s / measured bf16 matmul FLOP/s

Throughput is batch / median step time over `--iters` timed steps, after `--warmup` untimed ones. On a
shared CPU, competing processes make multi-threaded steps several times slower (one descheduled thread
stalls every op); each row records the 1-minute load average, and `--threads 1` is the robust choice there.

Output: a markdown table on stdout and `<output>/backbone.json` (environment + one record per measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dinov3_core.models import DinoVisionTransformer, build_backbone


def flops_per_image(model: DinoVisionTransformer, height: int, width: int) -> float:
    """Forward FLOPs of one image (formula in the module docstring)."""
    p, dim = model.patch_size, model.embed_dim
    hw = (height // p) * (width // p)
    tokens = 1 + model.n_storage_tokens + hw
    flops = 2.0 * hw * model.patch_embed.in_chans * p * p * dim
    for block in model.blocks:
        linear_weights = sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear))
        flops += 2.0 * tokens * linear_weights + 4.0 * tokens**2 * dim
    return flops


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """One (model, precision, mode) measurement in this process."""
    device, mode, batch = cfg["device"], cfg["mode"], cfg["batch_size"]
    if device == "cpu" and cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    model = build_backbone(cfg["model"], device=device)
    x = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"], device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=cfg["precision"] == "bf16")

    def step() -> None:
        if mode == "forward":
            with torch.inference_mode(), autocast:
                model(x)
        else:
            with autocast:
                out = model(x, is_training=True)
                loss = out["x_norm_clstoken"].float().square().mean() + out["x_norm_patchtokens"].float().mean()
            loss.backward()
            model.zero_grad(set_to_none=True)

    model.train(mode != "forward")
    for _ in range(cfg["warmup"]):
        step()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(cfg["iters"]):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    # Median, not mean: on a shared CPU one descheduled thread stalls a whole step, and such outliers say
    # more about the neighbours than about the model.
    seconds = statistics.median(times)

    fwd_flops = flops_per_image(model, cfg["img_size"], cfg["img_size"])
    flops = fwd_flops * (1 if mode == "forward" else 3)
    result = {
        **cfg,
        "params": sum(p.numel() for p in model.parameters()),
        "img_per_s": batch / seconds,
        "img_per_s_best": batch / min(times),
        "s_per_iter": seconds,
        "iter_times_s": times,
        "load_average_1m": os.getloadavg()[0],  # above the core count: competing work skews this row
        "gflop_per_img": flops / 1e9,
        "achieved_tflops": flops * batch / seconds / 1e12,
    }
    if device == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        result["peak_mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return result


def measure_bf16_matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def run_in_subprocess(cfg: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return {**cfg, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfgs = []
    common = {"img_size": args.img_size, "warmup": args.warmup, "iters": args.iters, "threads": args.threads}
    for model in args.models:
        for precision in ("fp32", "bf16"):
            for mode in ("forward", "forward+backward"):
                cfgs.append(
                    {
                        **common,
                        "device": "cpu",
                        "model": model,
                        "precision": precision,
                        "mode": mode,
                        "batch_size": args.batch_size,
                    }
                )
    if torch.cuda.is_available():
        for model in args.cuda_models:
            for mode in ("forward", "forward+backward"):
                cfgs.append(
                    {
                        **common,
                        "device": "cuda",
                        "model": model,
                        "precision": "bf16",
                        "mode": mode,
                        "batch_size": args.cuda_batch_size,
                        "warmup": 3,
                        "iters": 10,
                    }
                )
    return cfgs


def markdown(results: list[dict[str, Any]]) -> str:
    has_mfu = any("mfu" in r for r in results)
    head = "| device | model | precision | mode | batch | img/s | GFLOP/img | TFLOP/s | peak mem GiB | load |"
    head += " MFU |" if has_mfu else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['device']} | {r['model']} | {r['precision']} | {r['mode']} | error: {r['error']} |")
            continue
        row = (
            f"| {r['device']} | {r['model']} | {r['precision']} | {r['mode']} | {r['batch_size']} "
            f"| {r['img_per_s']:.2f} | {r['gflop_per_img']:.1f} | {r['achieved_tflops']:.3f} "
            f"| {r['peak_mem_gib']:.2f} | {r['load_average_1m']:.1f} |"
        )
        if has_mfu:
            row += f" {r['mfu'] * 100:.1f}% |" if "mfu" in r else " |"
        lines.append(row)
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],  # > cpu_count means other work was competing for the CPU
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("bench-output"), help="directory for backbone.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: ViT-S only, batch 1, 1 iteration, no warm-up")
    parser.add_argument("--models", nargs="+", default=["vit_small", "vit_base"])
    parser.add_argument("--cuda-models", nargs="+", default=["vit_base", "vit_large"])
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8, help="CPU batch size")
    parser.add_argument("--cuda-batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations (the 2nd is still slow on CPU)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return
    if args.quick:
        args.models, args.cuda_models = ["vit_small"], ["vit_base"]
        args.batch_size, args.cuda_batch_size, args.warmup, args.iters = 1, 8, 0, 1

    env = environment()
    start = time.perf_counter()
    results = []
    for cfg in plan(args):
        results.append(run_in_subprocess(cfg))
        r = results[-1]
        status = r.get("error") or f"{r['img_per_s']:.2f} img/s"
        print(f"  {cfg['device']} {cfg['model']} {cfg['precision']} {cfg['mode']}: {status}", file=sys.stderr)
    if torch.cuda.is_available():
        peak = measure_bf16_matmul_tflops()
        env["cuda_bf16_matmul_tflops"] = peak
        for r in results:
            if r["device"] == "cuda" and "error" not in r:
                r["mfu"] = r["achieved_tflops"] / peak
    env["wall_s"] = time.perf_counter() - start
    env["load_average_1m_end"] = os.getloadavg()[0]

    table = markdown(results)
    print(table)
    args.output.mkdir(parents=True, exist_ok=True)
    out = args.output / "backbone.json"
    out.write_text(json.dumps({"environment": env, "results": results}, indent=2) + "\n")
    print(f"\nwrote {out} ({env['wall_s']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
