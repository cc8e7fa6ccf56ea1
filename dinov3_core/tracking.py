"""MLflow glue shared by every stage (plain MLflow; Prefect-specific tagging lives in `tasks/`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core import tracking_runs
from dinov3_core.config_tree import flat_params
from dinov3_core.tracking_store import artifact_location, ensure_store

# Every function imports mlflow where it needs it (deferred: a slow import, docs/benchmarks.md): this module is
# imported by the stage runner and the CLI, which must stay light when tracking is off.

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"

# MLflow's routine chatter (system-metrics monitor start/stop on every run, database set-up) is not news to a user;
# its warnings and errors still show.
for _name in ("mlflow.system_metrics", "mlflow.store.db.utils", "alembic.runtime.migration"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@dataclass
class TrackingConfig:
    enabled: bool = True
    # null → $MLFLOW_TRACKING_URI, else the mlflow.db of the output's work directory (`run.default_tracking_store`)
    uri: str | None = None
    experiment: str = "wsidino"
    system_metrics: bool | None = None  # CPU/GPU/memory every 10 s; null → $MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING


def tracking_uri(cfg: TrackingConfig) -> str:
    return cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


class PendingRun:
    """An MLflow run that may still be opening on a background thread.

    Importing MLflow and setting up its SQLite store take a while (docs/benchmarks.md, tile stage); a stage that logs
    only after its work (tile) lets that happen beside the work. `wait()` returns the run (None when tracking is off),
    active in the calling thread; a failure to open it is raised there.
    """

    def __init__(self, open_run: Any = None, *, run: Any = None, system_metrics: bool | None = None) -> None:
        self._run, self._run_id, self._error = run, None, None
        self._system_metrics = system_metrics
        self._thread: threading.Thread | None = None
        if open_run is not None:
            self._thread = threading.Thread(target=self._open, args=(open_run,), name="mlflow-open", daemon=True)
            self._thread.start()

    def _open(self, open_run: Any) -> None:
        try:
            self._run_id = open_run()
        except BaseException as err:  # handed to the thread that waits
            self._error = err

    def wait(self) -> Any:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._error is not None:
                raise self._error
            import mlflow

            # The opening thread's active-run stack is its own (MLflow keeps it per thread): resume the run here.
            self._run = mlflow.start_run(run_id=self._run_id, log_system_metrics=self._system_metrics)
        return self._run


def _start_run(
    cfg: TrackingConfig,
    run_name: str,
    tags: Mapping[str, str] | None,
    run_id: str | None,
    parent_run_id: str | None,
    system_metrics: bool | None,
) -> Any:
    import mlflow

    uri = tracking_uri(cfg)
    ensure_store(uri)
    mlflow.set_tracking_uri(uri)
    resume = run_id or None  # the runner's run, handed down (a torchrun rank's __main__ reads $MLFLOW_RUN_ID)
    if not resume:
        ensure_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.experiment, uri)
    parent = None if resume else parent_run_id
    # A torchrun rank joining the runner's run leaves the runner as its owner; a retry in this process takes it over.
    owner = {} if resume and os.environ.get("MLFLOW_RUN_ID") == resume else tracking_runs.owner_tags()
    run = mlflow.start_run(
        run_id=resume,
        run_name=None if resume else run_name,
        parent_run_id=parent or None,
        tags={**(tags or {}), **owner},
        log_system_metrics=system_metrics,
    )
    if owner:
        tracking_runs.opened(run.info.run_id, uri)
    return run


@contextlib.contextmanager
def stage_run(
    cfg: TrackingConfig,
    run_name: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    *,
    run_id: str | None = None,
    parent_run_id: str | None = None,
) -> Iterator[Any]:
    """An MLflow run for one stage execution, or `None` when tracking is off.

    `run_id` resumes that run (a retried stage keeps one run); `parent_run_id` nests a new run under it.

    Logs into the active run when the caller (the stage runner) opened one; a torchrun rank 0 joins the runner's
    run by its id (`run_id`, which the rank's `__main__` reads from `$MLFLOW_RUN_ID`). A failure inside marks the
    run FAILED (unless the caller owns the run) and re-raises.
    """
    with pending_stage_run(cfg, run_name, params, tags, run_id=run_id, parent_run_id=parent_run_id) as pending:
        yield pending.wait()


@contextlib.contextmanager
def into_active_run(
    cfg: TrackingConfig, params: Mapping[str, Any] | None = None, tags: Mapping[str, str] | None = None
) -> Iterator[Any]:
    """The MLflow run the stage runner opened for an in-process stage, with `params` and `tags` logged into it; None
    (nothing logged) when tracking is off or the stage function was called without the runner. A stage function
    never opens a run of its own: the runner owns it (`dinov3_core.runner`)."""
    mlflow = sys.modules.get("mlflow")  # not imported yet: nobody opened a run
    active = mlflow.active_run() if cfg.enabled and mlflow is not None else None
    if active is not None:
        _log_into_active(params, tags)
    yield active


def _log_into_active(params: Mapping[str, Any] | None, tags: Mapping[str, str] | None) -> None:
    if params:
        log_params(params)
    if tags:
        _mlflow().set_tags(dict(tags))


@contextlib.contextmanager
def pending_stage_run(
    cfg: TrackingConfig,
    run_name: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    *,
    run_id: str | None = None,
    parent_run_id: str | None = None,
    background: bool = False,
) -> Iterator[PendingRun]:
    """`stage_run` as a `PendingRun`; with `background`, a new run is opened on a thread while the block runs."""
    if not cfg.enabled:
        yield PendingRun()
        return
    tracking_runs.install_sigterm()  # here, in the main thread: a background opener may not install it
    # Not imported yet: nobody opened a run, and importing it here would cost what the background saves.
    mlflow = sys.modules.get("mlflow")
    active = mlflow.active_run() if mlflow is not None else None
    if active is not None:  # the orchestration layer opened this stage's run (a pipeline child): log into it
        _log_into_active(params, tags)
        yield PendingRun(run=active)
        return

    # A broken store stops the stage before its work, not after it (a background opener would find it late);
    # creating a missing one is left to the opener.
    ensure_store(tracking_uri(cfg), create=not background)

    def open_run() -> str:
        # On the background thread MLflow's own system-metrics monitor is not started: `wait` starts it.
        run = _start_run(cfg, run_name, tags, run_id, parent_run_id, False if background else cfg.system_metrics)
        if params:
            log_params(params)
        return run.info.run_id

    if background:
        pending = PendingRun(open_run, system_metrics=cfg.system_metrics)
    else:
        open_run()
        pending = PendingRun(run=_mlflow().active_run())
    try:
        yield pending
    except BaseException:
        with contextlib.suppress(Exception):  # the stage's own error is the one to report
            pending.wait()
        _end_active("FAILED")
        raise
    else:
        pending.wait()
        _end_active("FINISHED")


def _end_active(status: str) -> None:
    """End the active run with `status`, unless the SIGTERM handler already ended it KILLED."""
    active = _mlflow().active_run()
    if active is not None:
        run_id = active.info.run_id
        _mlflow().end_run(status="KILLED" if tracking_runs.was_killed(run_id) else status)
        tracking_runs.closed(run_id)


def _mlflow() -> Any:
    import mlflow

    return mlflow


@contextlib.contextmanager
def terminated_after(client: Any, run_id: str) -> Iterator[None]:
    """End a parent run (a pipeline's, a retraining cycle's) FINISHED after the block, FAILED when it raises."""
    try:
        yield
    except BaseException:
        client.set_terminated(run_id, status="KILLED" if tracking_runs.was_killed(run_id) else "FAILED")
        raise
    else:
        client.set_terminated(run_id, status="FINISHED")
    finally:
        tracking_runs.closed(run_id)


def run_ui_url(cfg: TrackingConfig, run_id: str | None) -> str | None:
    """The run's page in the MLflow UI when tracking goes to a server (http/https); None for a local store, whose
    UI address this process cannot know."""
    return ui_url(tracking_uri(cfg), run_id)


def ui_url(uri: str | None, run_id: str | None) -> str | None:
    """`run_ui_url` for a tracking URI."""
    if not run_id or not uri or not uri.startswith(("http://", "https://")):
        return None
    from mlflow import MlflowClient

    try:
        experiment = MlflowClient(tracking_uri=uri).get_run(run_id).info.experiment_id
    except Exception:  # a link is a convenience: never fail a stage for it
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}?{ML_WORKFLOW}"


# MLflow 3.17's UI decides GenAI view (traces overview, runs filed under "Evaluations") or runs table from the
# browser's workflow type, not from the experiment: `?workflowType=` in the address, else the browser's saved choice,
# else GenAI (docs/orchestration.md#mlflow). Our links carry it; `dinov3_core.mlflow_app` serves the UI with it as
# the default. The experiment kind tag says the same to MLflow versions that read it.
ML_WORKFLOW = "workflowType=machine_learning"
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def ensure_experiment(name: str, uri: str) -> str:
    """Select the experiment, creating it with an explicit artifact location and the model-training kind the first
    time (an existing experiment without a kind gets it too)."""
    import mlflow

    ensure_store(uri)
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is None:
        # Another process may create it at the same moment; then set_experiment below finds theirs.
        with contextlib.suppress(mlflow.exceptions.MlflowException):
            mlflow.create_experiment(
                name, artifact_location=artifact_location(uri), tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
            )
    selected = mlflow.set_experiment(name)
    client = mlflow.MlflowClient(tracking_uri=uri)
    if EXPERIMENT_KIND_TAG not in selected.tags:  # created before wsidino set it, or by someone else
        with contextlib.suppress(mlflow.exceptions.MlflowException):
            client.set_experiment_tag(selected.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    tracking_runs.reap_dead(client, selected.experiment_id)  # runs a killed process left RUNNING, before ours opens
    return selected.experiment_id


@contextlib.contextmanager
def parent_run(
    cfg: TrackingConfig, run_name: str, tags: Mapping[str, str], *, reopen: str | None = None, find: str | None = None
) -> Iterator[str | None]:
    """A run that stage runs nest under (a pipeline's, a retraining cycle's), or None when tracking is off.

    Reopens `reopen` (a run id), else the first run matching the search filter `find` (a retried attempt), else
    creates one with `tags`. Ends FINISHED, or FAILED when the block raises."""
    if not cfg.enabled:
        yield None
        return
    import mlflow
    from mlflow import MlflowClient

    uri = tracking_uri(cfg)
    ensure_store(uri)
    mlflow.set_tracking_uri(uri)  # ensure_experiment works on the global URI
    client = MlflowClient(tracking_uri=uri)
    experiment = ensure_experiment(cfg.experiment, uri)
    run_id = reopen
    if run_id is None and find:
        found = client.search_runs([experiment], filter_string=find, max_results=1)
        run_id = found[0].info.run_id if found else None
    tracking_runs.install_sigterm()
    owner = tracking_runs.owner_tags()
    if run_id:
        client.update_run(run_id, status="RUNNING")
        for key, value in owner.items():
            client.set_tag(run_id, key, value)
    else:
        run_id = client.create_run(experiment, run_name=run_name, tags={**tags, **owner}).info.run_id
    tracking_runs.opened(run_id, uri)
    with terminated_after(client, run_id):
        yield run_id


def log_config_params(tracking: TrackingConfig, run_id: str | None, cfg: Any) -> None:
    """A typed config, flattened (`pretrain.config`, `trigger.min_new_slides`, …), as the params of a parent run.
    Params are write-once: a retried run skips those it already has."""
    if run_id is None:
        return
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri(tracking))
    existing = client.get_run(run_id).data.params
    for key, value in flat_params(cfg).items():
        if key not in existing:
            client.log_param(run_id, key, ("null" if value is None else str(value))[:6000])


def log_params(params: Mapping[str, Any]) -> None:
    """Log params, skipping keys that already hold a value (params are write-once in MLflow)."""
    import mlflow

    run = mlflow.active_run()
    existing = run.data.params if run is not None else {}
    fresh = {k: ("null" if v is None else str(v))[:6000] for k, v in params.items() if k not in existing}
    if fresh:
        mlflow.log_params(fresh)


def log_artifact(path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
    import mlflow

    if mlflow.active_run() is not None and Path(path).exists():
        mlflow.log_artifact(str(path), artifact_path=artifact_path)


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)


def set_tag(key: str, value: str) -> None:
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.set_tag(key, value[:5000])


STAGE_TAG = "wsidino.stage"


def find_stage_run(cfg: TrackingConfig, parent_run_id: str, stage: str, unfinished: bool = True) -> str | None:
    """A child run of `stage` under the pipeline run `parent_run_id`: with `unfinished`, one left by a failed
    attempt, which a retry resumes, so a stage keeps one MLflow run however often it is retried; otherwise any."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri(cfg))
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' and tags.`{STAGE_TAG}` = '{stage}'",
        max_results=10,
    )
    matching = [r for r in runs if r.info.status != "FINISHED" or not unfinished]
    return matching[0].info.run_id if matching else None


def run_env(run: Any, cfg: TrackingConfig) -> dict[str, str]:
    """Environment that lets a launched subprocess (torchrun rank 0) log into `run` (empty when `run` is None)."""
    if run is None:
        return {}
    return {
        "MLFLOW_RUN_ID": run.info.run_id,
        "MLFLOW_TRACKING_URI": tracking_uri(cfg),
        "MLFLOW_EXPERIMENT_ID": run.info.experiment_id,
    }


def log_artifact_to(cfg: TrackingConfig, run_id: str | None, path: str | os.PathLike[str], artifact_path: str) -> None:
    """Log a file into a run that is no longer active (the final manifest, written after the run closed)."""
    if not run_id or not Path(path).exists():
        return
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=tracking_uri(cfg)).log_artifact(run_id, str(path), artifact_path)
