"""The Prefect task that runs one stage: `dinov3_core.runner.run_stage` plus what only Prefect has.

    run_stage_task("export", cfg)              # in the flow-run process → StageOutcome (typed summary)
    run_job_stage("pretrain", cfg, launch)     # torchrun job, retried after crashes

The skip decision, the manifest, the MLflow run and the torchrun launch are `dinov3_core.runner`'s; this module
adds:

* the Prefect run logger as the log, the flow run's tags on the MLflow run, nesting under the pipeline's run;
* GPU slots: a strict Prefect global concurrency limit held while a torchrun job runs;
* a markdown artifact per stage; for tile, a progress artifact that follows the tiles and a per-slide table; for
  pretrain and gram, a progress artifact that follows the iterations and a markdown artifact with the latest
  health figures, then the verdict (`<output_dir>/training_metrics.json` read as it grows), and the verdict as
  the flow run's final message (`training_flow_result`); for evaluate, the evaluation table with the decision;
* retries of training stages after crashes (not after bad input or the wall-clock limit).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from dinov3_core import tracking
from dinov3_core.config import load_config
from dinov3_core.errors import WsidinoError
from dinov3_core.launch import TorchrunFailed
from dinov3_core.launch.training import LaunchSettings
from dinov3_core.runner import StageOutcome, run_stage
from dinov3_core.stages import RunHooks, Stage, get_stage
from tasks.launch_k8s import KubernetesRunner
from tasks.launch_params import KubernetesLaunch, SlurmLaunch
from tasks.launch_slurm import SlurmRunner
from tasks.tracking import current_pipeline_run, mlflow_run_name, nested_under, prefect_run_tags


def load_stage_config(stage: str, config: str | None, values: Mapping[str, Any]) -> Any:
    """The stage's typed config: schema defaults ← named config or YAML ← `values` (checked key by key)."""
    return load_config(get_stage(stage).schema(), config, dict(values), stage=stage)


@contextlib.contextmanager
def gpu_slots(launch: LaunchSettings) -> Iterator[None]:
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


@contextlib.contextmanager
def core_logs_to(run_logger: Any) -> Iterator[None]:
    """`dinov3_core`'s own log lines (INFO and up: progress with rate and ETA, skipped slides, warnings) into the
    Prefect run log while a stage runs in this process; Prefect only captures its own loggers by default."""
    core = logging.getLogger("dinov3_core")

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            with contextlib.suppress(Exception):
                run_logger.log(record.levelno, "%s", record.getMessage())

    handler, level = Forward(logging.INFO), core.level
    core.addHandler(handler)
    if core.getEffectiveLevel() > logging.INFO:
        core.setLevel(logging.INFO)
    try:
        yield
    finally:
        core.removeHandler(handler)
        core.setLevel(level)


class _ProgressArtifact:
    """A Prefect progress artifact `<stage>-progress` over tiles (tile: tiles written; extract: tiles embedded)."""

    def __init__(self, stage: str, description: str) -> None:
        self.key, self.description = f"{stage}-progress", description
        self.progress_id: Any = None
        self.last = -1.0

    def progress(self, done: int, planned: int) -> None:
        percent = round(100.0 * done / planned, 1) if planned else 0.0
        if percent == self.last:
            return
        self.last = percent
        with contextlib.suppress(Exception):  # a failed artifact update must never fail the stage
            if self.progress_id is None:
                self.progress_id = create_progress_artifact(percent, key=self.key, description=self.description)
            else:
                update_progress_artifact(self.progress_id, percent)


class _TileArtifacts(_ProgressArtifact):
    """Prefect artifacts of a tile run: a progress bar over planned tiles and, at the end, one row per slide."""

    def __init__(self, store: str) -> None:
        super().__init__("tile", f"Tiles written into {store}")
        self.store = store

    def on_slide(self, outcome: Any) -> None:
        logger = get_run_logger()
        if outcome.status == "failed":
            logger.warning("slide %s failed: %s", outcome.slide_id, outcome.error)
        else:
            where = f"on {outcome.tiled_by}" if outcome.tiled_by else f"{outcome.workers} worker(s)"
            logger.info(
                "slide %s %s: %d tiles in %.1f s, %s",
                outcome.slide_id,
                outcome.status,
                outcome.tile_count,
                outcome.seconds,
                where,
            )

    def finish(self, result: Any) -> None:
        from dinov3_core.tiling import report

        self.progress(1, 1)
        create_table_artifact(
            report.summary_rows(result), key="tile-summary", description=f"Slides of tile store {self.store}"
        )
        for line in report.format_summary(result).splitlines():
            get_run_logger().info(line)


class _TrainingArtifacts:
    """Prefect artifacts of a pretrain / gram job: a progress bar over its iterations and a markdown table of the
    latest health figures, then the verdict. Fed from `<output_dir>/training_metrics.json` (the records rank 0
    writes before it prints their console line), read incrementally whenever a console line arrives: no thread
    of its own, and the file, not the console text, is what gets parsed. Nothing here may fail the training."""

    FIGURES = ("dino_gap", "teacher_entropy", "agreement", "effective_rank", "invariance")
    MARKDOWN_EVERY_S = 120.0  # between health tables without a new probe point (each one is a new version)

    def __init__(self, stage: str, cfg: Any) -> None:
        self.stage = stage
        self.path = Path(cfg.output_dir) / "training_metrics.json"
        total = cfg.optim.epochs * cfg.train.epoch_length
        self.total = min(total, cfg.train.stop_at or total)
        self.offset, self.partial = 0, ""
        self.latest: dict[str, Any] = {}
        self.probe: dict[str, Any] = {}
        self.progress_id: Any = None
        self.health_id: Any = None
        self.percent = -1.0
        self.read_at = self.markdown_at = 0.0

    def wrap(self, log: Callable[[str], None]) -> Callable[[str], None]:
        def log_and_follow(line: str) -> None:
            log(line)
            with contextlib.suppress(Exception):  # a failed artifact update must never fail the training
                self.follow()

        return log_and_follow

    def follow(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.read_at < 1.0:
            return
        self.read_at = now
        new_probe = self._read()
        if not self.latest:
            return
        percent = round(min(100.0, 100.0 * (self.latest["iteration"] + 1) / self.total), 1)
        if percent != self.percent:
            self.percent = percent
            if self.progress_id is None:
                self.progress_id = create_progress_artifact(
                    percent, key=f"{self.stage}-progress", description=f"{self.stage}: iterations done"
                )
            else:
                update_progress_artifact(self.progress_id, percent)
        if new_probe or not self.markdown_at or now - self.markdown_at > self.MARKDOWN_EVERY_S:
            self.markdown_at = now
            self._publish(None)

    def finish(self, verdict: str | None) -> None:
        with contextlib.suppress(Exception):
            self.follow(force=True)
            self._publish(verdict)

    def _read(self) -> bool:
        """New complete lines since the last read (from the start again when a resume truncated the file)."""
        if not self.path.is_file():
            return False
        size = self.path.stat().st_size
        if size < self.offset:
            self.offset, self.partial = 0, ""
        with self.path.open() as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        *lines, self.partial = (self.partial + chunk).split("\n")
        new_probe = False
        for line in filter(str.strip, lines):
            record = json.loads(line)
            if "event" in record:  # a memory re-plan, not a step: its figures are on the step lines
                continue
            self.latest = record
            if isinstance(record.get("effective_rank"), int | float):
                self.probe, new_probe = record, True
        return new_probe

    def _publish(self, verdict: str | None) -> None:
        r, p = self.latest, self.probe
        rows = [f"| iteration | {r.get('iteration', '–')} of {self.total} |"]
        rows += [f"| {k} | {_fmt((p if k in ('effective_rank', 'invariance') else r).get(k))} |" for k in self.FIGURES]
        if p:
            rows.append(f"| probe measured at | iteration {p['iteration']} |")
        head = [f"# {self.stage}: is it learning?", "", verdict or "Training: the verdict comes at the end.", ""]
        text = "\n".join([*head, "| figure | latest |", "|---|---|", *rows]) + "\n"
        if self.health_id is None:  # one artifact per stage, updated in place: not a new version per checkpoint
            self.health_id = create_markdown_artifact(
                text, key=f"{self.stage}-health", description=f"{self.stage}: training health"
            )
        else:
            with get_client(sync_client=True) as client:
                client.update_artifact(self.health_id, ArtifactUpdate(data=text))


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "–" if value is None else str(value)


def _markdown(o: StageOutcome[Any], cfg: Any) -> str:
    m = o.manifest
    lines = [f"# {o.stage}: {o.status}", "", o.reason, "", f"Manifest: `{o.manifest_path}`"]
    evidence = getattr(o.summary, "evidence", None)  # evaluate: gate.evidence_line, as the pipeline prints it
    if evidence:
        lines[2:2] = [f"**{evidence}**", ""]
    if m.mlflow_run_id:
        url = tracking.run_ui_url(cfg.tracking, m.mlflow_run_id)
        lines.append(f"MLflow run: [{m.mlflow_run_id}]({url})" if url else f"MLflow run: `{m.mlflow_run_id}`")
    if m.outputs:
        lines += ["", "| output | path |", "|---|---|", *[f"| {k} | `{v}` |" for k, v in m.outputs.items()]]
    figures = o.summary.to_json()
    if figures:
        lines += ["", "| figure | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in figures.items()]]
    if m.lineage:
        lines += ["", "Lineage: " + ", ".join(f"{k} `{v}`" for k, v in m.lineage.items())]
    return "\n".join(lines) + "\n"


@task(name="run-stage", task_run_name="{stage}", cache_policy=NO_CACHE, persist_result=False, retry_delay_seconds=5)
def run_stage_task(
    stage: str, cfg: Any, force: bool = False, launch: LaunchSettings | None = None, run_groups: Any = None
) -> StageOutcome[Any]:
    """Run one stage under its manifest (skip when up to date), in its own MLflow run.

    Args:
        stage: tile, pretrain, gram, convert, export, evaluate or extract.
        cfg: The stage's typed config (`load_stage_config`).
        force: Run even when the manifest says the outputs are up to date.
        launch: torchrun settings (training stages; extract, and evaluate's embedding, when it asks for more than
            one process).
        run_groups: tile: where slide groups are tiled (`tasks.tile_groups.DaskSlideGroups`); None: the engine's
            own process pool.

    Returns:
        The outcome: status (ran / skipped), why, the manifest (outputs, MLflow run id, lineage) and the typed
        summary; a flow returns its `as_dict()`.
    """
    logger = get_run_logger()
    run_job = cluster_runner(launch)
    spec = get_stage(stage)
    tile = _TileArtifacts(str(cfg.output)) if spec.reports_slides else None  # slides as they are tiled
    shows = spec.shows_progress(launch) and tile is None
    extract = _ProgressArtifact(stage, f"Tiles embedded into {cfg.output}") if shows else None
    training = _TrainingArtifacts(stage, cfg) if spec.always_job else None  # iterations and health
    hooks = RunHooks(
        log=training.wrap(logger.info) if training else logger.info,
        parent_run_id=current_pipeline_run(),
        tags=prefect_run_tags(stage),
        run_name=mlflow_run_name(stage),
        # On a cluster its scheduler places the job and counts its GPUs: no Prefect GPU slots are held for it.
        hold_resources=gpu_slots if run_job is None else None,
        run_job=run_job,
        progress=(tile or extract).progress if (tile or extract) else None,
        on_slide=tile.on_slide if tile else None,
        run_groups=run_groups,
    )
    with core_logs_to(logger):
        outcome = run_stage(spec, cfg, force=force, launch=launch, hooks=hooks)
    if training is not None and outcome.status == "ran":
        training.finish(outcome.summary.health)
    if tile is not None and outcome.result is not None:
        tile.finish(outcome.result)
    if spec.review is not None and outcome.result is not None:  # what a reviewer reads first
        with contextlib.suppress(Exception):
            create_markdown_artifact(spec.review(outcome.result), key=stage, description=f"{stage}: read this first")
    with contextlib.suppress(Exception):  # outside a Prefect run (plain Python) there is nowhere to publish
        create_markdown_artifact(_markdown(outcome, cfg), key=f"{stage}-stage", description=f"{stage} stage outcome")
    return outcome


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


def cluster_runner(launch: LaunchSettings | None) -> Callable[..., None] | None:
    """What runs a stage's torchrun job for the launch's backend: SLURM, Kubernetes, or None: torchrun here (a
    `LocalLaunch`, or the plain `LaunchSettings` of a caller outside the forms)."""
    if isinstance(launch, SlurmLaunch):
        return SlurmRunner(launch.slurm)
    if isinstance(launch, KubernetesLaunch):
        return KubernetesRunner(launch.kubernetes)
    return None


def run_job_stage(stage: str, cfg: Any, launch: LaunchSettings, force: bool = False) -> StageOutcome[Any]:
    """`run_stage_task` for a stage that runs as a torchrun job (pretrain, gram; extract on several processes) with
    the launch's retries (crashes only, not bad input; each retry resumes: training from its checkpoint, extract
    with the slides not yet committed)."""
    retrying = run_stage_task.with_options(retries=launch.retries, retry_condition_fn=is_retriable)
    return retrying(stage, cfg, force=force, launch=launch)


def prefect_stage_runner(launch: LaunchSettings) -> Callable[..., StageOutcome[Any]]:
    """The `StageRunner` of a cycle or a pipeline flow: each stage as the `run-stage` task (a torchrun job with the
    launch's crash retries), its MLflow run nested under the cycle's or pipeline's."""

    def run(stage: Stage[Any], cfg: Any, parent: str | None, force: bool = False) -> StageOutcome[Any]:
        with nested_under(parent, cfg.tracking):
            if stage.as_job(launch):
                return run_job_stage(stage.name, cfg, launch, force=force)
            return run_stage_task(stage.name, cfg, force=force, launch=launch)  # evaluate: its embedding job

    return run


def training_flow_result(outcome: StageOutcome[Any]) -> Any:
    """What a pretrain / gram flow returns: the outcome, in a Completed state whose message is the health verdict
    (`health.policy=warn` lets a run that does not learn complete: the flow run then ends saying so). Callers of
    the flow, subflow calls included, still get the outcome dict."""
    from prefect.states import Completed

    verdict = outcome.summary.health
    if not verdict:
        return outcome.as_dict()
    return Completed(message=f"{outcome.stage}: {verdict}"[:4000], data=outcome.as_dict())


__all__ = [
    "gpu_slots",
    "is_retriable",
    "load_stage_config",
    "prefect_stage_runner",
    "run_job_stage",
    "run_stage_task",
    "training_flow_result",
]
