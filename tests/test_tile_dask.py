"""The tile engine's slide groups: grouping, the coordinator's bookkeeping, and the Prefect tile flow fanned out
over a real 2-worker Dask `LocalCluster` (prefect-dask), on real sample slides and a real zarr store.

The cluster is started by this module (2 worker processes, 1 thread each), so the flow connects to it by
scheduler address exactly as it would to a cluster on other hosts.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from dinov3_core.tiling import store as ts
from dinov3_core.tiling.engine import run_tile
from dinov3_core.tiling.groups import GroupJob, GroupReport, group_slides
from dinov3_core.tiling.plan import SlideTask
from flows.tile import tile_flow
from tasks.params import DaskParams, StageOptions, TileParams, TrackingParams
from tests import event_hooks
from tests.helpers import by_name, slide_list, tile_config
from tests.test_tile_flow import task_runs

# Small tiles at a coarse resolution: a few dozen tiles a slide, several shards each.
OVERRIDES = {"mpp": 1.0, "tile_size": 64, "tiles_per_shard": 8, "compressor": "jpeg"}
VOLATILE_ATTRS = {"created", "committed_at", "seconds", "write_seconds", "plan_seconds"}


# ------------------------------------------------------------------------------------------- no Prefect, no Dask


def test_group_slides_balances_file_sizes(tmp_path: Path) -> None:
    sizes = {"a": 10, "b": 70, "c": 30, "d": 40, "e": 20, "f": 0}
    tasks = []
    for name, size in sizes.items():
        (tmp_path / f"{name}.svs").write_bytes(b"x" * size)
        tasks.append(SlideTask(name, tmp_path / f"{name}.svs"))
    tasks.append(SlideTask("missing", tmp_path / "missing.svs"))  # counts 0 bytes: it fails at once

    groups = group_slides(tasks, 2)
    # Largest first onto the lighter group: b(70) → 0, d(40) → 1, c(30) → 1, e(20) → 0 (70 = 70: the lower
    # index), a(10) → 1, then the empty ones onto group 1 (80 < 90). Input order inside a group.
    assert [[t.slide_id for t in g.tasks] for g in groups] == [["b", "e"], ["a", "c", "d", "f", "missing"]]
    assert [g.size for g in groups] == [90, 80]
    assert sorted(t.slide_id for g in groups for t in g.tasks) == sorted(t.slide_id for t in tasks)

    assert [len(g.tasks) for g in group_slides(tasks[:2], 5)] == [1, 1]  # never an empty group
    assert [g.size for g in group_slides(tasks, 1)] == [170]
    with pytest.raises(ValueError, match="n_groups"):
        group_slides(tasks, 0)


class InProcessGroups:
    """`RunGroups` without a cluster: each group tiled here in turn. A group is reported lost (after running it when
    `run_lost`, a worker that died after committing; else instead of running it) when its index is in `lose` (in
    the first round only: a transient loss) or when it holds a slide in `poison` (every round: a slide that kills
    the process tiling it). `rounds` records the slides of each call."""

    def __init__(
        self, n_groups: int, lose: Sequence[int] = (), run_lost: bool = False, poison: Sequence[str] = ()
    ) -> None:
        self.n_groups, self.lose, self.run_lost, self.poison = n_groups, set(lose), run_lost, set(poison)
        self.rounds: list[tuple[bool, list[str]]] = []

    def __call__(self, job: GroupJob, todo: Sequence[SlideTask], isolate: bool = False) -> Iterator[GroupReport]:
        self.rounds.append((isolate, sorted(t.slide_id for t in todo)))
        for group in group_slides(todo, len(todo) if isolate else self.n_groups):
            ids = {t.slide_id for t in group.tasks}
            if not (not isolate and group.index in self.lose) and not (ids & self.poison):
                yield group, job.run(group)
                continue
            if self.run_lost:
                job.run(group)
            yield group, RuntimeError("KilledWorker: the worker died")


def test_a_lost_group_is_tiled_again_one_slide_per_group(sample_slides: Any, tmp_path: Path):
    slides = [p for p in sample_slides.slides if p.suffix == ".svs"]  # two slides: one per group
    listing = slide_list(tmp_path / "slides.txt", slides)
    cfg = tile_config(listing, tmp_path / "tiles.zarr", **OVERRIDES)
    progress: list[tuple[int, int]] = []
    seen: list[str] = []
    groups = InProcessGroups(2, lose=[1])
    result = run_tile(cfg, lambda d, p: progress.append((d, p)), lambda o: seen.append(o.slide_id), run_groups=groups)
    assert result.counts == {"ok": 2, "failed": 0, "skipped": 0}
    (first, retried) = groups.rounds
    assert first == (False, sorted(p.stem for p in slides)) and retried[0] and len(retried[1]) == 1
    assert sorted(seen) == sorted(p.stem for p in slides)  # every slide reported once, the retried one included
    assert progress[-1][0] == result.tiles_written == result.total_tiles > 0
    assert sorted(e["slide_id"] for e in ts.read_manifest(cfg.output)["slides"]) == sorted(seen)
    assert ts.complete_slide_ids(cfg.output) == sorted(seen)
    assert not any((Path(cfg.output) / ts.INCOMING).iterdir())


def test_a_slide_that_kills_its_worker_fails_alone_and_a_rerun_redoes_it(sample_slides: Any, tmp_path: Path):
    slides = list(sample_slides.slides)  # three slides, all in one group: the poisonous one takes the group down
    assert len(slides) == 3
    poison = slides[1].stem
    cfg = tile_config(slide_list(tmp_path / "slides.txt", slides), tmp_path / "tiles.zarr", **OVERRIDES)
    groups = InProcessGroups(1, poison=[poison])
    result = run_tile(cfg, run_groups=groups)
    by_id = {o.slide_id: o for o in result.outcomes}
    assert result.counts == {"ok": 2, "failed": 1, "skipped": 0}
    assert [r[0] for r in groups.rounds] == [False, True] and groups.rounds[1][1] == sorted(by_id)
    error = by_id[poison].error
    assert by_id[poison].status == "failed" and "was lost twice" in error and "KilledWorker" in error
    assert str(slides[1]) in error and "rerun" in error
    assert ts.complete_slide_ids(cfg.output) == sorted(s for s in by_id if s != poison)

    again = run_tile(cfg, run_groups=InProcessGroups(2))  # the slide no longer kills: only it is tiled
    assert {o.slide_id: o.status for o in again.outcomes} == {s: "ok" if s == poison else "skipped" for s in by_id}


def test_a_group_lost_after_committing_keeps_its_slides(sample_slides: Any, tmp_path: Path):
    slides = [p for p in sample_slides.slides if p.suffix == ".svs"]
    cfg = tile_config(slide_list(tmp_path / "slides.txt", slides), tmp_path / "tiles.zarr", **OVERRIDES)
    groups = InProcessGroups(1, lose=[0], run_lost=True)
    result = run_tile(cfg, run_groups=groups)
    assert result.counts == {"ok": 2, "failed": 0, "skipped": 0}
    assert len(groups.rounds) == 1  # nothing to tile again: the slides are complete on disk


# ------------------------------------------------------------------------------------- real Prefect, real Dask


@pytest.fixture(scope="module")
def dask_cluster(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real 2-worker `distributed.LocalCluster` (processes, 1 thread each), started after the Prefect server
    so its workers inherit the session's Prefect environment. Workers also inherit the `kill_worker_once` hook
    (it only acts on slides named crash*), and a task whose worker dies is not retried on another one (the
    default retries it 3 times, killing a worker each time on a poisonous slide)."""
    import dask
    from distributed import Client, LocalCluster

    patch = pytest.MonkeyPatch()
    event_hooks.arm(patch, "kill_worker_once", tmp_path_factory.mktemp("dask-events"))
    try:
        with (
            dask.config.set({"distributed.scheduler.allowed-failures": 0}),
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
            Client(cluster) as client,
        ):
            yield client
    finally:
        patch.undo()


def dask_params(listing: Path, output: Path, dask: DaskParams) -> TileParams:
    overrides = [f"{k}={v}" for k, v in OVERRIDES.items()]
    return TileParams(
        input=str(listing),
        output=str(output),
        stage=StageOptions(config="default", overrides=overrides),
        tracking=TrackingParams(enabled=False),
        dask=dask,
    )


def run_flow(params: TileParams) -> dict[str, Any]:
    state = tile_flow(params, return_state=True)
    assert state.is_completed(), f"flow run ended {state.name}: {state.message}"
    return {"summary": state.result(), "flow_run_id": state.state_details.flow_run_id}


def worker_pids(client: Any) -> set[int]:
    return set(client.run(os.getpid).values())


@pytest.fixture(scope="module")
def dask_run(dask_cluster: Any, sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The good sample slides and a truncated one through the flow on the cluster, once."""
    work = tmp_path_factory.mktemp("tile-dask")
    listing = slide_list(work / "slides.txt", [*sample_slides.slides, sample_slides.negatives["truncated"]])
    params = dask_params(listing, work / "tiles.zarr", DaskParams(address=dask_cluster.scheduler.address))
    return {**run_flow(params), "params": params, "root": work / "tiles.zarr", "listing": listing}


def test_flow_on_dask_tiles_every_slide_on_both_workers(dask_run: dict[str, Any], dask_cluster: Any, sample_slides):
    root, summary = dask_run["root"], dask_run["summary"]
    good = sorted(p.stem for p in sample_slides.slides)
    counts = summary["summary"]
    assert summary["status"] == "ran"
    assert {k: counts[k] for k in ("ok", "failed", "skipped")} == {"ok": 3, "failed": 1, "skipped": 0}
    assert ts.complete_slide_ids(root) == good
    assert not any((root / ts.INCOMING).iterdir())

    entries = ts.read_manifest(root)["slides"]
    assert sorted(e["slide_id"] for e in entries) == sorted([*good, "truncated"])  # each slide exactly once
    by_id = {e["slide_id"]: e for e in entries}
    assert by_id["truncated"]["status"] == "failed" and "truncated.svs" in by_id["truncated"]["error"]
    # One writer per slide group, and each of the two Dask worker processes tiled a group.
    pids = {int(e["tiled_by"].rsplit(":", 1)[1]) for e in entries}
    assert pids == worker_pids(dask_cluster)
    assert all(by_id[s]["workers"] == 1 and by_id[s]["tile_count"] > 0 for s in good)

    # The Prefect side: one tile-slide-group task run per group, beside the run-stage task.
    runs = task_runs(dask_run["flow_run_id"])
    names = sorted(r.name for r in runs)
    assert names == ["slide-group-0", "slide-group-1", "tile"]
    assert all(r.state.is_completed() for r in runs)


def test_flow_on_dask_writes_the_same_tiles_as_the_pool(dask_run: dict[str, Any], tmp_path: Path):
    pool = run_tile(tile_config(dask_run["listing"], tmp_path / "pool.zarr", workers=2, **OVERRIDES))
    ids = ts.complete_slide_ids(dask_run["root"])
    assert ids == ts.complete_slide_ids(pool.store)
    for slide_id in ids:
        a, b = (ts.read_slide_attrs(root, slide_id) for root in (dask_run["root"], pool.store))
        assert {k: v for k, v in a.items() if k not in VOLATILE_ATTRS} == {
            k: v for k, v in b.items() if k not in VOLATILE_ATTRS
        }
        for array in ("tiles", "coords"):
            x = zarr.open_array(str(dask_run["root"] / ts.SLIDES / slide_id / array), mode="r")[:]
            y = zarr.open_array(str(pool.store / ts.SLIDES / slide_id / array), mode="r")[:]
            assert np.array_equal(x, y), (slide_id, array)
        shards = sorted(p.name for p in (dask_run["root"] / ts.SLIDES / slide_id / "tiles" / "c").rglob("*"))
        assert shards  # the same shard files, byte for byte
        for rel in (dask_run["root"] / ts.SLIDES / slide_id / "tiles" / "c").rglob("*"):
            if rel.is_file():
                twin = pool.store / rel.relative_to(dask_run["root"])
                assert rel.read_bytes() == twin.read_bytes(), rel


def test_flow_on_dask_rerun_skips_complete_slides(dask_run: dict[str, Any], sample_slides: Any):
    root = dask_run["root"]
    before = {str(p): p.stat().st_mtime_ns for p in (root / ts.SLIDES).rglob("*")}
    again = run_flow(dask_run["params"])["summary"]
    assert again["reason"] == "the last run had 1 failed item(s)"
    counts = again["summary"]
    assert {k: counts[k] for k in ("ok", "failed", "skipped")} == {"ok": 0, "failed": 1, "skipped": 3}
    assert {str(p): p.stat().st_mtime_ns for p in (root / ts.SLIDES).rglob("*")} == before
    manifest = json.loads((root / ts.MANIFEST).read_text())
    assert len(manifest["slides"]) == 4


def test_flow_starts_its_own_local_cluster(prefect_api: str, sample_slides: Any, tmp_path: Path):
    """`dask.n_workers=2`: the flow run starts a temporary 2-worker LocalCluster, tiles on it and stops it."""
    listing = slide_list(tmp_path / "slides.txt", [p for p in sample_slides.slides if p.suffix == ".svs"])
    params = dask_params(listing, tmp_path / "tiles.zarr", DaskParams(n_workers=2))
    summary = run_flow(params)["summary"]["summary"]
    assert {k: summary[k] for k in ("ok", "failed")} == {"ok": 2, "failed": 0}
    entries = ts.read_manifest(params.output)["slides"]
    assert len({e["tiled_by"] for e in entries}) == 2  # one group per worker


def test_worker_lost_mid_group_is_retried_on_its_own(dask_cluster: Any, sample_slides: Any, tmp_path: Path):
    """A Dask worker dies while writing a slide (os._exit in the shard writer, once): its group's task run ends
    Crashed, the slide is tiled again in a group of its own in the same run, and the other group's slide is
    tiled. Last in this module: the killed worker is restarted by its nanny."""
    crash = tmp_path / "crash_me.svs"
    shutil.copyfile(by_name(sample_slides, "tissue_20x.svs"), crash)
    listing = slide_list(tmp_path / "slides.txt", [crash, by_name(sample_slides, "tissue_40x.svs")])
    params = dask_params(listing, tmp_path / "tiles.zarr", DaskParams(address=dask_cluster.scheduler.address))

    first_run = run_flow(params)
    first = first_run["summary"]["summary"]
    # The hook kills once: the lost group's slide is tiled again in a group of its own, in the same run.
    assert {k: first[k] for k in ("ok", "failed")} == {"ok": 2, "failed": 0}
    runs = [r for r in task_runs(first_run["flow_run_id"]) if r.name.startswith("slide-group")]
    assert sorted(r.state.type.value for r in runs) == ["COMPLETED", "COMPLETED", "CRASHED"]
    (crashed,) = [r.state for r in runs if r.state.is_crashed()]
    assert "was lost: KilledWorker" in crashed.message
    assert ts.complete_slide_ids(params.output) == ["crash_me", "tissue_40x"]

    assert run_flow(params)["summary"]["status"] == "skipped"  # nothing failed: the stage manifest is up to date
