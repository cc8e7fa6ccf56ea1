"""Memory pressure while training: sample it cheaply and judge it (`dinov3_core.train.replan` acts on it).

Why: a run planned to fit can still outgrow its machine (allocator growth, loader workers, other programs). Once
RAM fills, the kernel compresses and swaps and a 1 s step becomes a 300 s one every few dozen steps; users then
stop the run, lower the batch and restart by hand. The trainer instead watches and re-plans in place.

`MemorySampler` is a daemon thread reading, every `interval` seconds, this process's RSS plus the private memory of
its children (the loader workers: summing their RSS would count the pages they share with the trainer once per
worker), host available memory and system swap counters. The children are read once a second (~1-3 ms each);
RSS costs microseconds, so the thread costs well under 1 % of a core. `window()` hands over the peak since
the last call. CUDA peaks come from the allocator's own high-water marks instead (`device_peak_bytes`).

`PressureJudge` turns windows into a decision: pressure must persist over `patience` consecutive windows (a spike
is not pressure), and every rank reaches the same decision (`torch.distributed` MAX over ranks first).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Literal

import psutil
import torch
import torch.distributed as dist

MIB = 2**20
Pressure = Literal["host", "device"]


# ---------------------------------------------------------------------------------------------- sampling


def private_bytes(pid: int) -> int:
    """Memory only this process holds (Private_Clean + Private_Dirty + swapped out); RSS where that cannot be read."""
    try:  # smaps_rollup: the kernel sums the mappings itself (Linux >= 4.14): cheap enough to read every step
        total = 0
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Private_Clean:", b"Private_Dirty:", b"Swap:")):
                    total += int(line.split()[1]) * 1024
        return total
    except FileNotFoundError:
        return psutil.Process(pid).memory_info().rss


def children_private_bytes(process: psutil.Process) -> int:
    """Private memory of `process`'s descendants (the loader workers: what they add beyond the pages they share
    with the trainer they were forked from)."""
    total = 0
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.Error, OSError):  # a worker exited meanwhile
            total += private_bytes(child.pid)
    return total


@dataclass(frozen=True)
class MemoryWindow:
    """What one sampling window saw. `process_mb`: peak memory of the training process and its loader workers;
    `host_available_mb`: the lowest host available memory; swap: system-wide MiB swapped in / out meanwhile."""

    process_mb: float
    host_available_mb: float
    swap_in_mb: float
    swap_out_mb: float
    device_mb: float  # peak reserved GPU memory (0 on CPU)
    seconds: float

    def worst(self, other: MemoryWindow) -> MemoryWindow:
        """Both windows as one: the higher peaks, the lower available memory, the swap of both."""
        return MemoryWindow(
            process_mb=max(self.process_mb, other.process_mb),
            host_available_mb=min(self.host_available_mb, other.host_available_mb),
            swap_in_mb=self.swap_in_mb + other.swap_in_mb,
            swap_out_mb=self.swap_out_mb + other.swap_out_mb,
            device_mb=max(self.device_mb, other.device_mb),
            seconds=self.seconds + other.seconds,
        )

    def as_metrics(self) -> dict[str, float]:
        return {
            "memory_process_mb": self.process_mb,
            "memory_host_available_mb": self.host_available_mb,
            "memory_swap_in_mb": self.swap_in_mb,
            "memory_swap_out_mb": self.swap_out_mb,
            "memory_device_mb": self.device_mb,
        }


class MemorySampler:
    """Background sampling of the process tree's memory; `window()` returns and restarts the current window."""

    def __init__(self, device: torch.device, interval: float = 0.05, children_interval: float = 1.0) -> None:
        self.device, self.interval, self.children_interval = device, interval, children_interval
        self._process = psutil.Process(os.getpid())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._children, self._children_read = 0, -math.inf
        self._reset_window()

    def _reset_window(self) -> None:
        swap = psutil.swap_memory()
        self._start = time.monotonic()
        self._swap = (swap.sin, swap.sout)
        self._peak_process = 0
        self._min_available = math.inf

    def sample(self) -> None:
        now = time.monotonic()
        if now - self._children_read >= self.children_interval:
            self._children, self._children_read = children_private_bytes(self._process), now
        process = self._process.memory_info().rss + self._children
        available = psutil.virtual_memory().available
        with self._lock:
            self._peak_process = max(self._peak_process, process)
            self._min_available = min(self._min_available, available)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> MemorySampler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="wsidino-memory-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def window(self) -> MemoryWindow:
        """The window since the last call (sampled once more now, so it is never empty)."""
        self.sample()
        swap = psutil.swap_memory()
        with self._lock:
            window = MemoryWindow(
                process_mb=self._peak_process / MIB,
                host_available_mb=self._min_available / MIB,
                swap_in_mb=max(0, swap.sin - self._swap[0]) / MIB,
                swap_out_mb=max(0, swap.sout - self._swap[1]) / MIB,
                device_mb=device_peak_bytes(self.device) / MIB,
                seconds=time.monotonic() - self._start,
            )
            self._reset_window()
        return window


def device_peak_bytes(device: torch.device) -> int:
    """Peak reserved GPU memory since the last call (the allocator's high-water mark, then reset); 0 on CPU."""
    if device.type != "cuda":
        return 0
    peak = torch.cuda.max_memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def release_freed_memory() -> None:
    """Hand memory freed by Python and torch back to the OS and the GPU, so that the next window measures the new
    plan: glibc keeps freed heap pages mapped (they stay in RSS) until trimmed, and torch's CUDA caching allocator
    keeps freed blocks reserved. malloc_trim is a no-op where glibc is not the allocator."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class PressureLimits:
    """When a window counts as pressure. `process_mb`: the host budget of one rank's process tree; `device_mb`:
    the GPU budget (0: no GPU); host-wide: available memory under `min_available_mb`, or swapping in faster
    than `swap_in_mb_per_s` (pages coming back from swap are what makes steps crawl)."""

    process_mb: float
    device_mb: float
    min_available_mb: float
    swap_in_mb_per_s: float = 4.0

    def judge(self, window: MemoryWindow) -> tuple[Pressure | None, str]:
        """The kind of pressure in `window` and why (device first: on a GPU that is the budget that binds)."""
        if self.device_mb and window.device_mb > self.device_mb:
            return "device", f"GPU memory peaked at {window.device_mb:.0f} MiB > {self.device_mb:.0f} MiB"
        if window.process_mb > self.process_mb:
            return "host", f"process memory peaked at {window.process_mb:.0f} MiB > {self.process_mb:.0f} MiB"
        if window.host_available_mb < self.min_available_mb:
            return "host", f"host available memory fell to {window.host_available_mb:.0f} MiB"
        rate = window.swap_in_mb / max(window.seconds, 1e-3)
        if rate > self.swap_in_mb_per_s:
            return "host", f"the host swapped in {rate:.1f} MiB/s"
        return None, ""


class PressureJudge:
    """Sustained pressure: the same kind in `patience` consecutive windows."""

    def __init__(self, limits: PressureLimits, patience: int) -> None:
        self.limits, self.patience = limits, patience
        self.streak: list[tuple[Pressure, str]] = []

    def observe(self, window: MemoryWindow) -> tuple[Pressure, str] | None:
        kind, why = self.limits.judge(window)
        if kind is None or (self.streak and self.streak[-1][0] != kind):
            self.streak = []
        if kind is not None:
            self.streak.append((kind, why))
        if len(self.streak) >= self.patience:
            self.streak = []  # the next decision needs fresh evidence (the re-plan changes what is measured)
            return kind, f"{why} in {self.patience} consecutive checks"
        return None


# ------------------------------------------------------------------------------------------------ the watch


def pressure_limits(
    *, budget_bytes: int, explicit_budget: bool, device: torch.device, local_world_size: int, threshold: float
) -> PressureLimits:
    """Limits from the estimator's budget. On GPU the budget is GPU memory; on CPU it is host memory. Without an
    explicit `train.memory_budget_gb` only the machine binds: this rank's share of RAM, or 95 % of the GPU (the
    estimator's default 90 % is a planning margin; the caching allocator's reserved peak may pass it without
    trouble). Host-wide: under 5 % of RAM available (at least 256 MiB) is pressure anywhere."""
    host_total = psutil.virtual_memory().total
    host_share = host_total / local_world_size
    if device.type == "cuda":
        gpu = budget_bytes if explicit_budget else 0.95 * torch.cuda.get_device_properties(device).total_memory
        device_mb, process_mb = gpu * threshold / MIB, host_share / MIB
    else:
        device_mb = 0.0
        process_mb = (budget_bytes if explicit_budget else host_share) * threshold / MIB
    return PressureLimits(
        process_mb=process_mb, device_mb=device_mb, min_available_mb=max(256.0, 0.05 * host_total / MIB)
    )


class MemoryWatch:
    """The sampler, judged every check; `check()` is a collective (all ranks call it at the same iterations)."""

    def __init__(
        self, limits: PressureLimits, patience: int, device: torch.device, distributed: bool, *, judging: bool = True
    ) -> None:
        self.limits, self.device, self.distributed, self.judging = limits, device, distributed, judging
        self.judge = PressureJudge(limits, patience)
        self.sampler = MemorySampler(device)

    def start(self) -> MemoryWatch:
        self.sampler.start()
        return self

    def stop(self) -> None:
        self.sampler.stop()

    def check(self) -> tuple[MemoryWindow, tuple[Pressure, str] | None]:
        """This window (the worst over ranks) and the sustained pressure it completes, if any: every rank judges
        the same numbers, so every rank re-plans alike."""
        window = self.sampler.window()
        if self.distributed:
            window = _worst_over_ranks(window, self.device)
        return window, self.judge.observe(window) if self.judging else None


def _worst_over_ranks(window: MemoryWindow, device: torch.device) -> MemoryWindow:
    values = torch.tensor(
        [window.process_mb, -window.host_available_mb, window.swap_in_mb, window.swap_out_mb, window.device_mb],
        dtype=torch.float64,
        device=device if device.type == "cuda" else "cpu",
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    process, neg_available, swap_in, swap_out, device_mb = values.tolist()
    return MemoryWindow(process, -neg_available, swap_in, swap_out, device_mb, window.seconds)
