"""The work of one extract process, unit by unit (`dinov3_core.extract.extract.run_extract` drives it): rank 0's
plan over the ranks with the split slides' staging arrays, the batches of a unit read ahead on loader threads, the
model run over them and the rows handed to the background writer, and the errors that name the slide, the rows or
the device memory."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from dinov3_core import events
from dinov3_core.errors import disk_full, is_disk_full
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.feature_store import (
    SlideArrays,
    commit_slide,
    finish_exports,
    init_output,
    is_extracted,
    staged_exports,
    staging,
)
from dinov3_core.extract.plan import WorkUnit, plan_work, split_slides
from dinov3_core.inference.feature_model import ExtractError, FeatureModel
from dinov3_core.inference.loader import BackgroundWriter, TileReader
from dinov3_core.inference.team import Team

Batch = tuple[WorkUnit, int, np.ndarray]  # the unit, first row in the slide, global tile indices


def device_memory(device: torch.device | str | None) -> str:
    """What a CUDA device is and holds, e.g. ` (NVIDIA H100 80GB HBM3, 79.1 GiB, 2.3 GiB free)`; "" for the CPU."""
    if device is None or torch.device(device).type != "cuda":
        return ""
    d = torch.device(device)
    free, total = torch.cuda.mem_get_info(d)
    return f" ({torch.cuda.get_device_properties(d).name}, {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free)"


def does_not_fit(model: FeatureModel, cfg: ExtractConfig, err: BaseException) -> ExtractError:
    where = ", ".join(model.providers) + device_memory(model.device)
    return ExtractError(
        f"model {model.path} with batch_size={cfg.batch_size} does not fit on {where} "
        f"({str(err)[:200]}); lower batch_size, or use precision=bf16 (torch)"
    )


def out_of_memory(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or "failed to allocate memory" in text or "out of memory" in text


def unit_batches(ds: Any, units: list[WorkUnit], offsets: np.ndarray, batch_size: int) -> Iterator[Batch]:
    for unit in units:
        start = int(offsets[unit.slide])
        for b0 in range(unit.start, unit.stop, batch_size):
            yield unit, b0, np.arange(start + b0, start + min(unit.stop, b0 + batch_size))


def batch_reader(ds: Any, model: FeatureModel) -> Callable[[Batch], Any]:
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


class UnitWriter:
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
        self.width: int | None = None  # the features' width and patch tokens a row, once the model has run
        self.tokens = 0

    def __call__(self, unit: WorkUnit) -> None:
        incoming = staging(self.out, self.ds.slide_ids[unit.slide])
        if unit.whole:
            shutil.rmtree(incoming, ignore_errors=True)
            incoming.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._write(unit, incoming)
            if unit.whole:
                commit_slide(self.cfg, self.ds, unit.slide, self.model, self.out)
        except BaseException as err:
            self.writer.discard()  # nothing may still be writing into the staging directory
            if unit.whole:  # a range of a split slide: the job fails, and the next run redoes the whole slide
                shutil.rmtree(incoming, ignore_errors=True)
                shutil.rmtree(staged_exports(self.out, incoming.name), ignore_errors=True)
            if is_disk_full(err):
                raise disk_full(err, incoming, self._needed(unit)) from None
            raise

    def _needed(self, unit: WorkUnit) -> int | None:
        """Bytes the unit's rows take uncompressed (cls and mean_patch, the .h5's copy, patch tokens): what a full
        disk must make room for; None before the model gave the features' width."""
        if self.width is None:
            return None
        per_row = self.width * 4 * (2 + (self.cfg.format == "both") + self.tokens) + 16  # + the .h5's coords
        return unit.size * per_row

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
                if out_of_memory(err):
                    raise does_not_fit(model, cfg, err) from None
                if b0 != unit.start:
                    raise
                raise ExtractError(
                    f"model {model.path} failed on the {self.ds.tile_size} px tiles of slide {slide_id} "
                    f"({type(err).__name__}: {str(err)[:300]}); the tile size must be a multiple of the model's "
                    f"patch size"
                ) from None
            self.width, self.tokens = int(cls.shape[1]), int(patch.shape[1]) if patch is not None else 0
            if arrays is None:
                p = patch.shape[1] if patch is not None else 0
                arrays = SlideArrays.create(
                    group, unit.n_tiles, cls.shape[1], p, cfg.patch_tokens, cfg.chunk_rows, cfg.batch_size
                )
            self.writer.submit(arrays.write, b0, cls, mean, patch)
            self.bar.update(len(idx))
        self.writer.drain()


def stage_split_slides(
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


def plan_ranks(
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
    stage_split_slides(cfg, ds, model, out, split_slides(plan), offsets)
    skipped = [s for s in mine if s not in todo]
    for s in skipped:  # exports asked for after the slide was extracted, or left unrenamed by a stopped run
        finish_exports(cfg, out, ds.slide_ids[s], ds.slide_attrs(s), int(ds.tile_size))
    return plan, skipped


__all__ = ["Batch", "UnitWriter", "batch_reader", "device_memory", "plan_ranks", "unit_batches"]
