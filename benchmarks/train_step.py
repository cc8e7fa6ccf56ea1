"""Pretraining step throughput on CPU: images/s per optimizer step, the data pipeline alone, peak RSS.

    python benchmarks/train_step.py --output bench-output            # full CPU run, several minutes on 2 cores
    python benchmarks/train_step.py --quick --output bench-output    # smoke run, ~2 minutes

Every training measurement is a real `python -m dinov3_core.train` run (1 process) or a torchrun launch
(2 gloo processes, FSDP2) in a fresh subprocess, on a real tile store (the tile stage on the sample slides,
224 px tiles), so peak RSS belongs to that run alone. Throughput is the effective (global) batch divided by
the median iteration time from `training_metrics.json`, skipping the first two iterations (allocator
warm-up). Models:

* tiny: `configs/pretrain/tiny.yaml` (vit_test, 2×64 + 2×32 px crops, 256 prototypes), global batch 16.
* vit_small: ViT-S/16 with the official 2×224 + 8×96 crops and 65536-prototype heads
  (`--quick`: 2×112 + 4×48 crops, 4096 prototypes). Global batch 4: 2 per process with 2 processes, the
  least per-rank KoLeo neighbour set.

Data pipeline alone: tile reads + iBOT masks through the step loader (0 and 2 workers), then the multi-crop
augmentation on CPU per image (`crops.rng_group_size=1`) and per 16 images, images/s without any model.

Output: a markdown table on stdout and `<output>/train_step.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def make_store(work: Path) -> Path:
    """Tile store from the built-in sample slides (cached in the work directory)."""
    store = work / "tiles224.zarr"
    if (store / "manifest.json").exists():
        return store
    from dinov3_core.config import load_config
    from dinov3_core.tiling.config import TileConfig
    from dinov3_core.tiling.engine import run_tile
    from wsidino_dev.sample_slides import make_sample_slides

    slides = make_sample_slides(work / "slides", "test", negatives=False)
    values = {
        "input": str(work / "slides"),
        "output": str(store),
        "tile_size": 224,
        "progress": False,
        "tracking.enabled": False,
    }
    run_tile(load_config(TileConfig, None, values))
    del slides
    return store


def model_overrides(arch: str, quick: bool, n_local_crops: int, prototypes: int) -> dict[str, Any]:
    """`arch` with `n_local_crops` local crops (224/96 px, 112/48 px `quick`) and 2048-wide heads of `prototypes`
    prototypes into a 256-wide bottleneck: a ViT-S-sized model and step for the benchmarks that time one."""
    return {
        "student.arch": arch,
        "crops.global_size": 112 if quick else 224,
        "crops.local_size": 48 if quick else 96,
        "crops.n_local_crops": n_local_crops,
        **{f"heads.{h}.n_prototypes": prototypes for h in ("dino", "ibot")},
        **{f"heads.{h}.hidden_dim": 2048 for h in ("dino", "ibot")},
        **{f"heads.{h}.bottleneck_dim": 256 for h in ("dino", "ibot")},
    }


def model_cases(quick: bool) -> dict[str, dict[str, Any]]:
    small = model_overrides("vit_small", quick, 4 if quick else 8, 4096 if quick else 65536)
    return {
        "tiny": {"overrides": {}, "global_batch": 16, "iterations": 12 if quick else 40},
        "vit_small": {"overrides": small, "global_batch": 4, "iterations": 4 if quick else 6},
    }


def run_training(store: Path, out: Path, case: dict[str, Any], nproc: int, threads: int) -> dict[str, Any]:
    overrides = {
        "data.stores": [str(store)],
        "output_dir": str(out),
        "tracking.enabled": False,
        "train.global_batch_size": case["global_batch"],
        "train.batch_size_per_gpu": case["global_batch"] // nproc,
        "train.num_threads": threads,
        "train.log_period": 1,
        "train.stop_at": case["iterations"],
        "optim.epochs": 1,
        "train.epoch_length": case["iterations"],
        "optim.warmup_epochs": 0,
        "teacher.warmup_teacher_temp_epochs": 0,
        "optim.freeze_last_layer_epochs": 0,  # a freeze as long as the run is refused (config.validate)
        "checkpointing.period": 10**6,
        "evaluation.eval_period_iterations": 0,
        "data.num_workers": 1,
        **case["overrides"],
    }
    argv = ["-m", "dinov3_core.train", "--config", "tiny", *(f"{k}={json.dumps(v)}" for k, v in overrides.items())]
    if nproc > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"training run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "training_metrics.json").read_text().splitlines()]
    timed = [r for r in rows if r["iteration"] >= 2] or rows
    step = statistics.median(r["iter_time"] for r in timed)
    return {
        "images_per_s": case["global_batch"] / step,
        "step_s": step,
        "data_time_s": statistics.median(r["data_time"] for r in timed),
        "peak_rss_mb_rank0": max(r["peak_memory_mb"] for r in rows),
        "max_rss_mb_all_ranks": max(r["max_rss_mb"] for r in rows),
        "loader_rss_mb": max(r.get("loader_rss_mb", 0.0) for r in rows),
        "wall_s": wall,
        "iterations": len(rows),
    }


def data_pipeline(store: Path, quick: bool, threads: int) -> list[dict[str, Any]]:
    """Loader (tile reads + masks) alone, and loader + CPU augmentation, images/s."""
    from dinov3_core.config import load_config
    from dinov3_core.data.augment import MultiCropAugmentation
    from dinov3_core.data.masking import IBOTMaskSampler
    from dinov3_core.train import config as C
    from dinov3_core.train.sampler import StepSampler
    from dinov3_core.train.step_batches import StepTileSource, augment_step, build_loader
    from dinov3_core.train.trainer_setup import open_tiles

    torch.set_num_threads(threads)
    results = []
    batch, steps = 16, 6 if quick else 20
    for crops_name, crop_values in (
        ("tiny 2x64+2x32", {}),
        ("official 2x224+8x96", {"crops.global_size": 224, "crops.local_size": 96, "crops.n_local_crops": 8}),
    ):
        cfg = load_config(
            C.PretrainConfig,
            "tiny",
            {"data.stores": [str(store)], "output_dir": "unused", **crop_values},
            stage="pretrain",
        )
        tiles = open_tiles(cfg)
        masks = IBOTMaskSampler(cfg.crops.global_size // 16)
        source = StepTileSource(tiles, masks, seed=0, n_global_crops=2)
        augmentation = MultiCropAugmentation(cfg.crops)
        for workers in (0, 2):
            sampler = StepSampler(len(tiles), batch, stop_iteration=steps + 1)
            loader = build_loader(
                source, sampler, num_workers=workers, prefetch_factor=2, pin_memory=False, multiprocessing_context=None
            )
            it = iter(loader)
            first = next(it)  # worker start-up is not throughput
            del first
            start = time.perf_counter()
            load_time = augment_time = grouped_time = 0.0
            for _ in range(steps):
                t0 = time.perf_counter()
                step = next(it)
                t1 = time.perf_counter()
                augment_step(
                    augmentation, step.images, seed=0, first_sample=step.first_sample, rank_offset=0, group_size=1
                )
                t2 = time.perf_counter()
                augment_time += t2 - t1
                load_time += t1 - t0
                augment_step(
                    augmentation, step.images, seed=0, first_sample=step.first_sample, rank_offset=0, group_size=batch
                )
                grouped_time += time.perf_counter() - t2
            total = time.perf_counter() - start - grouped_time
            del it
            results.append(
                {
                    "crops": crops_name,
                    "workers": workers,
                    "loader_images_per_s": batch * steps / load_time,
                    "augment_images_per_s": batch * steps / augment_time,
                    "augment_group16_images_per_s": batch * steps / grouped_time,
                    "pipeline_images_per_s": batch * steps / total,
                }
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--store", help="existing tile store (default: sample slides tiled at 224 px)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (1: robust on shared CPUs)")
    args = parser.parse_args()
    out = Path(args.output).resolve()
    work = out / "train_step_work"
    work.mkdir(parents=True, exist_ok=True)
    store = Path(args.store) if args.store else make_store(work)

    records: list[dict[str, Any]] = []
    for name, case in model_cases(args.quick).items():
        for nproc in (1, 2):
            run_dir = work / f"{name}_{nproc}proc"
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)
            result = run_training(store, run_dir, case, nproc, args.threads)
            records.append({"model": name, "processes": nproc, "global_batch": case["global_batch"], **result})
            print(f"# {name} × {nproc}: {result['images_per_s']:.1f} img/s", file=sys.stderr, flush=True)
    pipeline = data_pipeline(store, args.quick, args.threads)

    lines = [
        f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} thread(s)/process, "
        f"torch {torch.__version__}, load {os.getloadavg()[0]:.1f}{' (quick)' if args.quick else ''}",
        "",
        "| model | processes | global batch | images/s per optimizer step | s/step | data s/step | peak RSS MiB "
        "(rank 0) | max RSS MiB (ranks) | loader RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['model']} | {r['processes']} | {r['global_batch']} | {r['images_per_s']:.1f} | {r['step_s']:.3f} | "
            f"{r['data_time_s']:.4f} | {r['peak_rss_mb_rank0']:.0f} | {r['max_rss_mb_all_ranks']:.0f} | "
            f"{r['loader_rss_mb']:.0f} |"
        )
    lines += [
        "",
        "| data pipeline (batch 16, CPU) | workers | loader images/s (read + masks) | augmentation images/s "
        "(rng_group_size 1) | augmentation images/s (rng_group_size 16) | pipeline images/s (group 1) |",
        "|---|---|---|---|---|---|",
    ]
    for p in pipeline:
        lines.append(
            f"| {p['crops']} | {p['workers']} | {p['loader_images_per_s']:.0f} | {p['augment_images_per_s']:.0f} | "
            f"{p['augment_group16_images_per_s']:.0f} | {p['pipeline_images_per_s']:.0f} |"
        )
    print("\n".join(lines))
    payload = {
        "environment": {
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "torch": torch.__version__,
            "quick": args.quick,
            "loadavg": os.getloadavg(),
        },
        "training": records,
        "data_pipeline": pipeline,
    }
    (out / "train_step.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
