"""Planning one slide: resolution, tissue mask, tile grid and per-tile QC scores, before any tile is read."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tifffile

from dinov3_core.config import to_dict
from dinov3_core.tiling import slide as slide_io
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.tiff_reader import TIFF_VENDORS, TiffLevelReader, UnsupportedTiff


@dataclass(frozen=True)
class SlideTask:
    slide_id: str
    path: Path


@dataclass
class SlidePlan:
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

    @property
    def n_tiles(self) -> int:
        return len(self.coords)

    def columns(self) -> dict[str, np.ndarray]:
        return {
            "coords": self.coords,
            "tissue_fraction": self.tissue_fraction,
            "pen_fraction": self.pen_fraction,
            "blur_score": self.blur_score,
        }


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
    # Imported here, in the worker that plans: the parent process never needs scikit-image (~0.5 s to import).
    from dinov3_core.tiling import tissue

    start = time.perf_counter()
    slide = slide_io.open_slide(task.path)  # first: it explains a missing or unreadable file
    try:
        size, fingerprint = slide_io.file_fingerprint(task.path)
        info = slide_io.describe_slide(slide, task.path, overrides, cfg.default_mpp)
        read = slide_io.plan_read(info, cfg.mpp, cfg.tile_size, cfg.stride, cfg.mpp_tolerance)
        thumb_mpp = tissue.mask_mpp(info.width * info.mpp, info.height * info.mpp, cfg.tissue)
        thumb, thumb_scale = slide_io.read_downsampled(slide, info, thumb_mpp)
        pen = tissue.pen_mask(thumb)
        mask, thresholds = tissue.tissue_mask(thumb, thumb_scale * info.mpp, cfg.tissue, pen)
        qc_mpp = max(info.mpp, max(info.width, info.height) * info.mpp / cfg.qc_thumbnail_px)
        if qc_mpp < thumb_mpp * 0.9:
            qc_image, qc_scale = slide_io.read_downsampled(slide, info, qc_mpp)
        else:
            qc_image, qc_scale = thumb, thumb_scale
        grid = tissue.grid_coords(info.width, info.height, read.tile_size_level0, read.stride_level0)
        fraction = tissue.fraction_per_tile(mask, grid, read.tile_size_level0, thumb_scale)
        enough = fraction >= cfg.tissue.min_tissue_fraction
        grid, fraction = grid[enough], fraction[enough]
        if len(grid) == 0:
            raise slide_io.SlideError(
                f"{task.path}: no tissue found ({mask.mean():.1%} of the thumbnail is tissue, no tile reaches "
                f"tissue.min_tissue_fraction={cfg.tissue.min_tissue_fraction}); if the slide has tissue, lower "
                "tissue.min_tissue_fraction or tissue.min_saturation"
            )
        pen_fraction = tissue.fraction_per_tile(pen, grid, read.tile_size_level0, thumb_scale)
        if cfg.filters.blur_filter:  # reading the slide at blur_mpp costs more than the rest of planning
            blur_img, blur_scale = slide_io.read_downsampled(slide, info, cfg.filters.blur_mpp)
            blur = tissue.blur_scores(blur_img, grid, read.tile_size_level0, blur_scale)
        else:
            blur = np.full(len(grid), np.nan, dtype=np.float32)
    finally:
        slide.close()
    reader = choose_reader(task.path, info, read, cfg)
    keep = np.ones(len(grid), dtype=bool)
    if cfg.filters.pen_filter:
        keep &= pen_fraction <= cfg.filters.pen_max_fraction
    if cfg.filters.blur_filter:
        keep &= blur >= cfg.filters.blur_min_score
    if not keep.any():
        raise slide_io.SlideError(
            f"{task.path}: the QC filters dropped all {len(grid)} tissue tiles (pen_filter={cfg.filters.pen_filter}, "
            f"blur_filter={cfg.filters.blur_filter}); check the QC picture or relax filters.*"
        )
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
    )


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
    }
