"""Measured pipeline bubble of the trainer's own `Pipeline`; run by benchmarks/pipeline_parallel.py under torchrun.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/pp_bubble_worker.py --overrides '{"student.backbone_overrides": {"depth": 8}}'

Every rank builds the same seeded student + EMA teacher from the `tiny` pretrain config with the given overrides
(`build_ssl_model`, as the trainer) and cuts its pipeline stages out of it (`pp_stages.split_model`, one
per rank, even split). Then, for each schedule (GPipe, 1F1B) and number of pipeline micro-batches n_mb (a fixed
micro-batch size, so the step batch is n_mb × that size):

* step: the wall time of `Pipeline.run` (forward + backward of every micro-batch through `torch.distributed
  .pipelining`, the last stage computing the real DINO + iBOT + KoLeo loss), from a barrier to a barrier, median
  of `--reps` steps after `--warmup` (the first step infers shapes). The teacher targets and the KoLeo neighbour set
  are computed once beforehand, outside the timing, as the trainer does before `run`.
* compute: each stage's forward + backward of the same n_mb micro-batches alone, without the pipeline (no sends,
  no waits): stage 0 on the real crops with a random output gradient, later stages on random activations of the
  received shape (input gradients on, as the pipeline computes them) and the last stage through the same loss.
  All ranks time their compute at the same time, as they run in the pipeline (one core or device each); steps and
  compute runs alternate, so a load from elsewhere on a shared machine hits both alike.

bubble = 1 − Σ_stages compute / (stages × step): the share of the step's rank-time not spent computing (idle in
the ramp-up / drain, waiting on an unbalanced neighbour, and send/receive overhead). Beside it: the textbook
(p−1)/(n_mb+p−1) for balanced stages with free communication, and the same schedule's ideal with the measured
(unbalanced) stage times, (n_mb+p−1)·max_s(c_s/n_mb) for the step. On CUDA, each rank's peak allocated memory
during `run` is recorded too (torch's peak counter, reset per schedule).

Rank 0 prints one JSON line per (schedule, n_mb), prefixed `BUBBLE `.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from dinov3_core.config import load_config
from dinov3_core.data.masking import IBOTMaskSampler
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.parallel_config import ParallelismConfig
from dinov3_core.train.pp import Pipeline, StepContext
from dinov3_core.train.pp_stages import split_model
from dinov3_core.train.ssl_model import build_ssl_model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stage_compute(pipeline: Pipeline, ctx: StepContext, local_crops: torch.Tensor, shapes, device) -> float:
    """Seconds of forward + backward of this stage alone over the step's micro-batches (no pipeline)."""
    stage, n_mb = pipeline.stage, pipeline.n_mb
    batch = ctx.global_crops.shape[1]
    b = batch // n_mb
    grid = ctx.masks.masks.view(ctx.global_crops.shape[0], batch, -1)
    pipeline.ctx = ctx
    sync(device)
    start = time.perf_counter()
    for m in range(n_mb):
        micro = slice(m * b, (m + 1) * b)
        if stage.is_first:
            out = stage(ctx.global_crops[:, micro], local_crops[:, micro], grid[:, micro])
        else:
            inputs = [torch.randn(s, device=device, requires_grad=True) for s in shapes]
            out = stage(*inputs)
        if stage.is_last:
            pipeline._loss(out, torch.arange(batch)[micro]).backward()
        else:
            torch.autograd.backward(out, [torch.randn_like(o) for o in out])
    sync(device)
    elapsed = time.perf_counter() - start
    pipeline.ctx = None
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overrides", default="{}", help="JSON overrides of the tiny pretrain config (the model)")
    parser.add_argument("--micro-size", type=int, default=2, help="images per pipeline micro-batch")
    parser.add_argument("--n-mb", default="2,4,8", help="pipeline micro-batch counts")
    parser.add_argument("--schedules", default="GPipe,1F1B")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.new_group(list(range(world)))
    solo = [dist.new_group([r]) for r in range(world)][rank]  # Sinkhorn's data-parallel group: this rank alone

    with tempfile.TemporaryDirectory() as tmp:
        values = {"data.stores": [tmp], "output_dir": tmp, **json.loads(args.overrides)}
        cfg = load_config(PretrainConfig, "tiny", values, stage="pretrain")
    torch.manual_seed(0)
    meta = build_ssl_model(cfg).model
    meta.dp_group = solo
    p0 = ParallelismConfig(pp_degree=world)
    meta.student = split_model(meta.student, p0, rank)
    meta.teacher = split_model(meta.teacher, p0, rank, features_only=True)
    meta.to(device)
    env = DistEnv(rank, world, rank, world, device, None, pp_size=world, pp_rank=rank, pp_group=group, dp_group=solo)
    s_g, s_l = cfg.crops.n_global_crops, cfg.crops.n_local_crops
    g_px, l_px = cfg.crops.global_size, cfg.crops.local_size
    patch = meta.student["backbone"].patch_size

    for n_mb in [int(n) for n in args.n_mb.split(",")]:
        batch = n_mb * args.micro_size
        gen = torch.Generator().manual_seed(1)
        global_crops = torch.randn(s_g, batch, 3, g_px, g_px, generator=gen).to(device)
        local_crops = torch.randn(s_l, batch, 3, l_px, l_px, generator=gen).to(device)
        masks = IBOTMaskSampler(g_px // patch)(batch, s_g, rng=0)
        masks = type(masks).from_masks(masks.masks.to(device), s_g)
        for schedule in args.schedules.split(","):
            p = ParallelismConfig(pp_degree=world, pp_microbatch_size=args.micro_size, pp_schedule=schedule)
            grids = [(g_px // patch,) * 2, (l_px // patch,) * 2]
            pipeline = Pipeline(meta, env, p, micro_batch=batch, accumulation=1, grids=grids)
            stage = pipeline.stage
            targets = pipeline.teacher_targets(global_crops, masks, 0.07)  # the teacher's stages, whole step
            koleo = pipeline.koleo_features(global_crops, local_crops, masks) if meta.needs_koleo else None
            ctx = StepContext(global_crops, masks, targets, pipeline.n_mb, koleo, 0)
            # The activation shapes between stages (the same at every cut): from stage 0's output.
            shapes: list = [None]
            if stage.is_first:
                with torch.no_grad():
                    b = args.micro_size
                    grid = masks.masks.view(s_g, batch, -1)
                    out = stage(global_crops[:, :b], local_crops[:, :b], grid[:, :b])
                shapes = [[tuple(o.shape) for o in out]]
            dist.broadcast_object_list(shapes, src=0)

            for _ in range(args.warmup):
                pipeline.run(ctx, local_crops)
                stage.zero_grad()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            steps, computes = [], []
            for _ in range(args.reps):  # alternated, so both see the same load on a shared machine
                dist.barrier()
                sync(device)
                start = time.perf_counter()
                pipeline.run(ctx, local_crops)
                sync(device)
                dist.barrier()
                steps.append(time.perf_counter() - start)
                stage.zero_grad()
                dist.barrier()
                computes.append(stage_compute(pipeline, ctx, local_crops, shapes[0], device))
                stage.zero_grad()
            peak_mb = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None  # (compute alone: lower)
            mine = {"step_s": statistics.median(steps), "compute_s": statistics.median(computes), "peak_mb": peak_mb}
            gathered: list = [None] * world
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                step = max(g["step_s"] for g in gathered)
                compute = [g["compute_s"] for g in gathered]
                ideal = (n_mb + world - 1) * max(compute) / n_mb  # this schedule with the measured stage times
                record = {
                    "schedule": schedule,
                    "stages": world,
                    "n_mb": n_mb,
                    "micro_batch_images": args.micro_size,
                    "step_batch_images": batch,
                    "step_s": step,
                    "compute_s_per_stage": compute,
                    "bubble": 1 - sum(compute) / (world * step),
                    "idle_per_stage": [1 - c / step for c in compute],
                    "bubble_theory": (world - 1) / (n_mb + world - 1),
                    "bubble_theory_measured_stages": 1 - sum(compute) / (world * ideal),
                    "peak_allocated_mb_per_rank": [g["peak_mb"] for g in gathered] if cuda else None,
                }
                print("BUBBLE " + json.dumps(record), flush=True)
            del pipeline
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
