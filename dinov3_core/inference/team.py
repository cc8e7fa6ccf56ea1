"""The ranks of a torchrun inference job (extract, evaluate's embedding): `Team`, each rank on its own GPU or
share of the cores (`rank_device`, `rank_threads`), and `rank_main`, the body of a rank's `main`.

`Team` is the little a job needs from torch.distributed: a barrier, a broadcast and a gather of small Python
objects. It always uses gloo, even on GPUs: no tensors cross ranks (each rank writes its own slides), gloo costs no
GPU memory, and its long timeout lets a rank that finished early wait for one still on a large slide.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dinov3_core.inference.feature_model import ExtractError
from dinov3_core.procutil import rank_entry

# How long a rank waits at a barrier for the others (the slowest rank's share of the cohort); a rank that dies
# does not make the others wait this long: torchrun stops the whole job as soon as one rank fails.
BARRIER_TIMEOUT = timedelta(days=7)


def rank_device(device: str | None, team: Team) -> tuple[str | None, int]:
    """This rank's torch device and ONNX Runtime CUDA device id: one GPU per local rank (`device` None or "cuda"
    in a job with GPUs); otherwise `device` as configured."""
    if team.world_size == 1 or not torch.cuda.is_available() or device not in (None, "cuda"):
        return device, 0
    gpus = torch.cuda.device_count()
    if team.local_world_size > gpus:
        raise ExtractError(
            f"{team.local_world_size} ranks on this node but {gpus} GPU(s): set --nproc-per-node to "
            f"at most {gpus} (one rank per GPU)"
        )
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
        team = cls(
            int(os.environ.get("RANK", "0")),
            world,
            int(os.environ.get("LOCAL_RANK", "0")),
            int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )
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
    line it returns on rank 0 (`procutil.rank_entry`: bad input exits 2 with no traceback)."""

    def in_team() -> str | None:
        team = Team.from_env()
        try:
            return work(team)
        finally:
            team.close()

    return rank_entry(in_team, lambda line: line)


__all__ = ["BARRIER_TIMEOUT", "Team", "rank_device", "rank_main", "rank_threads"]
