"""The run's fixed probe tiles, and their scores at every eval checkpoint with the EMA teacher as it is in memory.

At start every rank makes the same choice from `train.seed` (no communication), rank 0 records it in
`<output_dir>/health_probe.json`, and a resumed run reads it back, so every point of a run's curve is measured
on the same tiles with the same views. A gram run without its own record inherits its pretraining run's (same
stores), so slides held out of pretraining stay out of gram anchoring too.

Where the probe tiles come from (`health.holdout_slides`), a trade-off:

* 0 (default): from the training slides. Works on any store (the 1–3-slide demo included) but measures tiles
  the model has seen: fine for collapse (rank) and a comparable invariance curve, optimistic as generalisation;
* N > 0: N whole slides, drawn from the seed, are kept out of training (the `data.slide_ids` selection of the
  training data minus them) and the probe is drawn from them alone: tiles of unseen slides, as the evaluate
  stage measures, at the price of training on fewer slides. At least one slide must be left to train on.

The scores (`dinov3_core.train.label_free`, the same code the kNN curve of eval checkpoints runs): the CLS
effective rank of the clean tiles and the augmentation-invariance retrieval of two global crops of the training
recipe. Each rank embeds its share of the tile groups through the (possibly sharded) teacher backbone and the
features are all-gathered, so every rank holds the same scores: `health.policy=stop` then stops them alike.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dinov3_core.config import ConfigError
from dinov3_core.data import TileDataset
from dinov3_core.files import write_text_atomic
from dinov3_core.train import config as C
from dinov3_core.train import label_free as LF
from dinov3_core.train.checkpoint import CKPT_DIR, latest_checkpoint
from dinov3_core.train.distributed import DistEnv, autocast
from dinov3_core.train.trainer_setup import open_tiles

logger = logging.getLogger(__name__)

PROBE_FILE = "health_probe.json"
VERSION = 1


@dataclass(frozen=True)
class ProbeSet:
    """Which tiles (store, slide, row in the slide's arrays), which slides are out of training, which views."""

    stores: list[str]
    holdout: list[str]  # slide ids kept out of training
    tiles: list[tuple[int, str, int]]  # (store position in `stores`, slide id, tile row)
    views: LF.ProbeViews

    @property
    def hash(self) -> str:
        """Identity of the tile selection (the stores' contents are not hashed: re-tiling is a new run)."""
        return hashlib.sha256(json.dumps([self.stores, self.tiles]).encode()).hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "stores": self.stores,
            "holdout_slides": self.holdout,
            "hash": self.hash,
            "n_tiles": len(self.tiles),
            "tiles": [list(t) for t in self.tiles],
            "views": self.views.as_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeSet:
        tiles = [(int(s), str(slide), int(row)) for s, slide, row in d["tiles"]]
        return cls(list(d["stores"]), list(d["holdout_slides"]), tiles, LF.ProbeViews.from_dict(d["views"]))

    def read(self, positions: list[int]) -> torch.Tensor:
        """uint8 tiles [len(positions), T, T, 3] at these positions of the probe set."""
        wanted = sorted({self.tiles[p][1] for p in positions})
        ds = TileDataset(self.stores, slide_ids=wanted, image_format="numpy")
        where = {(ds.stores.index(ds.slide_store(s)), ds.slide_ids[s]): s for s in range(len(ds.slide_ids))}
        index = [ds.global_index(where[(st, slide)], row) for st, slide, row in (self.tiles[p] for p in positions)]
        return torch.from_numpy(ds.read_batch(np.asarray(index, np.int64)))


def read_probe(path: Path) -> ProbeSet | None:
    return ProbeSet.from_dict(json.loads(path.read_text())) if path.is_file() else None


def choose(cfg: C.PretrainConfig, tiles: TileDataset, patch_size: int) -> ProbeSet:
    """`health.probe_tiles` tiles drawn from the seed: from `health.holdout_slides` slides drawn first, or
    from every training slide."""
    h, rng = cfg.health, np.random.default_rng([cfg.train.seed, LF.PROBE_STREAM])
    slides = list(range(len(tiles.slide_ids)))
    if h.holdout_slides:
        if h.holdout_slides >= len(slides):
            raise ConfigError(
                f"health.holdout_slides={h.holdout_slides} keeps every slide of data.stores / data.slide_ids "
                f"({len(slides)}) out of training: lower it (0: probe tiles from the training slides)"
            )
        slides = sorted(int(s) for s in rng.choice(len(slides), h.holdout_slides, replace=False))
    # Positions in the pool of the candidate slides' tiles, mapped to global indices (no array over the pool:
    # a cohort has millions of tiles).
    counts = tiles.tile_counts[slides]
    ends, starts = np.cumsum(counts), np.concatenate([[0], np.cumsum(tiles.tile_counts)])[slides]
    drawn = np.sort(rng.choice(int(ends[-1]), min(h.probe_tiles, int(ends[-1])), replace=False))
    which = np.searchsorted(ends, drawn, side="right")
    slide_index, rows = tiles.locate_many(starts[which] + drawn - (ends - counts)[which])
    stores = [str(p) for p in tiles.stores]
    position = {str(p): i for i, p in enumerate(tiles.stores)}
    chosen = [
        (position[str(tiles.slide_store(int(s)))], tiles.slide_ids[int(s)], int(r))
        for s, r in zip(slide_index, rows, strict=True)
    ]
    holdout = [tiles.slide_ids[s] for s in slides] if h.holdout_slides else []
    views = LF.ProbeViews.of(cfg.crops, patch_size, tiles.tile_size, cfg.train.seed)
    return ProbeSet(stores, holdout, chosen, views)


def prepare(
    cfg: C.PretrainConfig, tiles: TileDataset, patch_size: int, *, inherit: Path | None = None
) -> tuple[ProbeSet | None, TileDataset]:
    """The run's probe set and the tiles to train on (`tiles` less the held-out slides). The probe: the run's
    record when resuming, else an inherited one (gram: the pretraining run's, if on the same stores), else a new
    choice; None with `health.probe_tiles=0` on a fresh run. Writes nothing (rank 0 calls `record` once the output
    directory exists)."""
    out = Path(cfg.output_dir)
    resume = cfg.checkpointing.resume and latest_checkpoint(out / CKPT_DIR) is not None
    probe = read_probe(out / PROBE_FILE) if resume else None  # a resumed run keeps its probe and held-out slides
    if probe is None and not cfg.health.probe_tiles:
        return None, tiles
    if probe is None and resume and cfg.health.holdout_slides:
        # A run started without a record trained on every slide: holding some out now would change its data.
        logger.warning("%s: no probe record to resume with; the probe is drawn from the training slides", out)
        probe = choose(_without_holdout(cfg), tiles, patch_size)
    if probe is None and inherit is not None:
        probe = read_probe(inherit)
        if probe is not None and probe.stores != [str(p) for p in tiles.stores]:
            probe = None  # other tiles than the pretraining run's: a probe of its own
    probe = probe or choose(cfg, tiles, patch_size)
    if not probe.holdout:
        return probe, tiles
    held = set(probe.holdout)  # the data.slide_ids selection, less the held-out slides
    return probe, open_tiles(cfg, slide_ids=[s for s in tiles.slide_ids if s not in held])


def record(cfg: C.PretrainConfig, probe: ProbeSet | None) -> None:
    """`<output_dir>/health_probe.json` (rank 0, after the output directory exists)."""
    if probe is not None:
        write_text_atomic(Path(cfg.output_dir) / PROBE_FILE, json.dumps(probe.as_dict(), indent=1) + "\n")
        logger.info(
            "health probe: %d tiles (selection %s)%s",
            len(probe.tiles),
            probe.hash,
            f", slides held out of training: {', '.join(probe.holdout)}" if probe.holdout else "",
        )


def _without_holdout(cfg: C.PretrainConfig) -> C.PretrainConfig:
    cfg = copy.deepcopy(cfg)
    cfg.health.holdout_slides = 0
    return cfg


class HealthProbe:
    """This rank's share of the probe tile groups (on the device), scored with a backbone as it is in memory."""

    def __init__(self, probe: ProbeSet, env: DistEnv, bf16: bool) -> None:
        self.probe, self.env, self.bf16 = probe, env, bf16
        self.n = len(probe.tiles)
        groups = LF.n_groups(self.n)
        # Shared over the data-parallel processes (the stages of one pipeline score the same groups together);
        # equal calls on every process (FSDP collectives), extras discarded.
        rank, world = env.dp_rank, env.dp_size
        per_rank = -(-groups // world)
        self.groups = [g if g < groups else 0 for g in range(rank, per_rank * world, world)]
        self.n_groups = groups
        positions = [p for g in self.groups for p in LF.group_rows(self.n, g)]
        tiles = probe.read(positions).to(env.device)
        self.tiles = tiles.view(len(self.groups), LF.GROUP, *tiles.shape[1:])

    @torch.no_grad()
    def measure(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """`effective_rank`, `invariance` (identical on every process) and `probe_seconds`. A collective.

        `embed(images [b, 3, S, S]) -> CLS [b, D]`: the teacher backbone, or its pipeline stages (real features on
        the last stage only, whose scores are then sent to the other stages)."""
        start = time.perf_counter()
        env = self.env
        with autocast(env, self.bf16):
            local = torch.stack(
                [LF.embed_group(embed, t, g, self.probe.views) for t, g in zip(self.tiles, self.groups, strict=True)]
            )
        if env.data_parallel:  # process r holds groups r, r + dp, …: interleave back into group order
            parts = [torch.empty_like(local) for _ in range(env.dp_size)]
            dist.all_gather(parts, local.contiguous(), group=env.dp_group)
            local = torch.stack(parts, dim=1).flatten(0, 1)
        features = local[: self.n_groups].permute(1, 0, 2, 3).flatten(1, 2)  # [3, groups·GROUP, D]
        scores = LF.scores(features.cpu(), self.n) if env.pp_rank == env.pp_size - 1 else {}
        if env.pp_size > 1:  # the last stage's scores
            shared = [scores]
            last = dist.get_global_rank(env.pp_group, env.pp_size - 1)
            dist.broadcast_object_list(shared, src=last, group=env.pp_group)
            scores = shared[0]
        return {**scores, "probe_seconds": time.perf_counter() - start}
