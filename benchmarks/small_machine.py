"""Training on a small machine: memory and speed of full fine-tuning, frozen blocks and LoRA, and the memory watch.

    python benchmarks/small_machine.py --output bench-output            # ~20 minutes on 2 cores
    python benchmarks/small_machine.py --quick --output bench-output    # ~6 minutes

Part 1, side by side for ViT-S/16 and ViT-B/16 warm-started from released-layout weights (random values with the
released flags, built here: nothing is downloaded): peak memory, trainable parameters and images/s of

* full fine-tuning (every weight, two AdamW states each),
* the first half of the blocks frozen, with the patch embedding (`student.freeze_blocks`),
* LoRA r = 8 and r = 16 on qkv and proj (`student.lora.rank`; the rest of the backbone frozen, heads train).

Part 2, ViT-S full fine-tuning under `train.memory_budget_gb` set to 80 % of its own measured peak, without and with
the memory watch: peak memory, system swap-in/out during the run, step-time p50 / p99, re-plans. Without the watch
the budget is only the planner's: nothing holds the run to it.

Every run is a fresh `python -m dinov3_core.train` process on a real tile store (the sample slides tiled at 224 px,
shared with train_step.py), one torch thread, no loader workers (each would add its own ~100 MiB). Peak memory is
the memory watch's reading: the training process's RSS plus its workers' private memory, sampled every 50 ms. Step
times skip the first two iterations (allocator warm-up). Output: markdown tables on stdout and
`<output>/small_machine.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from train_step import make_store, model_overrides

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {"vit_small": "vits16", "vit_base": "vitb16"}


def released_weights(work: Path, arch: str) -> Path:
    """A backbone file in the released key layout and flags (4 registers, masked K bias, layerscale 1e-5)."""
    from dinov3_core.models import build_backbone, save_backbone

    path = work / f"released_{arch}.pth"
    if not path.exists():
        torch.manual_seed(0)
        save_backbone(build_backbone(arch), path)
    return path


def base_overrides(store: Path, weights: Path, arch: str, quick: bool, iterations: int) -> dict[str, Any]:
    return {
        "data.stores": [str(store)],
        "data.num_workers": 0,
        "tracking.enabled": False,
        **model_overrides(arch, quick, 2 if quick else 4, 4096 if quick else 16384),
        "student.pretrained_weights": str(weights),
        "student.drop_path_rate": 0.1,
        "train.global_batch_size": 8,
        "train.batch_size_per_gpu": 8,
        "train.num_threads": 1,
        "train.log_period": 1,
        "train.stop_at": iterations,
        "train.memory_watch_period": 1,
        "optim.epochs": 1,
        "train.epoch_length": iterations,
        "optim.warmup_epochs": 0,
        "teacher.warmup_teacher_temp_epochs": 0,
        "optim.freeze_last_layer_epochs": 0,
        "checkpointing.period": 10**6,
        "evaluation.eval_period_iterations": 0,
        "health.probe_tiles": 0,
    }


def trainable_parameters(overrides: dict[str, Any]) -> tuple[int, int]:
    """(trainable, total) student parameters of this configuration (built on the meta device)."""
    from dinov3_core.config import load_config
    from dinov3_core.train.config import PretrainConfig
    from dinov3_core.train.memory import model_shape

    cfg = load_config(PretrainConfig, "tiny", {**overrides, "output_dir": "unused"}, stage="pretrain")
    shape = model_shape(cfg)
    return shape.trainable_params, shape.student_params


def run(out: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """One fresh training process (a previous run's directory is removed: it would resume, not train); its figures
    from `training_metrics.json` and system swap counters around it."""
    shutil.rmtree(out, ignore_errors=True)
    argv = ["-m", "dinov3_core.train", "--config", "tiny", f"output_dir={json.dumps(str(out))}"]
    argv += [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    swap_before = psutil.swap_memory()
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *argv], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, cwd=ROOT
    )
    wall = time.perf_counter() - start
    swap_after = psutil.swap_memory()
    if proc.returncode != 0:
        raise RuntimeError(f"training run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "training_metrics.json").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    timed = [r["iter_time"] for r in steps if r["iteration"] >= 2] or [r["iter_time"] for r in steps]
    events = [r for r in rows if r.get("event") == "memory_replan"]
    # Settled: from the second step after the last re-plan (the first one's window began before memory was released).
    settled = [r for r in steps if r["iteration"] > (events[-1]["iteration"] + 1 if events else 1)] or steps
    return {
        "peak_mb": max(r["memory_process_mb"] for r in steps),
        "settled_peak_mb": max(r["memory_process_mb"] for r in settled),  # after the last re-plan
        "settled_step_p50_s": statistics.median(r["iter_time"] for r in settled),
        "images_per_s": steps[-1]["global_batch_size"] / statistics.median(timed),
        "step_p50_s": statistics.median(timed),
        "step_p99_s": sorted(timed)[min(len(timed) - 1, round(0.99 * (len(timed) - 1)))],
        "swap_in_mb": (swap_after.sin - swap_before.sin) / 2**20,
        "swap_out_mb": (swap_after.sout - swap_before.sout) / 2**20,
        "replans": [f"it {r['iteration']}: {r['what']} → micro-batch {r['after']['micro_batch']}" for r in events],
        "final_micro_batch": steps[-1]["micro_batch_size"],
        "wall_s": wall,
    }


MODES: dict[str, dict[str, Any]] = {
    "full fine-tuning": {},
    "first half frozen": {"student.freeze_blocks": 6},  # both archs have 12 blocks
    "LoRA r=8": {"student.lora.rank": 8},
    "LoRA r=16": {"student.lora.rank": 16},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--store", help="existing tile store (default: sample slides tiled at 224 px)")
    args = parser.parse_args()
    out = Path(args.output).resolve()
    work = out / "small_machine_work"
    work.mkdir(parents=True, exist_ok=True)
    store = Path(args.store) if args.store else make_store(out / "train_step_work")
    iterations = 6 if args.quick else 10

    results: dict[str, Any] = {"modes": [], "budget": []}
    print(
        f"# Training on a small machine ({'quick' if args.quick else 'full'}): {platform.processor() or 'CPU'}, "
        f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, torch "
        f"{torch.__version__}, 1 thread, global batch 8\n"
    )
    print("| backbone | mode | trainable params | peak memory | img/s | vs full: memory | vs full: img/s |")
    print("|---|---|---|---|---|---|---|")
    for arch, released in ARCHS.items():
        weights = released_weights(work, released)
        base = base_overrides(store, weights, released, args.quick, iterations)
        full: dict[str, Any] | None = None
        for mode, extra in MODES.items():
            overrides = {**base, **extra}
            trainable, total = trainable_parameters(overrides)
            figures = run(work / f"{arch}-{mode.replace(' ', '_').replace('=', '')}", overrides)
            full = full or figures
            row = {"arch": arch, "mode": mode, "trainable": trainable, "params": total, **figures}
            results["modes"].append(row)
            print(
                f"| {arch} | {mode} | {trainable / 1e6:.2f} M of {total / 1e6:.1f} M | {figures['peak_mb']:.0f} MiB "
                f"| {figures['images_per_s']:.2f} | {figures['peak_mb'] / full['peak_mb']:.2f}× | "
                f"{figures['images_per_s'] / full['images_per_s']:.2f}× |",
                flush=True,
            )

    # Part 2: a budget below full fine-tuning's peak, without and with the watch.
    vit_s_full = next(r for r in results["modes"] if r["arch"] == "vit_small" and r["mode"] == "full fine-tuning")
    budget_gb = 0.8 * vit_s_full["peak_mb"] / 1024
    base = base_overrides(store, released_weights(work, "vits16"), "vits16", args.quick, 3 * iterations)
    print(f"\n## vit_small full fine-tuning under train.memory_budget_gb={budget_gb:.2f} (80 % of its peak)\n")
    print(
        "| memory watch | peak memory | after the last re-plan | swap in / out | step p50 | step p99 | "
        "step p50 after the last re-plan | re-plans |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for watch in (False, True):
        overrides = {
            **base,
            "train.memory_budget_gb": budget_gb,
            "train.memory_watch": watch,
            "train.memory_watch_patience": 2,
        }
        figures = run(work / f"budget-watch{int(watch)}", overrides)
        results["budget"].append({"memory_watch": watch, "budget_gb": budget_gb, **figures})
        settled = figures["settled_peak_mb"]
        within = "within" if settled <= budget_gb * 1024 else "over"
        print(
            f"| {'on' if watch else 'off'} | {figures['peak_mb']:.0f} MiB | {settled:.0f} MiB ({within} budget) | "
            f"{figures['swap_in_mb']:.0f} / {figures['swap_out_mb']:.0f} MiB | {figures['step_p50_s']:.2f} s | "
            f"{figures['step_p99_s']:.2f} s | {figures['settled_step_p50_s']:.2f} s | "
            f"{'; '.join(figures['replans']) or 'none'} |",
            flush=True,
        )
    results["machine"] = {
        "cores": psutil.cpu_count(),
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "swap_gib": psutil.swap_memory().total / 2**30,
        "torch": torch.__version__,
    }
    (out / "small_machine.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
