"""tile: whole-slide images → a zarr tile store (µm/px-exact tiles under a tissue mask, QC pictures), in this
process (or slide groups on Dask). One bad slide is a failed row, never a failed stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dinov3_core.stage import CliOption, Place, RunHooks, Stage
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.summary import TileSummary


def _inputs(cfg: TileConfig) -> dict[str, Any]:
    """A slide list (.txt/.csv) is fingerprinted with the files it names, so a replaced slide counts."""
    from dinov3_core.tiling.discovery import discover_slides

    inputs: dict[str, Any] = {"slides": cfg.input, "mpp_overrides": cfg.mpp_overrides}
    if Path(cfg.input).suffix.lower() in {".txt", ".csv"} and Path(cfg.input).is_file():
        inputs["listed_slides"] = [str(p) for p in discover_slides(cfg.input, cfg.extensions)]
    return inputs


def _check(cfg: TileConfig) -> None:
    """A bad output path or an input without slides fails here, before a stage manifest is written."""
    from dinov3_core.tiling.engine import prepare_store

    prepare_store(cfg)


def _check_input(cfg: TileConfig) -> None:
    from dinov3_core.tiling.discovery import discover_slides

    discover_slides(cfg.input, cfg.extensions)  # names the folder when it holds no slide


def _work(cfg: TileConfig, hooks: RunHooks) -> tuple[Any, TileSummary]:
    from dinov3_core.tiling.engine import run_tile

    result = run_tile(cfg, progress=hooks.progress, on_slide=hooks.on_slide, run_groups=hooks.run_groups)
    failed = [o.slide_id for o in result.outcomes if o.status == "failed"]
    summary = TileSummary(
        **result.counts, duplicate=result.duplicates, tiles_total=result.total_tiles, failed_slides=failed
    )
    return result, summary


def _report(result: Any) -> str:
    from dinov3_core.tiling import report

    return report.format_summary(result)  # one row per slide: ok, skipped or failed and why


def _log_after_work(cfg: TileConfig, result: Any) -> None:
    from dinov3_core.tiling import report

    report.log_to_mlflow(result)  # (its parameters went in as the run opened)


STAGE: Stage[TileSummary] = Stage(
    name="tile",
    help="Whole-slide images → zarr tile store (µm/px-exact tiles, tissue mask, QC).",
    schema=lambda: TileConfig,
    summary_type=TileSummary,
    output=lambda c: c.output,
    output_is_dir=True,
    place=Place("tiles.zarr", "cohort", "QC pictures: slides/<id>/qc_thumbnail.png, qc_mask.png"),
    inputs=_inputs,
    outputs=lambda c: {"store": c.output},  # fingerprinted by its slides' tile counts (dinov3_core.manifest)
    chain_values=lambda p: {"input": p.slides, "output": str(p.output("tile"))},
    work=_work,
    volatile=("tracking.", "progress", "workers"),
    check=_check,
    check_input=_check_input,
    log_after_work=_log_after_work,
    options=(
        CliOption("--input", "input", "directory, glob, slide file, or .txt/.csv list of slide paths"),
        CliOption("--output", "output", "tile store directory, e.g. out/tiles.zarr"),
        CliOption("--workers", "workers", "worker processes (default from config: 1)", type=int),
    ),
    override_example="tile_size=224 mpp=0.5 workers=4 filters.pen_filter=true",
    default_config="default",
    progress="always",
    reports_slides=True,
    report=_report,
)
