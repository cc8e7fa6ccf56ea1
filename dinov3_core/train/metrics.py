"""Observability: per-rank log files, `training_metrics.json` (JSON lines), memory readings, the loss curve.

Every `log_period` iterations rank 0 appends one line: the iteration, the MEAN over the iterations since the
previous line of each loss, grad norm and timing (so no step goes unrecorded), the current schedule values,
images/s of the effective (global) batch, and memory (RSS of this rank and of its loader workers, max RSS over
ranks, peak memory). `step_record` builds that line and `progress_line` its human-readable summary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist

from dinov3_core.progress import eta

if TYPE_CHECKING:
    from dinov3_core.train.distributed import DistEnv
    from dinov3_core.train.optim import ScheduleValues

METRICS_FILE = "training_metrics.json"
LOSS_CURVE_FILE = "loss_curve.png"
LOG_DIR = "logs"
SCHEDULE_KEYS = ("lr", "last_layer_lr", "wd", "momentum", "teacher_temp")


def setup_logging(output_dir: Path, rank: int) -> logging.Handler:
    """`logs/log.txt` on rank 0, `logs/log.txt.rank<N>` elsewhere (upstream layout); rank 0 also logs to
    stderr. Returns the file handler so the caller can remove it (in-process runs)."""
    log_dir = output_dir / LOG_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / ("log.txt" if rank == 0 else f"log.txt.rank{rank}"))
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("dinov3_core")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    if rank == 0 and not any(getattr(h, "_wsidino_console", False) for h in root.handlers):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        console._wsidino_console = True  # type: ignore[attr-defined]
        root.addHandler(console)
    return handler


def rss_mb() -> float:
    """Resident set size of this process now, MiB."""
    return psutil.Process().memory_info().rss / 2**20


def children_rss_mb() -> float:
    """Summed RSS of this process's children (DataLoader workers), MiB; shared pages count once per child."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # exited meanwhile
            total += child.memory_info().rss
    return total / 2**20


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated GPU memory since the memory watch's last window (it resets the GPU peaks), or peak RSS of this
    process on CPU, MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class WindowMeans:
    """Running sums of per-iteration values since the last flush."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.count += 1

    def flush(self) -> dict[str, float]:
        means = {k: v / self.count for k, v in self.sums.items()} if self.count else {}
        self.sums, self.count = {}, 0
        return means


class MetricsWriter:
    """Appends JSON lines to `training_metrics.json` (rank 0 only; other ranks get a no-op writer)."""

    def __init__(self, output_dir: Path, enabled: bool) -> None:
        self.path = output_dir / METRICS_FILE
        self.enabled = enabled

    def write(self, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())


def schedule_values(sched: ScheduleValues) -> dict[str, float]:
    """One iteration's schedule values as metrics."""
    return {key: getattr(sched, key) for key in SCHEDULE_KEYS}


def step_record(
    iteration: int,
    means: Mapping[str, float],
    sched: ScheduleValues,
    env: DistEnv,
    *,
    global_batch: int,
    micro_batch: int,
    accumulation_steps: int,
) -> dict[str, Any]:
    """One `training_metrics.json` line: the window's means, this iteration's schedule, throughput, memory.

    A collective under torch.distributed (max RSS over ranks): every rank calls it at the same iterations.
    """
    rss = torch.tensor([rss_mb()], dtype=torch.float64)
    if env.distributed:
        rss_max = rss.to(env.device) if env.device.type == "cuda" else rss
        dist.all_reduce(rss_max, op=dist.ReduceOp.MAX)
        max_rss = float(rss_max.item())
    else:
        max_rss = float(rss.item())
    return {
        "iteration": iteration,
        **{k: v for k, v in means.items() if k not in SCHEDULE_KEYS},
        **schedule_values(sched),
        "images_per_s": global_batch / means["iter_time"] if means.get("iter_time") else 0.0,
        **batch_fields(global_batch, micro_batch, accumulation_steps),
        "rss_mb": float(rss.item()),
        "loader_rss_mb": children_rss_mb(),
        "max_rss_mb": max_rss,
        "peak_memory_mb": peak_memory_mb(env.device),
    }


def batch_fields(global_batch: int, micro_batch: int, accumulation_steps: int) -> dict[str, int]:
    """How the step batch is split, on every metrics line: the memory watch may change it mid-run."""
    return {
        "global_batch_size": global_batch,
        "micro_batch_size": micro_batch,
        "accumulation_steps": accumulation_steps,
    }


def progress_line(record: Mapping[str, Any], total_iterations: int) -> str:
    """The log line of a `step_record`: losses, health signals, learning rate, throughput, data wait, RSS; and
    the probe's scores on the lines that have them."""
    probe = (
        f"  probe: effective rank {record['effective_rank']:.3f}, invariance {record.get('invariance', math.nan):.3f}"
        f" ({record.get('probe_seconds', math.nan):.1f}s)"
        if isinstance(record.get("effective_rank"), float)
        else ""
    )
    left = max(0, total_iterations - record["iteration"] - 1) * float(record.get("iter_time") or 0.0)
    return (
        f"it {record['iteration']}/{total_iterations}  loss {record.get('total_loss', math.nan):.4f} "
        f"(dino g {record.get('dino_global_loss', math.nan):.4f} l {record.get('dino_local_loss', math.nan):.4f}, "
        f"ibot {record.get('ibot_loss', math.nan):.4f}, koleo {record.get('koleo_loss', math.nan):.4f}; "
        f"dino below ln K {record.get('dino_gap', math.nan):.3f}, agreement {record.get('agreement', math.nan):.3f})  "
        f"lr {record['lr']:.2e}  {record['images_per_s']:.1f} img/s  eta {eta(left)}  "
        f"data {record.get('data_time', math.nan):.3f}s  "
        f"rss {record['rss_mb']:.0f} MiB{probe}"
    )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, before_iteration: int) -> None:
    """Drop lines at or after `before_iteration` (written after the checkpoint a resumed run restarts from), so
    the file reads like one uninterrupted run."""
    rows = read_metrics(path)
    kept = [r for r in rows if r.get("iteration", -1) < before_iteration]
    if len(kept) != len(rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


LOSS_TERMS = ("total_loss", "dino_global_loss", "dino_local_loss", "ibot_loss", "koleo_loss", "gram_loss")


def plot_loss_curve(metrics_path: Path, out_path: Path, stage: str = "pretrain") -> Path | None:
    """Loss terms against iteration and the learning rate (matplotlib, Agg), titled with the stage and the run
    directory. None when there is nothing to plot."""
    rows = [r for r in read_metrics(metrics_path) if "event" not in r]  # event lines: memory re-plans
    if not rows:
        return None
    # deferred: matplotlib (~0.4 s), only for the figures
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
    iterations = [r["iteration"] for r in rows]
    for key in LOSS_TERMS:  # gram_loss: the gram stage's own
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            ax_loss.plot(iterations, [math.nan if v is None else v for v in values], label=key)
    ax_loss.set_xlabel("iteration")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{stage} losses: {metrics_path.parent.name}")
    ax_loss.legend(fontsize=8)
    ax_lr.plot(iterations, [r.get("lr") for r in rows], label="lr")
    ax_lr.set_xlabel("iteration")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title(f"{stage} learning-rate schedule")
    fig.tight_layout()
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out_path)
    return out_path
