"""Memory on a schedule, the same on every rank (a component of `loop.Trainer.train`): the collector frozen over
the setup objects for the run, a `gc.collect()` every `train.gc_period` iterations (same iteration everywhere, so
no rank stalls a collective alone), and the memory watch (`replan.start_watch`) checked every
`train.memory_watch_period` iterations; the worst window since the last metrics line goes onto that line."""

from __future__ import annotations

import gc
from types import TracebackType

import torch

from dinov3_core.train import config as C
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.memory_watch import MemoryWatch, MemoryWindow, Pressure
from dinov3_core.train.replan import start_watch


class MemoryGuard:
    """`with MemoryGuard(...) as memory:` around the iterations; the watch stops and the collector is back as it
    was on the way out."""

    def __init__(self, cfg: C.PretrainConfig, env: DistEnv, budget_bytes: int) -> None:
        self.cfg, self.env, self.budget_bytes = cfg, env, budget_bytes
        self.seen: MemoryWindow | None = None  # the worst window since the last metrics line
        self.watch: MemoryWatch | None = None

    def __enter__(self) -> MemoryGuard:
        if self.env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.env.device)
        gc.collect()
        gc.freeze()  # setup objects (model, index arrays) move out of the collected generations
        self.watch = start_watch(self.cfg, self.env, self.budget_bytes)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self.watch is not None:
            self.watch.stop()
        gc.unfreeze()  # in-process callers (tests, notebooks) get their collector back as it was

    def check(self, iteration: int, *, last: bool) -> tuple[Pressure, str] | None:
        """The watch's verdict after `iteration` when a check is due (collective: same iterations, same verdict
        on every rank), else None."""
        if not ((iteration + 1) % self.cfg.train.memory_watch_period == 0 or last):
            return None
        assert self.watch is not None, "MemoryGuard.check outside its with-block"
        seen, pressure = self.watch.check()
        self.seen = seen if self.seen is None else self.seen.worst(seen)
        return pressure

    def collect(self, iteration: int) -> None:
        if (iteration + 1) % self.cfg.train.gc_period == 0:
            gc.collect()  # same iteration on every rank: no rank stalls a collective alone

    def window_metrics(self) -> dict[str, float]:
        """The worst window since the last call, as metrics ({} when none was checked); starts a new one."""
        seen, self.seen = self.seen, None
        return seen.as_metrics() if seen is not None else {}
