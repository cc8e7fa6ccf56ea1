"""The tile flow on real components: a Prefect API server, MLflow on SQLite, OpenSlide on sample slides."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import jsonschema
import pytest
from prefect import task
from prefect.exceptions import ParameterTypeError
from pydantic import ValidationError

from dinov3_core.config import ConfigError, load_config
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.config import TileConfig
from flows.tile import tile_flow
from tasks import tile as tile_tasks
from tasks.tile import TileParams, slide_task_runner
from tests.helpers import slide_list
from tests.prefect_fixtures import MlflowTracking

# --------------------------------------------------------------------------------------------------- helpers


def tree_mtimes(root: Path) -> dict[str, int]:
    """mtime (ns) of every file and directory under the committed slides."""
    slides = root / ts.SLIDES
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in [slides, *slides.rglob("*")]}


@dataclass
class FlowRun:
    id: UUID
    summary: dict[str, Any]
    root: Path
    manifest: dict[str, Any]
    mtimes: dict[str, int]


def run_flow(params: TileParams) -> FlowRun:
    state = tile_flow(params, return_state=True)
    assert state.is_completed(), f"flow run ended {state.name}: {state.message}"
    summary = state.result()
    root = Path(summary["store"])
    return FlowRun(
        id=state.state_details.flow_run_id,
        summary=summary,
        root=root,
        manifest=ts.read_manifest(root),
        mtimes=tree_mtimes(root),
    )


def task_runs(flow_run_id: UUID, timeout: float = 15.0) -> list[Any]:
    """The flow run's task runs, once the server shows them all in a final state (task states reach the
    server as events, so they can lag the flow's return by a moment)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            if all(r.state is not None and r.state.is_final() for r in runs) or time.monotonic() > deadline:
                return runs
            time.sleep(0.25)


def artifacts(flow_run_id: UUID) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in found if a.key}


def mlflow_runs(tracking: MlflowTracking, flow_run_id: UUID) -> list[Any]:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking.uri).search_runs(
        [tracking.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'"
    )


# ------------------------------------------------------------------------------------- parameters (no server)


def _property_schema(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of an optional property (`anyOf: [X, null]`), else the property itself."""
    branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"]
    return branches[0] if len(branches) == 1 else prop


def test_parameter_schema_renders_a_clean_form() -> None:
    schema = tile_flow.parameters.model_dump()
    assert schema["required"] == ["params"]
    assert schema["properties"]["params"]["$ref"] == "#/definitions/TileParams"
    assert schema["properties"]["params"]["description"]  # from the flow docstring's Args:
    model = schema["definitions"]["TileParams"]
    props = model["properties"]
    assert model["required"] == ["input", "output"]
    assert model["additionalProperties"] is False
    assert model["description"].startswith("Tile whole-slide images")
    expected = [
        *("input", "output", "mpp", "tile_size", "stride", "min_tissue_fraction", "pen_filter"),
        *("blur_filter", "compressor", "workers", "config", "overrides", "tracking_uri", "experiment", "force"),
    ]
    assert sorted(props, key=lambda k: props[k]["position"]) == expected
    for name, prop in props.items():
        assert len(prop.get("description", "")) > 20, f"{name} has no useful description"
        assert prop["title"], name
    assert (props["mpp"]["title"], props["workers"]["title"]) == ("Target µm/px", "Worker processes")
    assert _property_schema(props["compressor"])["enum"] == ["zstd", "jpeg", "none"]
    bounds = {name: _property_schema(props[name]) for name in props}
    assert (bounds["tile_size"]["minimum"], bounds["tile_size"]["maximum"]) == (16, 4096)
    assert (bounds["min_tissue_fraction"]["minimum"], bounds["min_tissue_fraction"]["maximum"]) == (0.0, 1.0)
    assert bounds["mpp"]["exclusiveMinimum"] == 0.0
    assert bounds["workers"]["minimum"] == 1
    assert props["overrides"]["items"]["pattern"]

    # Bad values are refused both by the JSON schema (UI form, deployment runs with enforce_parameter_schema)
    # and by the flow's own validation when it is called.
    good = {"input": "/slides", "output": "/tiles.zarr"}
    jsonschema.validate({"params": good}, schema)
    tile_flow.validate_parameters({"params": good})
    for bad in ({"compressor": "lz4"}, {"tile_size": 8}, {"min_tissue_fraction": 1.5}, {"tile_sise": 256}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"params": good | bad}, schema)
        with pytest.raises(ParameterTypeError, match=f"params.{next(iter(bad))}"):
            tile_flow.validate_parameters({"params": good | bad})


def test_params_precedence_config_fields_overrides(tmp_path: Path) -> None:
    base = {"input": str(tmp_path), "output": str(tmp_path / "tiles.zarr")}
    # Empty fields inherit the named config; set fields win over it; overrides reach any other key.
    cfg = load_config(TileConfig, "cohort-jpeg", TileParams(**base, config="cohort-jpeg").config_values(), stage="tile")
    assert (cfg.compressor, cfg.workers, cfg.filters.pen_filter) == ("jpeg", 8, True)
    params = TileParams(
        **base,
        config="cohort-jpeg",
        compressor="zstd",
        workers=2,
        min_tissue_fraction=0.25,
        overrides=["tiles_per_shard=64", "tissue.thumbnail_mpp=4"],
        tracking_uri="sqlite:///x.db",
        experiment="e",
    )
    cfg = load_config(TileConfig, params.config, params.config_values(), stage="tile")
    assert (cfg.compressor, cfg.workers, cfg.tiles_per_shard) == ("zstd", 2, 64)
    assert (cfg.tissue.min_tissue_fraction, cfg.tissue.thumbnail_mpp) == (0.25, 4.0)
    assert (cfg.tracking.uri, cfg.tracking.experiment) == ("sqlite:///x.db", "e")
    # The same key twice with different values is refused; the same value is fine.
    with pytest.raises(ConfigError, match="set both as a parameter"):
        TileParams(**base, workers=2, overrides=["workers=4"]).config_values()
    assert TileParams(**base, workers=2, overrides=["workers=2"]).config_values()["workers"] == 2
    with pytest.raises(ValidationError):
        TileParams(**base, overrides=["no-equals-sign"])
    with pytest.raises(ValidationError):
        TileParams(**base, tile_sise=256)  # type: ignore[call-arg]


def test_slide_task_runner_choice() -> None:
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    assert isinstance(slide_task_runner(4, 3), ProcessPoolTaskRunner)
    assert isinstance(slide_task_runner(4, 1), ThreadPoolTaskRunner)  # one slide: no pool to spawn
    runner = slide_task_runner(1, 10)
    assert isinstance(runner, ThreadPoolTaskRunner) and runner._max_workers == 1


# ----------------------------------------------------------------------------------- real server, real slides


@pytest.fixture(scope="module")
def first_run(
    prefect_api: str,
    mlflow_tracking: MlflowTracking,
    sample_slides: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[FlowRun, TileParams]:
    """Good slides + every negative through the flow once (one slide at a time, in the flow process)."""
    work = tmp_path_factory.mktemp("tile-flow")
    listing = slide_list(work / "slides.txt", [*sample_slides.slides, *sample_slides.negatives.values()])
    params = TileParams(
        input=str(listing),
        output=str(work / "tiles.zarr"),
        workers=1,
        tracking_uri=mlflow_tracking.uri,
        experiment=mlflow_tracking.experiment,
    )
    return run_flow(params), params


def test_flow_tiles_good_slides_and_records_failures(first_run: tuple[FlowRun, TileParams], sample_slides: Any):
    run, _ = first_run
    good = sorted(p.stem for p in sample_slides.slides)
    assert run.summary["slides"] == {"ok": len(good), "failed": 4, "skipped": 0}
    assert ts.complete_slide_ids(run.root) == good
    assert not any((run.root / ts.INCOMING).iterdir())
    assert (run.root / "config.yaml").is_file()

    entries = {e["slide_id"]: e for e in run.manifest["slides"]}
    assert set(entries) == {*good, *(p.stem for p in sample_slides.negatives.values())}
    stored = 0
    for slide_id in good:
        assert entries[slide_id]["status"] == "ok" and entries[slide_id]["tile_count"] > 0
        stored += ts.read_slide_attrs(run.root, slide_id)["tile_count"]
    assert run.summary["tiles_total"] == run.summary["tiles_written"] == stored
    for kind, path in sample_slides.negatives.items():
        entry = entries[path.stem]
        assert entry["status"] == "failed", kind
        assert path.name in entry["error"], f"{kind}: error does not name the file: {entry['error']}"
    assert sorted(run.summary["failed_slides"]) == sorted(p.stem for p in sample_slides.negatives.values())


def test_flow_logs_one_mlflow_run(
    first_run: tuple[FlowRun, TileParams],
    mlflow_tracking: MlflowTracking,
    sample_slides: Any,
):
    from mlflow.tracking import MlflowClient

    run, _ = first_run
    (ml,) = mlflow_runs(mlflow_tracking, run.id)
    assert ml.info.run_id == run.summary["mlflow_run_id"]
    assert ml.info.status == "FINISHED"
    metrics = ml.data.metrics
    assert metrics["slides_ok"] == 3 and metrics["slides_failed"] == 4 and metrics["slides_skipped"] == 0
    assert metrics["tiles_total"] == run.summary["tiles_total"] > 0
    assert metrics["bytes_per_tile"] > 0
    assert ml.data.params["tile_size"] == "224" and ml.data.params["compressor"] == "zstd"
    assert ml.data.params["output"] == str(run.root)
    tags = ml.data.tags
    assert tags["wsidino.stage"] == "tile" and tags["prefect.flow_name"] == "tile"
    assert ml.info.run_name == f"tile/{tags['prefect.flow_run_name']}"
    if "prefect.flow_run_url" in tags:
        assert tags["prefect.flow_run_url"].endswith(f"/flow-runs/flow-run/{run.id}")

    client = MlflowClient(mlflow_tracking.uri)
    top = {a.path for a in client.list_artifacts(ml.info.run_id)}
    assert {"config.yaml", "manifest.json", "qc"} <= top
    for slide in sample_slides.slides:
        qc = {Path(a.path).name for a in client.list_artifacts(ml.info.run_id, f"qc/{slide.stem}")}
        assert qc == {"qc_thumbnail.png", "qc_mask.png"}, slide.stem
    assert ml.info.artifact_uri.startswith(mlflow_tracking.artifact_root.as_uri())


def test_flow_publishes_prefect_artifacts_and_task_runs(first_run: tuple[FlowRun, TileParams], sample_slides: Any):
    run, _ = first_run
    found = artifacts(run.id)
    assert {"tile-summary", "tile-report", "tile-progress"} <= set(found)
    table = found["tile-summary"]
    assert table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    by_slide = {r["slide"]: r for r in rows}
    assert len(rows) == 7
    for slide in sample_slides.slides:
        assert by_slide[slide.stem]["status"] == "ok" and by_slide[slide.stem]["tiles"] > 0
    for path in sample_slides.negatives.values():
        assert by_slide[path.stem]["status"] == "failed" and path.name in by_slide[path.stem]["error"]
    report = found["tile-report"]
    assert report.type == "markdown" and run.summary["mlflow_run_id"] in report.data
    assert found["tile-progress"].type == "progress" and float(found["tile-progress"].data) == 100.0

    runs = task_runs(run.id)
    per_slide = [r for r in runs if r.name in {f"tile-{s}" for s in by_slide}]
    assert len(per_slide) == 7  # one task run per slide, named after it
    assert len(runs) == 7 + 3  # plus prepare-tile-store, select-slides, finalize-tile-run
    assert all(r.state.is_completed() for r in runs), [(r.name, r.state.name) for r in runs]


def test_second_run_skips_without_rewriting(
    first_run: tuple[FlowRun, TileParams],
    mlflow_tracking: MlflowTracking,
    sample_slides: Any,
):
    run, params = first_run
    again = run_flow(params)
    good = {p.stem for p in sample_slides.slides}
    assert again.summary["slides"] == {"ok": 0, "failed": 4, "skipped": len(good)}
    assert again.summary["tiles_written"] == 0 and again.summary["tiles_total"] == run.summary["tiles_total"]
    assert again.mtimes == run.mtimes  # no slide directory or file was touched
    statuses = {e["slide_id"]: e["status"] for e in again.manifest["slides"]}
    assert {s for s, status in statuses.items() if status == "skipped"} == good
    # Only the failed slides were retried: one task run each; the skipped slides got none.
    names = {r.name for r in task_runs(again.id)}
    assert {n for n in names if n.startswith("tile-") and n[5:] in statuses} == {
        f"tile-{p.stem}" for p in sample_slides.negatives.values()
    }
    (ml,) = mlflow_runs(mlflow_tracking, again.id)
    assert ml.data.metrics["slides_skipped"] == len(good) and ml.data.metrics["tiles_written"] == 0


def test_process_pool_workers(
    prefect_api: str,
    mlflow_tracking: MlflowTracking,
    sample_slides: Any,
    tmp_path: Path,
):
    slides = [*sample_slides.slides[:2], sample_slides.negatives["not_a_slide"]]
    params = TileParams(
        input=str(slide_list(tmp_path / "slides.txt", slides)),
        output=str(tmp_path / "tiles.zarr"),
        workers=2,
        compressor="jpeg",
        tracking_uri=mlflow_tracking.uri,
        experiment=mlflow_tracking.experiment,
    )
    run = run_flow(params)
    assert run.summary["slides"] == {"ok": 2, "failed": 1, "skipped": 0}
    assert ts.complete_slide_ids(run.root) == sorted(p.stem for p in slides[:2])
    assert ts.read_slide_attrs(run.root, slides[0].stem)["compressor"] == "jpeg"
    # Task runs executed in the worker processes report to the same server, under this flow run.
    slide_runs = [r for r in task_runs(run.id) if r.name in {f"tile-{p.stem}" for p in slides}]
    assert len(slide_runs) == 3 and all(r.state.is_completed() for r in slide_runs)
    (ml,) = mlflow_runs(mlflow_tracking, run.id)
    assert ml.data.params["workers"] == "2" and ml.data.metrics["slides_ok"] == 2


def test_flow_fails_fast_on_bad_config_or_locked_store(prefect_api: str, sample_slides: Any, tmp_path: Path):
    params = TileParams(
        input=str(sample_slides.slides[0]), output=str(tmp_path / "tiles.zarr"), overrides=["tile_sise=256"]
    )
    state = tile_flow(params, return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match="did you mean 'tile_size'"):
        state.result()
    assert not (tmp_path / "tiles.zarr").exists()  # nothing created for a config that cannot run

    root = ts.init_store(tmp_path / "locked.zarr")
    with ts.store_lock(root):  # another run holds the store
        locked = params.model_copy(update={"output": str(root), "overrides": ["tracking.enabled=false"]})
        state = tile_flow(locked, return_state=True)
    assert state.is_failed()
    with pytest.raises(ts.TileStoreError, match="being written by"):
        state.result()
    assert ts.complete_slide_ids(root) == []


def test_a_task_that_does_not_complete_is_recorded_as_failed(
    prefect_api: str, sample_slides: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`tile_one_slide` never raises, but the task around it can die (a crashed worker, an engine error): the
    slide is then recorded as failed with the reason, and the flow still completes."""

    @task(name="tile-slide", task_run_name="tile-{slide.slide_id}")
    def exploding(slide: Any, root: Path, cfg: TileConfig, mpp_overrides: dict[str, float]) -> Any:
        raise RuntimeError(f"simulated failure on {slide.path.name}")

    monkeypatch.setattr(tile_tasks, "tile_slide", exploding)
    slide = sample_slides.slides[1]
    params = TileParams(input=str(slide), output=str(tmp_path / "tiles.zarr"), overrides=["tracking.enabled=false"])
    run = run_flow(params)
    assert run.summary["slides"] == {"ok": 0, "failed": 1, "skipped": 0}
    assert run.summary["mlflow_run_id"] is None
    (entry,) = run.manifest["slides"]
    assert f"{slide}: the tiling task did not complete (RuntimeError: simulated failure" in entry["error"]
    assert ts.complete_slide_ids(run.root) == []
    (task_run,) = [r for r in task_runs(run.id) if r.name == f"tile-{slide.stem}"]
    assert task_run.state.is_failed()  # a finished task keeps its own state; only unfinished ones become Crashed
