"""The set-up steps `Trainer.__init__` runs, one function each, so the trainer reads as their order alone.

Each step checks its own input and raises with the fix before anything is written: `open_tiles` (tile stores,
slide selection), `checkpoint_to_resume` (existing checkpoints must be wanted, intact, and fit the model and the
schedule), then `load_training_state` (model, optimizer and sampler position from a checkpoint, keeping this
config's param-group multipliers) and `build_step_loader` (sampler, iBOT masks and the step-batch DataLoader,
starting where the run left off). The batch plan has its own module (`batch_plan`); what a checkpoint's meta.json
records, `checkpoint_meta`.
"""

from __future__ import annotations

import logging
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
from dinov3_core.train import model_config as MC
from dinov3_core.train.distributed import DistEnv, cpu_has_bf16_matmul
from dinov3_core.train.resume_check import check_schedule, schedule_record
from dinov3_core.train.sampler import LevelMix, SamplerState, StepSampler
from dinov3_core.train.ssl_model import SSLMetaArch
from dinov3_core.train.step_batches import StepTileSource, build_loader

logger = logging.getLogger(__name__)

__all__ = [
    "build_step_loader",
    "checkpoint_meta",
    "checkpoint_to_resume",
    "describe_start",
    "load_training_state",
    "open_levels",
    "open_tiles",
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


def uses_bf16(cfg: C.PretrainConfig, env: DistEnv) -> bool:
    """`train.precision` on this device; warns when bf16 would be slower than fp32 (a CPU without bf16 units)."""
    bf16 = cfg.train.uses_bf16(env.device.type)
    if bf16 and env.device.type == "cpu" and not cpu_has_bf16_matmul():
        logger.warning(
            "train.precision=bf16 on a CPU without bf16 matrix instructions (AMX / AVX512-BF16): "
            "slower than fp32 here; set train.precision=fp32"
        )
    return bf16


def checkpoint_to_resume(
    cfg: C.PretrainConfig, ckpt_root: Path, model: ckpt.ModelLayout, global_batch: int, stop_iteration: int
) -> Path | None:
    """The latest intact checkpoint under `ckpt_root` (a damaged or unverifiable one is skipped, named in a warning),
    checked against `model` and against this run's schedule, batch and stop (`resume_check`); None for a fresh run.
    Checkpoints none of which is intact are refused: a fresh start would write over them."""
    found = ckpt.complete_checkpoints(ckpt_root)
    if found and not cfg.checkpointing.resume:
        raise WsidinoError(
            f"{ckpt_root} already holds checkpoints but checkpointing.resume=false: choose a new "
            "output_dir (nothing was changed)"
        )
    if not found:
        return None
    latest = ckpt.latest_intact_checkpoint(ckpt_root)
    if latest is None:
        raise WsidinoError(
            f"no checkpoint under {ckpt_root} can be resumed: {', '.join(p.name for _, p in found)} are damaged or "
            "cannot be verified (see the warnings). Nothing was changed. Restore one from a copy, write its checksums "
            f"if you know it is intact (dinov3_core.checksums.write_checksums), or move {ckpt_root} away to start over"
        )
    ckpt.check_compatible(latest, model)
    check_schedule(latest, cfg, global_batch, stop_iteration)
    return latest


def checkpoint_meta(trainer: Any) -> dict[str, Any]:
    """What a checkpoint's meta.json records of the trainer's run, for people and tools: convert reads the
    architecture and adaptation, a resume the batch plan and the schedule it must match (`resume_check`)."""
    return {
        "arch": trainer.arch,
        "global_batch": trainer.global_batch,
        "micro_batch": trainer.micro_batch,
        "accumulation_steps": trainer.accumulation_steps,
        "run_plan": trainer.run_plan.to_dict(),
        "memory_replans": trainer.memory_replans,
        "config_hash": core_config.config_hash(trainer.cfg),
        "schedule": schedule_record(trainer.cfg, trainer.global_batch),
        "adaptation": MC.adaptation_meta(trainer.cfg),  # student.lora / freeze_blocks
    }


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
    adaptation = MC.adaptation_summary(cfg)
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
