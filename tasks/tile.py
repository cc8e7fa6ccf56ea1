"""Prefect tasks of the tile stage: thin wrappers around `dinov3_core.tiling`.

The flow (`flows/tile.py`) runs, in order:

1. `prepare_tile_store`: typed `TileConfig` from the parameters, store created or validated, slides listed;
2. `hold_store_lock` (in the flow process, for the rest of the run): one tiling run per store;
3. `select_slides`: under the lock, clear debris of interrupted runs, save `config.yaml`, skip done slides;
4. `run_slide_tasks`: one mapped `tile_slide` task per remaining slide, on a process pool when `workers > 1`;
5. `finalize_tile_run`: manifest (single writer), MLflow run, Prefect table + markdown artifacts.

A bad slide never fails its task: `tile_one_slide` returns a `failed` outcome with a message naming the file,
the task logs a warning, and the failure is listed in the manifest, the MLflow metrics and the artifacts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

from prefect import get_run_logger, task, unmapped
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner
from pydantic import BaseModel, ConfigDict, Field

from dinov3_core.config import flat_params, load_config, save_config
from dinov3_core.tiling import report
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.plan import SlideTask
from dinov3_core.tiling.stage import (
    SlideOutcome,
    TileResult,
    is_up_to_date,
    prepare_store,
    skipped_outcome,
    store_extras,
    tile_one_slide,
)
from tasks.params import Override, merge_values
from tasks.params import ui as _ui
from tasks.tracking import stage_mlflow_run

STAGE = "tile"
SUMMARY_ARTIFACT_KEY = "tile-summary"
REPORT_ARTIFACT_KEY = "tile-report"
PROGRESS_ARTIFACT_KEY = "tile-progress"


class TileParams(BaseModel):
    """Tile whole-slide images into a zarr tile store (µm/px-exact tiles, tissue mask, QC pictures).

    Empty fields take their value from `config` (or from the built-in defaults when no config is named):
    explicit fields win over the config file, and setting a key both here and in `overrides` is an error.
    """

    model_config = ConfigDict(extra="forbid", title="Tile stage parameters")

    input: str = Field(
        title="Slides",
        min_length=1,
        description="Slides: a directory (searched recursively), a glob, one slide file, "
        "or a .txt/.csv list of slide paths.",
        json_schema_extra=_ui(0),
    )
    output: str = Field(
        title="Tile store",
        min_length=1,
        description="Tile store directory, e.g. /data/cohort/tiles.zarr (created if missing; reruns resume).",
        json_schema_extra=_ui(1),
    )
    mpp: float | None = Field(
        title="Target µm/px",
        default=None,
        gt=0.0,
        le=64.0,
        description="Target µm/px of every tile (0.5 ≈ 20× objective). Empty: from config, default 0.5.",
        json_schema_extra=_ui(2),
    )
    tile_size: int | None = Field(
        title="Tile size (px)",
        default=None,
        ge=16,
        le=4096,
        description="Tile side in px at the target µm/px. Empty: from config, default 224.",
        json_schema_extra=_ui(3),
    )
    stride: int | None = Field(
        title="Stride (px)",
        default=None,
        ge=1,
        le=4096,
        description="Step between tiles in px at the target µm/px (< tile_size overlaps). "
        "Empty: from config, default = tile_size.",
        json_schema_extra=_ui(4),
    )
    min_tissue_fraction: float | None = Field(
        title="Minimum tissue fraction",
        default=None,
        ge=0.0,
        le=1.0,
        description="Keep a tile when at least this share of it is tissue. Empty: from config, default 0.5.",
        json_schema_extra=_ui(5),
    )
    pen_filter: bool | None = Field(
        title="Pen-ink filter",
        default=None,
        description="Drop tiles covered by pen ink. Empty: from config, default off.",
        json_schema_extra=_ui(6),
    )
    blur_filter: bool | None = Field(
        title="Blur filter",
        default=None,
        description="Drop out-of-focus tiles (Laplacian variance). Empty: from config, default off.",
        json_schema_extra=_ui(7),
    )
    compressor: Literal["zstd", "jpeg", "none"] | None = Field(
        title="Compressor",
        default=None,
        description="Tile codec: zstd (lossless), jpeg (lossy, 5-10x smaller) or none. "
        "Empty: from config, default zstd.",
        json_schema_extra=_ui(8),
    )
    workers: int | None = Field(
        title="Worker processes",
        default=None,
        ge=1,
        le=64,
        description="Slides tiled in parallel, one process each (1 = one at a time in the flow process). "
        "Empty: from config, default 1.",
        json_schema_extra=_ui(9),
    )
    config: str | None = Field(
        title="Named config or YAML",
        default=None,
        description="A config name under configs/tile/ (e.g. default, cohort-jpeg) or a path to a YAML file.",
        json_schema_extra=_ui(10),
    )
    overrides: list[Override] = Field(
        title="Config overrides",
        default_factory=list,
        description="Any other TileConfig key as key=value, e.g. tiles_per_shard=512, "
        "tissue.thumbnail_mpp=4, stride=null.",
        json_schema_extra=_ui(11),
    )
    tracking_uri: str | None = Field(
        title="MLflow tracking URI",
        default=None,
        description="MLflow tracking URI. Empty: from config, else $MLFLOW_TRACKING_URI, "
        "else sqlite:///mlflow.db in the working directory.",
        json_schema_extra=_ui(12),
    )
    experiment: str | None = Field(
        title="MLflow experiment",
        default=None,
        min_length=1,
        description="MLflow experiment name. Empty: from config, default wsidino.",
        json_schema_extra=_ui(13),
    )
    force: bool = Field(
        title="Force",
        default=False,
        description="Check every slide even when the stage manifest shows the same slides and settings "
        "(complete slides are still skipped one by one).",
        json_schema_extra=_ui(14),
    )

    def config_values(self) -> dict[str, Any]:
        """The overrides for `load_config`: the `overrides` list plus every field that is set.

        Returns:
            Dotted `TileConfig` key → value.

        Raises:
            ConfigError: A key is given both as a field and in `overrides` with different values.
        """
        fields = {
            "input": self.input,
            "output": self.output,
            "mpp": self.mpp,
            "tile_size": self.tile_size,
            "stride": self.stride,
            "tissue.min_tissue_fraction": self.min_tissue_fraction,
            "filters.pen_filter": self.pen_filter,
            "filters.blur_filter": self.blur_filter,
            "compressor": self.compressor,
            "workers": self.workers,
            "tracking.uri": self.tracking_uri,
            "tracking.experiment": self.experiment,
        }
        return merge_values(self.overrides, fields, "tile")


@dataclass(frozen=True)
class PreparedStore:
    """What `prepare_tile_store` returns: the resolved config, the store root and the slides to consider."""

    cfg: TileConfig
    root: Path
    slides: list[SlideTask]
    mpp_overrides: dict[str, float]
    started: float  # time.time() when preparation began, for the run's wall-clock seconds


@dataclass(frozen=True)
class TilePlan:
    """What `select_slides` decided under the store lock."""

    store: PreparedStore
    todo: list[SlideTask]
    skipped: list[SlideOutcome]


# ----------------------------------------------------------------------------------------------------- tasks


@task(name="prepare-tile-store", cache_policy=NO_CACHE, persist_result=False)
def prepare_tile_store(params: TileParams) -> PreparedStore:
    """Resolve the typed config, create or validate the store and list the input slides.

    Args:
        params: The flow parameters.

    Returns:
        The resolved config, store root, slides (with unique ids) and the µm/px overrides table.

    Raises:
        ConfigError: Unknown key, wrong type, missing input, or no slides found.
        TileStoreError: The output exists and is not a tile store, or is not writable.
    """
    started = time.time()
    cfg = load_config(TileConfig, params.config, params.config_values(), stage=STAGE)
    root, slides, mpp_overrides = prepare_store(cfg)
    get_run_logger().info("%d slide(s) from %s → %s", len(slides), cfg.input, root)
    return PreparedStore(cfg=cfg, root=root, slides=slides, mpp_overrides=mpp_overrides, started=started)


@contextlib.contextmanager
def hold_store_lock(root: Path) -> Iterator[Path]:
    """Hold the store's run lock in the calling (flow) process; fails at once if another run holds it.

    Args:
        root: The tile store root returned by `prepare_tile_store`.

    Yields:
        `root`.

    Raises:
        TileStoreError: Another process is writing this store.
    """
    with ts.store_lock(root):
        yield root


@task(name="select-slides", cache_policy=NO_CACHE, persist_result=False)
def select_slides(store: PreparedStore) -> TilePlan:
    """Under the store lock: drop debris of interrupted runs, save `config.yaml`, skip up-to-date slides.

    Args:
        store: The output of `prepare_tile_store`.

    Returns:
        The slides to tile and the `skipped` outcomes of the slides already complete with the same source
        file and tiling parameters.
    """
    logger = get_run_logger()
    removed = ts.clear_incoming(store.root)
    if removed:
        logger.info("removed %d unfinished slide(s) of an interrupted run: %s", len(removed), ", ".join(removed))
    save_config(store.cfg, store.root / "config.yaml")
    todo: list[SlideTask] = []
    skipped: list[SlideOutcome] = []
    for slide in store.slides:
        try:
            if is_up_to_date(store.root, slide, store.cfg, store.mpp_overrides):
                skipped.append(skipped_outcome(store.root, slide))
                continue
        except Exception as err:  # unreadable file or attrs: tiling it reports the real error
            logger.debug("up-to-date check failed for %s: %s", slide.path, err)
        todo.append(slide)
    logger.info("%d slide(s) to tile, %d up to date", len(todo), len(skipped))
    return TilePlan(store=store, todo=todo, skipped=skipped)


@task(name="tile-slide", task_run_name="tile-{slide.slide_id}", cache_policy=NO_CACHE, persist_result=False)
def tile_slide(slide: SlideTask, root: Path, cfg: TileConfig, mpp_overrides: dict[str, float]) -> SlideOutcome:
    """Tile one slide into the store and commit it atomically.

    Never raises for a bad slide: the task completes with a `failed` outcome whose error names the file, and
    logs a warning.

    Args:
        slide: Slide id and path.
        root: Tile store root (the flow holds its lock).
        cfg: The resolved tile config.
        mpp_overrides: µm/px overrides table (file name, stem or path → µm/px).

    Returns:
        The slide's outcome: `ok`, `skipped` (already complete) or `failed`.
    """
    outcome = tile_one_slide(slide, root, cfg, mpp_overrides)
    logger = get_run_logger()
    if outcome.status == "failed":
        logger.warning("slide %s failed: %s", slide.slide_id, outcome.error)
    else:
        logger.info("slide %s %s: %d tiles in %.1f s", slide.slide_id, outcome.status, outcome.tile_count,
                    outcome.seconds)  # fmt: skip
    return outcome


def slide_task_runner(workers: int, n_slides: int) -> TaskRunner[Any]:
    """The runner for the per-slide tasks.

    Args:
        workers: `TileConfig.workers`.
        n_slides: Slides to tile.

    Returns:
        `ProcessPoolTaskRunner` with `min(workers, n_slides)` processes when that is above 1 (tiling is
        CPU-bound, and `tile_one_slide` keeps module-global slide caches, so two slides must never run in
        threads of one process); otherwise a one-thread runner: one slide at a time in the flow process.
    """
    n = min(workers, n_slides)
    return ProcessPoolTaskRunner(max_workers=n) if n > 1 else ThreadPoolTaskRunner(max_workers=1)


@contextlib.contextmanager
def _share_api_with_subprocesses() -> Iterator[None]:
    """Point process-pool workers at this process's Prefect API.

    Without `PREFECT_API_URL` (ephemeral mode) every spawned worker would start its own temporary server and
    report its task runs there, invisible to this flow run. The runner passes the current settings to its
    workers, so pinning the URL of the server this process talks to while the runner is in use fixes both.
    """
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    api_url = str(get_client(sync_client=True).api_url).rstrip("/")
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        yield


def _crashed_outcome(slide: SlideTask, err: BaseException) -> SlideOutcome:
    """The outcome of a slide whose task did not complete (`tile_one_slide` itself never raises)."""
    return SlideOutcome(
        slide.slide_id,
        str(slide.path),
        "failed",
        error=f"{slide.path}: the tiling task did not complete ({type(err).__name__}: {err}); the worker "
        "process may have crashed on corrupt image data. Open the slide in a viewer or re-export it, "
        "then rerun.",
    )


def _mark_crashed(task_run_id: UUID, message: str) -> None:
    """A task whose worker process died stays `Running` on the server forever: mark it `Crashed` instead."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        if not client.read_task_run(task_run_id).state.is_final():
            client.set_task_run_state(task_run_id, Crashed(message=message), force=True)


def _finished_locally(future: Any) -> bool:
    try:
        return bool(future.state.is_final())
    except Exception:  # a future whose process died may not even report a state
        return False


def run_slide_tasks(plan: TilePlan) -> list[SlideOutcome]:
    """Run one `tile_slide` task per slide to tile and collect the outcomes (call from the flow).

    A task that does not complete (its worker process died, e.g. in a C library on corrupt image data) becomes
    a `failed` outcome and is marked `Crashed` on the server; the pool replaces the worker and the other slides
    go on. A progress artifact (`tile-progress`) follows the slides as they finish.

    Args:
        plan: The output of `select_slides`.

    Returns:
        One outcome per slide of `plan.todo`, in the same order.
    """
    todo, store = plan.todo, plan.store
    if not todo:
        return []
    logger = get_run_logger()
    progress_id = create_progress_artifact(
        0.0, key=PROGRESS_ARTIFACT_KEY, description=f"Slides tiled into {store.root}"
    )
    outcomes: dict[str, SlideOutcome] = {}
    runner = slide_task_runner(store.cfg.workers, len(todo))
    sharing = _share_api_with_subprocesses() if isinstance(runner, ProcessPoolTaskRunner) else nullcontext()
    with sharing, runner:
        futures = runner.map(
            tile_slide,
            {
                "slide": todo,
                "root": unmapped(store.root),
                "cfg": unmapped(store.cfg),
                "mpp_overrides": unmapped(store.mpp_overrides),
            },
        )
        slide_of = {future.task_run_id: slide for future, slide in zip(futures, todo, strict=True)}
        for done, future in enumerate(as_completed(list(futures)), start=1):
            slide = slide_of[future.task_run_id]
            try:
                outcomes[slide.slide_id] = future.result()
            except Exception as err:  # a crashed/failed task run, or a broken process pool
                outcome = outcomes[slide.slide_id] = _crashed_outcome(slide, err)
                logger.error("slide %s: %s", slide.slide_id, outcome.error)
                # A task that raised has a final local state already (its server state may still be in flight);
                # only a task whose process died never got one.
                if not _finished_locally(future):
                    _mark_crashed(future.task_run_id, outcome.error or "worker process died")
            update_progress_artifact(progress_id, 100.0 * done / len(todo))
    return [outcomes[s.slide_id] for s in todo]


@task(name="finalize-tile-run", cache_policy=NO_CACHE, persist_result=False)
def finalize_tile_run(plan: TilePlan, outcomes: Sequence[SlideOutcome]) -> dict[str, Any]:
    """Write the manifest, log the run to MLflow and publish the Prefect artifacts.

    The manifest is written first (it is the store's record); the Prefect artifacts are published even when
    MLflow logging fails, and the MLflow error is then re-raised so the flow run fails visibly.

    Args:
        plan: The output of `select_slides`.
        outcomes: The outcomes of the tiled slides (`run_slide_tasks`).

    Returns:
        A JSON-able summary: store path, counts per status, tiles, failed slides, MLflow run id.
    """
    store = plan.store
    by_id = {o.slide_id: o for o in [*plan.skipped, *outcomes]}
    ordered = [by_id[s.slide_id] for s in store.slides if s.slide_id in by_id]
    ts.write_manifest(store.root, [o.as_manifest_entry() for o in ordered], store_extras(store.cfg))
    result = TileResult(
        store=store.root,
        outcomes=ordered,
        seconds=time.time() - store.started,
        tiles_written=sum(o.tile_count for o in outcomes if o.status == "ok"),
    )
    logger = get_run_logger()
    run_id: str | None = None
    mlflow_error: Exception | None = None
    try:
        with stage_mlflow_run(store.cfg.tracking, STAGE, params=flat_params(store.cfg)) as run:
            if run is not None:
                run_id = run.info.run_id
                report.log_to_mlflow(result)
    except Exception as err:
        mlflow_error = err
        logger.error("MLflow logging failed: %s", err)
    summary = _summary(result, run_id)
    create_table_artifact(
        report.summary_rows(result),
        key=SUMMARY_ARTIFACT_KEY,
        description=f"Slides of tile store {store.root}",
    )
    create_markdown_artifact(_markdown(summary, mlflow_error), key=REPORT_ARTIFACT_KEY, description="Tile run totals")
    for line in report.format_summary(result).splitlines():
        logger.info(line)
    if summary["failed_slides"]:
        logger.warning("%d slide(s) failed: %s", len(summary["failed_slides"]), ", ".join(summary["failed_slides"]))
    if mlflow_error is not None:
        raise mlflow_error
    return summary


def _summary(result: TileResult, mlflow_run_id: str | None) -> dict[str, Any]:
    return {
        "store": str(result.store),
        "slides": result.counts,
        "tiles_total": result.total_tiles,
        "tiles_written": result.tiles_written,
        "seconds": round(result.seconds, 2),
        "failed_slides": [o.slide_id for o in result.outcomes if o.status == "failed"],
        "mlflow_run_id": mlflow_run_id,
    }


def _markdown(summary: dict[str, Any], mlflow_error: Exception | None) -> str:
    counts = summary["slides"]
    lines = [
        "# Tile run",
        "",
        "| | |",
        "|---|---|",
        f"| store | `{summary['store']}` |",
        f"| slides tiled | {counts['ok']} |",
        f"| slides up to date (skipped) | {counts['skipped']} |",
        f"| slides failed | {counts['failed']} |",
        f"| tiles in store (these slides) | {summary['tiles_total']} |",
        f"| tiles written this run | {summary['tiles_written']} |",
        f"| seconds | {summary['seconds']} |",
        f"| MLflow run | {'`' + summary['mlflow_run_id'] + '`' if summary['mlflow_run_id'] else 'none'} |",
    ]
    if summary["failed_slides"]:
        lines += [
            "",
            f"**Failed:** {', '.join(summary['failed_slides'])} (errors in the `tile-summary` table).",
        ]
    if mlflow_error is not None:
        lines += ["", f"**MLflow logging failed:** {mlflow_error}"]
    return "\n".join(lines) + "\n"


__all__: Sequence[str] = (
    "PreparedStore",
    "TileParams",
    "TilePlan",
    "finalize_tile_run",
    "hold_store_lock",
    "prepare_tile_store",
    "run_slide_tasks",
    "select_slides",
    "slide_task_runner",
    "tile_slide",
)
