"""The tile engine on one host: slide planning and shard-range writes spread over a spawn process pool.

One large slide uses every worker (its shard ranges are separate jobs); a worker that dies (corrupt image data
crashing a reader) is replaced, its jobs get one more attempt, then their slide is marked failed. Each slide is
committed, and its store-manifest entry written, as soon as its last shard is on disk.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dinov3_core.tiling import store as ts
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.plan import SlidePlan, SlideTask, plan_slide
from dinov3_core.tiling.slide_job import (
    ProgressFn,
    SlideFn,
    SlideOutcome,
    begin_plan,
    draw_qc,
    error_text,
    fail_slide,
    finish_plan,
    limit_zarr_threads,
    store_extras,
)
from dinov3_core.tiling.writer import write_unit

log = logging.getLogger("wsidino.tile")

MAX_UNIT_ATTEMPTS = 2  # a unit whose worker died is retried once before its slide is marked failed


@dataclass
class _SlideState:
    plan: SlidePlan
    incoming: ts.IncomingSlide
    remaining: int
    started: float
    writers: set[int] = field(default_factory=set)  # pids of the worker processes that wrote its shards


def run_pool(
    root: Path,
    todo: list[SlideTask],
    cfg: TileConfig,
    overrides: dict[str, float],
    outcomes: dict[str, SlideOutcome],
    progress: ProgressFn | None,
    on_slide: SlideFn | None,
    timing: dict[str, float],
) -> int:
    """Plan jobs first, then shard-range write jobs; survives worker crashes by rebuilding the pool."""
    if not todo:
        return 0
    ctx = mp.get_context("spawn")  # the parent runs zarr's event-loop thread: never fork it

    def new_pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=cfg.workers, mp_context=ctx, initializer=_init_worker)

    pool = new_pool()
    pending: dict[Future[Any], tuple[str, Any, int]] = {}
    states: dict[str, _SlideState] = {}
    done_tiles = planned_tiles = 0
    started = {t.slide_id: time.perf_counter() for t in todo}

    def submit(kind: str, payload: Any, attempt: int = 1) -> None:
        fn = plan_slide if kind == "plan" else write_unit
        args = (payload, cfg, overrides) if kind == "plan" else (payload,)
        pending[pool.submit(fn, *args)] = (kind, payload, attempt)

    def fail(task_or_id: SlideTask | str, path: str, message: str) -> None:
        slide_id = task_or_id if isinstance(task_or_id, str) else task_or_id.slide_id
        state = states.pop(slide_id, None)
        outcomes[slide_id] = fail_slide(slide_id, path, message, state.incoming if state is not None else None)
        ts.write_manifest(root, [outcomes[slide_id].as_manifest_entry()], store_extras(cfg))
        if on_slide is not None:
            on_slide(outcomes[slide_id])

    def commit(state: _SlideState) -> None:
        outcome = finish_plan(state.incoming, state.plan, cfg, time.perf_counter() - state.started)
        states.pop(outcome.slide_id, None)
        outcome.workers = len(state.writers)
        outcomes[outcome.slide_id] = outcome
        ts.write_manifest(root, [outcome.as_manifest_entry()], store_extras(cfg))
        if on_slide is not None:
            on_slide(outcome)

    for task in todo:
        submit("plan", task)
    try:
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            crashed: list[tuple[str, Any, int]] = []
            for fut in done:
                kind, payload, attempt = pending.pop(fut)
                slide_id = payload.slide_id if kind == "plan" else payload.incoming.slide_id
                path = str(payload.path if kind == "plan" else payload.source)
                if kind == "write" and slide_id not in states:
                    continue  # its slide already failed
                try:
                    result = fut.result()
                except BrokenProcessPool:
                    crashed.append((kind, payload, attempt))
                    continue
                except Exception as err:
                    fail(slide_id, path, error_text(err))
                    continue
                if kind == "plan":
                    plan: SlidePlan = result
                    timing["plan"] += plan.seconds
                    try:
                        incoming, units = begin_plan(root, plan, cfg)
                    except Exception as err:
                        fail(slide_id, path, error_text(err))
                        continue
                    states[slide_id] = _SlideState(plan, incoming, len(units), started[slide_id])
                    planned_tiles += plan.n_tiles
                    for unit in units:
                        submit("write", unit)
                    try:
                        draw_qc(incoming, plan, cfg)  # while the workers write
                    except Exception as err:
                        fail(slide_id, path, error_text(err))
                        continue
                    if not units:
                        commit(states[slide_id])
                else:
                    state = states[slide_id]
                    state.remaining -= 1
                    _, n_tiles, seconds, pid = result
                    done_tiles += n_tiles
                    timing["write"] += seconds
                    state.writers.add(pid)
                    if state.remaining == 0:
                        try:
                            commit(state)
                        except Exception as err:
                            fail(slide_id, path, error_text(err))  # also abandons its .incoming/ directory
                if progress:
                    progress(done_tiles, planned_tiles)
            if crashed:
                # A dead worker fails every unfinished job of the pool and we cannot tell whose job killed it:
                # rebuild the pool and give each affected job one more attempt.
                leftovers = crashed + list(pending.values())
                pending.clear()
                pool.shutdown(wait=False, cancel_futures=True)
                pool = new_pool()
                for kind, payload, attempt in leftovers:
                    slide_id = payload.slide_id if kind == "plan" else payload.incoming.slide_id
                    path = str(payload.path if kind == "plan" else payload.source)
                    if kind == "write" and slide_id not in states:
                        continue
                    if attempt >= MAX_UNIT_ATTEMPTS:
                        fail(
                            slide_id,
                            path,
                            f"{path}: a worker process crashed while reading this slide "
                            "(corrupt image data?); open it in a slide viewer or re-export it",
                        )
                    else:
                        submit(kind, payload, attempt + 1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for state in states.values():
            ts.abandon_slide(state.incoming)
    return done_tiles


def _init_worker() -> None:
    limit_zarr_threads()
