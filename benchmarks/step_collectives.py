"""Where a data-parallel CPU step spends its time: collectives per step and their wall time, from torch.profiler.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/step_collectives.py \\
        --store out/tiles.zarr --output /tmp/collectives --batch 4
    python benchmarks/step_collectives.py --store out/tiles.zarr --output /tmp/collectives-1 --batch 8   # 1 process

A real `Trainer` on the `tiny` config (health probe and eval checkpoints off) runs 10 warm-up steps, then 20
profiled ones. Rank 0 prints the median step time and, per collective kind, calls and milliseconds per step. The
milliseconds are wall time inside the call, so they include waiting for the slower rank.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from dinov3_core.config import load_config
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.distributed import init_distributed
from dinov3_core.train.loop import Trainer

WARMUP, STEPS = 10, 20
KINDS = ("all_gather", "reduce_scatter", "allreduce", "all_reduce", "broadcast", "gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="a tile store (tiles.zarr)")
    parser.add_argument("--output", required=True, help="a fresh output directory")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    values = {
        "data.stores": [args.store],
        "output_dir": args.output,
        "tracking.enabled": False,
        "optim.epochs": 8,
        "train.stop_at": 40,
        "checkpointing.period": 1000,
        "evaluation.eval_period_iterations": 0,
        "health.probe_tiles": 0,
        "train.batch_size_per_gpu": args.batch,
    }
    env = init_distributed("cpu")
    trainer = Trainer(load_config(PretrainConfig, "tiny", values, stage="pretrain"), env)
    batches = iter(trainer.loader)
    for i in range(WARMUP):
        trainer.train_step(i, next(batches))
    times = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(WARMUP, WARMUP + STEPS):
            batch = next(batches)
            start = time.perf_counter()
            trainer.train_step(i, batch)
            times.append(time.perf_counter() - start)
    if env.is_main:
        rows = {
            e.key: (e.count / STEPS, round(e.cpu_time_total / STEPS / 1e3, 2))
            for e in prof.key_averages()
            if any(kind in e.key for kind in KINDS)
        }
        top = dict(sorted(rows.items(), key=lambda kv: -kv[1][1])[:10])
        print(
            json.dumps(
                {
                    "processes": env.world_size,
                    "step_ms_median": round(sorted(times)[STEPS // 2] * 1e3, 1),
                    "per_step_calls_and_ms": top,
                },
                indent=1,
            )
        )
    trainer.close()
    if env.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
