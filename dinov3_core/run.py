"""The stage runner: one stage, under its stage manifest, in its MLflow run. The CLI and the Prefect tasks both
call `run_stage`; neither has a skip rule, a launcher or an MLflow nesting rule of its own.

    outcome = run_stage("export", cfg)                                    # in this process
    outcome = run_stage("pretrain", cfg, launch=LaunchSettings(nproc_per_node=2))   # a torchrun job

What every stage gets from here (the stage functions know nothing of it):

* **skip**: the manifest (`dinov3_core.manifest`) shows the same config hash and input fingerprints and the
  outputs exist → nothing runs (unless `force`); inside a pipeline the skip is recorded as a child run that
  points at the reused one;
* **one MLflow run per stage**: nested under the pipeline's run when there is one (`RunHooks.parent_run_id`),
  tagged with its lineage (`wsidino.lineage.<stage>_run_id`), its inputs and output, and carrying the manifest;
  a retry of a failed attempt reopens that attempt's run;
* **the manifest**: `running` while the stage runs, `failed` with the error, `complete` with outputs and an output
  fingerprint after it; one run per output at a time (a lock beside the manifest);
* **training stages** run as a torchrun job (`dinov3_core.launch`) with the launch settings; rank 0 logs into the
  stage's MLflow run; everything else runs in this process;
* the ``stage.start`` event (`dinov3_core.events`) for fault drills.

`RunHooks` is what a caller adds: where log lines go, the Prefect tags, a GPU-slot guard, tile progress callbacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dinov3_core import events, tracking
from dinov3_core import manifest as mf
from dinov3_core.config import describe_changes, flat_params, to_yaml
from dinov3_core.errors import RunStopped, WsidinoError
from dinov3_core.launch import TorchrunFailed, run_torchrun
from dinov3_core.launch.training import LaunchSettings, training_job
from dinov3_core.stage_specs import STAGE_SPECS, StageSpec

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


@dataclass
class StageOutcome:
    """What one `run_stage` call did: ran or skipped, why, and the manifest now on disk."""

    stage: str
    status: Literal["ran", "skipped"]
    reason: str
    manifest_path: Path
    manifest: mf.StageManifest
    result: Any = None  # the stage function's own result object (in-process stages that ran)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: what the Prefect tasks and flows return, and the UI shows."""
        m = self.manifest
        return {
            "stage": self.stage,
            "status": self.status,
            "reason": self.reason,
            "manifest": str(self.manifest_path),
            "outputs": dict(m.outputs),
            "mlflow_run_id": m.mlflow_run_id,
            "lineage": dict(m.lineage),
            "summary": dict(m.summary),
        }


def default_tracking_store(spec: StageSpec, cfg: Any) -> None:
    """With no tracking URI configured (config or $MLFLOW_TRACKING_URI), a stage logs to the `mlflow.db` of the
    work directory its output lives in, never into whatever directory the command was started from: the nearest
    `mlflow.db` in the output's folder or the one above it (a `wsidino pipeline` workdir), else a new one in the
    output's folder (`runs/lab1/tiles.zarr` → `runs/lab1/mlflow.db`)."""
    t = cfg.tracking
    if not t.enabled or t.uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return
    out = Path(spec.output(cfg)).expanduser().resolve()
    home = out.parent
    found = next((d for d in (home, home.parent) if (d / "mlflow.db").is_file()), home)
    t.uri = f"sqlite:///{found / 'mlflow.db'}"


def lineage_tags(lineage: Mapping[str, str]) -> dict[str, str]:
    return {f"wsidino.lineage.{stage}_run_id": run_id for stage, run_id in lineage.items()}


def run_stage(
    stage: str,
    cfg: Any,
    *,
    force: bool = False,
    launch: LaunchSettings | None = None,
    hooks: RunHooks | None = None,
) -> StageOutcome:
    """Run one stage under its manifest unless it is up to date, in its own MLflow run.

    Args:
        stage: tile, pretrain, gram, convert, export, evaluate or extract.
        cfg: The stage's typed config (`dinov3_core.config.load_config`).
        force: Run even when the manifest says the outputs are up to date.
        launch: torchrun settings (training stages; default: one process on this node).
        hooks: Logging, MLflow nesting and callbacks from the caller.

    Raises:
        WsidinoError: Bad input (naming the key or file); `TorchrunFailed`: a training job failed.
    """
    spec = STAGE_SPECS[stage]
    hooks = hooks or RunHooks()
    default_tracking_store(spec, cfg)
    if spec.check is not None:
        spec.check(cfg)
    inputs, decision = spec.decide(cfg)
    if decision.up_to_date and not force:
        return _record_skip(spec, cfg, decision, hooks)
    reason = "forced" if decision.up_to_date else decision.reason
    hooks.log(f"{stage}: running ({reason})")
    hooks.log(describe_changes(stage, cfg))  # what this run sets on top of its named config
    path = spec.manifest_path(cfg)
    result = None
    with manifest_guard(spec, cfg, inputs) as m:
        previous = decision.previous
        retry_of = (
            previous.mlflow_run_id
            if previous is not None and previous.status != "complete" and previous.config_hash == m.config_hash
            else None
        )  # a retry of a failed attempt keeps its MLflow run
        tags = {
            "wsidino.output": str(Path(spec.output(cfg)).resolve()),
            **lineage_tags(m.lineage),
            **{f"wsidino.input.{k}": v["path"] for k, v in inputs.items()},
        }
        background = stage in LOGS_AFTER_WORK
        # A background stage's parameters are logged by the thread that opens its run, beside the work.
        params = flat_params(cfg) if background else None
        with _stage_mlflow_run(cfg.tracking, stage, hooks, tags, retry_of, background, params) as pending:

            def record_run() -> Any:
                run = pending.wait()
                m.mlflow_run_id = run.info.run_id if run is not None else None
                mf.write_manifest(path, m)  # a crash mid-run still leaves the run id on record
                return run

            run = None if background else record_run()
            events.emit("stage.start", stage=stage, output=str(path.parent), training=spec.distributed)
            if spec.distributed:
                m.summary = _launch_training(stage, cfg, launch or LaunchSettings(), run, hooks)
            else:
                try:
                    result, m.summary = IN_PROCESS[stage](cfg, hooks)
                except BaseException:
                    if background:
                        with contextlib.suppress(Exception):  # the stage's error is the one to report
                            record_run()
                    raise
                if background:
                    run = record_run()
                if run is not None:
                    LOGS_AFTER_WORK.get(stage, _no_log)(cfg, result)
                    _log_stage_artifacts(stage, cfg)
            if run is not None and stage == "export":
                _tag_model_version(m.summary, m.lineage, cfg)
            # State inputs (a registry alias) are recorded as the run leaves them: a promotion is the run's own
            # output, and only a later change by someone else should make a rerun necessary.
            states = {k: v for k, v in spec.inputs(cfg).items() if isinstance(v, mf.StateInput)}
            m.inputs.update(mf.fingerprint_inputs(states))
    tracking.log_artifact_to(cfg.tracking, m.mlflow_run_id if cfg.tracking.enabled else None, path, "manifest")
    return StageOutcome(stage, "ran", reason, path, m, result)


@contextlib.contextmanager
def manifest_guard(spec: StageSpec, cfg: Any, inputs: dict[str, dict[str, str]]) -> Iterator[mf.StageManifest]:
    """`running` manifest while the block runs; `complete` (with outputs and a new output fingerprint) after it,
    `failed` with the error when it raises. The caller fills `run_id` and `summary` on the yielded manifest."""
    path = spec.manifest_path(cfg)
    paths = [i["path"] for i in inputs.values()]
    m = mf.StageManifest(
        stage=spec.name,
        status="running",
        config_hash=spec.config_hash(cfg),
        inputs=inputs,
        lineage=mf.lineage_of(paths),
        started_at=mf.now(),
    )
    created = _first_missing_dir(path.parent)  # removed again when the run stops on bad input
    try:
        with mf.output_lock(path):  # one run per output: a second one fails at once, naming the holder
            mf.write_manifest(path, m)
            try:
                yield m
            except BaseException as err:
                m.status, m.error, m.finished_at = "failed", f"{type(err).__name__}: {err}"[:4000], mf.now()
                mf.write_manifest(path, m)
                raise
            m.outputs = {k: str(Path(v).resolve()) for k, v in spec.outputs(cfg).items()}
            missing = [k for k, v in m.outputs.items() if not Path(v).exists()]
            if missing:
                m.status, m.error = "failed", f"outputs missing after the run: {', '.join(missing)}"
                mf.write_manifest(path, m)
                raise OutputsMissing(f"{spec.name}: {m.error} (see {path})")
            m.status, m.finished_at = "complete", mf.now()
            m.output_fingerprint = mf.completion_fingerprint(m)
            mf.write_manifest(path, m)
    except BaseException as err:
        if created is not None and _bad_input(err):
            shutil.rmtree(created, ignore_errors=True)  # nothing but an empty output, a lock and a failed manifest
        raise


def _first_missing_dir(directory: Path) -> Path | None:
    """The outermost directory of `directory`'s chain that does not exist yet (None when it exists)."""
    missing = None
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            return missing
        missing = candidate
    return missing


class OutputsMissing(WsidinoError):
    """A stage ended without error but without all of its outputs (what it wrote is kept for a look)."""


def _bad_input(err: BaseException) -> bool:
    """The run stopped before doing anything worth keeping: bad input, here or in a training rank (exit 2)."""
    if isinstance(err, OutputsMissing | RunStopped):  # a stopped run keeps its checkpoints
        return False
    return isinstance(err, WsidinoError) or (isinstance(err, TorchrunFailed) and err.rank_exit_code == 2)


@contextlib.contextmanager
def _stage_mlflow_run(
    cfg: tracking.TrackingConfig,
    stage: str,
    hooks: RunHooks,
    tags: Mapping[str, str],
    resume: str | None,
    background: bool = False,
    params: Mapping[str, Any] | None = None,
) -> Iterator[tracking.PendingRun]:
    """Inside a pipeline: the unfinished child a failed attempt left, or a new child; alone: `resume` or new."""
    parent = hooks.parent_run_id if cfg.enabled else None
    run_id = tracking.find_stage_run(cfg, parent, stage) if parent else resume
    all_tags = {tracking.STAGE_TAG: stage, **hooks.tags, **tags}
    with tracking.pending_stage_run(
        cfg, hooks.run_name or stage, params, all_tags, run_id=run_id, parent_run_id=parent, background=background
    ) as pending:  # fmt: skip
        yield pending


def _record_skip(spec: StageSpec, cfg: Any, decision: mf.Decision, hooks: RunHooks) -> StageOutcome:
    """Up to date: log it; inside a pipeline give its run a FINISHED child that points at the reused run."""
    previous = decision.previous
    assert previous is not None
    hooks.log(f"{spec.name}: up to date ({decision.reason}); skipped. Force it to recompute.")
    path = spec.manifest_path(cfg)
    parent = hooks.parent_run_id if cfg.tracking.enabled else None
    # A retried pipeline run already has this stage's child run (it completed in an earlier attempt).
    if parent and not tracking.find_stage_run(cfg.tracking, parent, spec.name, unfinished=False):
        tags = {
            "wsidino.status": "skipped",
            "wsidino.reused_run_id": previous.mlflow_run_id or "",
            **lineage_tags(previous.lineage),
        }
        quiet = dataclasses.replace(cfg.tracking, system_metrics=False)  # a record, not a workload to monitor
        with _stage_mlflow_run(quiet, spec.name, hooks, tags, None) as pending:
            if pending.wait() is not None:
                tracking.log_artifact(path, "manifest")
    return StageOutcome(spec.name, "skipped", decision.reason, path, previous)


# ------------------------------------------------------------------------------------------- training stages


def _launch_training(stage: str, cfg: Any, launch: LaunchSettings, run: Any, hooks: RunHooks) -> dict[str, Any]:
    job = training_job(stage, cfg, launch, env=tracking.run_env(run, cfg.tracking))
    hooks.log(f"{stage}: torchrun {job.nproc_per_node} process(es) × {job.nnodes} node(s), logs in {job.log_dir}")
    guard = hooks.hold_resources(launch) if hooks.hold_resources is not None else contextlib.nullcontext()
    with guard:
        run_torchrun(job, log=hooks.log)
    return training_summary(stage, cfg)


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


def _no_log(cfg: Any, result: Any) -> None:
    """The other in-process stages log to MLflow themselves, as they go."""


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

    r = run_evaluate(cfg)
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
    return r, {"slides_extracted": len(r.extracted), "slides_up_to_date": len(r.skipped), "tiles": r.tiles,
               "tiles_per_s": round(r.tiles_per_s, 1), "model_hash": r.model_hash, "backend": r.backend}  # fmt: skip


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


def _log_stage_artifacts(stage: str, cfg: Any) -> None:
    """The resolved config, and pictures worth a look in MLflow, beyond what the stage logs itself."""
    import mlflow

    if mlflow.active_run() is None:
        return
    mlflow.log_text(to_yaml(cfg), f"config/{stage}.yaml")
    if stage == "extract":
        from dinov3_core.export.extract import pictures_dir

        for png in sorted(pictures_dir(cfg.output).glob("*/pca.png"))[:50]:
            tracking.log_artifact(png, f"pca/{png.parent.name}")


def _tag_model_version(summary: Mapping[str, Any], lineage: Mapping[str, str], cfg: Any) -> None:
    """The registered ONNX model version carries the run ids it came from (registry → training → tiles)."""
    if not summary.get("model_version"):
        return
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    for key, value in {**lineage_tags(lineage), "wsidino.weights": str(cfg.weights)}.items():
        client.set_model_version_tag(summary["registered_model"], summary["model_version"], key, value)


__all__ = ["IN_PROCESS", "RunHooks", "StageOutcome", "lineage_tags", "manifest_guard", "run_stage", "training_summary"]
