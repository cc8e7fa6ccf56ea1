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


def progress_line(record: Mapping[str, Any], total_iterations: int, end_iteration: int | None = None) -> str:
    """The log line of a `step_record`: losses, health signals, learning rate, throughput, data wait, RSS; and
    the probe's scores on the lines that have them. `end_iteration`: where this run stops (`train.stop_at`) when
    before the schedule's end; the ETA counts to it, since the schedule's remainder is not this run's."""
    probe = (
        f"  probe: effective rank {record['effective_rank']:.3f}, invariance {record.get('invariance', math.nan):.3f}"
        f" ({record.get('probe_seconds', math.nan):.1f}s)"
        if isinstance(record.get("effective_rank"), float)
        else ""
    )
    end = min(total_iterations, end_iteration or total_iterations)
    left = max(0, end - record["iteration"] - 1) * float(record.get("iter_time") or 0.0)
    stops = f" (stops at {end})" if end < total_iterations else ""
    return (
        f"it {record['iteration']}/{total_iterations}{stops}  loss {record.get('total_loss', math.nan):.4f} "
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


def health_series(metrics_path: Path, n_prototypes: int | None = None) -> dict[str, tuple[list[int], list[float]]]:
    """The "is it learning?" signals of a run's metrics file (docs/stages.md), each as (iterations, values), only
    where they were logged: ``dino_gap`` = ln K − DINO global-crop loss (from the lines' own `dino_gap`, or from
    `dino_global_loss` and `n_prototypes` K for files that lack it), ``teacher_entropy`` (a fraction of ln K),
    ``agreement``, and the probe's ``effective_rank`` (eval checkpoints only)."""
    rows = [r for r in read_metrics(metrics_path) if "event" not in r]
    ln_k = math.log(n_prototypes) if n_prototypes else None

    def gap(r: dict[str, Any]) -> float | None:
        if isinstance(r.get("dino_gap"), (int, float)):
            return float(r["dino_gap"])
        loss = r.get("dino_global_loss")
        return ln_k - float(loss) if ln_k is not None and isinstance(loss, (int, float)) else None

    out: dict[str, tuple[list[int], list[float]]] = {}
    for key, get in (("dino_gap", gap), *((k, lambda r, k=k: r.get(k)) for k in HEALTH_SIGNALS[1:])):
        points = [(int(r["iteration"]), float(v)) for r in rows if isinstance(v := get(r), (int, float))]
        points = [(i, v) for i, v in points if math.isfinite(v)]
        if points:
            out[key] = ([i for i, _ in points], [v for _, v in points])
    return out


HEALTH_SIGNALS = ("dino_gap", "teacher_entropy", "agreement", "effective_rank")


def plot_loss_curve(
    metrics_path: Path,
    out_path: Path,
    stage: str = "pretrain",
    run_name: str | None = None,
    n_prototypes: int | None = None,
    min_gap: float | None = None,
    min_effective_rank: float | None = None,
) -> Path | None:
    """Loss terms and the learning rate against iteration (matplotlib, Agg), and under them the run's health: the
    DINO loss's gap to ln K with the `health.min_gap` it must reach, the teacher's normalised entropy (and the
    student/teacher agreement, chance 1/K), the probe's effective rank with its `health.min_effective_rank` alarm.
    Titled with the stage and `run_name` (default: the run directory and its parent). None when nothing to plot."""
    rows = [r for r in read_metrics(metrics_path) if "event" not in r]  # event lines: memory re-plans
    if not rows:
        return None
    # deferred: matplotlib is slow to import, and only the figures need it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = run_name or f"{metrics_path.parent.parent.name}/{metrics_path.parent.name}".lstrip("/")
    fig = plt.figure(figsize=(13, 7.5))
    grid = fig.add_gridspec(2, 3)
    ax_loss, ax_lr = fig.add_subplot(grid[0, :2]), fig.add_subplot(grid[0, 2])
    ax_gap, ax_ent, ax_rank = (fig.add_subplot(grid[1, k]) for k in range(3))
    iterations = [r["iteration"] for r in rows]
    for key in LOSS_TERMS:  # gram_loss: the gram stage's own
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            ax_loss.plot(iterations, [math.nan if v is None else v for v in values], label=key)
    ax_loss.set_xlabel("iteration")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("losses")
    ax_loss.legend(fontsize=8)
    ax_lr.plot(iterations, [r.get("lr") for r in rows], label="lr")
    ax_lr.set_xlabel("iteration")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title("learning-rate schedule")

    series = health_series(metrics_path, n_prototypes)
    none = "not logged by this run"
    if "dino_gap" in series:
        ax_gap.plot(*series["dino_gap"], color="tab:blue", lw=0.8, label="ln K − DINO loss (global crops)")
    ax_gap.axhline(0.0, color="grey", lw=0.8, ls=":", label="0: nothing learnt")
    if min_gap is not None:
        ax_gap.axhline(min_gap, color="tab:red", ls="--", lw=1, label=f"health.min_gap {min_gap:g}")
    ax_gap.set_title("DINO loss below ln K (nats)" + ("" if "dino_gap" in series else f": {none}"))
    ax_gap.set_xlabel("iteration")
    ax_gap.legend(fontsize=7)
    for key, label, colour in (
        ("teacher_entropy", "teacher entropy / ln K (1: uniform)", "tab:purple"),
        ("agreement", "student–teacher agreement", "tab:green"),
    ):
        if key in series:
            ax_ent.plot(*series[key], color=colour, lw=0.8, label=label)
    if n_prototypes and "agreement" in series:
        ax_ent.axhline(1 / n_prototypes, color="tab:green", ls=":", lw=0.8, label=f"chance 1/K (K={n_prototypes})")
    ax_ent.set_ylim(0, 1.05)
    ax_ent.set_title("teacher targets" + ("" if "teacher_entropy" in series else f": {none}"))
    ax_ent.set_xlabel("iteration")
    if ax_ent.get_legend_handles_labels()[0]:
        ax_ent.legend(fontsize=7)
    if "effective_rank" in series:
        ax_rank.plot(*series["effective_rank"], "o-", color="tab:orange", label="probe tiles, teacher CLS")
    if min_effective_rank is not None:
        ax_rank.axhline(
            min_effective_rank,
            color="tab:red",
            ls="--",
            lw=1,
            label=f"collapse alarm: health.min_effective_rank {min_effective_rank:g}",
        )
    ax_rank.set_ylim(0, 1.05)
    ax_rank.set_title("effective rank at eval checkpoints" + ("" if "effective_rank" in series else f": {none}"))
    ax_rank.set_xlabel("iteration")
    if ax_rank.get_legend_handles_labels()[0]:
        ax_rank.legend(fontsize=7)
    fig.suptitle(f"{stage} run {run}: losses (top), is it learning? (bottom; docs/stages.md)")
    fig.tight_layout()
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out_path)
    return out_path
