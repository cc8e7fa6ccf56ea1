"""What pretrain and gram share: both are DINOv3 training runs launched as a torchrun job, with the same run
directory layout, the same summary (the last metrics line and the health verdict) and the same checks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core.stages.base import PreflightFacts, Problem, Summary

# The last metrics line's figures a training stage's summary carries (losses, health signals, throughput, memory).
METRIC_KEYS = ("total_loss", "dino_gap", "teacher_entropy", "agreement", "images_per_s", "max_rss_mb", "gram_loss")


@dataclass
class TrainingSummary(Summary):
    iteration: int | None = None
    total_loss: float | None = None
    dino_gap: float | None = None
    teacher_entropy: float | None = None
    agreement: float | None = None
    images_per_s: float | None = None
    max_rss_mb: float | None = None
    gram_loss: float | None = None
    memory_replans: int | None = None
    effective_rank: float | None = None  # the health probe's latest scores (dinov3_core.train.health_probe)
    invariance: float | None = None
    health: str | None = None  # the verdict: learning, or not and why
    gram_teacher: str | None = None  # gram: the chosen teacher checkpoint
    gram_teacher_iteration: int | None = None


def training_summary(cfg: Any) -> TrainingSummary:
    """The last metrics line (iteration, losses, throughput, memory), the health probe's latest scores and
    verdict and, for gram, the chosen teacher."""
    out = Path(cfg.output_dir)
    s = TrainingSummary()
    metrics = out / "training_metrics.json"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        rows = [r for r in records if "event" not in r]  # event lines (memory re-plans) are not steps
        if rows:
            last = rows[-1]
            s.iteration = last.get("iteration")
            for key in METRIC_KEYS:
                if isinstance(last.get(key), int | float):
                    setattr(s, key, round(float(last[key]), 4))
            s.memory_replans = sum(1 for r in records if r.get("event") == "memory_replan") or None
            probed = [r for r in rows if isinstance(r.get("effective_rank"), int | float)]
            if probed:
                s.effective_rank = round(float(probed[-1]["effective_rank"]), 4)
                s.invariance = round(float(probed[-1]["invariance"]), 4)
    health = out / "health.json"
    if health.is_file():
        s.health = json.loads(health.read_text()).get("verdict")
    selection = out / "gram_teacher_selection.json"
    if selection.is_file():
        chosen = json.loads(selection.read_text()).get("chosen", {})
        s.gram_teacher = chosen.get("path")
        s.gram_teacher_iteration = chosen.get("iteration")
    return s


def run_outputs(cfg: Any) -> dict[str, str]:
    from dinov3_core.train.checkpoint import latest_checkpoint

    run = Path(cfg.output_dir)
    out = {"run_dir": str(run)}
    last = latest_checkpoint(run / "ckpt")
    if last is not None:
        out["last_checkpoint"] = str(last)
    evals = sorted((run / "eval").glob("training_*/teacher_checkpoint.pth"))
    if evals:
        out["last_eval_teacher"] = str(evals[-1])
    return out


def check_job(cfg: Any, world_size: int) -> None:
    """Bad parallelism settings fail before torchrun starts a rank, with the keys to change (exit code 2)."""
    from dinov3_core.train.batch_plan import check_parallelism

    check_parallelism(cfg, world_size)


def store_tiles(cfg: Any, facts: PreflightFacts) -> tuple[int | None, int | None]:
    """(tiles, tile size) the training config would read, its slide and tissue filters applied; (None, None) while
    its stores are not tiled yet or cannot be read (the tile stage or the training job then says why)."""
    from dinov3_core.data.tile_index import TileIndex

    stores = [Path(s) for s in (cfg.data.stores or ([facts.tile_store] if facts.tile_store else []))]
    if not stores or not all(p.is_dir() for p in stores):
        return None, None
    try:
        index = TileIndex(stores, slide_ids=cfg.data.slide_ids, min_tissue_fraction=cfg.data.min_tissue_fraction)
    except Exception:  # an empty or unreadable store, unknown slide ids: named by the stage that reads it
        return None, None
    return len(index), index.tile_size


def preflight(cfg: Any, facts: PreflightFacts) -> list[Problem]:
    """What would stop the training job minutes in, found before any stage starts: a tile store smaller than one
    global batch, crops larger than the tiles they are cut from."""
    problems: list[Problem] = []
    tiles, tile_size = store_tiles(cfg, facts)
    train = cfg.train
    micro = train.batch_size_per_gpu
    k = facts.key
    if train.global_batch_size is not None:
        batch, key = train.global_batch_size, "train.global_batch_size"
    elif isinstance(micro, int):
        batch, key = micro * train.accumulation_steps * facts.world_size, "train.batch_size_per_gpu"
    else:
        batch, key = None, ""
    if tiles is not None and batch is not None and tiles < batch:
        fits = max(1, tiles // max(1, facts.world_size))
        if key == "train.global_batch_size":
            fix = (
                f"set {k(key)}={_floor_multiple(tiles, facts.world_size)} (or fewer) and "
                f"{k('train.batch_size_per_gpu')} to a divisor of it, or add slides"
            )
        else:
            fix = f"set {k(key)}={fits} (or fewer), or add slides"
        problems.append(Problem(k(key), f"one batch is {batch} tiles but the tile store holds {tiles}", fix))
    if tile_size is not None and cfg.crops.global_size > tile_size:
        # A larger crop than its tile is all upsampled pixels: legal for the augmentation, never what was meant.
        problems.append(
            Problem(
                k("crops.global_size"),
                f"{cfg.crops.global_size} px is larger than the store's {tile_size} px tiles",
                f"set {k('crops.global_size')} to at most {tile_size} (a multiple of the patch size), or tile "
                "larger (tile.tile_size)",
            )
        )
    return problems


def _floor_multiple(n: int, k: int) -> int:
    return max(k, n // k * k)


__all__ = ["METRIC_KEYS", "TrainingSummary", "check_job", "preflight", "run_outputs", "training_summary"]
