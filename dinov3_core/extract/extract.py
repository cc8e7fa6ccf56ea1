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
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
import zarr

from dinov3_core import events, tracking
from dinov3_core.config import to_dict
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.exports import h5_dir
from dinov3_core.extract.feature_store import (
    ATTRS_KEY,
    SlideArrays,
    commit_slide,
    export_h5,
    init_output,
    is_extracted,
    pictures_dir,
    staging,
)
from dinov3_core.extract.plan import WorkUnit, committer, plan_work, split_slides
from dinov3_core.inference.feature_model import ExtractError, FeatureModel, open_model
from dinov3_core.inference.loader import BackgroundWriter, TileReader, read_ahead
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
Batch = tuple[WorkUnit, int, np.ndarray]  # the unit, first row in the slide, global tile indices


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


def _device_memory(device: torch.device | str | None) -> str:
    """What a CUDA device is and holds, e.g. ` (NVIDIA H100 80GB HBM3, 79.1 GiB, 2.3 GiB free)`; "" for the CPU."""
    if device is None or torch.device(device).type != "cuda":
        return ""
    d = torch.device(device)
    free, total = torch.cuda.mem_get_info(d)
    return f" ({torch.cuda.get_device_properties(d).name}, {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free)"


def _does_not_fit(model: FeatureModel, cfg: ExtractConfig, err: BaseException) -> ExtractError:
    where = ", ".join(model.providers) + _device_memory(model.device)
    return ExtractError(
        f"model {model.path} with batch_size={cfg.batch_size} does not fit on {where} "
        f"({str(err)[:200]}); lower batch_size, or use precision=bf16 (torch)"
    )


def _out_of_memory(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or "failed to allocate memory" in text or "out of memory" in text


def _batches(ds: Any, units: list[WorkUnit], offsets: np.ndarray, batch_size: int) -> Iterator[Batch]:
    for unit in units:
        start = int(offsets[unit.slide])
        for b0 in range(unit.start, unit.stop, batch_size):
            yield unit, b0, np.arange(start + b0, start + min(unit.stop, b0 + batch_size))


def _batch_reader(ds: Any, model: FeatureModel) -> Callable[[Batch], Any]:
    """Reads and prepares a batch on any thread; a failure names the slide and its rows (it surfaces in the main
    thread when the model reaches that batch)."""
    reader = TileReader(ds, model.prepare)

    def read(batch: Batch) -> Any:
        unit, b0, idx = batch
        try:
            return reader(idx)
        except Exception as err:
            raise ExtractError(
                f"tiles {b0}-{b0 + len(idx) - 1} of slide {ds.slide_ids[unit.slide]} in tile store "
                f"{ds.slide_store(unit.slide)} cannot be read ({type(err).__name__}: {str(err)[:300]}); re-tile the "
                f"slide"
            ) from err

    return read


class _UnitWriter:
    """Runs the model over one unit's batches and hands the rows to the background writer."""

    def __init__(
        self,
        cfg: ExtractConfig,
        ds: Any,
        model: FeatureModel,
        out: Path,
        bar: Any,
        batches: Iterator[tuple[Batch, Any]],
        writer: BackgroundWriter,
        rank: int,
    ) -> None:
        self.cfg, self.ds, self.model, self.out, self.bar = cfg, ds, model, out, bar
        self.batches, self.writer, self.rank = batches, writer, rank

    def __call__(self, unit: WorkUnit) -> None:
        incoming = staging(self.out, self.ds.slide_ids[unit.slide])
        if unit.whole:
            shutil.rmtree(incoming, ignore_errors=True)
            incoming.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._write(unit, incoming)
            if unit.whole:
                commit_slide(self.cfg, self.ds, unit.slide, self.model, self.out)
        except BaseException:
            self.writer.discard()  # nothing may still be writing into the staging directory
            if unit.whole:  # a range of a split slide: the job fails, and the next run redoes the whole slide
                shutil.rmtree(incoming, ignore_errors=True)
            raise

    def _write(self, unit: WorkUnit, incoming: Path) -> None:
        cfg, model, slide_id = self.cfg, self.model, self.ds.slide_ids[unit.slide]
        group = zarr.open_group(str(incoming), mode="w" if unit.whole else "r+")
        arrays = None if unit.whole else SlideArrays.open(group)
        for _ in range(unit.start, unit.stop, cfg.batch_size):
            (got, b0, idx), prepared = next(self.batches)
            assert got == unit, "batches out of step with the work units"
            events.emit("extract.batch", output=str(self.out), slide_id=slide_id, start=b0, rank=self.rank)
            try:
                cls, mean, patch = model.infer(prepared, cfg.patch_tokens)  # type: ignore[misc]
            except (RuntimeError, ValueError, AssertionError) as err:
                if _out_of_memory(err):
                    raise _does_not_fit(model, cfg, err) from None
                if b0 != unit.start:
                    raise
                raise ExtractError(
                    f"model {model.path} failed on the {self.ds.tile_size} px tiles of slide {slide_id} "
                    f"({type(err).__name__}: {str(err)[:300]}); the tile size must be a multiple of the model's "
                    f"patch size"
                ) from None
            if arrays is None:
                p = patch.shape[1] if patch is not None else 0
                arrays = SlideArrays.create(
                    group, unit.n_tiles, cls.shape[1], p, cfg.patch_tokens, cfg.chunk_rows, cfg.batch_size
                )
            self.writer.submit(arrays.write, b0, cls, mean, patch)
            self.bar.update(len(idx))
        self.writer.drain()


def _stage_split_slides(
    cfg: ExtractConfig, ds: Any, model: FeatureModel, out: Path, split: dict[int, list[WorkUnit]], offsets: np.ndarray
) -> None:
    """Rank 0, before any rank writes: the staging arrays of the slides split over ranks (their width from one
    tile through the model), so every rank only writes rows into arrays that exist."""
    if not split:
        return
    first = next(iter(split))
    probe = TileReader(ds, model.prepare)(np.array([int(offsets[first])]))
    cls, _, patch = model.infer(probe, cfg.patch_tokens)  # type: ignore[misc]
    p = patch.shape[1] if patch is not None else 0
    for s in split:
        incoming = staging(out, ds.slide_ids[s])
        shutil.rmtree(incoming, ignore_errors=True)
        incoming.parent.mkdir(parents=True, exist_ok=True)
        group = zarr.open_group(str(incoming), mode="w")
        SlideArrays.create(
            group, int(ds.tile_counts[s]), cls.shape[1], p, cfg.patch_tokens, cfg.chunk_rows, cfg.batch_size
        )


def _plan(
    cfg: ExtractConfig, ds: Any, model: FeatureModel, out: Path, team: Team, offsets: np.ndarray
) -> tuple[list[list[WorkUnit]], list[int]]:
    """Rank 0: (units per rank, slides skipped as up to date), with the split slides' staging arrays created."""
    init_output(out, cfg.store)
    mine = list(range(cfg.shard_index, len(ds.slide_ids), cfg.num_shards))
    fingerprints = {s: ds.slide_attrs(s).get("source_fingerprint") for s in mine}
    todo = [
        s for s in mine if not is_extracted(out, ds.slide_ids[s], model.hash, fingerprints[s], cfg.precision, cfg.mpp)
    ]
    align = math.lcm(cfg.chunk_rows, cfg.batch_size) if cfg.patch_tokens else cfg.chunk_rows
    plan = plan_work({s: int(ds.tile_counts[s]) for s in todo}, team.world_size, align)
    _stage_split_slides(cfg, ds, model, out, split_slides(plan), offsets)
    skipped = [s for s in mine if s not in todo]
    if cfg.format == "both":  # extracted before .h5 files were asked for: written from the store
        for s in skipped:
            if not (h5_dir(out) / f"{ds.slide_ids[s]}.h5").is_file():
                export_h5(out, ds.slide_ids[s], ds.slide_attrs(s), int(ds.tile_size))
    return plan, skipped


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
                f"model {cfg.model} does not fit on {device}{_device_memory(device)} "
                f"({str(err)[:300]}); use a GPU with more memory"
            ) from None
        if model.patch_size and ds.tile_size % model.patch_size:
            raise ExtractError(
                f"tile store {cfg.store} has {ds.tile_size} px tiles, not a multiple of the model's patch size "
                f"{model.patch_size}: re-tile with a tile_size that is"
            )
        out = Path(cfg.output)
        offsets = np.concatenate([[0], np.cumsum(ds.tile_counts)])
        plan, skipped = team.broadcast(_plan(cfg, ds, model, out, team, offsets) if team.is_main else None)
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
            jobs = _batches(ds, units, offsets, cfg.batch_size)
            work_start = time.perf_counter()
            try:
                with contextlib.closing(read_ahead(jobs, _batch_reader(ds, model), readers, depth)) as batches:
                    write_unit = _UnitWriter(cfg, ds, model, out, bar, batches, writer, team.rank)
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
