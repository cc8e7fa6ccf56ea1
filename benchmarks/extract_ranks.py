"""Extraction as a torchrun job: tiles/s with 1 and 2 ranks side by side, and what bf16 / fp16 autocast do to the
features (vs fp32); with CUDA, ViT-B tiles/s per GPU for 1 … N ranks, loading included.

The same store and models as benchmarks/extract.py (the tile stage on the "test" sample slides, 224 px tiles at
0.5 µm/px, stride 64: ~550 overlapping tiles; randomly initialised `vit_small` in the released layout). Each row is
one `run_stage("extract", …)` as `wsidino extract` runs it: "in process" (one process, no torchrun) or a torchrun
job of N gloo ranks (`--nproc-per-node N`), everything included (torchrun and every rank's start-up, opening the
store and the model, reading, the model, zarr writes; PCA maps off). "work tiles/s" is the sum over ranks of each
rank's tiles / its own time in the extraction loop: what the ranks did once started. Rows are interleaved over
`--repeats`, best kept.

On a CPU host the ranks share its cores (each rank gets cores / ranks intra-op threads), so more ranks buy no
arithmetic: the CPU rows measure what a job costs over one process. The point of ranks is one per GPU.

Usage: python benchmarks/extract_ranks.py [--quick] [--output DIR]   (writes DIR/extract_ranks.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from extract import extract_config, make_model, make_store  # the sibling script (its dir is sys.path[0])

from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.extract.extract import read_run_record
from dinov3_core.inference.feature_model import open_model
from dinov3_core.launch.training import LaunchSettings
from dinov3_core.runner import run_stage


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def one_run(store: Path, model: Path, out: Path, ranks: int | None, values: dict[str, Any]) -> dict[str, Any]:
    """`ranks` None: in process; else a torchrun job of that many ranks."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_suffix(""), ignore_errors=True)
    cfg = extract_config(store, model, out, values, stage="extract")
    start = time.perf_counter()
    launch = LaunchSettings(nproc_per_node=ranks) if ranks else None
    run_stage("extract", cfg, launch=launch, force=True)
    seconds = time.perf_counter() - start
    record = read_run_record(out)
    tiles = int(record["tiles"])
    work = sum(r["tiles_per_s"] for r in record["ranks"])
    return {"tiles": tiles, "seconds": seconds, "tiles_per_s": tiles / seconds, "work_tiles_per_s": work}


def parity(weights: Path, store: Path, device: str, n: int = 128) -> list[dict[str, Any]]:
    """bf16 / fp16 autocast vs fp32 on `n` real tiles: max abs error over the CLS scale, and the worst cosine."""
    ds = TileDataset(store, image_format="numpy")
    tiles = ds.read_batch(np.arange(min(n, len(ds))))
    ref = None
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        model = open_model(weights, backend="torch", device=device, precision=precision)
        cls, mean, _ = model.infer(model.prepare(tiles), False)
        if ref is None:
            ref = cls, mean
            continue
        row = {"device": device, "precision": precision}
        for name, got, want in (("cls", cls, ref[0]), ("mean_patch", mean, ref[1])):
            scale = float(np.abs(want).max())
            cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
            row[f"{name}_max_abs_over_scale"] = float(np.abs(got - want).max()) / scale
            row[f"{name}_min_cosine"] = float(cos.min())
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--gpu-batch-size", type=int, default=256)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="wsidino-extract-ranks-"))
    try:
        store = make_store(root, 224, 64)
        weights, _onnx, _ = make_model(root, "vit_small")
        cpu = {"batch_size": args.batch_size, "device": "cpu"}
        configs = [("in process", None), ("torchrun, 2 ranks", 2)]  # one process never starts torchrun
        results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in configs}
        for r in range(repeats):
            for label, ranks in configs:
                got = one_run(store, weights, root / "features.zarr", ranks, cpu)
                results[label].append(got)
                log(f"repeat {r}: {label}: {got['tiles_per_s']:.1f} tiles/s")
        rows = [
            {"device": "cpu", "ranks": label, **max(runs, key=lambda x: x["tiles_per_s"])}
            for label, runs in results.items()
        ]
        checks = parity(weights, store, "cpu")
        gpus = torch.cuda.device_count()
        if gpus:
            big_weights, _, _ = make_model(root, "vit_base")
            gpu = {"batch_size": args.gpu_batch_size, "device": "cuda", "precision": "bf16", "loader_threads": 4}
            for ranks in sorted({1, 2, gpus}):
                if ranks > gpus:
                    continue
                got = max(
                    (one_run(store, big_weights, root / "f-gpu.zarr", ranks, gpu) for _ in range(repeats)),
                    key=lambda x: x["tiles_per_s"],
                )
                how = "in process, 1 GPU" if ranks == 1 else f"torchrun, {ranks} GPU ranks"
                rows.append(
                    {
                        "device": torch.cuda.get_device_name(0),
                        "ranks": f"{how}, ViT-B bf16",
                        **got,
                        "tiles_per_s_per_gpu": got["tiles_per_s"] / ranks,
                    }
                )
            checks += parity(big_weights, store, "cuda")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "rows": rows,
        "parity": checks,
        "repeats": repeats,
    }
    (out_dir / "extract_ranks.json").write_text(json.dumps(report, indent=1))
    print("| device | run | tiles | seconds | tiles/s (whole run) | work tiles/s (sum of ranks) |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['device']} | {row['ranks']} | {row['tiles']} | {row['seconds']:.1f} | {row['tiles_per_s']:.1f} "
            f"| {row['work_tiles_per_s']:.1f} |"
        )
    base = rows[0]["tiles_per_s"]
    print("\nratios vs in process: " + ", ".join(f"{r['ranks']} {r['tiles_per_s'] / base:.2f}×" for r in rows[1:2]))
    print(
        "\n| device | precision | CLS max abs err / scale | CLS min cosine | mean patch max abs err / scale | "
        "mean patch min cosine |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for c in checks:
        print(
            f"| {c['device']} | {c['precision']} | {c['cls_max_abs_over_scale']:.2e} | {c['cls_min_cosine']:.5f} | "
            f"{c['mean_patch_max_abs_over_scale']:.2e} | {c['mean_patch_min_cosine']:.5f} |"
        )


if __name__ == "__main__":
    main()
