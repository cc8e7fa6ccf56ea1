"""Who extracts what: the slides still to do, split over the ranks of a job, and the ranks themselves (`Team`,
each on its own GPU or share of the cores: `rank_device`, `rank_threads`; evaluate's embedding job uses them too).

`plan_work` is deterministic in (tiles per slide, world size, alignment): whole slides go to ranks longest first
onto the least-loaded rank; a slide larger than an even share (total tiles / world size) is cut into row ranges
that start on chunk boundaries (`align`), so one 10⁵-tile slide keeps 8 GPUs busy and no zarr chunk has two
writers. Rank 0 plans and broadcasts the plan, so every rank works from the same one even while other ranks
commit slides.

`Team` is the little a job needs from torch.distributed: a barrier, a broadcast and a gather of small Python
objects. It always uses gloo, even on GPUs: no tensors cross ranks (each rank writes its own slides), gloo costs no
GPU memory, and its long timeout lets a rank that finished early wait for one still on a large slide.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dinov3_core.errors import WsidinoError, exit_code
from dinov3_core.export.feature_model import ExtractError
from dinov3_core.procutil import die_with_parent

# How long a rank waits at a barrier for the others (the slowest rank's share of the cohort); a rank that dies
# does not make the others wait this long: torchrun stops the whole job as soon as one rank fails.
BARRIER_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True)
class WorkUnit:
    """Rows [start, stop) of slide `slide` (an index into the tile dataset), which has `n_tiles` rows in all."""

    slide: int
    start: int
    stop: int
    n_tiles: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        """The whole slide: this unit's rank writes and commits it alone, as a single process would."""
        return self.start == 0 and self.stop == self.n_tiles


def plan_work(tile_counts: dict[int, int], world_size: int, align: int) -> list[list[WorkUnit]]:
    """Per rank, the units it extracts (in slide order); `tile_counts`: slide index → tiles, for the slides to do.

    Args:
        tile_counts: The slides still to extract and their tile counts.
        world_size: Ranks in the job.
        align: Row ranges of a split slide start at multiples of this (the zarr chunk rows of every output array).
    """
    if world_size < 1 or align < 1:
        raise ValueError(f"world_size and align must be >= 1, got {world_size}, {align}")
    total = sum(tile_counts.values())
    share = max(1, math.ceil(total / world_size))
    units: list[WorkUnit] = []
    for slide, n in tile_counts.items():
        step = n
        if world_size > 1 and n > share:
            parts = math.ceil(n / share)
            step = math.ceil(math.ceil(n / parts) / align) * align
        units += [WorkUnit(slide, a, min(n, a + step), n) for a in range(0, n, max(step, 1))]
    loads, plan = [0] * world_size, [[] for _ in range(world_size)]  # type: ignore[var-annotated]
    for unit in sorted(units, key=lambda u: (-u.size, u.slide, u.start)):  # longest first, onto the least loaded
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        plan[rank].append(unit)
        loads[rank] += unit.size
    return [sorted(units, key=lambda u: (u.slide, u.start)) for units in plan]


def split_slides(plan: list[list[WorkUnit]]) -> dict[int, list[WorkUnit]]:
    """Slides cut into ranges: slide → its units; the rank holding the first range commits it (`committer`)."""
    split: dict[int, list[WorkUnit]] = {}
    for units in plan:
        for unit in units:
            if not unit.whole:
                split.setdefault(unit.slide, []).append(unit)
    return {s: sorted(us, key=lambda u: u.start) for s, us in sorted(split.items())}


def committer(plan: list[list[WorkUnit]], slide: int) -> int:
    """The rank that commits a split slide once every rank is done: the one holding its first rows."""
    return next(r for r, units in enumerate(plan) for u in units if u.slide == slide and u.start == 0)


def rank_device(device: str | None, team: Team) -> tuple[str | None, int]:
    """This rank's torch device and ONNX Runtime CUDA device id: one GPU per local rank (`device` None or "cuda"
    in a job with GPUs); otherwise `device` as configured."""
    if team.world_size == 1 or not torch.cuda.is_available() or device not in (None, "cuda"):
        return device, 0
    gpus = torch.cuda.device_count()
    if team.local_world_size > gpus:
        raise ExtractError(f"{team.local_world_size} ranks on this node but {gpus} GPU(s): set --nproc-per-node to "
                           f"at most {gpus} (one rank per GPU)")  # fmt: skip
    return f"cuda:{team.local_rank}", team.local_rank


def rank_threads(num_threads: int, team: Team) -> int:
    """Intra-op threads: `num_threads` when set, else this rank's share of the cores (ranks on one node's CPU
    would otherwise each start one thread per core and slow each other down); 0: the library's default."""
    if num_threads or team.local_world_size == 1:
        return num_threads
    return max(1, len(os.sched_getaffinity(0)) // team.local_world_size)


@dataclass
class Team:
    """This process's rank in an extract job; a single process is a team of one (every call is then a no-op)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    owns_group: bool = field(default=False, repr=False)

    @classmethod
    def from_env(cls) -> Team:
        """torchrun's RANK / WORLD_SIZE / LOCAL_RANK; joins (or starts) a gloo process group when there are several."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        team = cls(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")),
                   int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))  # fmt: skip
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
            team.owns_group = True
        return team

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (also a barrier)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def rank_main(work: Callable[[Team], str | None]) -> int:
    """The body of a torchrun rank's `main` (extract, evaluate's embedding): join the team, run `work`, print the
    line it returns on rank 0. Bad input (a `WsidinoError`) prints its message and exits 2 with no traceback; any
    other error propagates to `@record`, which hands it to torchrun as this rank's root cause."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a torchrun rank: do not outlive a SIGKILLed torchrun
        die_with_parent()
    team = None
    try:
        team = Team.from_env()
        line = work(team)
    except WsidinoError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return exit_code(err)
    finally:
        if team is not None:
            team.close()
    if line and team.is_main:
        print(line, flush=True)
    return 0


__all__ = ["BARRIER_TIMEOUT", "Team", "WorkUnit", "committer", "plan_work", "rank_device", "rank_main", "rank_threads",
           "split_slides"]  # fmt: skip
