"""The tile engine's slide groups as Prefect tasks on a Dask cluster (prefect-dask's `DaskTaskRunner`).

    run_stage_task("tile", cfg, run_groups=DaskSlideGroups(address="tcp://scheduler:8786"))

`run_tile` (in the flow-run process, holding the store lock) lists the slides and skips the complete ones; for
the rest it calls `DaskSlideGroups`, which starts a temporary `distributed.LocalCluster` (`n_workers`) or
connects to an existing scheduler (`address`), cuts the slides into one group per Dask worker thread
(`dinov3_core.tiling.groups.group_slides`), submits one `tile-slide-group` task per group and reports each
group as it finishes. The coordinator writes the store manifest once, at the end; the stage manifest, skip
rule and MLflow run are `run_stage`'s as for every stage.

Why the task runner is built here rather than set on the flow: a flow's task runner is fixed before its
parameters are read, and a subflow would split the stage's MLflow tags and artifacts over two flow runs. So the
runner is made from the flow's parameters and used the way `Task.submit` uses a flow's own
(`task_runner.submit(task, parameters)`): the group tasks are ordinary Prefect task runs of the tile flow run.

Every Dask worker must see the slides and the store at the same paths (a shared filesystem) and have wsidino
installed; a worker runs its group in its own process, one slide at a time (`tile_slide_group` says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from dinov3_core.errors import WsidinoError
from dinov3_core.tiling.groups import GroupJob, GroupReport, GroupResult, SlideGroup, group_slides
from dinov3_core.tiling.plan import SlideTask

WORKERS_TIMEOUT_S = 120.0  # how long an existing cluster may take to show its first worker


@task(
    name="tile-slide-group",
    task_run_name="slide-group-{group.index}",
    cache_policy=NO_CACHE,  # a rerun is decided by the store (complete slides are skipped), never by a cache
    persist_result=False,  # the result travels back through Dask; it is in the store manifest anyway
)
def tile_group_task(job: GroupJob, group: SlideGroup) -> GroupResult:
    """Plan, write and commit each slide of one group on this Dask worker (one writer per slide group)."""
    return job.run(group)


@dataclass(frozen=True)
class DaskSlideGroups:
    """`RunGroups` on Dask through prefect-dask: an existing scheduler (`address`) or a temporary local cluster
    of `n_workers` single-threaded worker processes."""

    address: str | None = None
    n_workers: int = 2

    def task_runner(self) -> Any:
        from prefect_dask import DaskTaskRunner

        if self.address:
            return DaskTaskRunner(address=self.address)
        # One thread per worker process: a group tiles one slide at a time on one core (zarr is limited to one
        # encode thread there too), so the worker count is the parallelism, as `workers` is for the pool.
        cluster_kwargs = {"n_workers": self.n_workers, "threads_per_worker": 1, "processes": True}
        return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs=cluster_kwargs)

    def __call__(self, job: GroupJob, todo: Sequence[SlideTask], isolate: bool = False) -> Iterator[GroupReport]:
        with self.task_runner() as runner:
            groups = group_slides(todo, len(todo) if isolate else self._slots(runner))
            futures = {runner.submit(tile_group_task, {"job": job, "group": g}): g for g in groups}
            for future in as_completed(list(futures)):
                group = futures[future]
                try:
                    yield group, future.result()
                except Exception as err:  # the group's worker died (KilledWorker) or the task itself failed
                    _mark_crashed(future.task_run_id, group, err)
                    yield group, err

    def _slots(self, runner: Any) -> int:
        """Worker threads of the cluster, once it has at least one worker: one slide group each."""
        where = f"the Dask scheduler at {self.address}" if self.address else "a local Dask cluster"
        try:
            client = runner.client  # starts the local cluster, or connects to the scheduler
            client.wait_for_workers(1, timeout=WORKERS_TIMEOUT_S)
        except Exception as err:
            raise WsidinoError(
                f"no Dask worker to tile on at {where} ({type(err).__name__}: {err}); check the address, and start "
                "workers with `dask worker <scheduler address> --nthreads 1` on hosts that see the slides and store"
            ) from err
        return max(1, sum(client.nthreads().values()))


def _mark_crashed(task_run_id: Any, group: SlideGroup, err: BaseException) -> None:
    """A worker that died mid-task left its task run Running on the server: end it as Crashed, saying why."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    message = f"slide group {group.index} ({len(group.tasks)} slides) was lost: {type(err).__name__}: {err}"
    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        run = client.read_task_run(task_run_id)
        if run.state is None or not run.state.is_final():
            client.set_task_run_state(task_run_id, Crashed(message=message[:4000]), force=True)


__all__ = ["DaskSlideGroups", "tile_group_task"]
