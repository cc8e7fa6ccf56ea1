"""The stage runner: one stage, under its stage manifest, in its MLflow run. The CLI, the chains (pipeline,
retrain) and the Prefect tasks all call `run_stage`; none has a skip rule, a launcher or an MLflow nesting rule of
its own.

    outcome = run_stage("export", cfg)                                              # in this process
    outcome = run_stage("pretrain", cfg, launch=LaunchSettings(nproc_per_node=2))   # a torchrun job
    outcome.summary.model_version                                                   # typed (ExportSummary)

What every stage gets from here (the stage modules, `dinov3_core.stages`, know nothing of it):

* **skip**: the manifest (`dinov3_core.manifest`) shows the same config hash and input fingerprints and the
  outputs exist → nothing runs (unless `force`); inside a chain the skip is recorded as a child run that points at
  the reused one;
* **one MLflow run per stage, owned here**: opened before the work and active while it runs (an in-process stage
  logs into it), nested under the chain's run when there is one (`RunHooks.parent_run_id`), tagged with its
  lineage, inputs and output, carrying the manifest; a retry of a failed attempt reopens that attempt's run. A
  torchrun job gets the run's id in its environment, and only its rank 0's `__main__` joins it;
* **the manifest**: `running` while the stage runs, `failed` with the error, `complete` with outputs and an output
  fingerprint after it; one run per output at a time (a lock beside the manifest);
* **a torchrun job** for the stages that always are one (pretrain, gram), and for extract when the launch asks for
  more than one process (`Stage.as_job`); everything else runs `Stage.work` in this process;
* the ``stage.start`` event (`dinov3_core.events`) for fault drills.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from dinov3_core import checksums, events, tracking
from dinov3_core import manifest as mf
from dinov3_core.config import describe_changes
from dinov3_core.config_tree import flat_params, to_yaml
from dinov3_core.errors import RunStopped, WsidinoError
from dinov3_core.launch import TorchrunFailed, run_torchrun
from dinov3_core.launch.training import LaunchSettings
from dinov3_core.stages import RunHooks, Stage, StageName, Summary, get_stage

S = TypeVar("S", bound=Summary)


@dataclass
class StageOutcome(Generic[S]):
    """What one `run_stage` call did: ran or skipped, why, the manifest now on disk and its summary, typed."""

    stage: str
    status: Literal["ran", "skipped"]
    reason: str
    manifest_path: Path
    manifest: mf.StageManifest
    summary: S
    result: Any = None  # the stage function's own result object (in-process stages that ran)

    @property
    def mlflow_run_id(self) -> str | None:
        return self.manifest.mlflow_run_id

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: what the Prefect flows return and the UI shows (the only place an outcome becomes a dict)."""
        m = self.manifest
        return {
            "stage": self.stage,
            "status": self.status,
            "reason": self.reason,
            "manifest": str(self.manifest_path),
            "outputs": dict(m.outputs),
            "mlflow_run_id": m.mlflow_run_id,
            "lineage": dict(m.lineage),
            "summary": self.summary.to_json(),
        }


def default_tracking_store(spec: Stage[Any], cfg: Any) -> None:
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


def run_stage(
    stage: Stage[S] | StageName,
    cfg: Any,
    *,
    force: bool = False,
    launch: LaunchSettings | None = None,
    hooks: RunHooks | None = None,
) -> StageOutcome[S]:
    """Run one stage under its manifest unless it is up to date, in its own MLflow run.

    Args:
        stage: A `Stage` (`dinov3_core.stages`), or its name.
        cfg: The stage's typed config (`dinov3_core.config.load_config`).
        force: Run even when the manifest says the outputs are up to date.
        launch: torchrun settings (training stages; extract and evaluate's embedding when more than one process;
            default: one process on this node).
        hooks: Logging, MLflow nesting and callbacks from the caller.

    Raises:
        WsidinoError: Bad input (naming the key or file); `TorchrunFailed`: a training job failed.
    """
    spec = get_stage(stage)
    stage = spec.name
    hooks = hooks or RunHooks()
    if launch is not None:  # in-process stages see it too: evaluate embeds as a job on several processes
        hooks = dataclasses.replace(hooks, launch=launch)
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
            **mf.lineage_tags(m.lineage),
            **{f"wsidino.input.{k}": v["path"] for k, v in inputs.items()},
        }
        background = spec.log_after_work is not None
        # A background stage's parameters are logged by the thread that opens its run, beside the work.
        params = flat_params(cfg) if background else None
        summary: Summary
        with _stage_mlflow_run(cfg.tracking, stage, hooks, tags, retry_of, background, params) as pending:

            def record_run() -> Any:
                run = pending.wait()
                m.mlflow_run_id = run.info.run_id if run is not None else None
                mf.write_manifest(path, m)  # a crash mid-run still leaves the run id on record
                return run

            run = None if background else record_run()
            as_job = spec.as_job(launch)
            events.emit("stage.start", stage=stage, output=str(path.parent), training=as_job)
            if as_job:
                summary = _run_job(spec, cfg, launch or LaunchSettings(), run, hooks)
            else:
                assert spec.work is not None, f"{stage} runs only as a torchrun job"
                try:
                    result, summary = spec.work(cfg, hooks)
                except BaseException:
                    if background:
                        with contextlib.suppress(Exception):  # the stage's error is the one to report
                            record_run()
                    raise
                if background:
                    run = record_run()
                if run is not None and spec.log_after_work is not None:
                    spec.log_after_work(cfg, result)
            m.summary = summary.to_json()
            if run is not None:
                if not spec.always_job:
                    _log_stage_artifacts(spec, cfg)
                if spec.after_run is not None:
                    spec.after_run(cfg, m)
            # State inputs (a registry alias) are recorded as the run leaves them: a promotion is the run's own
            # output, and only a later change by someone else should make a rerun necessary.
            states = {k: v for k, v in spec.inputs(cfg).items() if isinstance(v, mf.StateInput)}
            m.inputs.update(mf.fingerprint_inputs(states))
    tracking.log_artifact_to(cfg.tracking, m.mlflow_run_id if cfg.tracking.enabled else None, path, "manifest")
    return StageOutcome(stage, "ran", reason, path, m, spec.summary(m.summary), result)


@contextlib.contextmanager
def manifest_guard(spec: Stage[Any], cfg: Any, inputs: dict[str, dict[str, str]]) -> Iterator[mf.StageManifest]:
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
        # One run per output: a second one fails at once naming the holder (OutputBusy, so nothing here is removed).
        with mf.output_lock(path):
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
            m.artifacts = checksums.record_artifacts(m.outputs)  # what a skip decision and the next stage check
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
    ) as pending:
        yield pending


def _record_skip(spec: Stage[S], cfg: Any, decision: mf.Decision, hooks: RunHooks) -> StageOutcome[S]:
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
            **mf.lineage_tags(previous.lineage),
        }
        quiet = dataclasses.replace(cfg.tracking, system_metrics=False)  # a record, not a workload to monitor
        with _stage_mlflow_run(quiet, spec.name, hooks, tags, None) as pending:
            if pending.wait() is not None:
                tracking.log_artifact(path, "manifest")
    return StageOutcome(spec.name, "skipped", decision.reason, path, previous, spec.summary(previous.summary))


def _run_job(spec: Stage[S], cfg: Any, launch: LaunchSettings, run: Any, hooks: RunHooks) -> S:
    """The stage as a torchrun job (rank 0 joins `run`); returns the summary kept in the manifest."""
    job = spec.torchrun_job(cfg, launch, env=tracking.run_env(run, cfg.tracking))
    hooks.log(f"{spec.name}: torchrun {job.nproc_per_node} process(es) × {job.nnodes} node(s), logs in {job.log_dir}")
    guard = hooks.hold_resources(launch) if hooks.hold_resources is not None else contextlib.nullcontext()
    log = hooks.log
    if spec.job_log is not None and hooks.progress is not None:
        log = spec.job_log(cfg, hooks)  # its ranks' progress with each line rank 0 prints
    with guard:
        (hooks.run_job or run_torchrun)(job, log=log)
    assert spec.job_summary is not None
    return spec.job_summary(cfg)


def _log_stage_artifacts(spec: Stage[Any], cfg: Any) -> None:
    """The resolved config, and pictures worth a look, into the stage's MLflow run (active in this thread)."""
    import mlflow  # deferred: a slow import (docs/benchmarks.md), only reached with a run open

    if mlflow.active_run() is None:
        return
    mlflow.log_text(to_yaml(cfg), f"config/{spec.name}.yaml")
    for path, folder in spec.mlflow_artifacts(cfg) if spec.mlflow_artifacts is not None else []:
        tracking.log_artifact(path, folder)


__all__ = ["OutputsMissing", "RunHooks", "StageOutcome", "default_tracking_store", "manifest_guard", "run_stage"]
