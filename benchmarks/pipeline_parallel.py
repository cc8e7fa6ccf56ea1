"""Pipeline parallelism: step time and peak memory per rank of FSDP-only vs PP(2) vs PP(2)×DP(2), and the bubble.

    python benchmarks/pipeline_parallel.py --output bench-output            # ~5 minutes on 2 cores
    python benchmarks/pipeline_parallel.py --quick --output bench-output    # ~2 minutes
    python benchmarks/pipeline_parallel.py --device cuda --output bench-output   # ViT-L / ViT-7B shapes, ≥ 4 GPUs

Part 1, per model, all layouts at the same global batch (16), each a fresh training launch (`python -m
dinov3_core.train` for the 1-process reference, else `torch.distributed.run`; gloo on CPU, one torch thread per
process) on a real tile store in a fresh output directory (a reused one would resume, not train):

* 1 process (reference): the whole student, no sharding, micro-batch 16;
* FSDP-only, 2 processes: every process the whole student, FSDP2-sharded, micro-batch 8 each;
* PP(2), 2 processes, 1F1B and GPipe: one pipeline stage (half of the blocks) each, micro-batch 16 in 4 pipeline
  micro-batches of 4 (`parallelism.pp_degree=2`, `pp_microbatch_size=4`);
* PP(2)×DP(2), 4 processes, 1F1B: two FSDP-sharded processes per stage, micro-batch 8 in 4 pipeline
  micro-batches of 2. On a 2-core machine 4 processes oversubscribe the cores: its time says little, its memory
  per rank still does.

Models on CPU: `vit_test` (the `tiny` config: 64-d, 2 blocks, 64/32 px crops, 256 prototypes) and a deeper one,
ViT-S/16 cut to 8 blocks (`student.arch=vit_small`, `student.backbone_overrides.depth=8`, same crops and heads).
With `--device cuda`: ViT-L/16 and a ViT-7B-shaped backbone (4096-d, SwiGLU), both cut to 8 blocks, 224/96 px
crops; a layout needs one GPU per process, rows that need more GPUs than there are are marked skipped.

Step time: the median `iter_time` of `training_metrics.json` (rank 0's; the step is collective), skipping the first
two iterations; images/s = global batch / that. Memory per rank (the metrics file only holds the maximum over
ranks), read by a thread here from /proc every 25 ms for each of the launcher's children (`RANK` in their
environment): the largest RSS sampled once training runs (from the first metrics line on: the state of the
training steps), and the kernel's whole-life peak (`VmHWM`), which also holds the setup, where every rank builds the
whole student and teacher before cutting out its stage or sharding them. Both include the ~300 MiB of the torch
runtime (the peak of a bare trainer import is printed). On CUDA, each process's GPU memory as `nvidia-smi` reports
it is sampled instead.

Part 2, the pipeline bubble, measured (benchmarks/pp_bubble_worker.py under torchrun, 2 ranks = 2 stages): the
wall time of the trainer's `Pipeline.run` per schedule and number of pipeline micro-batches n_mb (2 images each)
against each stage's forward + backward of the same micro-batches alone; bubble = 1 − Σ compute / (2 × step),
beside the textbook (p−1)/(n_mb+p−1) and the schedule's ideal with the measured (unbalanced) stage times.

The machine may be shared: compare ratios within one run. Output: markdown tables on stdout and
`<output>/pipeline_parallel.json`; rows that fail keep their error there (`--strict`: exit 1 then).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from train_step import make_store

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
GLOBAL_BATCH = 16
BUBBLE_MICRO = 2  # images per pipeline micro-batch in the bubble measurement

CPU_MODELS: dict[str, dict[str, Any]] = {
    "vit_test": {},  # the tiny config as it is
    "vit_small, 8 blocks": {"student.arch": "vit_small", "student.backbone_overrides": {"depth": 8}},
}
GPU_COMMON: dict[str, Any] = {
    "crops.global_size": 224,
    "crops.local_size": 96,
    "crops.n_local_crops": 4,
    **{f"heads.{h}.n_prototypes": 16384 for h in ("dino", "ibot")},
    **{f"heads.{h}.hidden_dim": 2048 for h in ("dino", "ibot")},
    **{f"heads.{h}.bottleneck_dim": 256 for h in ("dino", "ibot")},
}
GPU_MODELS: dict[str, dict[str, Any]] = {
    "vitl16, 8 blocks": {**GPU_COMMON, "student.arch": "vitl16", "student.backbone_overrides": {"depth": 8}},
    "vit7b16, 8 blocks": {**GPU_COMMON, "student.arch": "vit7b16", "student.backbone_overrides": {"depth": 8}},
}
# (layout, processes, pipeline stages, schedule)
LAYOUTS: list[tuple[str, int, int, str | None]] = [
    ("1 process (reference)", 1, 1, None),
    ("FSDP-only", 2, 1, None),
    ("PP(2)", 2, 2, "1F1B"),
    ("PP(2)", 2, 2, "GPipe"),
    ("PP(2)×DP(2)", 4, 2, "1F1B"),
]
QUICK_LAYOUTS = [0, 1, 2, 4]  # no GPipe row: the bubble part compares the schedules


def layout_overrides(nproc: int, pp: int, schedule: str | None) -> dict[str, Any]:
    dp = nproc // pp
    micro = GLOBAL_BATCH // dp
    values: dict[str, Any] = {"train.global_batch_size": GLOBAL_BATCH, "train.batch_size_per_gpu": micro}
    if pp > 1:
        values |= {
            "parallelism.pp_degree": pp,
            "parallelism.pp_schedule": schedule,
            "parallelism.pp_microbatch_size": micro // 4,
        }
    return values


def base_overrides(store: Path, iterations: int, device: str) -> dict[str, Any]:
    return {
        "data.stores": [str(store)],
        "data.num_workers": 0,
        "tracking.enabled": False,
        "train.device": device,
        "train.num_threads": 1,
        "train.log_period": 1,
        "train.stop_at": iterations,
        "train.memory_watch": False,  # sampled, never re-planned: the layout stays the one measured
        "checkpointing.period": 10**6,
        "evaluation.eval_period_iterations": 0,
        "health.probe_tiles": 0,
    }


def _rss_hwm_mib(pid: int) -> tuple[float, float] | None:
    """A process's RSS now and the kernel's peak of it (VmRSS, VmHWM), MiB; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = [re.search(rf"^{key}:\s+(\d+) kB", text, re.M) for key in ("VmRSS", "VmHWM")]
    return (int(found[0][1]) / 1024, int(found[1][1]) / 1024) if found[0] and found[1] else None


def _gpu_mib() -> dict[int, float]:
    """GPU memory per process id as nvidia-smi reports it (empty without nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return {int(pid): float(mb) for pid, mb in rows if pid.strip().isdigit() and mb.strip().isdigit()}


class RankMemory(threading.Thread):
    """Samples the memory of each training rank of a launch, keyed by its RANK: the kernel's whole-life peak RSS
    (VmHWM: includes the setup, where every rank builds the whole student and teacher before splitting or sharding
    them), the largest RSS sampled once `training` says the first step is done, and GPU memory."""

    def __init__(self, root: int, launcher: bool, gpu: bool, training: Any, interval: float = 0.025) -> None:
        super().__init__(daemon=True)
        self.root, self.launcher, self.gpu, self.interval = root, launcher, gpu, interval
        self.training = training
        self.rank_of: dict[int, int | None] = {}
        self.peak_mib: dict[int, float] = {}
        self.train_mib: dict[int, float] = {}
        self.gpu_mib: dict[int, float] = {}
        self.done = threading.Event()

    def _ranks(self) -> dict[int, int]:
        try:
            procs = psutil.Process(self.root).children(recursive=True) if self.launcher else [psutil.Process(self.root)]
        except psutil.Error:
            return {}
        for proc in procs:
            if self.rank_of.get(proc.pid) is None:  # asked again until known: between fork and exec, no RANK yet
                try:
                    rank = proc.environ().get("RANK") if self.launcher else "0"
                except psutil.Error:
                    continue
                self.rank_of[proc.pid] = int(rank) if rank is not None else None
        return {pid: rank for pid, rank in self.rank_of.items() if rank is not None}

    def run(self) -> None:
        last_gpu = 0.0
        while not self.done.is_set():
            ranks = self._ranks()
            training = self.training()
            for pid, rank in ranks.items():
                read = _rss_hwm_mib(pid)
                if read is not None:
                    self.peak_mib[rank] = max(self.peak_mib.get(rank, 0.0), read[1])
                    if training:
                        self.train_mib[rank] = max(self.train_mib.get(rank, 0.0), read[0])
            if self.gpu and time.monotonic() - last_gpu > 0.5:
                last_gpu = time.monotonic()
                for pid, mb in _gpu_mib().items():
                    if pid in ranks:
                        self.gpu_mib[ranks[pid]] = max(self.gpu_mib.get(ranks[pid], 0.0), mb)
            self.done.wait(self.interval)


def launch(out: Path, overrides: dict[str, Any], nproc: int, gpu: bool, timeout: int = 900) -> dict[str, Any]:
    """One fresh training launch; its step times (from `training_metrics.json`) and per-rank peak memory."""
    shutil.rmtree(out, ignore_errors=True)  # a previous run's directory would resume, not train
    argv = ["-m", "dinov3_core.train", "--config", "tiny", f"output_dir={json.dumps(str(out))}"]
    argv += [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if nproc > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *argv], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = out / "training_metrics.json"  # its first line: iteration 0 is done
    watch = RankMemory(proc.pid, launcher=nproc > 1, gpu=gpu, training=metrics.exists)
    watch.start()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        output += f"\n(timed out after {timeout} s)"
    watch.done.set()
    watch.join()
    wall = time.perf_counter() - start
    figures: dict[str, Any] = {
        "wall_s": wall,
        "peak_rss_mib_per_rank": [watch.peak_mib.get(r) for r in range(nproc)],  # VmHWM, setup included
        "training_rss_mib_per_rank": [watch.train_mib.get(r) for r in range(nproc)],  # sampled from iteration 1
    }
    if gpu:
        figures["gpu_mib_per_rank"] = [watch.gpu_mib.get(r) for r in range(nproc)]
    if proc.returncode != 0:
        errors = [m.group(0) for m in re.finditer(r"\b\w*(Error|Exception): .*", output)]
        figures["error"] = errors[0].strip() if errors else f"exit {proc.returncode}"
        figures["output_tail"] = output[-4000:]
        return figures
    rows = [json.loads(line) for line in (out / "training_metrics.json").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    timed = [r["iter_time"] for r in steps if r["iteration"] >= 2] or [r["iter_time"] for r in steps]
    p50 = statistics.median(timed)
    figures |= {
        "step_p50_s": p50,
        "images_per_s": steps[-1]["global_batch_size"] / p50,
        "iter_times_s": [r["iter_time"] for r in steps],
        "max_rss_mib_metrics": max(r.get("max_rss_mb", 0.0) for r in steps),  # the trainer's own max over ranks
        "device_mib_metrics": max(r.get("memory_device_mb", 0.0) or 0.0 for r in steps),
    }
    return figures


def runtime_baseline_mib() -> float:
    """Peak RSS of a process that only imports the trainer (torch, the distributed stack): in every rank's figure."""
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would report this (forking) process's size.
    code = "import torch.distributed, dinov3_core.train.loop; print(open('/proc/self/status').read())"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    match = re.search(r"^VmHWM:\s+(\d+) kB", out.stdout, re.M)
    return int(match.group(1)) / 1024 if match else float("nan")


def bubble(overrides: dict[str, Any], n_mb: list[int], reps: int, device: str) -> list[dict[str, Any]]:
    argv = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(HERE / "pp_bubble_worker.py"),
        "--overrides",
        json.dumps(overrides),
        "--micro-size",
        str(BUBBLE_MICRO),
        "--n-mb",
        ",".join(map(str, n_mb)),
        "--reps",
        str(reps),
        "--device",
        device,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"bubble worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line.removeprefix("BUBBLE ")) for line in proc.stdout.splitlines() if line.startswith("BUBBLE ")]


def fmt_mib(values: list[float | None]) -> tuple[str, str, str]:
    known = [v for v in values if v is not None]
    if not known:
        return "–", "–", "–"
    return f"{max(known):.0f}", f"{min(known):.0f}", " / ".join("?" if v is None else f"{v:.0f}" for v in values)


def memory_of(row: dict[str, Any], gpu: bool) -> list[float | None]:
    return row.get("gpu_mib_per_rank" if gpu else "training_rss_mib_per_rank") or []


def print_layouts(model: str, rows: list[dict[str, Any]], gpu: bool) -> None:
    """One model's table; ratios against the FSDP-only row (time: higher is slower; memory: the max rank's)."""
    what = "GPU memory" if gpu else "peak RSS while training"
    print(f"## {model}\n")
    print(
        f"| processes | layout | schedule | step p50 (s) | images/s | {what} per rank, max / min (MiB) | "
        "per rank (MiB) | per rank incl. setup, VmHWM (MiB) | vs FSDP-only: step time | "
        "vs FSDP-only: memory (max rank) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    fsdp = next((r for r in rows if r["layout"] == "FSDP-only" and "step_p50_s" in r), None)
    fsdp_mem = max((v for v in memory_of(fsdp, gpu) if v is not None), default=None) if fsdp else None
    for r in rows:
        procs = f"{r['processes']}" + (" (oversubscribed)" if not gpu and r["processes"] > psutil.cpu_count() else "")
        head = f"| {procs} | {r['layout']} | {r['schedule'] or '–'} |"
        high, low, per_rank = fmt_mib(memory_of(r, gpu))
        hwm = fmt_mib(r.get("peak_rss_mib_per_rank") or [])[2]
        if "skipped" in r:
            print(f"{head} skipped: {r['skipped']} | | | | | | |")
        elif "error" in r:
            print(
                f"{head} FAILED: {r['error'].split('!')[0][:120]} | | {high} / {low} | {per_rank} | {hwm} "
                "(until it failed) | | |"
            )
        else:
            vs_time = f"{r['step_p50_s'] / fsdp['step_p50_s']:.2f}×" if fsdp else "–"
            vs_mem = f"{float(high) / fsdp_mem:.2f}×" if fsdp_mem and high != "–" else "–"
            print(
                f"{head} {r['step_p50_s']:.3f} | {r['images_per_s']:.1f} | {high} / {low} | {per_rank} | {hwm} | "
                f"{vs_time} | {vs_mem} |"
            )
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--store", help="existing tile store (default: sample slides tiled at 224 px)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a layout fails")
    args = parser.parse_args()
    out = Path(args.output).resolve()
    work = out / "pipeline_parallel_work"
    work.mkdir(parents=True, exist_ok=True)
    store = Path(args.store) if args.store else make_store(out / "train_step_work")
    gpu = args.device == "cuda"
    n_gpus = torch.cuda.device_count() if gpu else 0
    models = GPU_MODELS if gpu else CPU_MODELS
    iterations = 6 if args.quick else 16
    layouts = [LAYOUTS[i] for i in QUICK_LAYOUTS] if args.quick else LAYOUTS
    started = time.perf_counter()

    baseline = runtime_baseline_mib()
    where = (
        f"{n_gpus}× {torch.cuda.get_device_name(0) if n_gpus else 'no GPU'}, nccl"
        if gpu
        else f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, gloo"
    )
    print(
        f"# Pipeline parallelism ({'quick' if args.quick else 'full'}): {where}, torch {torch.__version__}, "
        f"1 thread per process, global batch {GLOBAL_BATCH}, {iterations} iterations (first 2 not timed); "
        f"a bare trainer import peaks at {baseline:.0f} MiB RSS\n"
    )
    results: dict[str, Any] = {
        "layouts": [],
        "bubble": [],
        "baseline_rss_mib": baseline,
        "global_batch": GLOBAL_BATCH,
        "iterations": iterations,
        "device": args.device,
    }
    for model, model_overrides in models.items():
        rows = []
        for layout, nproc, pp, schedule in layouts:
            row: dict[str, Any] = {"model": model, "layout": layout, "processes": nproc, "pp": pp, "schedule": schedule}
            if gpu and nproc > n_gpus:
                row["skipped"] = f"needs {nproc} GPUs, {n_gpus} here"
            else:
                overrides = {
                    **base_overrides(store, iterations, args.device),
                    **model_overrides,
                    **layout_overrides(nproc, pp, schedule),
                }
                name = f"{model.split(',')[0]}-{nproc}p-pp{pp}-{schedule or 'none'}"
                row |= launch(work / name, overrides, nproc, gpu)
            rows.append(row)
            print(
                f"  ({model}, {layout} {schedule or ''}: {row.get('error') or row.get('skipped') or 'done'})",
                file=sys.stderr,
                flush=True,
            )
        results["layouts"] += rows
        print_layouts(model, rows, gpu)
    # Part 2: the bubble per schedule, measured.
    n_mb = [2, 4] if args.quick else [2, 4, 8]
    reps = 5 if args.quick else 20
    bubble_models = dict(list(models.items())[-1:]) if args.quick else models
    if gpu and n_gpus < 2:
        print(f"## Pipeline bubble: skipped (needs 2 GPUs, {n_gpus} here)\n")
        bubble_models = {}
    for model, model_overrides in bubble_models.items():
        print(
            f"## Pipeline bubble, {model}: 2 stages, micro-batches of {BUBBLE_MICRO} images, median of {reps} steps\n"
        )
        print(
            "| schedule | n_mb | step (ms) | compute per stage (ms) | bubble, measured | idle per stage | "
            "theory (p−1)/(n_mb+p−1) | theory with the measured stage times |"
        )
        print("|---|---|---|---|---|---|---|---|")
        records = bubble(model_overrides, n_mb, reps, args.device)
        for r in sorted(records, key=lambda r: (r["schedule"], r["n_mb"])):
            r["model"] = model
            compute = " / ".join(f"{1000 * c:.1f}" for c in r["compute_s_per_stage"])
            idle = " / ".join(f"{100 * c:.0f} %" for c in r["idle_per_stage"])
            print(
                f"| {r['schedule']} | {r['n_mb']} | {1000 * r['step_s']:.1f} | {compute} | {100 * r['bubble']:.0f} % "
                f"| {idle} | {100 * r['bubble_theory']:.0f} % | {100 * r['bubble_theory_measured_stages']:.0f} % |",
                flush=True,
            )
            results["bubble"].append(r)
        print()
    results["machine"] = {
        "cores": psutil.cpu_count(),
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "torch": torch.__version__,
        "gpus": n_gpus,
    }
    results["wall_s"] = time.perf_counter() - started
    (out / "pipeline_parallel.json").write_text(json.dumps(results, indent=2))
    failed = [
        f"{r['model']} {r['layout']} {r['schedule'] or ''}: {r['error']}" for r in results["layouts"] if "error" in r
    ]
    print(f"wall time {results['wall_s'] / 60:.1f} min" + (f"; {len(failed)} layout(s) failed" if failed else ""))
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    sys.exit(1 if failed and args.strict else 0)


if __name__ == "__main__":
    main()
