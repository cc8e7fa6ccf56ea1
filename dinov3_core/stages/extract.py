"""extract: features for every tile of a tile store, slide embeddings and PCA maps, in this process or as a
torchrun job on several processes (`python -m dinov3_core.extract.job`, one store, any world size)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.summary import ExtractSummary, summarize
from dinov3_core.stage import ChainPaths, CliOption, Place, RunHooks, Stage


def _work(cfg: ExtractConfig, hooks: RunHooks) -> tuple[Any, ExtractSummary]:
    from dinov3_core.extract.extract import run_extract

    r = run_extract(cfg, progress=hooks.progress)
    hooks.log(f"extract: {len(r.extracted)} slides extracted, {len(r.skipped)} up to date → {r.output}")
    return r, summarize(dataclasses.asdict(r))


def _job_summary(cfg: ExtractConfig) -> ExtractSummary:
    from dinov3_core.extract.extract import read_run_record

    return summarize(read_run_record(cfg.output))


def _job_dir(cfg: ExtractConfig) -> Path:
    """The folder beside the feature store: nothing but zarr goes into the store."""
    from dinov3_core.extract.feature_store import pictures_dir

    return pictures_dir(cfg.output)


def job_progress_log(cfg: ExtractConfig, hooks: RunHooks) -> Callable[[str], None]:
    """`hooks.log` that also reports the whole job's progress (every rank's count) with each line rank 0 prints:
    its progress lines come every `progress_every_s`. Called in the launching thread, as Prefect's artifacts need."""
    from dinov3_core.extract.extract import PROGRESS_DIR, job_progress, pictures_dir

    shutil.rmtree(pictures_dir(cfg.output) / PROGRESS_DIR, ignore_errors=True)  # counts of an earlier job
    progress = hooks.progress
    assert progress is not None

    def log(line: str) -> None:
        hooks.log(line)
        done, total = job_progress(cfg.output)
        if total:
            progress(done, total)

    return log


def _check(cfg: ExtractConfig) -> None:
    """An output that is not a feature store fails here, before a manifest is written into it or a job starts."""
    from dinov3_core.extract.feature_store import check_output

    check_output(Path(cfg.output))


def _outputs(cfg: ExtractConfig) -> dict[str, Any]:
    """The feature store and each committed slide's exports: their SHA-256 in the manifest makes a damaged export a
    reason to rerun (which rewrites it from the stored features)."""
    from dinov3_core.extract.feature_store import export_targets

    out = Path(cfg.output)
    slides = sorted(p.name for p in (out / "slides").iterdir() if p.is_dir()) if (out / "slides").is_dir() else []
    exports = {f"{s}/{n}": str(p) for s in slides for n, p in export_targets(cfg, out, s).items() if p.is_file()}
    return {"features": cfg.output, **exports}


def _pictures(cfg: ExtractConfig) -> list[tuple[Path, str]]:
    from dinov3_core.extract.extract import pictures_dir

    return [(png, f"pca/{png.parent.name}") for png in sorted(pictures_dir(cfg.output).glob("*/pca.png"))[:50]]


def _chain_values(p: ChainPaths) -> dict[str, Any]:
    values: dict[str, Any] = {
        "store": str(p.output("tile")),
        "model": p.extract_model or str(p.output("export")),
        "output": str(p.output("extract")),
    }
    if p.slide_ids is not None:
        values["slide_ids"] = p.slide_ids
    return values


STAGE: Stage[ExtractSummary] = Stage(
    name="extract",
    help="Features for every tile of a tile store, slide embeddings, PCA maps.",
    schema=lambda: ExtractConfig,
    summary_type=ExtractSummary,
    output=lambda c: c.output,
    output_is_dir=True,
    place=Place(
        "features.zarr",
        "cohort",
        "PCA pictures: features/<id>/pca.png; per-slide .h5 (TRIDENT/CLAM) in features_h5/ with extract.format=both; "
        "QuPath detections features/<id>/tiles.geojson with extract.qupath=true",
    ),
    inputs=lambda c: {"tile_store": c.store, "model": c.model},
    outputs=_outputs,
    chain_values=_chain_values,
    work=_work,
    job_module="dinov3_core.extract.job",
    job_dir=_job_dir,
    job_summary=_job_summary,
    job_log=job_progress_log,
    progress="as_job",
    volatile=(
        "tracking.",
        "progress",
        "num_threads",
        "batch_size",
        "providers",
        "device",
        "loader_threads",
        "prefetch_batches",
        "chunk_rows",
    ),
    check=_check,
    options=(
        CliOption("--store", "store", "tile store (tiles.zarr)"),
        CliOption("--model", "model", "model.onnx (ONNX Runtime) or backbone.pth (PyTorch)"),
        CliOption("--output", "output", "feature store (features.zarr)"),
    ),
    launch_help="extraction",
    override_example="batch_size=128 patch_tokens=true",
    rerun_hint="finish the slides not yet extracted",
    mlflow_artifacts=_pictures,
)
