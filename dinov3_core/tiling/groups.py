"""The tile engine's slides handed out in groups, for executors on other hosts (the Prefect flow's Dask workers).

The coordinator (`engine.run_tile`, holding the store lock) cuts the slides to tile into groups balanced by file
size and gives them to a `RunGroups` callable, which runs `tile_slide_group` for each group wherever it likes
and reports each group's outcomes as it finishes. One writer per slide group: a slide is only ever planned,
written and committed by the one process tiling its group, so groups never share a slide's `.incoming/`
directory. Each slide is still committed atomically as soon as it is written, so a group lost half-way keeps
the slides it committed: their attributes mark them complete, and the coordinator (and any rerun's up-to-date
check) recognises them as such. The store lock, clearing `.incoming/` and the store manifest stay the
coordinator's, which writes the manifest once, after every group has finished.

A group runs in the calling process, slide after slide, with no process pool of its own: see `tile_slide_group`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.discovery import is_up_to_date
from dinov3_core.tiling.plan import SlideTask, plan_slide
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
    process_name,
    skipped_outcome,
)
from dinov3_core.tiling.writer import close_cached_readers, write_unit

log = logging.getLogger("wsidino.tile")


@dataclass(frozen=True)
class SlideGroup:
    """Slides one process tiles, one after the other; `size` is their summed file size in bytes."""

    index: int
    tasks: tuple[SlideTask, ...]
    size: int


@dataclass(frozen=True)
class GroupJob:
    """What every group of one run shares; picklable, so a remote executor can call `job.run(group)`."""

    cfg: TileConfig
    root: Path
    overrides: dict[str, float]

    def run(self, group: SlideGroup) -> GroupResult:
        return tile_slide_group(self.cfg, self.root, group.tasks, self.overrides)


@dataclass
class GroupResult:
    outcomes: list[SlideOutcome] = field(default_factory=list)
    plan_seconds: float = 0.0  # tissue masks, grids, QC scores
    write_seconds: float = 0.0  # reading, resizing, encoding and writing tiles


GroupReport = tuple[SlideGroup, GroupResult | BaseException]  # a group with its result, or what lost it


class RunGroups(Protocol):
    """Tiles the slides `todo` of `job` in groups, wherever it likes (e.g. one Prefect task per group on Dask).

    Cuts them with `group_slides` (as many groups as it has workers; with `isolate`, one slide per group), runs
    `job.run(group)` for each and yields every group, as it finishes, with its `GroupResult`, or with the exception
    that lost it (a dead worker): the coordinator then records that group's slides. It raises only when it cannot
    run groups at all.
    """

    def __call__(self, job: GroupJob, todo: Sequence[SlideTask], isolate: bool = False) -> Iterable[GroupReport]: ...


def group_slides(tasks: Sequence[SlideTask], n_groups: int) -> list[SlideGroup]:
    """At most `n_groups` groups of similar total file size: the largest slide first, each onto the group with
    the fewest bytes so far (ties: the lower index). File size stands for tiling time; a missing file counts 0
    (it fails at once). Slides keep their input order inside a group; empty groups are dropped."""
    if n_groups < 1:
        raise ValueError(f"n_groups must be at least 1, not {n_groups}")
    sizes = {t.slide_id: _file_size(t.path) for t in tasks}
    members: list[list[SlideTask]] = [[] for _ in range(min(n_groups, len(tasks)))]
    loads = [0] * len(members)
    for task in sorted(tasks, key=lambda t: -sizes[t.slide_id]):  # stable: equal sizes keep input order
        lightest = min(range(len(members)), key=lambda i: (loads[i], i))
        members[lightest].append(task)
        loads[lightest] += sizes[task.slide_id]
    order = {t.slide_id: i for i, t in enumerate(tasks)}
    return [
        SlideGroup(index=i, tasks=tuple(sorted(m, key=lambda t: order[t.slide_id])), size=loads[i])
        for i, m in enumerate(members)
        if m
    ]


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tile_slide_group(
    cfg: TileConfig, root: Path, tasks: Sequence[SlideTask], overrides: dict[str, float]
) -> GroupResult:
    """Plan, write and commit each slide of a group in this process; a bad slide is recorded, never fatal.

    The remote half of `run_tile`: it takes no store lock, clears no `.incoming/` and writes no store manifest,
    because the coordinator that called `RunGroups` holds the lock and does those once for the whole run.

    It uses no process pool: Dask worker processes are daemonic and may not start children, and a pool would
    also oversubscribe cores that Dask already counts as this worker's. So the parallelism is the cluster's
    (one single-threaded Dask worker per core) and a large slide is tiled by one worker. A slide that raises
    fails alone; one that kills the process (a crashing reader) loses the rest of its group, which the
    coordinator tiles again one slide per group (`collect_groups`).
    """
    limit_zarr_threads()  # this worker is one core
    result = GroupResult()
    tiled_by = process_name()
    try:
        for task in tasks:
            outcome = _tile_one(cfg, root, task, overrides, result)
            outcome.tiled_by = tiled_by
            result.outcomes.append(outcome)
    finally:
        close_cached_readers()  # the worker lives on: do not keep the last slide open
    return result


def _tile_one(
    cfg: TileConfig, root: Path, task: SlideTask, overrides: dict[str, float], result: GroupResult
) -> SlideOutcome:
    start = time.perf_counter()
    incoming = None
    try:
        plan = plan_slide(task, cfg, overrides)
        result.plan_seconds += plan.seconds
        incoming, units = begin_plan(root, plan, cfg)
        draw_qc(incoming, plan, cfg)
        for unit in units:
            _, _, seconds, _ = write_unit(unit)
            result.write_seconds += seconds
        outcome = finish_plan(incoming, plan, cfg, time.perf_counter() - start)
    except Exception as err:
        return fail_slide(task.slide_id, task.path, error_text(err), incoming)
    outcome.workers = 1
    return outcome


def remote_job(
    cfg: TileConfig, root: Path, todo: Sequence[SlideTask], overrides: dict[str, float]
) -> tuple[GroupJob, list[SlideTask]]:
    """The job and slides with absolute paths: a worker on another host (or in another directory) must find the
    same files. A µm/px override keyed by a slide's relative path also applies under its absolute path."""
    tasks = [SlideTask(t.slide_id, t.path.absolute()) for t in todo]
    moved = {str(a.path): overrides[str(t.path)] for t, a in zip(todo, tasks, strict=True) if str(t.path) in overrides}
    return GroupJob(cfg=cfg, root=root.absolute(), overrides={**overrides, **moved}), tasks


def collect_groups(
    job: GroupJob,
    todo: Sequence[SlideTask],
    run_groups: RunGroups,
    outcomes: dict[str, SlideOutcome],
    progress: ProgressFn | None,
    on_slide: SlideFn | None,
    timing: dict[str, float],
) -> int:
    """The coordinator's side: hand `todo` to `run_groups`, record every slide's outcome as its group reports,
    and return the tiles written. Progress is per group: the tiles planned are extrapolated from the file
    sizes of the groups done so far.

    A lost group's unfinished slides get one more round, one slide per group: a slide that kills the process
    tiling it (a crashing reader on corrupt image data) then takes down only itself, not its group-mates, as the
    pool retries a crashed unit once before failing its slide.
    """
    done = {"tiles": 0, "bytes": 0}
    total_bytes = sum(_file_size(t.path) for t in todo)

    def record(group: SlideGroup, group_outcomes: list[SlideOutcome]) -> None:
        for outcome in group_outcomes:
            outcomes[outcome.slide_id] = outcome
            if outcome.status == "ok":
                done["tiles"] += outcome.tile_count
            if on_slide is not None and outcome.status != "retry":
                on_slide(outcome)
        done["bytes"] += sum(_file_size(t.path) for t in group.tasks if outcomes[t.slide_id].status != "retry")
        if progress is not None:
            planned = round(done["tiles"] * total_bytes / done["bytes"]) if done["bytes"] else done["tiles"]
            progress(done["tiles"], max(planned, done["tiles"]))

    retry: list[SlideTask] = []
    for isolate, tasks in ((False, list(todo)), (True, retry)):
        if not tasks:
            continue
        for group, result in run_groups(job, tasks, isolate=isolate):
            if isinstance(result, BaseException):
                log.warning(
                    "slide group %d (%d slides) was lost: %s", group.index, len(group.tasks), error_text(result)
                )
                group_outcomes = [_lost_slide(job, task, result, last_try=isolate) for task in group.tasks]
                retry.extend(t for t, o in zip(group.tasks, group_outcomes, strict=True) if o.status == "retry")
            else:
                timing["plan"] += result.plan_seconds
                timing["write"] += result.write_seconds
                group_outcomes = result.outcomes
            record(group, group_outcomes)
        if retry and not isolate:
            log.warning("tiling %d slide(s) of lost groups again, one slide per group", len(retry))
    for task in todo:
        if outcomes.get(task.slide_id) is None or outcomes[task.slide_id].status == "retry":
            # A runner that dropped a group: say so rather than lose the slide.
            outcomes[task.slide_id] = SlideOutcome(
                task.slide_id, str(task.path), "failed", error=f"{task.path}: no slide group reported this slide"
            )
            if on_slide is not None:
                on_slide(outcomes[task.slide_id])
    return done["tiles"]


def _lost_slide(job: GroupJob, task: SlideTask, err: BaseException, last_try: bool) -> SlideOutcome:
    """A slide of a lost group: complete if its group committed it before dying; else, on the first try, marked
    for one more (status "retry", never reported); on the last, failed (a rerun redoes it)."""
    try:
        if is_up_to_date(job.root, task, job.cfg, job.overrides):
            return skipped_outcome(job.root, task, status="ok")
    except Exception as check_err:  # unreadable source: report the loss below
        log.debug("up-to-date check failed for %s: %s", task.path, check_err)
    if not last_try:
        return SlideOutcome(task.slide_id, str(task.path), "retry")
    return SlideOutcome(
        task.slide_id,
        str(task.path),
        "failed",
        error=f"{task.path}: the worker tiling this slide was lost twice, the second time tiling only this slide "
        f"({error_text(err)}): its image data may crash the reader; open it in a slide viewer or re-export it, "
        "then rerun the stage",
    )
