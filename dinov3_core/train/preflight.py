"""The checks a training config gets before its job starts (pretrain and gram alike): parallelism settings for
the world size, and what would stop the job minutes in (a tile store smaller than one batch, crops larger than
the tiles), each a `Problem` naming the key as the user types it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dinov3_core.stage import PreflightFacts, Problem


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


__all__ = ["check_job", "preflight", "store_tiles"]
