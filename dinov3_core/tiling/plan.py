"""Planning one slide: resolution, tissue mask, tile grid and per-tile QC scores, before any tile is read."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tifffile

from dinov3_core.config_tree import to_dict
from dinov3_core.tiling import slide as slide_io
from dinov3_core.tiling.config import TISSUE_MASK_VERSION, TileConfig
from dinov3_core.tiling.tiff_reader import TIFF_VENDORS, TiffLevelReader, UnsupportedTiff


@dataclass(frozen=True)
class SlideTask:
    slide_id: str
    path: Path


class TileColumns:
    """The per-tile arrays a level's group holds, by name (a slide's first level and each further one)."""

    coords: np.ndarray
    tissue_fraction: np.ndarray
    pen_fraction: np.ndarray
    blur_score: np.ndarray

    def columns(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in ("coords", "tissue_fraction", "pen_fraction", "blur_score")}


@dataclass
class LevelPlan(TileColumns):
    """One further µm/px of a slide (`TileConfig.mpp` a list): its read plan and kept tiles, from the first level's
    tissue mask. Stored under `slides/<id>/levels/<index>/` (docs/tile-store.md)."""

    index: int  # 1, 2, …: position in `TileConfig.mpp_levels`
    read: slide_io.ReadPlan
    reader: str
    coords: np.ndarray
    tissue_fraction: np.ndarray
    pen_fraction: np.ndarray
    blur_score: np.ndarray
    dropped_count: int
    candidate_count: int

    @property
    def n_tiles(self) -> int:
        return len(self.coords)

    @property
    def path(self) -> str:
        """The level's group, relative to the slide's."""
        return f"{LEVELS}/{self.index}"


LEVELS = "levels"  # the group of a slide's further levels


@dataclass
class SlidePlan(TileColumns):
    """Everything needed to write a slide's tiles; small enough to pass between processes."""

    task: SlideTask
    info: slide_io.SlideInfo
    read: slide_io.ReadPlan
    reader: str  # tile reader backend: tifffile | tifffile-dct | openslide
    fingerprint: str
    size: int
    params_hash: str
    coords: np.ndarray  # (N, 2) int64, kept tiles, row-major
    tissue_fraction: np.ndarray  # (N,)
    pen_fraction: np.ndarray  # (N,)
    blur_score: np.ndarray  # (N,)
    dropped_coords: np.ndarray  # tiles with enough tissue that a QC filter dropped
    candidate_count: int
    thumb: np.ndarray
    thumb_scale: float  # level-0 px per thumbnail px
    qc_image: np.ndarray  # the picture behind the QC overlay, `qc_scale` level-0 px per px
    qc_scale: float
    tissue_mask: np.ndarray
    pen_mask: np.ndarray
    thresholds: dict[str, float]
    seconds: float
    levels: list[LevelPlan] = field(default_factory=list)  # the further µm/px of `TileConfig.mpp` (a list)

    @property
    def n_tiles(self) -> int:
        return len(self.coords)


def tiling_params(cfg: TileConfig) -> dict[str, Any]:
    """The settings that change stored tiles; a slide is redone when any of them changes."""
    d = to_dict(cfg)
    keep = [
        "mpp",
        "mpp_tolerance",
        "tile_size",
        "stride",
        "tissue",
        "filters",
        "reader",
        "compressor",
        "jpeg_quality",
    ]
    params = {k: d[k] for k in keep}
    # The mask's algorithm decides which tiles exist as much as the settings do; version 1 (before this key) stores
    # are re-tiled, as their masks took dense nuclei for pen ink.
    params["tissue_mask_version"] = TISSUE_MASK_VERSION
    if cfg.compressor == "zstd":
        params["compression_level"] = cfg.compression_level
    # A key added later enters only when it departs from what stores made before it did, so that those slides,
    # tiled again with the same settings, keep their hash and are skipped rather than re-tiled.
    if cfg.scaled_decode:
        params["scaled_decode"] = True
    return params


def slide_params_hash(cfg: TileConfig, mpp_override: float | None) -> str:
    """Tiling parameters plus the µm/px override or default that applies to this slide."""
    payload = {"params": tiling_params(cfg), "mpp_override": mpp_override, "default_mpp": cfg.default_mpp}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def choose_reader(path: Path, info: slide_io.SlideInfo, read: slide_io.ReadPlan, cfg: TileConfig) -> str:
    """`tifffile` where the level is a plain tiled TIFF page OpenSlide would read as is, `tifffile-dct` where its JPEG
    tiles can also be decoded at the reduced scale the target needs (`scaled_decode`), else `openslide`."""
    if cfg.reader == "openslide":
        return "openslide"
    level = read.level
    if info.vendor in TIFF_VENDORS:
        reduce = read.whole_reduction
        # Reduced decoding needs every tile origin on the reduced grid: whole level downsamples keep it there.
        if cfg.scaled_decode and reduce > 1 and float(info.level_downsamples[level]).is_integer():
            try:
                TiffLevelReader(path, info.level_dimensions[level], reduce).close()
                return "tifffile-dct"
            except (UnsupportedTiff, OSError, ValueError, tifffile.TiffFileError):
                pass  # not JPEG/YCbCr, odd tile size …: decode in full below
        try:
            TiffLevelReader(path, info.level_dimensions[level]).close()
            return "tifffile"
        except (UnsupportedTiff, OSError, ValueError, tifffile.TiffFileError) as err:
            if cfg.reader == "tifffile":
                raise slide_io.SlideError(
                    f"{path}: cannot read level {level} directly ({err}); use reader=auto"
                ) from None
    elif cfg.reader == "tifffile":
        raise slide_io.SlideError(f"{path}: reader=tifffile needs an SVS or generic TIFF (vendor is {info.vendor})")
    return "openslide"


def plan_slide(task: SlideTask, cfg: TileConfig, overrides: dict[str, float]) -> SlidePlan:
    """Open the slide, resolve µm/px, build the tissue mask and the kept-tile grid with QC scores."""
    # Imported here, in the worker that plans: the parent process never needs scikit-image (slow to import).
    from dinov3_core.tiling import tissue

    start = time.perf_counter()
    slide = slide_io.open_slide(task.path)  # first: it explains a missing or unreadable file
    try:
        size, fingerprint = slide_io.file_fingerprint(task.path)
        info = slide_io.describe_slide(slide, task.path, overrides, cfg.default_mpp)
        levels = cfg.mpp_levels
        reads = [slide_io.plan_read(info, m, cfg.tile_size, cfg.stride, cfg.mpp_tolerance) for m in levels]
        read = reads[0]
        thumb_mpp = tissue.mask_mpp(info.width * info.mpp, info.height * info.mpp, cfg.tissue)
        thumb, thumb_scale = slide_io.read_downsampled(slide, info, thumb_mpp)
        pen = tissue.pen_mask(thumb, thumb_scale * info.mpp)
        mask, thresholds = tissue.tissue_mask(thumb, thumb_scale * info.mpp, cfg.tissue, pen)
        qc_mpp = max(info.mpp, max(info.width, info.height) * info.mpp / cfg.qc_thumbnail_px)
        if qc_mpp < thumb_mpp * 0.9:
            qc_image, qc_scale = slide_io.read_downsampled(slide, info, qc_mpp)
        else:
            qc_image, qc_scale = thumb, thumb_scale
        blur_read = None
        if cfg.filters.blur_filter:  # reading the slide at blur_mpp costs more than the rest of planning
            blur_read = slide_io.read_downsampled(slide, info, cfg.filters.blur_mpp)
    finally:
        slide.close()
    # Every level's grid is cut from the same tissue mask (and pen mask, blur picture).
    grids = [_level_grid(info, r, mask, pen, thumb_scale, blur_read, cfg) for r in reads]
    grid, fraction, pen_fraction, blur, keep = grids[0]
    if len(grid) == 0:
        raise slide_io.SlideError(
            f"{task.path}: no tissue found ({mask.mean():.1%} of the thumbnail is tissue, no tile reaches "
            f"tissue.min_tissue_fraction={cfg.tissue.min_tissue_fraction}); if the slide has tissue, lower "
            "tissue.min_tissue_fraction or tissue.min_saturation"
        )
    reader = choose_reader(task.path, info, read, cfg)
    if not keep.any():
        raise slide_io.SlideError(
            f"{task.path}: the QC filters dropped all {len(grid)} tissue tiles (pen_filter={cfg.filters.pen_filter}, "
            f"blur_filter={cfg.filters.blur_filter}); check the QC picture or relax filters.*"
        )
    extra = [
        LevelPlan(
            index=k,
            read=r,
            reader=choose_reader(task.path, info, r, cfg),
            coords=g[kp],
            tissue_fraction=f[kp],
            pen_fraction=pf[kp],
            blur_score=b[kp],
            dropped_count=int((~kp).sum()),
            candidate_count=len(g),
        )
        for k, (r, (g, f, pf, b, kp)) in enumerate(zip(reads, grids, strict=True))
        if k > 0
    ]
    mpp_override = slide_io.override_for(task.path, overrides)
    return SlidePlan(
        task=task,
        info=info,
        read=read,
        reader=reader,
        fingerprint=fingerprint,
        size=size,
        params_hash=slide_params_hash(cfg, mpp_override),
        coords=grid[keep],
        tissue_fraction=fraction[keep],
        pen_fraction=pen_fraction[keep],
        blur_score=blur[keep],
        dropped_coords=grid[~keep],
        candidate_count=len(grid),
        thumb=thumb,
        thumb_scale=thumb_scale,
        qc_image=qc_image,
        qc_scale=qc_scale,
        tissue_mask=mask,
        pen_mask=pen,
        thresholds=thresholds,
        seconds=time.perf_counter() - start,
        levels=extra,
    )


def _level_grid(
    info: slide_io.SlideInfo,
    read: slide_io.ReadPlan,
    mask: np.ndarray,
    pen: np.ndarray,
    thumb_scale: float,
    blur_read: tuple[np.ndarray, float] | None,
    cfg: TileConfig,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One level's tissue tiles: (grid, tissue fraction, pen fraction, blur score, kept by the QC filters)."""
    from dinov3_core.tiling import tissue

    grid = tissue.grid_coords(info.width, info.height, read.tile_size_level0, read.stride_level0)
    fraction = tissue.fraction_per_tile(mask, grid, read.tile_size_level0, thumb_scale)
    enough = fraction >= cfg.tissue.min_tissue_fraction
    grid, fraction = grid[enough], fraction[enough]
    if len(grid) == 0:
        empty = np.empty(0, dtype=np.float32)
        return grid, fraction, empty, empty, np.zeros(0, dtype=bool)
    pen_fraction = tissue.fraction_per_tile(pen, grid, read.tile_size_level0, thumb_scale)
    if blur_read is not None:
        blur = tissue.blur_scores(blur_read[0], grid, read.tile_size_level0, blur_read[1])
    else:
        blur = np.full(len(grid), np.nan, dtype=np.float32)
    keep = np.ones(len(grid), dtype=bool)
    if cfg.filters.pen_filter:
        keep &= pen_fraction <= cfg.filters.pen_max_fraction
    if cfg.filters.blur_filter:
        keep &= blur >= cfg.filters.blur_min_score
    return grid, fraction, pen_fraction, blur, keep


def slide_attrs(plan: SlidePlan, cfg: TileConfig) -> dict[str, Any]:
    """The slide group's provenance attributes (see docs/tile-store.md)."""
    info, read = plan.info, plan.read
    d = to_dict(cfg)
    return {
        "source_path": info.path,
        "input_path": str(plan.task.path),  # as the input named it (source_path is resolved): what the id came from
        "source_size": plan.size,
        "source_fingerprint": plan.fingerprint,
        "vendor": info.vendor,
        "objective_power": info.objective_power,
        "openslide_version": info.openslide_version,
        "openslide_python_version": info.openslide_python_version,
        "level0_width": info.width,
        "level0_height": info.height,
        "level0_mpp": info.mpp,
        "mpp_source": info.mpp_source,
        "level_count": info.level_count,
        "level_downsamples": list(info.level_downsamples),
        "reader": plan.reader,
        "level_used": read.level,
        "level_mpp": read.level_mpp,
        "read_size": read.read_size,
        "mpp_requested": read.mpp_requested,
        "mpp_effective": read.mpp_effective,
        "tile_size": read.tile_size,
        "stride": read.stride,
        "tile_size_level0": read.tile_size_level0,
        "stride_level0": read.stride_level0,
        "tissue": {**d["tissue"], "thresholds_used": plan.thresholds},
        "filters": d["filters"],
        "candidate_count": plan.candidate_count,
        "dropped_by_filters": len(plan.dropped_coords),
        "compressor": cfg.compressor,
        "params_hash": plan.params_hash,
        "plan_seconds": round(plan.seconds, 3),
        # Several µm/px (`mpp` a list): every level's provenance, the first one's (group "") repeating the keys
        # above. Absent in a single-level store, whose attributes stay exactly what they were.
        **({"levels": [first_level_attrs(plan)] + [level_attrs(lv) for lv in plan.levels]} if plan.levels else {}),
    }


def _read_attrs(read: slide_io.ReadPlan) -> dict[str, Any]:
    return {
        "mpp_requested": read.mpp_requested,
        "mpp_effective": read.mpp_effective,
        "level_used": read.level,
        "level_mpp": read.level_mpp,
        "read_size": read.read_size,
        "tile_size": read.tile_size,
        "stride": read.stride,
        "tile_size_level0": read.tile_size_level0,
        "stride_level0": read.stride_level0,
    }


def first_level_attrs(plan: SlidePlan) -> dict[str, Any]:
    """The first level's entry of a multi-level slide's `levels` attribute: its arrays are the slide group's own."""
    return {
        "index": 0,
        "path": "",
        **_read_attrs(plan.read),
        "reader": plan.reader,
        "tile_count": plan.n_tiles,
        "candidate_count": plan.candidate_count,
        "dropped_by_filters": len(plan.dropped_coords),
    }


def level_attrs(level: LevelPlan) -> dict[str, Any]:
    """A further level's provenance: its entry in the slide's `levels` attribute and its own group's attributes."""
    return {
        "index": level.index,
        "path": level.path,
        **_read_attrs(level.read),
        "reader": level.reader,
        "tile_count": level.n_tiles,
        "candidate_count": level.candidate_count,
        "dropped_by_filters": level.dropped_count,
    }
