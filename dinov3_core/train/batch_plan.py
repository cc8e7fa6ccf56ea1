"""Batch planning, one home: how a step's images split over processes, micro-batches and accumulation steps.

    plan = plan_batch(cfg, shape, world_size=8, budget_bytes=70 * 2**30, device_type="cuda")
    plan.micro_batch, plan.accumulation_steps  # micro_batch × accumulation_steps × data-parallel ranks == global

`plan_batch` is the entry point: a fixed `train.batch_size_per_gpu` (accumulation from `global_batch_size`, or
`accumulation_steps`), or `auto`: the largest micro-batch dividing the per-process step batch whose memory
estimate (`memory.estimate_memory`) fits the budget. With pipeline parallelism the per-process step batch is the
global batch / data-parallel degree and only micro-batches the pipeline contract accepts are tried.

Around it: `check_parallelism` (the pipeline contract and a fixed batch's arithmetic, before any process starts),
`check_batch` (the plan against the data and the losses), and what the memory watch may change mid-run
(`RunPlan`, re-planned one rung at a time by `next_plan`; `plan_from_checkpoint` restores it on resume). The
re-plan ladder, for sustained pressure or an out-of-memory step:

1. fewer loader workers and prefetch 1 (host pressure only: workers live in host RAM);
2. a smaller micro-batch with more accumulation steps — the per-rank step batch, hence the global batch, the
   teacher's Sinkhorn targets (computed over the whole step) and the objective stay exactly the same;
3. activation checkpointing;
4. nothing left: the trainer checkpoints and stops (`replan.out_of_memory`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dinov3_core.config import ConfigError
from dinov3_core.errors import WsidinoError
from dinov3_core.train import checkpoint as ckpt
from dinov3_core.train import config as C
from dinov3_core.train import model_config as MC
from dinov3_core.train.memory import estimate_memory
from dinov3_core.train.memory_terms import GIB, MemoryEstimate, ModelShape
from dinov3_core.train.memory_watch import Pressure
from dinov3_core.train.parallel_config import check_pipeline_contract
from dinov3_core.train.sampler import check_dataset_size


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int  # per rank
    accumulation_steps: int
    global_batch: int
    estimate: MemoryEstimate
    budget_bytes: int

    @property
    def rank_batch(self) -> int:
        """Images one data-parallel process takes per optimizer step."""
        return self.micro_batch * self.accumulation_steps


def plan_batch(
    cfg: C.PretrainConfig,
    shape: ModelShape,
    *,
    world_size: int,
    budget_bytes: int,
    device_type: str,
    tile_size: int = 224,
) -> BatchPlan:
    """Micro-batch per rank and accumulation steps: fixed by the config, or planned to fit `budget_bytes` ("auto")."""
    sizes = {"world_size": world_size, "device_type": device_type, "tile_size": tile_size}
    if cfg.train.batch_size_per_gpu == "auto":
        return _fit_budget(cfg, shape, budget_bytes, **sizes)
    return _fixed(cfg, shape, budget_bytes, **sizes)


def _fixed(
    cfg: C.PretrainConfig, shape: ModelShape, budget: int, *, world_size: int, device_type: str, tile_size: int
) -> BatchPlan:
    """The configured micro-batch; the model itself (not its activations) must fit an explicit budget."""
    train = cfg.train
    dp_size = world_size // cfg.parallelism.pp_degree
    micro = int(train.batch_size_per_gpu)
    accum = fixed_accumulation(train, dp_size)
    estimate = estimate_memory(
        cfg,
        shape,
        micro_batch=micro,
        step_batch=micro * accum,
        world_size=world_size,
        device_type=device_type,
        tile_size=tile_size,
    )
    model_bytes = estimate.weights + estimate.grads + estimate.optimizer + estimate.teacher
    if train.memory_budget_gb is not None and model_bytes > budget:
        raise ConfigError(
            f"train.memory_budget_gb={train.memory_budget_gb} GiB is smaller than the model itself: weights, "
            f"gradients, AdamW states and the EMA teacher take {model_bytes / GIB:.2f} GiB per process. Raise the "
            "budget, train fewer weights (student.lora.rank, student.freeze_blocks), or shard over more processes"
        )
    return BatchPlan(micro, accum, micro * accum * dp_size, estimate, budget)


def _fit_budget(
    cfg: C.PretrainConfig, shape: ModelShape, budget: int, *, world_size: int, device_type: str, tile_size: int
) -> BatchPlan:
    """The largest micro-batch the run accepts (`_micro_batches`) whose estimate fits `budget`."""
    global_batch = cfg.train.global_batch_size
    step_batch, candidates = _micro_batches(cfg, shape, world_size=world_size)
    assert global_batch is not None
    tried = None
    for micro in candidates:
        est = estimate_memory(
            cfg,
            shape,
            micro_batch=micro,
            step_batch=step_batch,
            world_size=world_size,
            device_type=device_type,
            tile_size=tile_size,
        )
        if est.total <= budget:
            return BatchPlan(micro, step_batch // micro, global_batch, est, budget)
        tried = est
    assert tried is not None
    raise WsidinoError(
        f"a global batch of {global_batch} does not fit {budget / GIB:.2f} GiB per rank even with "
        f"micro-batch {tried.micro_batch}: estimated {tried.describe()}. Set train.activation_checkpointing=true, "
        "use smaller crops or heads, more processes, or raise train.memory_budget_gb"
    )


def _micro_batches(cfg: C.PretrainConfig, shape: ModelShape, *, world_size: int) -> tuple[int, list[int]]:
    """(per-process step batch = global batch / data-parallel degree, the micro-batches dividing it that the run
    accepts, largest first: every divisor, or under pipeline parallelism those the pipeline contract accepts)."""
    p = cfg.parallelism
    global_batch = cfg.train.global_batch_size
    if not p.enabled:
        if global_batch is None or global_batch % world_size:
            raise WsidinoError(
                f"train.global_batch_size={global_batch} must be set and divisible by the {world_size} process(es)"
            )
        step_batch = global_batch // world_size
        return step_batch, sorted((d for d in range(1, step_batch + 1) if step_batch % d == 0), reverse=True)
    check_pipeline_contract(p, world_size=world_size, micro_batch=None, depth=shape.depth)
    dp = world_size // p.pp_degree
    if global_batch is None or global_batch % dp:
        raise WsidinoError(
            f"train.global_batch_size={global_batch} must be set and divisible by the data-parallel degree {dp} "
            f"({world_size} processes / parallelism.pp_degree={p.pp_degree})"
        )
    step_batch = global_batch // dp
    accepted, reason = [], ""
    for micro in sorted((d for d in range(1, step_batch + 1) if step_batch % d == 0), reverse=True):
        try:
            check_pipeline_contract(p, world_size=world_size, micro_batch=micro, depth=shape.depth)
        except ConfigError as err:
            reason = reason or str(err)
            continue
        accepted.append(micro)
    if not accepted:
        raise WsidinoError(
            f"no micro-batch dividing the per-process step batch {step_batch} (train.global_batch_size="
            f"{global_batch} / data-parallel degree {dp}) can be cut into pipeline micro-batches "
            f"(parallelism.pp_microbatch_size={p.pp_microbatch_size}, pp_schedule={p.pp_schedule}, "
            f"{p.n_stages} stages). For the whole step batch: {reason}"
        )
    return step_batch, accepted


# ----------------------------------------------------------------------------------------------- checks


def check_parallelism(cfg: C.PretrainConfig, world_size: int, micro_batch: int | None = None) -> None:
    """The pipeline contract for `world_size` processes (`parallel_config`): before torchrun starts (the launcher,
    micro-batch from the config) and again in every rank once the batch is planned and the model built."""
    if cfg.train.compile_step and cfg.parallelism.enabled:
        raise ConfigError(
            "train.compile=step compiles one process's whole step, which a pipeline splits into stages: set "
            "train.compile=true (each block compiled) with parallelism.pp_degree > 1"
        )
    bs = cfg.train.batch_size_per_gpu
    if micro_batch is None and not isinstance(bs, str):
        micro_batch = int(bs)
    depth = MC.configured_depth(cfg)
    if depth is not None:
        check_pipeline_contract(cfg.parallelism, world_size=world_size, micro_batch=micro_batch, depth=depth)
    if not isinstance(bs, str):  # a fixed batch: its arithmetic needs no model, so it fails before ranks start
        fixed_accumulation(cfg.train, world_size // cfg.parallelism.pp_degree)


def micro_batch_ok(cfg: C.PretrainConfig, world_size: int, micro_batch: int) -> bool:
    """Whether a re-plan may use this micro-batch: under pipeline parallelism it must keep the contract."""
    try:
        check_parallelism(cfg, world_size, micro_batch)
    except ConfigError:
        return False
    return True


def fixed_accumulation(train: C.TrainConfig, dp_size: int) -> int:
    """Accumulation steps of a fixed `train.batch_size_per_gpu` over `dp_size` data-parallel processes: from
    `global_batch_size` when set (it must split evenly), else `accumulation_steps`."""
    micro = int(train.batch_size_per_gpu)
    if train.global_batch_size is None:
        return train.accumulation_steps
    if train.global_batch_size % (micro * dp_size):
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not a multiple of train.batch_size_per_gpu × "
            f"data-parallel processes = {micro} × {dp_size} (processes / parallelism.pp_degree): set "
            f"train.batch_size_per_gpu to a divisor of {train.global_batch_size // dp_size or 1}, or "
            "train.batch_size_per_gpu=auto"
        )
    accum = train.global_batch_size // (micro * dp_size)
    if train.accumulation_steps not in (1, accum):
        raise ConfigError(
            f"train.accumulation_steps={train.accumulation_steps} contradicts global_batch_size / "
            f"(batch_size_per_gpu × processes) = {accum}; set only one of them"
        )
    return accum


def check_batch(cfg: C.PretrainConfig, n_tiles: int, plan: BatchPlan) -> None:
    """The batch plan against the data and the losses: enough tiles, a KoLeo neighbour set, whole RNG groups."""
    rank_batch = plan.rank_batch
    check_dataset_size(n_tiles, plan.global_batch)
    koleo_set = plan.global_batch if cfg.losses.koleo_scope == "global" else rank_batch
    if cfg.losses.koleo_weight and koleo_set < 2:
        raise ConfigError(
            f"KoLeo needs at least 2 images in its neighbour set, got {koleo_set} (losses.koleo_scope="
            f"{cfg.losses.koleo_scope}): raise the batch, set losses.koleo_scope=global, or losses.koleo_weight=0"
        )
    if rank_batch % cfg.crops.rng_group_size:
        raise ConfigError(
            f"crops.rng_group_size={cfg.crops.rng_group_size} must divide the per-process step batch "
            f"{rank_batch} (micro-batch {plan.micro_batch} × {plan.accumulation_steps} accumulation steps)"
        )


# ------------------------------------------------------------------------------------------- re-planning


@dataclass(frozen=True)
class RunPlan:
    """The settings a re-plan may change. `micro_batch × accumulation_steps` is fixed: the per-rank step batch.
    Checkpoints record it (meta.json `run_plan`), so a resumed run starts with it."""

    micro_batch: int
    accumulation_steps: int
    num_workers: int
    prefetch_factor: int
    activation_checkpointing: bool

    @classmethod
    def of(cls, plan: BatchPlan, cfg: C.PretrainConfig) -> RunPlan:
        """The run's starting settings: the batch plan's split, the config's loader and checkpointing."""
        return cls(
            micro_batch=plan.micro_batch,
            accumulation_steps=plan.accumulation_steps,
            num_workers=cfg.data.num_workers,
            prefetch_factor=cfg.data.prefetch_factor,
            activation_checkpointing=cfg.train.activation_checkpointing,
        )

    @property
    def step_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps

    def to_dict(self) -> dict[str, int | bool]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"micro-batch {self.micro_batch} × {self.accumulation_steps} accumulation step(s), "
            f"{self.num_workers} loader worker(s) × prefetch {self.prefetch_factor}, "
            f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}"
        )


@dataclass(frozen=True)
class Replan:
    what: str  # "loader", "micro_batch", "activation_checkpointing"
    before: RunPlan
    after: RunPlan

    def event(self, iteration: int, why: str) -> dict[str, Any]:
        """The `training_metrics.json` line (and MLflow tag) of this re-plan."""
        return {
            "iteration": iteration,
            "event": "memory_replan",
            "what": self.what,
            "why": why,
            "before": self.before.to_dict(),
            "after": self.after.to_dict(),
        }


def next_plan(plan: RunPlan, pressure: Pressure, micro_ok: Callable[[int], bool] = lambda _: True) -> Replan | None:
    """The next rung of the ladder for this kind of pressure, or None when nothing is left to give. `micro_ok`: which
    micro-batches the run can take (pipeline parallelism: those that keep its micro-batch contract)."""
    if pressure == "host" and plan.num_workers > 0:
        return Replan("loader", plan, replace(plan, num_workers=plan.num_workers // 2, prefetch_factor=1))
    smaller = [d for d in range(1, plan.micro_batch // 2 + 1) if plan.step_batch % d == 0 and micro_ok(d)]
    if smaller:
        micro = smaller[-1]  # at least halves the micro-batch's activations
        after = replace(plan, micro_batch=micro, accumulation_steps=plan.step_batch // micro)
        return Replan("micro_batch", plan, after)
    if not plan.activation_checkpointing:
        return Replan("activation_checkpointing", plan, replace(plan, activation_checkpointing=True))
    return None


def plan_from_checkpoint(
    latest: Path | None, plan: RunPlan, cfg: C.PretrainConfig, world_size: int
) -> tuple[RunPlan, int]:
    """The settings the memory watch chose before `latest` was written and how many re-plans led there, so a
    resumed run starts with them rather than rediscovering the pressure; (`plan`, 0) when there were none, or the
    processes or step batch changed (the config's plan is then safe: the watch re-plans if needed); `plan` with
    the count when the saved micro-batch breaks this run's pipeline contract (re-planned under another layout)."""
    meta = ckpt.read_meta(latest) if latest is not None else {}
    saved, replans = meta.get("run_plan"), int(meta.get("memory_replans") or 0)
    if not replans or not isinstance(saved, dict) or meta.get("world_size") != world_size:
        return plan, 0
    try:
        resumed = RunPlan(**saved)
    except TypeError:  # written by another version
        return plan, 0
    if resumed.step_batch != plan.step_batch:
        return plan, 0
    return (resumed if micro_batch_ok(cfg, world_size, resumed.micro_batch) else plan), replans
