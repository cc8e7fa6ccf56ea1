"""The tile stage: whole-slide images → zarr tile store.

`run_tile(cfg)` is the one tile engine, behind the CLI and the Prefect tile flow alike (both through
`dinov3_core.run.run_stage`). It spreads slide planning and shard-range writes over a process pool, so one large
slide also uses every worker, commits each slide atomically when all of its shards are written, and records every
slide's outcome in the store manifest. `progress` and `on_slide` callbacks (called in the calling thread) let the
caller draw a progress bar, or publish Prefect progress and table artifacts.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dinov3_core.config import save_config
from dinov3_core.errors import WsidinoError
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.discovery import assign_slide_ids, discover_slides, is_up_to_date
from dinov3_core.tiling.plan import (
    SlidePlan,
    SlideTask,
    plan_slide,
    slide_attrs,
    tiling_params,
)
from dinov3_core.tiling.qc import save_qc_pictures
from dinov3_core.tiling.slide import load_mpp_overrides
from dinov3_core.tiling.writer import WriteUnit, write_unit

log = logging.getLogger("wsidino.tile")

SHARDS_PER_UNIT = 1
MAX_UNIT_ATTEMPTS = 2  # a unit whose worker died is retried once before its slide is marked failed


@dataclass
class SlideOutcome:
    slide_id: str
    source_path: str
    status: str  # ok | failed | skipped
    error: str | None = None
    tile_count: int = 0
    seconds: float = 0.0
    bytes_per_tile: float | None = None
    mpp_effective: float | None = None
    qc: dict[str, str] = field(default_factory=dict)
    workers: int = 0  # worker processes that wrote this slide's tiles (a large slide is spread over all of them)

    def as_manifest_entry(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TileResult:
    store: Path
    outcomes: list[SlideOutcome]
    seconds: float
    tiles_written: int
    plan_seconds: float = 0.0  # summed over workers: tissue masks, grids, QC scores
    write_seconds: float = 0.0  # summed over workers: reading, resizing, encoding and writing tiles

    @property
    def counts(self) -> dict[str, int]:
        out = {"ok": 0, "failed": 0, "skipped": 0}
        for o in self.outcomes:
            out[o.status] += 1
        return out

    @property
    def total_tiles(self) -> int:
        return sum(o.tile_count for o in self.outcomes if o.status in ("ok", "skipped"))


# ------------------------------------------------------------------------------------------- skipped slides


def skipped_outcome(root: Path, task: SlideTask) -> SlideOutcome:
    attrs = ts.read_slide_attrs(root, task.slide_id)
    return SlideOutcome(
        slide_id=task.slide_id,
        source_path=str(task.path),
        status="skipped",
        tile_count=int(attrs.get("tile_count", 0)),
        bytes_per_tile=attrs.get("bytes_per_tile"),
        mpp_effective=attrs.get("mpp_effective"),
        qc=_qc_paths(task.slide_id, {"thumbnail": "qc_thumbnail.png", "mask": "qc_mask.png"}),
    )


def _qc_paths(slide_id: str, names: dict[str, str]) -> dict[str, str]:
    return {k: f"{ts.SLIDES}/{slide_id}/{v}" for k, v in names.items()}


def _error_text(err: BaseException) -> str:
    if isinstance(err, WsidinoError):
        return str(err)
    return f"{type(err).__name__}: {err}"


# ----------------------------------------------------------------------------------------------- one slide


def begin_plan(root: Path, plan: SlidePlan, cfg: TileConfig) -> tuple[ts.IncomingSlide, list[WriteUnit]]:
    incoming = ts.begin_slide(
        root,
        plan.task.slide_id,
        n_tiles=plan.n_tiles,
        tile_size=cfg.tile_size,
        tiles_per_shard=cfg.tiles_per_shard,
        compressor=cfg.compressor,
        compression_level=cfg.compression_level,
        jpeg_quality=cfg.jpeg_quality,
        columns=plan.columns(),
    )
    units = [
        WriteUnit(
            incoming=incoming,
            source=plan.task.path,
            read=plan.read,
            reader=plan.reader,
            level_size=plan.info.level_dimensions[plan.read.level],
            level_downsample=plan.info.level_downsamples[plan.read.level],
            start=a,
            coords=plan.coords[a:b],
        )
        for a, b in incoming.shard_ranges(SHARDS_PER_UNIT)
    ]
    return incoming, units


def finish_plan(incoming: ts.IncomingSlide, plan: SlidePlan, cfg: TileConfig, seconds: float) -> SlideOutcome:
    qc = save_qc_pictures(
        incoming.path,
        plan.qc_image,
        plan.qc_scale,
        plan.tissue_mask,
        plan.pen_mask,
        plan.coords,
        plan.dropped_coords,
        plan.read.tile_size_level0,
        max_side=cfg.qc_thumbnail_px,
        title=f"{plan.task.slide_id}: {plan.n_tiles} tiles @ {plan.read.mpp_effective:.3f} um/px",
    )
    final = ts.commit_slide(incoming, slide_attrs(plan, cfg))
    attrs = ts.read_slide_attrs(final.parent.parent, plan.task.slide_id)
    return SlideOutcome(
        slide_id=plan.task.slide_id,
        source_path=str(plan.task.path),
        status="ok",
        tile_count=plan.n_tiles,
        seconds=round(seconds, 3),
        bytes_per_tile=attrs.get("bytes_per_tile"),
        mpp_effective=plan.read.mpp_effective,
        qc=_qc_paths(plan.task.slide_id, qc),
    )


# -------------------------------------------------------------------------------------------------- whole stage


def prepare_store(cfg: TileConfig) -> tuple[Path, list[SlideTask], dict[str, float]]:
    """List the slides, load µm/px overrides, then validate (and create) the output: an input without slides or a
    bad overrides file fails before anything is written, so it leaves no empty store behind."""
    tasks = assign_slide_ids(discover_slides(cfg.input, cfg.extensions))
    overrides = {**load_mpp_overrides(cfg.mpp_overrides), **cfg.mpp_by_slide}
    root = ts.init_store(cfg.output)
    return root, tasks, overrides


def store_extras(cfg: TileConfig) -> dict[str, Any]:
    return {"tiling": tiling_params(cfg)}


ProgressFn = Callable[[int, int], None]  # (tiles done, tiles planned so far)
SlideFn = Callable[[SlideOutcome], None]  # a slide finished: ok, skipped (already complete) or failed


def run_tile(cfg: TileConfig, progress: ProgressFn | None = None, on_slide: SlideFn | None = None) -> TileResult:
    """Tile every input slide into the store at `cfg.output`; a bad slide is recorded, never fatal.

    Args:
        cfg: The resolved tile config.
        progress: Called with (tiles written, tiles planned so far) as shards finish.
        on_slide: Called with each slide's outcome as soon as it is known (skipped ones first).
    """
    start = time.perf_counter()
    root, tasks, overrides = prepare_store(cfg)
    with ts.store_lock(root):
        ts.clear_incoming(root)
        save_config(cfg, root / "config.yaml")
        outcomes: dict[str, SlideOutcome] = {}
        todo: list[SlideTask] = []
        for task in tasks:
            try:
                if is_up_to_date(root, task, cfg, overrides):
                    outcomes[task.slide_id] = skipped_outcome(root, task)
                    if on_slide is not None:
                        on_slide(outcomes[task.slide_id])
                    continue
            except Exception as err:  # an unreadable file: let planning report it
                log.debug("up-to-date check failed for %s: %s", task.path, err)
            todo.append(task)
        if outcomes:
            ts.write_manifest(root, [o.as_manifest_entry() for o in outcomes.values()], store_extras(cfg))
        timing = {"plan": 0.0, "write": 0.0}
        written = _run_pool(root, todo, cfg, overrides, outcomes, progress, on_slide, timing)
        ts.write_manifest(root, [o.as_manifest_entry() for o in outcomes.values()], store_extras(cfg))
    ordered = [outcomes[t.slide_id] for t in tasks]
    return TileResult(
        store=root,
        outcomes=ordered,
        seconds=time.perf_counter() - start,
        tiles_written=written,
        plan_seconds=timing["plan"],
        write_seconds=timing["write"],
    )


@dataclass
class _SlideState:
    plan: SlidePlan
    incoming: ts.IncomingSlide
    remaining: int
    started: float
    writers: set[int] = field(default_factory=set)  # pids of the worker processes that wrote its shards


def _run_pool(
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
        if state is not None:
            ts.abandon_slide(state.incoming)
        outcomes[slide_id] = SlideOutcome(slide_id, path, "failed", error=message)
        ts.write_manifest(root, [outcomes[slide_id].as_manifest_entry()], store_extras(cfg))
        log.warning("slide failed: %s", message)
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
                    fail(slide_id, path, _error_text(err))
                    continue
                if kind == "plan":
                    plan: SlidePlan = result
                    timing["plan"] += plan.seconds
                    try:
                        incoming, units = begin_plan(root, plan, cfg)
                    except Exception as err:
                        fail(slide_id, path, _error_text(err))
                        continue
                    states[slide_id] = _SlideState(plan, incoming, len(units), started[slide_id])
                    planned_tiles += plan.n_tiles
                    for unit in units:
                        submit("write", unit)
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
                            fail(slide_id, path, _error_text(err))  # also abandons its .incoming/ directory
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
    """One core per worker: zarr would otherwise encode chunks on a thread pool as wide as the machine, so
    `workers` processes would oversubscribe the cores they were given."""
    import zarr

    zarr.config.set({"threading.max_workers": 1})
