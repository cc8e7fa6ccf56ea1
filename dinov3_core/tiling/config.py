"""Typed configuration of the tile stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import MISSING

from dinov3_core.config import require
from dinov3_core.tracking import TrackingConfig

# Version of the tissue and pen-ink mask algorithms (`tissue.tissue_mask`, `tissue.pen_mask`): part of every slide's
# tiling hash (`plan.tiling_params`), so that a store tiled with an older mask is tiled again. Bump it whenever the
# masks change for the same thumbnail and settings. 1: saturation-based pen test (took dense violet nuclei for blue
# ink); 2: hue and optical-density pen test. Here rather than in `tissue`, which imports scikit-image.
TISSUE_MASK_VERSION = 2


@dataclass
class TissueConfig:
    """Tissue mask from a low-resolution thumbnail."""

    thumbnail_mpp: float = 8.0  # µm/px of the thumbnail the mask is computed on (at most)
    min_thumbnail_px: int = 1024  # …but finer on small slides, so the long side has at least this many px
    saturation_threshold: float | None = None  # HSV saturation in [0, 255]; null → Otsu on the slide itself
    brightness_threshold: float | None = None  # grey level in [0, 255] below which is tissue; null → from glass
    glass_margin: float = 18.0  # tissue is at least this much darker than the glass (grey levels)
    min_contrast: float = 6.0  # local grey std (5 px window) above which a pixel is textured, i.e. tissue
    close_um: float = 16.0  # morphological closing radius: joins tissue fragments across small gaps
    open_um: float = 8.0  # morphological opening radius: removes slivers thinner than 2 × this (ink rims)
    min_saturation: float = 15.0  # floor under the saturation threshold: glass must not become "tissue"
    max_brightness: float = 245.0  # brighter pixels (glass) are never tissue
    fill_holes: bool = True
    max_hole_area_um2: float = 50_000.0  # holes larger than this stay background (lumina, fat)
    min_region_area_um2: float = 20_000.0  # smaller specks are dropped (dust, debris)
    min_tissue_fraction: float = 0.5  # keep a tile when at least this share of it is tissue

    def __post_init__(self) -> None:
        require(
            0.0 <= self.min_tissue_fraction <= 1.0,
            "min_tissue_fraction",
            f"must be in [0, 1], got {self.min_tissue_fraction}",
        )


@dataclass
class FilterConfig:
    """Optional per-tile QC filters; scores are stored whether or not the filter drops tiles."""

    pen_filter: bool = False
    pen_max_fraction: float = 0.1  # drop a tile when more than this share of it is pen ink
    blur_filter: bool = False
    blur_min_score: float = 15.0  # drop a tile whose Laplacian variance (at blur_mpp) is lower
    blur_mpp: float = 2.0


@dataclass
class TileConfig:
    """The tile stage: whole-slide images → zarr tile store."""

    input: str = MISSING  # a directory, a glob, or a single slide file
    output: str = MISSING  # the tile store directory (…/tiles.zarr)
    # Target µm/px of every tile, or a list of them: [0.5, 1.0, 2.0] cuts every slide at each (same tissue mask and
    # tile size); the first is stored where a single-level store keeps its tiles, the others under
    # slides/<id>/levels/<k>/ (docs/tile-store.md). A plain number (or a one-element list) is a single-level store.
    mpp: Any = 0.5
    mpp_tolerance: float = 0.05  # relative: a pyramid level within ±5 % of the target is read without resizing
    mpp_overrides: str | None = None  # CSV with columns slide,mpp (slide = file name or stem)
    mpp_by_slide: dict[str, float] = field(default_factory=dict)  # the same in the config; wins over the CSV
    default_mpp: float | None = None  # used for slides whose files carry no µm/px at all
    tile_size: int = 224  # px at the target µm/px
    stride: int | None = None  # px at the target µm/px; null → tile_size (no overlap)
    tissue: TissueConfig = field(default_factory=TissueConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)
    reader: Literal["auto", "openslide", "tifffile"] = "auto"  # auto: direct TIFF decoding for SVS/generic TIFF
    # With the direct TIFF reader, decode JPEG slide tiles straight at 1/2, 1/4 or 1/8 scale (libjpeg-turbo's DCT
    # scaling) when the target µm/px is that many times coarser than the level read (e.g. 0.5 µm/px from a 40×
    # scan): faster than a full decode + box average, within a grey level of it on average (docs/benchmarks.md).
    scaled_decode: bool = True
    # jpeg: several times smaller than lossless zstd, faster to write, and it moves a backbone's features less than a
    # 1-px shift of the tile does (docs/benchmarks.md, tile storage).
    # zstd: lossless, for pixel-exact work; none: raw.
    compressor: Literal["zstd", "jpeg", "none"] = "jpeg"
    compression_level: int = 1  # zstd level: higher ones save few more bytes on tissue tiles, at a fraction of speed
    jpeg_quality: int = 90  # 4:2:0 chroma; higher qualities cost noticeably more bytes
    tiles_per_shard: int = 256  # one writer per shard; also the unit of parallel work inside a slide
    workers: int = 1  # processes; slides and shard ranges of large slides are spread over them
    extensions: list[str] = field(
        default_factory=lambda: [".svs", ".tif", ".tiff", ".ndpi", ".mrxs", ".scn", ".vms", ".bif", ".dcm"]
    )
    qc_thumbnail_px: int = 1024  # longest side of the QC picture
    progress: bool = True
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def mpp_levels(self) -> list[float]:
        """The target µm/px of every level, the first one first."""
        return [float(m) for m in self.mpp] if isinstance(self.mpp, list) else [float(self.mpp)]

    def __post_init__(self) -> None:
        self.mpp = _check_mpp(self.mpp)
        bad = {k: v for k, v in self.mpp_by_slide.items() if not v > 0}
        require(not bad, "mpp_by_slide", f"values must be positive µm/px, got {bad}")
        require(self.tile_size >= 16, "tile_size", f"must be >= 16, got {self.tile_size}")
        require(self.stride is None or self.stride >= 1, "stride", f"must be >= 1 or null, got {self.stride}")
        require(1 <= self.jpeg_quality <= 100, "jpeg_quality", f"must be in 1..100, got {self.jpeg_quality}")
        for key in ("tiles_per_shard", "workers"):
            require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")


def _check_mpp(mpp: Any) -> float | list[float]:
    """`mpp` as a float (one level: today's store exactly) or a list of distinct positive floats (several)."""
    values = list(mpp) if isinstance(mpp, list | tuple) else [mpp]
    require(bool(values), "mpp", "must be a positive µm/px or a non-empty list of them, got []")
    for v in values:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and v > 0
        require(ok, "mpp", f"must be a positive µm/px or a list of them, got {mpp!r}")
    floats = [float(v) for v in values]
    require(len(set(floats)) == len(floats), "mpp", f"lists a µm/px twice: {floats}")
    return floats[0] if len(floats) == 1 else floats
