"""`parallelism.*`: how the processes split a training step (pipeline stages × data parallel), and the pipeline's
micro-batch contract, checked before any process group exists (docs/reference/distributed.md#pipeline-micro-batches).

    processes = parallelism.pp_degree × data-parallel degree
    micro-batch (train.batch_size_per_gpu) = PP micro-batches × parallelism.pp_microbatch_size

Every process of one pipeline holds one stage of the student (a run of consecutive blocks; the first also the
patch embedding, the last also the norm and both heads) and sees the same images; the data-parallel degree
(FSDP over the processes holding the same stage) divides the global batch as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining.schedules import PipelineScheduleMulti, ScheduleGPipe, get_schedule_class

from dinov3_core.config import ConfigError, require

# Schedules whose ranks hold several stages each (`pp_stages_per_rank` > 1); V-shaped ones exactly two.
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SUPPORTED_SCHEDULES = SINGLE_STAGE_SCHEDULES  # what `pp` runs today (one stage per process)


@dataclass
class ParallelismConfig:
    """Pipeline parallelism for backbones that do not fit one device even sharded (ViT-7B, ViT-H+), and for
    multi-node jobs where pipeline stages cut cross-node traffic. Off by default (pp_degree 1)."""

    pp_degree: int = 1  # pipeline stages (1: off; every process holds the whole student, FSDP-sharded)
    # Images per pipeline micro-batch; it must divide the micro-batch (train.batch_size_per_gpu).
    # null: the micro-batch cut into 2 × pp_degree pieces when it divides, else into pp_degree.
    pp_microbatch_size: int | None = None
    pp_schedule: str = "1F1B"  # torch.distributed.pipelining schedule: GPipe or 1F1B
    pp_stages_per_rank: int = 1  # virtual stages per process (looped / interleaved schedules need > 1)
    # Blocks per stage, first to last (sums to the depth); null: even, earlier stages one block longer.
    pp_split: list[int] | None = None

    def __post_init__(self) -> None:
        require(self.pp_degree >= 1, "pp_degree", f"must be >= 1 (1: no pipeline), got {self.pp_degree}")
        require(
            self.pp_microbatch_size is None or self.pp_microbatch_size >= 1,
            "pp_microbatch_size",
            f"must be >= 1 image (or null: chosen from the micro-batch), got {self.pp_microbatch_size}",
        )
        try:
            schedule = get_schedule_class(self.pp_schedule)
        except ValueError:
            raise ConfigError(
                f"unknown schedule {self.pp_schedule!r}; choose one of {', '.join(SUPPORTED_SCHEDULES)}",
                key="pp_schedule",
            ) from None
        name = next(n for n in (*SINGLE_STAGE_SCHEDULES, *MULTI_STAGE_SCHEDULES) if get_schedule_class(n) is schedule)
        self.pp_schedule = name  # torch's spelling (names are case-insensitive there)
        require(
            name in SUPPORTED_SCHEDULES,
            "pp_schedule",
            f"{name} runs several stages per process, which wsidino does not split yet; use 1F1B (or GPipe)",
        )
        require(
            self.pp_stages_per_rank == 1 or issubclass(schedule, PipelineScheduleMulti),
            "pp_stages_per_rank",
            f"{name} runs one stage per process: set pp_stages_per_rank=1",
        )
        require(self.pp_stages_per_rank >= 1, "pp_stages_per_rank", f"must be >= 1, got {self.pp_stages_per_rank}")
        if self.pp_split is not None:
            require(
                len(self.pp_split) == self.n_stages and all(n >= 1 for n in self.pp_split),
                "pp_split",
                f"needs {self.n_stages} positive block counts (pp_degree × pp_stages_per_rank), got {self.pp_split}",
            )

    @property
    def enabled(self) -> bool:
        return self.pp_degree > 1

    @property
    def n_stages(self) -> int:
        return self.pp_degree * self.pp_stages_per_rank


def split_blocks(p: ParallelismConfig, depth: int) -> list[range]:
    """Contiguous block ranges per stage: `pp_split`, or even with earlier stages one block longer."""
    if p.pp_split is not None:
        counts = list(p.pp_split)
    else:
        base, extra = divmod(depth, p.n_stages)
        counts = [base + (s < extra) for s in range(p.n_stages)]
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


def pipeline_microbatches(p: ParallelismConfig, micro_batch: int) -> int:
    """PP micro-batches per schedule step for a per-process micro-batch (the contract is checked separately)."""
    if p.pp_microbatch_size is not None:
        return max(micro_batch // p.pp_microbatch_size, 1)
    for n in (2 * p.n_stages, p.n_stages):
        if micro_batch % n == 0:
            return n
    return 1  # the contract check names what to set


def check_pipeline_contract(p: ParallelismConfig, *, world_size: int, micro_batch: int | None, depth: int) -> None:
    """The rules of docs/reference/distributed.md#pipeline-micro-batches as ConfigErrors naming the keys and a
    setting that works. `micro_batch` None: not known yet (train.batch_size_per_gpu=auto); the batch rules are then
    checked once it is planned."""
    if world_size % p.pp_degree:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"parallelism.pp_degree={p.pp_degree} does not divide the {world_size} processes: pipeline stages × "
            f"data-parallel degree must equal the process count. Use pp_degree in {valid} or launch a multiple "
            f"of {p.pp_degree} processes",
        )
    if not p.enabled:
        return
    if p.pp_split is not None and sum(p.pp_split) != depth:
        raise ConfigError(
            f"parallelism.pp_split={p.pp_split} covers {sum(p.pp_split)} blocks but the backbone has {depth}; "
            "make the counts sum to the depth, or set pp_split=null for an even split",
        )
    if depth < p.n_stages:
        raise ConfigError(
            f"{p.n_stages} pipeline stages (parallelism.pp_degree × pp_stages_per_rank) but the backbone has only "
            f"{depth} blocks; use at most {depth} stages",
        )
    if micro_batch is None:
        return
    size = p.pp_microbatch_size
    if size is None:
        n_mb = pipeline_microbatches(p, micro_batch)
        if micro_batch % n_mb or (n_mb < p.n_stages and get_schedule_class(p.pp_schedule) is not ScheduleGPipe):
            raise ConfigError(
                f"train.batch_size_per_gpu={micro_batch} cannot be cut into {p.n_stages} or {2 * p.n_stages} "
                f"pipeline micro-batches; use a multiple of {p.n_stages} (e.g. "
                f"{p.n_stages * max(1, micro_batch // p.n_stages)}) or set parallelism.pp_microbatch_size",
            )
        return
    if micro_batch % size:
        raise ConfigError(
            f"parallelism.pp_microbatch_size={size} does not divide the micro-batch train.batch_size_per_gpu="
            f"{micro_batch}; use a divisor of it (e.g. {_largest_divisor(micro_batch, size)})",
        )
    n_mb = micro_batch // size
    if get_schedule_class(p.pp_schedule) is not ScheduleGPipe and n_mb < p.n_stages:
        raise ConfigError(
            f"{p.pp_schedule} needs at least as many micro-batches as stages: train.batch_size_per_gpu={micro_batch}"
            f" / parallelism.pp_microbatch_size={size} = {n_mb} < {p.n_stages} stages. Use pp_microbatch_size="
            f"{_largest_divisor(micro_batch, micro_batch // p.n_stages)} or smaller, a larger batch, or "
            "pp_schedule=GPipe",
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max((d for d in range(1, max(at_most, 1) + 1) if n % d == 0), default=1)
