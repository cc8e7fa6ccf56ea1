"""extract: features for every tile of a tile store, slide embeddings and PCA maps, in this process or as a
torchrun job on several processes (`python -m dinov3_core.extract.job`, one store, any world size)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core.extract.config import ExtractConfig
from dinov3_core.stages.base import ChainPaths, CliOption, RunHooks, Stage, Summary


@dataclass
class ExtractSummary(Summary):
    slides_extracted: int = 0
    slides_up_to_date: int = 0
    tiles: int | None = None
    tiles_per_s: float | None = None
    model_hash: str | None = None
    backend: str | None = None
    ranks: int | None = None  # a job of more than one rank: how many, and each one's rate
    tiles_per_s_per_rank: list[float] | None = None


def summarize(r: Mapping[str, Any]) -> ExtractSummary:
    """An extract run (`ExtractResult` as a dict, or the job's run record) as the manifest keeps it."""
    s = ExtractSummary(
        len(r.get("extracted", [])),
        len(r.get("skipped", [])),
        r.get("tiles"),
        round(float(r.get("tiles_per_s", 0.0)), 1),
        r.get("model_hash"),
        r.get("backend"),
    )
    ranks = r.get("ranks") or []
    if len(ranks) > 1:
        s.ranks, s.tiles_per_s_per_rank = len(ranks), [x["tiles_per_s"] for x in ranks]
    return s


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


def _pictures(cfg: ExtractConfig) -> list[tuple[Path, str]]:
    from dinov3_core.extract.extract import pictures_dir

    return [(png, f"pca/{png.parent.name}") for png in sorted(pictures_dir(cfg.output).glob("*/pca.png"))[:50]]


def _chain_values(p: ChainPaths) -> dict[str, Any]:
    values: dict[str, Any] = {
        "store": str(p.tile_store),
        "model": p.extract_model or str(p.onnx),
        "output": str(p.features),
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
    inputs=lambda c: {"tile_store": c.store, "model": c.model},
    outputs=lambda c: {"features": c.output},
    chain_values=_chain_values,
    work=_work,
    job_module="dinov3_core.extract.job",
    job_dir=_job_dir,
    job_summary=_job_summary,
    job_log=job_progress_log,
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
