"""Stage launchers: one Prefect task runs one stage, in-process or as a torchrun job, under its stage manifest.

    run_stage("export", cfg)                      # in the flow-run process
    run_stage("pretrain", cfg, launch=launch)     # torchrun subprocess, rank 0's output in the Prefect logs

What every stage gets from here (the stage functions in dinov3_core know nothing of it):

* skip: the manifest (`dinov3_core.manifest`) shows the same config hash and input fingerprints and the outputs
  exist → nothing runs (unless `force`), and the run records which earlier run it reused;
* one MLflow run per stage, nested under the pipeline's run when there is one, tagged with its lineage
  (`wsidino.lineage.<stage>_run_id` for every upstream stage) and with the manifest as an artifact;
* training stages: torchrun with nproc/nnodes/rendezvous/GPUs, a GPU-slot concurrency limit, a wall-clock limit,
  retries after crashes (each resumes from the last DCP checkpoint) but not after bad input.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from dinov3_core import faults, tracking
from dinov3_core import manifest as mf
from dinov3_core.config import load_config, save_config, to_yaml
from dinov3_core.errors import WsidinoError
from dinov3_core.stages import IN_PROCESS, STAGE_SPECS, StageSpec, manifest_guard
from tasks.launch import TorchrunFailed, TorchrunJob, run_torchrun
from tasks.params import LaunchParams
from tasks.tracking import current_pipeline_run, find_stage_run, stage_mlflow_run

LAUNCH_CONFIG = "launch_config.yaml"  # the resolved config a torchrun job is started with (in its output dir)
TRAINING_MODULES = {"pretrain": "dinov3_core.train", "gram": "dinov3_core.gram"}


def load_stage_config(stage: str, config: str | None, values: Mapping[str, Any]) -> Any:
    """The stage's typed config: schema defaults ← named config or YAML ← `values` (checked key by key)."""
    return load_config(STAGE_SPECS[stage].schema(), config, dict(values), stage=stage)


# ------------------------------------------------------------------------------------------------ manifests


def lineage_tags(lineage: Mapping[str, str]) -> dict[str, str]:
    return {f"wsidino.lineage.{stage}_run_id": run_id for stage, run_id in lineage.items()}


def _markdown(stage: str, status: str, reason: str, m: mf.StageManifest | None, path: Path) -> str:
    lines = [f"# {stage}: {status}", "", reason, "", f"Manifest: `{path}`"]
    if m is not None:
        if m.mlflow_run_id:
            lines.append(f"MLflow run: `{m.mlflow_run_id}`")
        if m.outputs:
            lines += ["", "| output | path |", "|---|---|", *[f"| {k} | `{v}` |" for k, v in m.outputs.items()]]
        if m.summary:
            lines += ["", "| figure | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in m.summary.items()]]
        if m.lineage:
            lines += ["", "Lineage: " + ", ".join(f"{k} `{v}`" for k, v in m.lineage.items())]
    return "\n".join(lines) + "\n"


def _artifact(stage: str, body: str) -> None:
    with contextlib.suppress(Exception):  # outside a Prefect run (plain Python) there is nowhere to publish
        create_markdown_artifact(body, key=f"{stage}-stage", description=f"{stage} stage outcome")


def record_skip(spec: StageSpec, cfg: Any, decision: mf.Decision) -> dict[str, Any]:
    """A stage found up to date: log it, give the pipeline run a FINISHED child that points at the reused run."""
    previous = decision.previous
    assert previous is not None
    get_run_logger().info("%s: up to date (%s); skipped. Force it to recompute.", spec.name, decision.reason)
    path = spec.manifest_path(cfg)
    parent = current_pipeline_run()
    # A retried pipeline run already has this stage's child run (it completed in an earlier attempt).
    if parent and cfg.tracking.enabled and not find_stage_run(cfg.tracking, parent, spec.name, unfinished=False):
        tags = {
            "wsidino.status": "skipped",
            "wsidino.reused_run_id": previous.mlflow_run_id or "",
            **lineage_tags(previous.lineage),
        }
        with stage_mlflow_run(cfg.tracking, spec.name, tags=tags) as run:
            if run is not None:
                tracking.log_artifact(path, "manifest")
    _artifact(spec.name, _markdown(spec.name, "skipped", decision.reason, previous, path))
    return outcome(spec.name, "skipped", decision.reason, path, previous)


def outcome(stage: str, status: str, reason: str, path: Path, m: mf.StageManifest) -> dict[str, Any]:
    """What a stage task returns (JSON-able: it is shown in the UI and returned by the flows)."""
    return {
        "stage": stage,
        "status": status,
        "reason": reason,
        "manifest": str(path),
        "outputs": dict(m.outputs),
        "mlflow_run_id": m.mlflow_run_id,
        "lineage": dict(m.lineage),
        "summary": dict(m.summary),
    }


# ----------------------------------------------------------------------------------------- in-process stages


def _log_stage_artifacts(stage: str, cfg: Any) -> None:
    """The resolved config, and pictures worth a look in MLflow, beyond what the stage logs itself."""
    import mlflow

    mlflow.log_text(to_yaml(cfg), f"config/{stage}.yaml")
    if stage == "extract":
        for png in sorted(Path(cfg.output).glob("slides/*/pca.png"))[:50]:
            tracking.log_artifact(png, f"pca/{png.parent.name}")


def _tag_model_version(summary: Mapping[str, Any], lineage: Mapping[str, str], cfg: Any) -> None:
    """The registered ONNX model version carries the run ids it came from (registry → training → tiles)."""
    if not summary.get("model_version"):
        return
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    for key, value in {**lineage_tags(lineage), "wsidino.weights": str(cfg.weights)}.items():
        client.set_model_version_tag(summary["registered_model"], summary["model_version"], key, value)


# ------------------------------------------------------------------------------------------- training stages


def _training_summary(stage: str, cfg: Any) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    summary: dict[str, Any] = {}
    metrics = out / "training_metrics.json"
    if metrics.is_file():
        lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
        if lines:
            last = json.loads(lines[-1])
            summary["iteration"] = last.get("iteration")
            for key in ("total_loss", "images_per_s", "max_rss_mb", "gram_loss"):
                if isinstance(last.get(key), int | float):
                    summary[key] = round(float(last[key]), 4)
    selection = out / "gram_teacher_selection.json"
    if stage == "gram" and selection.is_file():
        chosen = json.loads(selection.read_text()).get("chosen", {})
        summary["gram_teacher"] = chosen.get("path")
        summary["gram_teacher_iteration"] = chosen.get("iteration")
    return summary


def torchrun_job(stage: str, cfg: Any, launch: LaunchParams, env: Mapping[str, str]) -> TorchrunJob:
    """The torchrun job of a training stage: the resolved config is written to `<output_dir>/launch_config.yaml`
    and every rank loads it, so ranks, retries and the manifest all see one config."""
    out = Path(cfg.output_dir)
    cfg_path = save_config(cfg, out / LAUNCH_CONFIG)
    return TorchrunJob(
        module=TRAINING_MODULES[stage],
        args=["--config", str(cfg_path)],
        nproc_per_node=launch.nproc_per_node,
        nnodes=launch.nnodes,
        rdzv_endpoint=launch.rdzv_endpoint,
        rdzv_id=f"wsidino-{stage}-{out.name}",
        cuda_visible_devices=launch.cuda_visible_devices,
        env=dict(env),
        log_dir=out / "torchrun_logs",
        timeout_s=launch.timeout_hours * 3600 if launch.timeout_hours else None,
    )


@contextlib.contextmanager
def gpu_slots(launch: LaunchParams) -> Iterator[None]:
    """Occupy `nproc_per_node` slots of the named global concurrency limit while the job runs (queue otherwise)."""
    if not launch.gpu_slots:
        yield
        return
    from prefect.concurrency.sync import concurrency

    get_run_logger().info("waiting for %d slot(s) of %r", launch.nproc_per_node, launch.gpu_slots)
    with contextlib.ExitStack() as stack:
        try:  # strict: a misspelled limit must not mean "unlimited"
            stack.enter_context(concurrency(launch.gpu_slots, occupy=launch.nproc_per_node, strict=True))
        except Exception as err:
            raise WsidinoError(
                f"launch.gpu_slots={launch.gpu_slots!r}: no such global concurrency limit on the Prefect server "
                f"({err}); create it with `prefect gcl create {launch.gpu_slots} --limit <GPUs>` or leave it empty"
            ) from err
        yield


def _launch_training(stage: str, cfg: Any, launch: LaunchParams, run: Any) -> dict[str, Any]:
    from tasks.tracking import mlflow_run_env

    logger = get_run_logger()
    env = {**mlflow_run_env(run, cfg.tracking)}
    if faults.ENV in os.environ:
        env[faults.ENV] = os.environ[faults.ENV]
    job = torchrun_job(stage, cfg, launch, env)
    logger.info("%s: torchrun %d process(es) × %d node(s), logs in %s", stage, job.nproc_per_node, job.nnodes,
                job.log_dir)  # fmt: skip
    with gpu_slots(launch):
        run_torchrun(job, log=logger.info)
    return _training_summary(stage, cfg)


def is_retriable(task: Any, task_run: Any, state: Any) -> bool:
    """Retry crashes (a killed rank, a lost node, NCCL errors); not bad input and not the wall-clock limit."""
    try:
        state.result()
    except TorchrunFailed as err:
        return not err.timed_out and err.rank_exit_code != 2  # torchrun itself always exits 1
    except WsidinoError:
        return False
    except Exception:
        return True
    return False


# ----------------------------------------------------------------------------------------------------- task


@task(name="run-stage", task_run_name="{stage}", cache_policy=NO_CACHE, persist_result=False, retry_delay_seconds=5)
def run_stage(stage: str, cfg: Any, force: bool = False, launch: LaunchParams | None = None) -> dict[str, Any]:
    """Run one stage under its manifest (skip when up to date), in its own MLflow run.

    Args:
        stage: One of tile's successors: pretrain, gram, convert, export, extract.
        cfg: The stage's typed config (`load_stage_config`).
        force: Run even when the manifest says the outputs are up to date.
        launch: torchrun settings (training stages).

    Returns:
        The outcome: status (ran / skipped), why, outputs, MLflow run id, lineage and summary figures.
    """
    spec = STAGE_SPECS[stage]
    logger = get_run_logger()
    path = spec.manifest_path(cfg)
    inputs, decision = spec.decide(cfg)
    if decision.up_to_date and not force:
        return record_skip(spec, cfg, decision)
    reason = "forced" if decision.up_to_date else decision.reason
    logger.info("%s: running (%s)", stage, reason)
    with manifest_guard(spec, cfg, inputs) as m:
        tags = {
            "wsidino.output": str(Path(spec.output(cfg)).resolve()),
            **lineage_tags(m.lineage),
            **{f"wsidino.input.{k}": v["path"] for k, v in inputs.items()},
        }
        previous = decision.previous
        retry_of = (
            previous.mlflow_run_id
            if previous is not None and previous.status != "complete" and previous.config_hash == m.config_hash
            else None
        )  # a retry of a failed attempt keeps its MLflow run
        with stage_mlflow_run(cfg.tracking, stage, tags=tags, resume_run_id=retry_of) as run:
            m.mlflow_run_id = run.info.run_id if run is not None else None
            mf.write_manifest(path, m)  # a crash mid-run still leaves the run id on record
            if spec.distributed:
                m.summary = _launch_training(stage, cfg, launch or LaunchParams(), run)
            else:
                faults.maybe_fail(stage, Path(spec.manifest_path(cfg)).parent)
                _, m.summary = IN_PROCESS[stage](cfg)
                if run is not None:
                    _log_stage_artifacts(stage, cfg)
            if run is not None and stage == "export":
                _tag_model_version(m.summary, m.lineage, cfg)
    if run is not None:
        _log_final_manifest(cfg, m.mlflow_run_id, path)
    _artifact(stage, _markdown(stage, "ran", reason, m, path))
    return outcome(stage, "ran", reason, path, m)


def _log_final_manifest(cfg: Any, run_id: str | None, path: Path) -> None:
    if not run_id:
        return
    from mlflow import MlflowClient

    with contextlib.suppress(Exception):
        MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking)).log_artifact(run_id, str(path), "manifest")


def run_training_stage(stage: str, cfg: Any, launch: LaunchParams, force: bool = False) -> dict[str, Any]:
    """`run_stage` for pretrain / gram with the launch's retries (crashes only; each retry resumes)."""
    retrying = run_stage.with_options(retries=launch.retries, retry_condition_fn=is_retriable)
    return retrying(stage, cfg, force=force, launch=launch)


__all__ = [
    "LAUNCH_CONFIG",
    "is_retriable",
    "lineage_tags",
    "load_stage_config",
    "outcome",
    "record_skip",
    "run_stage",
    "run_training_stage",
    "torchrun_job",
]
