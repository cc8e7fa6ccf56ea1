"""One slide through the tile engine: its write units, its atomic commit and its outcome.

Shared by both ways the engine hands out work: the process pool of one host (`engine_pool`), which spreads one
slide's shard ranges over every worker, and slide groups (`groups`), where one process tiles a whole group of
slides, e.g. on a Dask worker of another host.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dinov3_core.errors import WsidinoError
from dinov3_core.tiling import stain
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.discovery import Repeat
from dinov3_core.tiling.plan import SlidePlan, SlideTask, slide_attrs, tiling_params
from dinov3_core.tiling.qc import QC_PICTURES, draw_qc_picture, save_qc_pictures
from dinov3_core.tiling.writer import WriteUnit

SHARDS_PER_UNIT = 1

log = logging.getLogger("wsidino.tile")


@dataclass
class SlideOutcome:
    slide_id: str
    source_path: str
    status: str  # ok | failed | skipped | duplicate (an input another one covers: see `duplicate_of`, `note`)
    error: str | None = None  # of a failed slide: names its file, says what is wrong and what to do
    tile_count: int = 0
    seconds: float = 0.0
    bytes_per_tile: float | None = None
    mpp_effective: float | None = None
    qc: dict[str, str] = field(default_factory=dict)
    workers: int = 0  # worker processes that wrote this slide's tiles (a large slide is spread over all of them)
    tiled_by: str | None = None  # "host:pid" of the process that tiled it as part of a slide group (Dask worker)
    duplicate_of: str | None = None  # of a duplicate: the id of the slide that holds its tissue
    note: str | None = None  # of a duplicate: which input it repeats and how

    def as_manifest_entry(self) -> dict[str, Any]:
        return asdict(self)


ProgressFn = Callable[[int, int], None]  # (tiles done, tiles planned so far)
SlideFn = Callable[[SlideOutcome], None]  # a slide finished: ok, skipped (already complete) or failed


def store_extras(cfg: TileConfig) -> dict[str, Any]:
    """What the store manifest records besides its slides: the tiling parameters."""
    return {"tiling": tiling_params(cfg)}


def process_name() -> str:
    """This process as "host:pid": which machine and worker process tiled a slide group."""
    return f"{socket.gethostname()}:{os.getpid()}"


def limit_zarr_threads() -> None:
    """One core per tiling process: zarr would otherwise encode chunks on a thread pool as wide as the machine,
    so N tiling processes would oversubscribe the cores they were given. Process-wide, and effective only before
    zarr's first use in the process (zarr creates its pool once)."""
    # deferred: zarr is slow to import, only in the process that tiles
    import zarr

    zarr.config.set({"threading.max_workers": 1})


def skipped_outcome(root: Path, task: SlideTask, status: str = "skipped") -> SlideOutcome:
    """The outcome of a slide the store already holds complete, read back from its committed attributes."""
    attrs = ts.read_slide_attrs(root, task.slide_id)
    return SlideOutcome(
        slide_id=task.slide_id,
        source_path=str(task.path),
        status=status,
        tile_count=int(attrs.get("tile_count", 0)),
        bytes_per_tile=attrs.get("bytes_per_tile"),
        mpp_effective=attrs.get("mpp_effective"),
        qc=qc_paths(task.slide_id, QC_PICTURES),
    )


def qc_paths(slide_id: str, names: dict[str, str]) -> dict[str, str]:
    return {k: f"{ts.SLIDES}/{slide_id}/{v}" for k, v in names.items()}


def error_text(err: BaseException) -> str:
    if isinstance(err, WsidinoError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def fail_slide(
    slide_id: str, path: str | os.PathLike[str], message: str, incoming: ts.IncomingSlide | None = None
) -> SlideOutcome:
    """A failed slide's row, logged; its `.incoming/` group (when begun) is abandoned. Its error names the slide
    file once: our own errors already start with it, a library's (OpenSlideError: Bogus marker length, [Errno 28]
    No space left on device) does not."""
    if incoming is not None:
        ts.abandon_slide(incoming)
    path = str(path)
    error = message if path in message else f"{path}: {message}"
    log.warning("slide failed: %s", error)
    return SlideOutcome(slide_id, path, "failed", error=error)


def duplicate_outcome(repeat: Repeat) -> SlideOutcome:
    """The row of an input not tiled because another input holds the same tissue (`discovery.find_repeats`)."""
    return SlideOutcome(
        repeat.task.slide_id,
        str(repeat.task.path),
        "duplicate",
        duplicate_of=repeat.of.slide_id,
        note=repeat.why,
    )


def begin_plan(root: Path, plan: SlidePlan, cfg: TileConfig) -> tuple[ts.IncomingSlide, list[WriteUnit]]:
    """Create the slide's group under `.incoming/` (and a group inside it for each further µm/px level) and cut
    every level's tiles into shard-aligned write units."""
    layout = {  # the same for every level's group
        "tile_size": cfg.tile_size,
        "tiles_per_shard": cfg.tiles_per_shard,
        "compressor": cfg.compressor,
        "compression_level": cfg.compression_level,
        "jpeg_quality": cfg.jpeg_quality,
    }
    slide_id = plan.task.slide_id
    incoming = ts.begin_slide(root, slide_id, n_tiles=plan.n_tiles, columns=plan.columns(), **layout)
    units = _units(incoming, plan, plan.read, plan.reader, plan.coords)
    for level in plan.levels:
        into = ts.begin_slide(
            root, slide_id, n_tiles=level.n_tiles, columns=level.columns(), level_of=incoming, sub=level.path, **layout
        )
        units += _units(into, plan, level.read, level.reader, level.coords, record_stain=False)
    return incoming, units


def _units(
    incoming: ts.IncomingSlide,
    plan: SlidePlan,
    read: Any,
    reader: str,
    coords: Any,
    record_stain: bool = True,
) -> list[WriteUnit]:
    return [
        WriteUnit(
            incoming=incoming,
            source=plan.task.path,
            read=read,
            reader=reader,
            level_size=plan.info.level_dimensions[read.level],
            level_downsample=plan.info.level_downsamples[read.level],
            start=a,
            coords=coords[a:b],
            record_stain=record_stain,
        )
        for a, b in incoming.shard_ranges(SHARDS_PER_UNIT)
    ]


def draw_qc(incoming: ts.IncomingSlide, plan: SlidePlan, cfg: TileConfig) -> None:
    """The slide's QC pictures, into its `.incoming/` folder: drawn while its tiles are being written, so that after
    the last shard only the commit is left to wait for."""
    picture, _ = draw_qc_picture(
        plan,
        max_side=cfg.qc_thumbnail_px,
        title=f"{plan.task.slide_id}: {plan.n_tiles} tiles @ {plan.read.mpp_effective:.3f} um/px",
        pen_filter=cfg.filters.pen_filter,
    )
    save_qc_pictures(incoming.path, picture, plan.tissue_mask)


def finish_plan(incoming: ts.IncomingSlide, plan: SlidePlan, cfg: TileConfig, seconds: float) -> SlideOutcome:
    """The atomic commit of the slide into `slides/` (its QC pictures drawn by `draw_qc` before)."""
    stain_attrs = stain.slide_stain_attrs(stain.pop_slide_sums(incoming.path))  # the units' sums, pooled
    attrs = {**slide_attrs(plan, cfg), **stain_attrs}
    for entry in attrs.get("levels", [])[1:]:  # further µm/px levels: their bytes, and their provenance on their group
        stored = ts.stored_bytes(incoming.path / entry["path"] / "tiles")
        entry.update(
            bytes_stored=stored, bytes_per_tile=round(stored / entry["tile_count"], 1) if entry["tile_count"] else 0.0
        )
        ts.set_group_attrs(incoming.path / entry["path"], entry)
    final = ts.commit_slide(incoming, attrs)
    attrs = ts.read_slide_attrs(final.parent.parent, plan.task.slide_id)
    return SlideOutcome(
        slide_id=plan.task.slide_id,
        source_path=str(plan.task.path),
        status="ok",
        tile_count=plan.n_tiles,
        seconds=round(seconds, 3),
        bytes_per_tile=attrs.get("bytes_per_tile"),
        mpp_effective=plan.read.mpp_effective,
        qc=qc_paths(plan.task.slide_id, QC_PICTURES),
    )
