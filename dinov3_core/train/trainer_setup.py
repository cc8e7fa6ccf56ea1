"""The set-up steps `Trainer.__init__` runs, one function each, so the trainer reads as their order alone.

Each step checks its own input and raises with the fix before anything is written: `open_tiles` (tile stores,
slide selection), `resolve_batch` (micro-batch and accumulation from the config or a memory plan) and
`check_batch` (dataset size, KoLeo neighbour set, crop RNG groups), `checkpoint_to_resume` (existing
checkpoints must be wanted and fit the model), then `load_training_state` (model, optimizer and sampler
position from a checkpoint, keeping this config's param-group multipliers) and `build_step_loader` (sampler,
iBOT masks and the step-batch DataLoader, starting where the run left off).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from dinov3_core import config as core_config
from dinov3_core.data import TileDataset
from dinov3_core.data.masking import IBOTMaskSampler
from dinov3_core.data.tile_levels import LevelTiles
from dinov3_core.errors import WsidinoError
from dinov3_core.tiling import store as ts
from dinov3_core.train import checkpoint as ckpt
from dinov3_core.train import config as C
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.memory import BatchPlan, estimate_memory, memory_budget_bytes, plan_batch, shape_of
from dinov3_core.train.memory_terms import GIB
from dinov3_core.train.replan import RunPlan
from dinov3_core.train.sampler import LevelMix, SamplerState, StepSampler, check_dataset_size
from dinov3_core.train.ssl_model import SSLMetaArch
from dinov3_core.train.step_batches import StepTileSource, build_loader

__all__ = [
    "build_step_loader",
    "check_batch",
    "checkpoint_to_resume",
    "describe_start",
    "load_training_state",
    "open_levels",
    "open_tiles",
    "plan_from_checkpoint",
    "resolve_batch",
]

# Param-group settings that come from this run's config (layer decay, last-layer freezing), not the checkpoint.
_CONFIG_GROUP_KEYS = ("lr_multiplier", "wd_multiplier", "is_last_layer")


def open_tiles(cfg: C.PretrainConfig, slide_ids: list[str] | None = None) -> TileDataset:
    """The training tiles: `data.slide_ids` of `data.stores` (or `slide_ids`: the health probe's held-out slides
    removed from that selection), tiles with at least `data.min_tissue_fraction`."""
    try:
        return TileDataset(
            cfg.data.stores,
            slide_ids=cfg.data.slide_ids if slide_ids is None else slide_ids,
            min_tissue_fraction=cfg.data.min_tissue_fraction,
        )
    except ValueError as err:  # unknown slide ids, nothing left after filtering, duplicate stores
        raise WsidinoError(f"data.stores / data.slide_ids / data.min_tissue_fraction: {err}") from None


def open_levels(cfg: C.PretrainConfig, tiles: TileDataset) -> tuple[LevelTiles, LevelMix] | None:
    """`data.mpp_weights`: the weighted µm/px levels of the training slides (those of `tiles`) and the stream that
    mixes them; None without weights (the first level only, as `tiles`)."""
    weights = {m: w for m, w in (cfg.data.mpp_weights or {}).items() if w > 0}
    if not weights:
        return None
    have = sorted(
        {
            float(lv["mpp_requested"])
            for s in range(len(tiles.slide_ids))
            for lv in ts.slide_levels(tiles.slide_attrs(s))
            if lv.get("mpp_requested") is not None
        }
    )
    for mpp in weights:
        if not any(abs(mpp - h) <= 1e-6 * mpp for h in have):
            near = min(have, key=lambda h: abs(h - mpp)) if have else None
            hint = f"; did you mean {near:g}?" if near is not None else ""
            raise core_config.ConfigError(
                f"{mpp:g} µm/px is not a level of the tile store(s) {', '.join(map(str, tiles.stores))} (levels: "
                f"{ts.format_mpps(have)} µm/px){hint} Tile them with that level in tile.mpp, or drop it",
                key="data.mpp_weights",
            )
    try:
        keep = cfg.data.min_tissue_fraction
        datasets = [
            TileDataset(cfg.data.stores, slide_ids=tiles.slide_ids, min_tissue_fraction=keep, mpp=m) for m in weights
        ]
    except ts.TileStoreError as err:  # a slide lacking one of the levels (a store of mixed tilings)
        raise core_config.ConfigError(str(err), key="data.mpp_weights") from None
    except ValueError as err:
        raise WsidinoError(f"data.mpp_weights: {err}") from None
    levels = LevelTiles(datasets, list(weights))
    return levels, LevelMix(levels.sizes, list(weights.values()), seed=cfg.train.seed)


def resolve_batch(cfg: C.PretrainConfig, env: DistEnv, model: SSLMetaArch, tile_size: int) -> BatchPlan:
    """Micro-batch per rank and accumulation steps: fixed by the config, or planned to fit memory ("auto")."""
    train = cfg.train
    shape = shape_of(model.student, cfg)
    budget = memory_budget_bytes(cfg, env.device, env.local_world_size)
    if train.batch_size_per_gpu == "auto":
        return plan_batch(
            cfg, shape, world_size=env.world_size, budget_bytes=budget, device_type=env.device.type, tile_size=tile_size
        )
    micro = int(train.batch_size_per_gpu)
    accum = C.fixed_accumulation(train, env.dp_size)
    estimate = estimate_memory(
        cfg,
        shape,
        micro_batch=micro,
        step_batch=micro * accum,
        world_size=env.world_size,
        device_type=env.device.type,
        tile_size=tile_size,
    )
    model_bytes = estimate.weights + estimate.grads + estimate.optimizer + estimate.teacher
    if train.memory_budget_gb is not None and model_bytes > budget:
        raise core_config.ConfigError(
            f"train.memory_budget_gb={train.memory_budget_gb} GiB is smaller than the model itself: weights, "
            f"gradients, AdamW states and the EMA teacher take {model_bytes / GIB:.2f} GiB per process. Raise the "
            "budget, train fewer weights (student.lora.rank, student.freeze_blocks), or shard over more processes"
        )
    return BatchPlan(micro, accum, micro * accum * env.dp_size, estimate, budget)


def plan_from_checkpoint(latest: Path | None, plan: RunPlan, world_size: int) -> tuple[RunPlan, int]:
    """The settings the memory watch chose before `latest` was written and how many re-plans led there, so a
    resumed run starts with them rather than rediscovering the pressure; (`plan`, 0) when there were none, or the
    processes or step batch changed (the config's plan is then safe: the watch re-plans if needed)."""
    meta = ckpt.read_meta(latest) if latest is not None else {}
    saved, replans = meta.get("run_plan"), int(meta.get("memory_replans") or 0)
    if not replans or not isinstance(saved, dict) or meta.get("world_size") != world_size:
        return plan, 0
    try:
        resumed = RunPlan(**saved)
    except TypeError:  # written by another version
        return plan, 0
    return (resumed, replans) if resumed.step_batch == plan.step_batch else (plan, 0)


def check_batch(cfg: C.PretrainConfig, n_tiles: int, plan: BatchPlan) -> None:
    """The batch plan against the data and the losses: enough tiles, a KoLeo neighbour set, whole RNG groups."""
    rank_batch = plan.micro_batch * plan.accumulation_steps
    check_dataset_size(n_tiles, plan.global_batch)
    koleo_set = plan.global_batch if cfg.losses.koleo_scope == "global" else rank_batch
    if cfg.losses.koleo_weight and koleo_set < 2:
        raise core_config.ConfigError(
            f"KoLeo needs at least 2 images in its neighbour set, got {koleo_set} (losses.koleo_scope="
            f"{cfg.losses.koleo_scope}): raise the batch, set losses.koleo_scope=global, or losses.koleo_weight=0"
        )
    if rank_batch % cfg.crops.rng_group_size:
        raise core_config.ConfigError(
            f"crops.rng_group_size={cfg.crops.rng_group_size} must divide the per-process step batch "
            f"{rank_batch} (micro-batch {plan.micro_batch} × {plan.accumulation_steps} accumulation steps)"
        )


def checkpoint_to_resume(cfg: C.PretrainConfig, ckpt_root: Path, model: SSLMetaArch) -> Path | None:
    """The latest intact checkpoint under `ckpt_root` (a damaged one is skipped, named in a warning), checked
    against `model`; None for a fresh run."""
    latest = ckpt.latest_intact_checkpoint(ckpt_root)
    if latest is not None and not cfg.checkpointing.resume:
        raise WsidinoError(
            f"{ckpt_root} already holds checkpoints but checkpointing.resume=false: choose a new "
            "output_dir (nothing was changed)"
        )
    if latest is not None:
        ckpt.check_compatible(latest, model)
    return latest


def load_training_state(
    latest: Path,
    model: SSLMetaArch,
    optimizer: torch.optim.Optimizer,
    template: dict[str, Any],
    env: DistEnv,
    n_tiles: int,
) -> tuple[int, SamplerState]:
    """Model, optimizer and sampler position from `latest` (resharded to this run's processes).

    `template` is the trainer's `train_state` layout (DCP loads non-tensor entries into it). Returns the
    checkpoint's iteration and the sampler state mapped onto a dataset of `n_tiles` tiles.
    """
    state = load_weights(latest, model, optimizer, env, template)
    return int(state["iteration"]), SamplerState.from_dict(state["sampler"], n_tiles)


def load_weights(
    latest: Path,
    model: SSLMetaArch,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
    template: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Model and optimizer state from `latest` (and the train state into `template`, when given), keeping this
    config's per-group multipliers: layer decay and the last-layer freeze come from the config, not the checkpoint.
    Used to resume and, by the gram stage, to start from a pretraining run."""
    multipliers = [{k: g[k] for k in _CONFIG_GROUP_KEYS} for g in optimizer.param_groups]
    state = ckpt.load_checkpoint(latest, model, optimizer, template or {}, env)
    for group, own in zip(optimizer.param_groups, multipliers, strict=True):
        group.update(own)
    return state


def build_step_loader(
    cfg: C.PretrainConfig,
    env: DistEnv,
    tiles: TileDataset,
    *,
    patch_size: int,
    global_batch: int,
    start_iteration: int,
    start_sample: int,
    stop_iteration: int,
    num_workers: int,
    prefetch_factor: int,
) -> tuple[StepSampler, Any]:
    """This rank's step sampler and the DataLoader of its `StepBatch`es, from `start_iteration` on, read by
    `num_workers` processes `prefetch_factor` steps ahead (the memory watch may lower both mid-run)."""
    mixed = open_levels(cfg, tiles)  # data.mpp_weights: tiles of several µm/px levels, drawn by weight
    sampler = StepSampler(
        len(tiles),  # the sampler state's unit (a checkpoint's dataset_size); the level mix draws its own indices
        global_batch,
        rank=env.dp_rank,  # the processes of one pipeline read the same images
        world_size=env.dp_size,
        seed=cfg.train.seed,
        start_iteration=start_iteration,
        start_sample=start_sample,
        stop_iteration=stop_iteration,
        levels=mixed[1] if mixed else None,
    )
    n_patches = cfg.crops.global_size // patch_size
    masks = IBOTMaskSampler(
        n_patches, mask_ratio=tuple(cfg.crops.mask_ratio), mask_probability=cfg.crops.mask_probability
    )
    source = StepTileSource(
        mixed[0] if mixed else tiles, masks, seed=cfg.train.seed, n_global_crops=cfg.crops.n_global_crops
    )
    loader = build_loader(
        source,
        sampler,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
        pin_memory=env.device.type == "cuda",
        multiprocessing_context=cfg.data.multiprocessing_context,
    )
    return sampler, loader


def describe_start(trainer: Any, latest: Path | None) -> str:
    """The run's first log line: model and what this process trains, data, batch split, length, start, memory."""
    cfg, env, model = trainer.cfg, trainer.env, trainer.model
    backbone = sum(
        math.prod(shape) for k, shape in trainer.layout.shapes.items() if k.startswith("model.teacher.backbone.")
    )
    student = model.student.parameters()
    held = sum(p.numel() for p in model.student.parameters())
    trained = sum(p.numel() for p in student if p.requires_grad)
    adaptation = C.adaptation_summary(cfg)
    where = "this process's pipeline stage" if trainer.pipeline is not None else "the student"
    # The CPU threads this rank computes with (torch.set_num_threads / OMP_NUM_THREADS): the first thing to check
    # when one launch is slower than another on the same box.
    threads = f" ({torch.get_num_threads()} torch threads)" if env.device.type == "cpu" else ""
    return (
        f"{trainer.stage}: {trainer.arch} backbone ({backbone / 1e6:.2f}M parameters; {trained / 1e6:.2f}M of "
        f"{where}'s {held / 1e6:.2f}M train{f': {adaptation}' if adaptation else ''}) on {env.device}{threads}: "
        f"{len(trainer.tiles)} tiles, global batch {trainer.global_batch} = {env.dp_size} data-parallel process(es) × "
        f"micro-batch {trainer.micro_batch} × {trainer.accumulation_steps} accumulation step(s)"
        f"{trainer.pipeline.describe() if trainer.pipeline else ''}; {C.length_summary(cfg)}; "
        f"{C.start_summary(cfg, latest)}; memory estimate {trainer.plan.estimate.describe()} (budget "
        f"{trainer.plan.budget_bytes / 2**30:.1f} GiB); output {trainer.output_dir}"
    )
