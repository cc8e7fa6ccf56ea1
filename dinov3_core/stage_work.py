"""What each stage runs once the runner (`dinov3_core.run.run_stage`) has decided it must: a torchrun job for the
training stages (and for extract on several processes), a plain function in this process for the others, and what
the latter log to MLflow. evaluate runs here, but on several processes embeds each model's labelled tiles as a
torchrun job (`dinov3_core.evaluate.embed_job`).

`RunHooks` is what a caller adds: where log lines go, the Prefect tags, a GPU-slot guard, tile progress callbacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dinov3_core import tracking
from dinov3_core.config import to_yaml
from dinov3_core.launch import run_torchrun
from dinov3_core.launch.training import TRAINING_STAGES, LaunchSettings, stage_job

GuardFactory = Callable[[LaunchSettings], contextlib.AbstractContextManager[Any]]


@dataclass
class RunHooks:
    """What the caller adds around a stage run (the CLI and the Prefect task fill different parts)."""

    log: Callable[[str], None] = print
    parent_run_id: str | None = None  # the pipeline's MLflow run: the stage's run nests under it
    tags: Mapping[str, str] = field(default_factory=dict)  # extra MLflow tags (the Prefect flow run)
    run_name: str | None = None  # MLflow run name; default: the stage name
    hold_resources: GuardFactory | None = None  # entered around a torchrun job (Prefect GPU slots)
    progress: Callable[[int, int], None] | None = None  # tile, extract: (tiles done, tiles planned so far)
    on_slide: Callable[[Any], None] | None = None  # tile: each slide's SlideOutcome as it finishes
    run_groups: Any = None  # tile: a `tiling.groups.RunGroups` (slide groups on a Dask cluster); None: the pool
    # Runs a stage's `TorchrunJob` (pretrain, gram, extract on several processes): None → `run_torchrun` on this
    # host; a cluster backend submits it to its scheduler instead (tasks.launch_slurm.SlurmRunner).
    run_job: Callable[..., None] | None = None
    launch: Any = None  # the stage's `LaunchSettings`: evaluate embeds as a torchrun job when it asks for > 1 process


# -------------------------------------------------------------------------------------------- torchrun jobs


def launch_job(stage: str, cfg: Any, launch: LaunchSettings, run: Any, hooks: RunHooks) -> dict[str, Any]:
    """The stage as a torchrun job (rank 0 logs into `run`); returns the summary kept in the manifest."""
    job = stage_job(stage, cfg, launch, env=tracking.run_env(run, cfg.tracking))
    hooks.log(f"{stage}: torchrun {job.nproc_per_node} process(es) × {job.nnodes} node(s), logs in {job.log_dir}")
    guard = hooks.hold_resources(launch) if hooks.hold_resources is not None else contextlib.nullcontext()
    log = hooks.log
    if stage == "extract" and hooks.progress is not None:
        log = _with_job_progress(cfg, hooks)
    with guard:
        (hooks.run_job or run_torchrun)(job, log=log)
    if stage in TRAINING_STAGES:
        return training_summary(stage, cfg)
    from dinov3_core.export.extract import read_run_record

    return extract_summary(read_run_record(cfg.output))


def _with_job_progress(cfg: Any, hooks: RunHooks) -> Callable[[str], None]:
    """`hooks.log` that also reports the whole job's progress (every rank's count) with each line rank 0 prints: its
    progress lines come every `progress_every_s`. Called in the launching thread, as Prefect's artifacts need."""
    import shutil

    from dinov3_core.export.extract import PROGRESS_DIR, job_progress, pictures_dir

    shutil.rmtree(pictures_dir(cfg.output) / PROGRESS_DIR, ignore_errors=True)  # counts of an earlier job
    assert hooks.progress is not None

    def log(line: str) -> None:
        hooks.log(line)
        done, total = job_progress(cfg.output)
        if total:
            hooks.progress(done, total)  # type: ignore[misc]

    return log


# The last metrics line's figures a training stage's summary carries (losses, health signals, throughput, memory).
SUMMARY_KEYS = ("total_loss", "dino_gap", "teacher_entropy", "agreement", "images_per_s", "max_rss_mb", "gram_loss")


def training_summary(stage: str, cfg: Any) -> dict[str, Any]:
    """The last metrics line (iteration, losses, throughput, memory), the health probe's latest scores and
    verdict and, for gram, the chosen teacher."""
    out = Path(cfg.output_dir)
    summary: dict[str, Any] = {}
    metrics = out / "training_metrics.json"
    if metrics.is_file():
        rows = [r for r in map(json.loads, filter(str.strip, metrics.read_text().splitlines())) if "event" not in r]
        if rows:  # event lines (memory re-plans) are not steps
            last = rows[-1]
            summary["iteration"] = last.get("iteration")
            for key in SUMMARY_KEYS:
                if isinstance(last.get(key), int | float):
                    summary[key] = round(float(last[key]), 4)
            replans = sum(1 for r in map(json.loads, filter(str.strip, metrics.read_text().splitlines()))
                          if r.get("event") == "memory_replan")  # fmt: skip
            if replans:
                summary["memory_replans"] = replans
            probed = [r for r in rows if isinstance(r.get("effective_rank"), int | float)]
            if probed:  # the health probe's latest scores (dinov3_core.train.health_probe)
                summary |= {k: round(float(probed[-1][k]), 4) for k in ("effective_rank", "invariance")}
    health = out / "health.json"
    if health.is_file():
        summary["health"] = json.loads(health.read_text()).get("verdict")
    selection = out / "gram_teacher_selection.json"
    if stage == "gram" and selection.is_file():
        chosen = json.loads(selection.read_text()).get("chosen", {})
        summary["gram_teacher"] = chosen.get("path")
        summary["gram_teacher_iteration"] = chosen.get("iteration")
    return summary


# ----------------------------------------------------------------------------------------- in-process stages


def _tile(cfg: Any, hooks: RunHooks) -> tuple[Any, dict[str, Any]]:
    from dinov3_core.tiling.engine import run_tile

    result = run_tile(cfg, progress=hooks.progress, on_slide=hooks.on_slide, run_groups=hooks.run_groups)
    failed = [o.slide_id for o in result.outcomes if o.status == "failed"]
    return result, {**result.counts, "tiles_total": result.total_tiles, "failed_slides": failed}


def _log_tile(cfg: Any, result: Any) -> None:
    from dinov3_core.tiling import report

    report.log_to_mlflow(result)  # (its parameters went in as the run opened)


def _convert(cfg: Any, hooks: RunHooks) -> tuple[Any, dict[str, Any]]:
    from dinov3_core.export.convert import run_convert

    r = run_convert(cfg)
    hooks.log(f"convert: {r.checkpoint} → {r.backbone}")
    mb = {"backbone_mb": round(r.backbone_bytes / 1e6, 2), "checkpoint_mb": round(r.checkpoint_bytes / 1e6, 2)}
    return r, {"checkpoint": str(r.checkpoint), "iteration": r.iteration, "arch": r.arch, **mb}


def _export(cfg: Any, hooks: RunHooks) -> tuple[Any, dict[str, Any]]:
    from dinov3_core.export.model_card import write_model_card
    from dinov3_core.export.onnx_export import run_export

    r = run_export(cfg)
    hooks.log(f"export: {r.path} (ONNX Runtime vs PyTorch: max abs error {r.max_abs_error:.2e}, "
              f"{r.max_rel_error:.1e} of the output scale)")  # fmt: skip
    card = write_model_card(r.path, Path(cfg.weights), {"outputs": r.outputs, "max_abs_error": r.max_abs_error,
                            "max_rel_error": r.max_rel_error, "model_version": r.model_version,
                            "registered_model": cfg.register_name})  # fmt: skip
    _describe_version(cfg, cfg.register_name, r.model_version, card)
    hf: dict[str, Any] = {}
    if cfg.huggingface:
        from dinov3_core.export.hf_export import write_hf_model
        from dinov3_core.export.model_card import HF_DIR

        h = write_hf_model(Path(cfg.weights), r.path.parent / HF_DIR, card=card.read_text(),
                           atol=cfg.parity_tolerance, rtol=cfg.parity_rtol)  # fmt: skip
        hooks.log(f"export: {h.path} (transformers vs PyTorch: {h.max_rel_error:.1e} of the output scale; as "
                  f"loaded, with transformers' own RoPE frequencies: {h.as_loaded_rel_error:.1e})")  # fmt: skip
        hf = {"huggingface": str(h.path), "hf_max_rel_error": h.max_rel_error,
              "hf_as_loaded_rel_error": h.as_loaded_rel_error}  # fmt: skip
    summary = {"onnx": str(r.path), "n_nodes": r.n_nodes, "max_abs_error": r.max_abs_error, **hf,
               "max_rel_error": r.max_rel_error, "fp16_max_rel_error": r.fp16_max_rel_error,
               "model_uri": r.model_uri, "registered_model": cfg.register_name if r.model_version else None,
               "model_version": r.model_version, "alias": cfg.register_alias if r.model_version else None}  # fmt: skip
    return r, {k: v for k, v in summary.items() if v is not None}


def _evaluate(cfg: Any, hooks: RunHooks) -> tuple[Any, dict[str, Any]]:
    from dinov3_core.evaluate.evaluation import run_evaluate
    from dinov3_core.export.model_card import add_evaluation

    embed_job = None
    if hooks.launch is not None and hooks.launch.nproc_per_node > 1:  # each model's labelled tiles: a job on this node
        from dinov3_core.evaluate.embed_job import launch_embedding

        embed_job = functools.partial(launch_embedding, cfg, hooks.launch, log=hooks.log,
                                      hold_resources=hooks.hold_resources, run_job=hooks.run_job)  # fmt: skip
    r = run_evaluate(cfg, embed_job)
    for line in r.table.splitlines():
        hooks.log(line)
    d, cand = r.decision, r.evaluation["models"]["candidate"]
    card = add_evaluation(Path(cfg.candidate), r.table, d.reason)
    _describe_version(cfg, cfg.register_name, cand.get("version"), card)
    primary = cfg.gate.primary_metric.split(".")
    value = cand.get("probes", {}).get(primary[0], {}).get(primary[1], {}).get("value")
    summary = {
        "labelled_tiles": r.evaluation["labelled_tiles"],
        "promoted": d.applied,
        "promote": d.promote,
        "decision": d.reason,
        "champion_model": r.champion_model,
        cfg.gate.primary_metric: value,
        "cls_effective_rank": cand["health"].get("cls_effective_rank"),
        "seconds": round(r.seconds, 1),
    }
    return r, {k: v for k, v in summary.items() if v is not None}


def _describe_version(cfg: Any, name: str, version: str | None, card: Path | None) -> None:
    """The model card as the registered version's description (what the MLflow UI shows on its page)."""
    if not version or card is None or not cfg.tracking.enabled:
        return
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    client.update_model_version(name, str(version), description=card.read_text()[:5000])


def _extract(cfg: Any, hooks: RunHooks) -> tuple[Any, dict[str, Any]]:
    from dinov3_core.export.extract import run_extract

    r = run_extract(cfg, progress=hooks.progress)
    hooks.log(f"extract: {len(r.extracted)} slides extracted, {len(r.skipped)} up to date → {r.output}")
    return r, extract_summary(dataclasses.asdict(r))


def extract_summary(r: Mapping[str, Any]) -> dict[str, Any]:
    """What the manifest keeps of an extract run (`ExtractResult` as a dict, or the job's run record)."""
    summary = {"slides_extracted": len(r.get("extracted", [])), "slides_up_to_date": len(r.get("skipped", [])),
               "tiles": r.get("tiles"), "tiles_per_s": round(float(r.get("tiles_per_s", 0.0)), 1),
               "model_hash": r.get("model_hash"), "backend": r.get("backend")}  # fmt: skip
    ranks = r.get("ranks") or []
    if len(ranks) > 1:
        summary["ranks"] = len(ranks)
        summary["tiles_per_s_per_rank"] = [x["tiles_per_s"] for x in ranks]
    return summary


# The stages that run in the calling process: (stage function result, summary kept in the manifest).
IN_PROCESS: dict[str, Callable[[Any, RunHooks], tuple[Any, dict[str, Any]]]] = {
    "tile": _tile,
    "convert": _convert,
    "export": _export,
    "evaluate": _evaluate,
    "extract": _extract,
}


# Stages that log to MLflow only once their work is done: their run opens on a thread while they work (importing
# MLflow and opening its store take ~2 s, a large share of a short tile run), and this logs their results after.
LOGS_AFTER_WORK: dict[str, Callable[[Any, Any], None]] = {"tile": _log_tile}


def log_stage_artifacts(stage: str, cfg: Any) -> None:
    """The resolved config, and pictures worth a look in MLflow, beyond what the stage logs itself."""
    import mlflow

    if mlflow.active_run() is None:
        return
    mlflow.log_text(to_yaml(cfg), f"config/{stage}.yaml")
    if stage == "extract":
        from dinov3_core.export.extract import pictures_dir

        for png in sorted(pictures_dir(cfg.output).glob("*/pca.png"))[:50]:
            tracking.log_artifact(png, f"pca/{png.parent.name}")
