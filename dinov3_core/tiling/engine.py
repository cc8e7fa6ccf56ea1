"""The tile stage: whole-slide images → zarr tile store.

`run_tile(cfg)` is the one tile engine, behind the CLI and the Prefect tile flow alike (both through
`dinov3_core.runner.run_stage`). It lists the slides, skips those already complete, holds the store lock, then hands
the rest to one of two executors: by default its own process pool (`engine_pool`: slide planning and shard-range
writes over `cfg.workers` processes, so one large slide also uses every worker), or, given `run_groups`, slide
groups tiled elsewhere (`groups`: e.g. one Prefect task per group on a Dask cluster). Each slide is committed
atomically and its outcome recorded in the store manifest. `progress` and `on_slide` callbacks (called in the
calling thread) let the caller draw a progress bar, or publish Prefect progress and table artifacts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from dinov3_core.config import save_config
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.discovery import (
    Repeat,
    assign_slide_ids,
    discover_slides,
    find_repeats,
    holds_content,
    is_up_to_date,
)
from dinov3_core.tiling.engine_pool import run_pool
from dinov3_core.tiling.groups import RunGroups, collect_groups, remote_job
from dinov3_core.tiling.plan import SlideTask
from dinov3_core.tiling.slide import load_mpp_overrides
from dinov3_core.tiling.slide_job import (
    ProgressFn,
    SlideFn,
    SlideOutcome,
    duplicate_outcome,
    skipped_outcome,
    store_extras,
)

log = logging.getLogger("wsidino.tile")

__all__ = ["ProgressFn", "SlideFn", "SlideOutcome", "TileResult", "prepare_store", "run_tile", "store_extras"]


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
        """Slides tiled, failed and already up to date (the stage summary's fields); duplicates: `duplicates`."""
        out = {"ok": 0, "failed": 0, "skipped": 0}
        for o in self.outcomes:
            if o.status in out:
                out[o.status] += 1
        return out

    @property
    def duplicates(self) -> int:
        """Inputs not tiled because another input holds the same tissue (neither tiled nor failed)."""
        return sum(o.status == "duplicate" for o in self.outcomes)

    @property
    def total_tiles(self) -> int:
        return sum(o.tile_count for o in self.outcomes if o.status in ("ok", "skipped"))


# -------------------------------------------------------------------------------------------------- whole stage


def prepare_store(cfg: TileConfig) -> tuple[Path, list[SlideTask], dict[str, float]]:
    """List the slides, load µm/px overrides, then validate (and create) the output: an input without slides or a
    bad overrides file fails before anything is written, so it leaves no empty store behind."""
    tasks = assign_slide_ids(discover_slides(cfg.input, cfg.extensions))
    overrides = {**load_mpp_overrides(cfg.mpp_overrides), **cfg.mpp_by_slide}
    root = ts.init_store(cfg.output)
    return root, tasks, overrides


def run_tile(
    cfg: TileConfig,
    progress: ProgressFn | None = None,
    on_slide: SlideFn | None = None,
    run_groups: RunGroups | None = None,
) -> TileResult:
    """Tile every input slide into the store at `cfg.output`; a bad slide is recorded, never fatal.

    Args:
        cfg: The resolved tile config.
        progress: Called with (tiles written, tiles planned so far) as shards (slide groups) finish.
        on_slide: Called with each slide's outcome as soon as it is known (skipped ones first).
        run_groups: Tile the slides in groups with this instead of the engine's own process pool (`groups`);
            the store manifest is then written once, when every group has finished.
    """
    start = time.perf_counter()
    root, inputs, overrides = prepare_store(cfg)
    notes: dict[str, str] = {}  # copies the store already holds under two ids: both stay, their rows say so
    tasks, repeats = find_repeats(inputs, held=lambda task: holds_content(root, task), notes=notes)
    for note in notes.values():
        log.warning("%s", note)
    with ts.store_lock(root):
        ts.clear_incoming(root)
        save_config(cfg, root / "config.yaml")
        outcomes: dict[str, SlideOutcome] = {}
        for repeat in repeats:
            outcomes[repeat.task.slide_id] = _duplicate(root, repeat)
            if on_slide is not None:
                on_slide(outcomes[repeat.task.slide_id])
        todo: list[SlideTask] = []
        for task in tasks:
            try:
                if is_up_to_date(root, task, cfg, overrides):
                    outcomes[task.slide_id] = skipped_outcome(root, task)
                    outcomes[task.slide_id].note = notes.get(task.slide_id)
                    if on_slide is not None:
                        on_slide(outcomes[task.slide_id])
                    continue
            except Exception as err:  # an unreadable file: let planning report it
                log.debug("up-to-date check failed for %s: %s", task.path, err)
            todo.append(task)
        timing = {"plan": 0.0, "write": 0.0}
        try:
            if run_groups is None:
                if outcomes:  # the pool writes each slide's entry as it commits: record the others first
                    ts.write_manifest(root, [o.as_manifest_entry() for o in outcomes.values()], store_extras(cfg))
                written = run_pool(root, todo, cfg, overrides, outcomes, progress, on_slide, timing)
            elif todo:
                job, absolute_todo = remote_job(cfg, root, todo, overrides)
                written = collect_groups(job, absolute_todo, run_groups, outcomes, progress, on_slide, timing)
            else:
                written = 0
        finally:  # also when a group runner gives up: the slides committed so far are in the manifest
            ts.write_manifest(root, [o.as_manifest_entry() for o in outcomes.values()], store_extras(cfg))
    ordered = [outcomes[t.slide_id] for t in inputs]
    return TileResult(
        store=root,
        outcomes=ordered,
        seconds=time.perf_counter() - start,
        tiles_written=written,
        plan_seconds=timing["plan"],
        write_seconds=timing["write"],
    )


def _duplicate(root: Path, repeat: Repeat) -> SlideOutcome:
    """The row of an input another input covers. A copy the store holds from this content is never one
    (`find_repeats` keeps it), so tiles stored under its id are from content the file no longer has: they are
    removed, as a changed slide's are replaced (the same tissue twice in the store would let it land in both a
    training and a test split); its row says so."""
    outcome = duplicate_outcome(repeat)
    if repeat.task.slide_id in ts.complete_slide_ids(root):
        ts.remove_slide(root, repeat.task.slide_id)
        outcome.note = f"{outcome.note}; its tiles from an earlier run were removed from the store"
        log.warning("%s", outcome.note)
    return outcome
