"""Who extracts what: the slides still to do, split over the ranks of a job (the ranks themselves:
`dinov3_core.inference.team`).

`plan_work` is deterministic in (tiles per slide, world size, alignment): whole slides go to ranks longest first
onto the least-loaded rank; a slide larger than an even share (total tiles / world size) is cut into row ranges
that start on chunk boundaries (`align`), so one 10⁵-tile slide keeps 8 GPUs busy and no zarr chunk has two
writers. Rank 0 plans and broadcasts the plan, so every rank works from the same one even while other ranks
commit slides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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


__all__ = ["WorkUnit", "committer", "plan_work", "split_slides"]
