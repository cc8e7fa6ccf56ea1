"""extract: per-tile features of a tile store with the exported ONNX model (ONNX Runtime) or the PyTorch backbone.

    cfg = load_config(ExtractConfig, None, {"store": "out/tiles.zarr", "model": "out/model/model.onnx",
                                             "output": "out/features.zarr"}, stage="extract")
    result = run_extract(cfg)

The store's layout and how a slide is committed: `dinov3_core.extract.feature_store`. Tiles are normalised as in
training (ImageNet mean / std). A rerun skips slides already extracted with the same model (hash) and redoes the
others. One process, or one rank of a torchrun job (`wsidino extract --nproc-per-node N`, entry point
`dinov3_core.extract.job`): rank 0 plans who extracts what (`dinov3_core.extract.plan`: whole slides,
and row ranges of slides larger than an even share), each rank writes its own slides and ranges, and a slide split
over ranks is committed by one rank once every rank is done. `num_shards` / `shard_index` split the slides over
independent processes writing the same output (per-slide commits do not collide). Within a process
`loader_threads` threads read, decode and normalise the next `prefetch_batches` batches while the model runs and
one thread writes behind it (`dinov3_core.inference.loader`); the features are bit-identical to the serial loop
(`loader_threads=0`) and to any number of ranks. The model: `dinov3_core.inference.feature_model`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from dinov3_core import tracking
from dinov3_core.config_tree import to_dict
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.errors import disk_full, is_disk_full
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.feature_store import (
    ATTRS_KEY,
    commit_slide,
    pictures_dir,
)
from dinov3_core.extract.plan import committer, split_slides
from dinov3_core.extract.units import UnitWriter, batch_reader, device_memory, plan_ranks, unit_batches
from dinov3_core.inference.feature_model import ExtractError, open_model
from dinov3_core.inference.loader import BackgroundWriter, read_ahead
from dinov3_core.inference.team import Team, rank_device, rank_threads
from dinov3_core.progress import Progress
from dinov3_core.tiling import store as ts

__all__ = [
    "ATTRS_KEY",
    "RESULT_NAME",
    "ExtractConfig",
    "ExtractResult",
    "job_progress",
    "pictures_dir",
    "run_extract",
]

logger = logging.getLogger(__name__)

RESULT_NAME = "extract_result.json"  # beside the store (pictures_dir): what the last run did, for the launcher
PROGRESS_DIR = "progress"  # beside the store: each rank's count while a job runs (`job_progress`)


@dataclass
class ExtractResult:
    output: Path
    extracted: list[str]
    skipped: list[str]
    tiles: int
    seconds: float
    tiles_per_s: float
    model_hash: str
    backend: str
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank: tiles, seconds, tiles_per_s, device
    mpp: float | None = None  # the tile store level read (µm/px as tiled; `mpp`, or the store's first level)


def _open_dataset(cfg: ExtractConfig) -> Any:
    root = ts.check_store(cfg.store)  # TileStoreError (a WsidinoError) names the store and what to do
    try:
        return TileDataset(root, slide_ids=cfg.slide_ids, image_format="numpy", mpp=cfg.mpp)
    except (ValueError, KeyError, OSError) as err:
        raise ExtractError(f"tile store {root} cannot be read for extraction: {err}") from None


def run_extract(
    cfg: ExtractConfig,
    progress: Callable[[int, int], None] | None = None,
    team: Team | None = None,
    mlflow_run_id: str | None = None,
) -> ExtractResult:
    """Extract per `cfg`; returns which slides were extracted / skipped and the throughput.

    `progress(tiles done, tiles to do)`: called as batches finish (the Prefect progress artifact); with
    `cfg.progress` a bar on a terminal, else a log line with rate and ETA every 30 s. `team`: this process's rank
    in a torchrun job (`dinov3_core.extract.job`); None: a single process. MLflow: the stage runner's run,
    active in this process or named by `mlflow_run_id` (a job's rank 0); nothing is logged without one."""
    team = team or Team()
    start_time = time.perf_counter()
    ds = _open_dataset(cfg)
    torch_threads = torch.get_num_threads()
    threads = rank_threads(cfg.num_threads, team)
    if threads:
        torch.set_num_threads(threads)
    try:
        device, device_id = rank_device(cfg.device, team)
        try:
            model = open_model(
                cfg.model,
                cfg.backend,
                cfg.providers,
                threads,
                device,
                cfg.precision,
                device_id,
                compile=cfg.compile,
                batch_size=cfg.batch_size,
            )
        except torch.OutOfMemoryError as err:
            raise ExtractError(
                f"model {cfg.model} does not fit on {device}{device_memory(device)} "
                f"({str(err)[:300]}); use a GPU with more memory"
            ) from None
        if model.patch_size and ds.tile_size % model.patch_size:
            raise ExtractError(
                f"tile store {cfg.store} has {ds.tile_size} px tiles, not a multiple of the model's patch size "
                f"{model.patch_size}: re-tile with a tile_size that is"
            )
        out = Path(cfg.output)
        offsets = np.concatenate([[0], np.cumsum(ds.tile_counts)])
        plan, skipped = team.broadcast(plan_ranks(cfg, ds, model, out, team, offsets) if team.is_main else None)
        if team.is_main:
            for s in skipped:
                logger.info("slide %s already extracted with model %s: skipped", ds.slide_ids[s], model.hash)
        units = plan[team.rank]
        total = sum(u.size for u in units)
        label = "extract" if team.world_size == 1 else f"extract rank {team.rank}"
        if team.world_size > 1:  # the launcher adds up the ranks' counts (`job_progress`)
            progress = _RankProgress(out, team.rank)
        bar = Progress(
            label, unit="tile", total=total, enabled=cfg.progress, callback=progress, every_s=cfg.progress_every_s
        )
        params = {"model_hash": model.hash, "backend": model.backend, "store": cfg.store}
        # In process: the runner's active run; a job's rank 0: the runner's run, joined by its id.
        joined = tracking.stage_run(cfg.tracking, "extract", params=params, run_id=mlflow_run_id)
        with joined if mlflow_run_id else tracking.into_active_run(cfg.tracking, params=params):
            readers, depth = cfg.loader_threads, cfg.prefetch_batches
            writer = BackgroundWriter(readers, depth)
            jobs = unit_batches(ds, units, offsets, cfg.batch_size)
            work_start = time.perf_counter()
            try:
                with contextlib.closing(read_ahead(jobs, batch_reader(ds, model), readers, depth)) as batches:
                    write_unit = UnitWriter(cfg, ds, model, out, bar, batches, writer, team.rank)
                    for unit in units:
                        write_unit(unit)
            finally:
                writer.close()
                bar.close()
            work_s = time.perf_counter() - work_start
            ranks = team.gather(
                {
                    "rank": team.rank,
                    "tiles": total,
                    "seconds": round(work_s, 3),
                    "tiles_per_s": round(total / max(work_s, 1e-9), 1),
                    "device": ",".join(model.providers),
                }
            )
            split = split_slides(plan)
            for s in split:  # every rank is done (the gather): the split slides' rows are all written
                if committer(plan, s) == team.rank:
                    commit_slide(cfg, ds, s, model, out)
            team.barrier()
            seconds = time.perf_counter() - start_time
            tiles = sum(r["tiles"] for r in ranks)
            if cfg.tracking.enabled and team.is_main:
                tracking.log_metrics(
                    {"tiles": tiles, "tiles_per_s": tiles / max(seconds, 1e-9), "ranks": team.world_size}
                )
    except OSError as err:  # a full disk outside a slide's own writes (the run record, a skipped slide's exports)
        if is_disk_full(err):
            raise disk_full(err, cfg.output) from None
        raise
    finally:
        torch.set_num_threads(torch_threads)
    result = ExtractResult(
        output=out,
        extracted=[ds.slide_ids[s] for s in sorted({u.slide for r in plan for u in r})],
        skipped=[ds.slide_ids[s] for s in skipped],
        tiles=tiles,
        seconds=seconds,
        tiles_per_s=tiles / max(seconds, 1e-9),
        model_hash=model.hash,
        backend=model.backend,
        ranks=ranks,
        mpp=cfg.mpp if cfg.mpp is not None else ds.slide_attrs(0).get("mpp_requested"),
    )
    if team.is_main:
        _write_run_record(cfg, result)
        logger.info(
            "extracted %d tiles of %d slides (%d skipped) in %.1f s: %.1f tiles/s on %d rank(s)",
            tiles,
            len(result.extracted),
            len(skipped),
            seconds,
            result.tiles_per_s,
            team.world_size,
        )
    return result


class _RankProgress:
    """A rank's tiles done / to do in `<pictures_dir>/progress/rank-<r>.json`, at most once a second."""

    def __init__(self, output: Path, rank: int) -> None:
        self.path = pictures_dir(output) / PROGRESS_DIR / f"rank-{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < 1.0 and done < total:
            return
        self.last = now
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"done": done, "total": total}))
        os.replace(tmp, self.path)


def job_progress(output: str | os.PathLike[str]) -> tuple[int, int]:
    """Tiles done and to do, summed over the ranks of the running job (what each rank reported last)."""
    done = total = 0
    for path in (pictures_dir(output) / PROGRESS_DIR).glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            count = json.loads(path.read_text())
            done, total = done + int(count["done"]), total + int(count["total"])
    return done, total


def _write_run_record(cfg: ExtractConfig, result: ExtractResult) -> None:
    """The resolved config and what the run did, beside the store (the launcher of a torchrun job reads the latter)."""
    where = pictures_dir(cfg.output)
    where.mkdir(parents=True, exist_ok=True)
    (where / "extract_config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    record = {**asdict(result), "output": str(result.output)}
    tmp = where / f".{RESULT_NAME}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, where / RESULT_NAME)


def read_run_record(output: str | os.PathLike[str]) -> dict[str, Any]:
    path = pictures_dir(output) / RESULT_NAME
    return json.loads(path.read_text()) if path.is_file() else {}
