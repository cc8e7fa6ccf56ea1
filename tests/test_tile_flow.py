"""The tile flow on real components: a Prefect API server, MLflow on SQLite, OpenSlide on sample slides.

The flow runs the CLI's tile engine through the shared stage runner, so these tests also check that both paths
write identical stores and that one large slide is spread over every worker under Prefect.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import jsonschema
import numpy as np
import pytest
import zarr
from prefect.exceptions import ParameterTypeError
from pydantic import ValidationError

from dinov3_core.cli import main as cli_main
from dinov3_core.config import ConfigError, load_config
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.config import TileConfig
from flows.tile import tile_flow
from tasks.params import StageOptions, TileParams, TrackingParams
from tests import event_hooks
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
    root = Path(params.output)
    return FlowRun(
        id=state.state_details.flow_run_id,
        summary=summary,
        root=root,
        manifest=ts.read_manifest(root),
        mtimes=tree_mtimes(root),
    )


def params_for(input: Path, output: Path, tracking: MlflowTracking | None, *overrides: str) -> TileParams:
    mlflow = (
        TrackingParams(tracking_uri=tracking.uri, experiment=tracking.experiment)
        if tracking is not None
        else TrackingParams(enabled=False)
    )
    return TileParams(
        input=str(input),
        output=str(output),
        stage=StageOptions(config="default", overrides=list(overrides)),
        tracking=mlflow,
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
    # Paths, a config name with overrides, MLflow: no tiling key is declared a second time in the form.
    order = ["input", "output", "stage", "tracking", "force", "dask"]
    assert sorted(props, key=lambda k: props[k]["position"]) == order
    assert set(props) & {f.name for f in dataclasses.fields(TileConfig)} == {"input", "output", "tracking"}
    for name, prop in props.items():
        assert prop.get("title") or "$ref" in prop, name
    good = {"input": "/slides", "output": "/tiles.zarr"}
    jsonschema.validate({"params": good}, schema)
    tile_flow.validate_parameters({"params": good})
    tile_flow.validate_parameters({"params": good | {"dask": {"address": "tcp://10.0.0.5:8786"}}})
    with pytest.raises(ParameterTypeError, match="not both"):
        tile_flow.validate_parameters({"params": good | {"dask": {"address": "tcp://h:8786", "n_workers": 2}}})
    for bad in ({"tile_size": 256}, {"stage": {"overrides": ["no-equals-sign"]}}, {"dask": {"n_workers": -1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"params": good | bad}, schema)
        with pytest.raises(ParameterTypeError, match=f"params.{next(iter(bad))}"):
            tile_flow.validate_parameters({"params": good | bad})


def test_params_precedence_config_overrides_paths(tmp_path: Path) -> None:
    base = {"input": str(tmp_path), "output": str(tmp_path / "tiles.zarr")}
    cfg = load_config(TileConfig, "cohort-jpeg", TileParams(**base).config_values(), stage="tile")
    assert (cfg.compressor, cfg.workers, cfg.filters.pen_filter) == ("jpeg", 8, True)
    params = TileParams(
        **base,
        stage=StageOptions(config="cohort-jpeg", overrides=["compressor=zstd", "workers=2", "tiles_per_shard=64"]),
        tracking=TrackingParams(tracking_uri="sqlite:///x.db", experiment="e"),
    )
    cfg = load_config(TileConfig, params.stage.config, params.config_values(), stage="tile")
    assert (cfg.compressor, cfg.workers, cfg.tiles_per_shard) == ("zstd", 2, 64)
    assert (cfg.tracking.uri, cfg.tracking.experiment) == ("sqlite:///x.db", "e")
    with pytest.raises(ConfigError, match="set both as a parameter"):
        TileParams(**base, stage=StageOptions(overrides=["output=/elsewhere"])).config_values()
    with pytest.raises(ValidationError):
        TileParams(**base, tile_sise=256)  # type: ignore[call-arg]


# ----------------------------------------------------------------------------------- real server, real slides


@pytest.fixture(scope="module")
def first_run(
    prefect_api: str,
    mlflow_tracking: MlflowTracking,
    sample_slides: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[FlowRun, TileParams]:
    """Good slides + every negative through the flow once, on two worker processes."""
    work = tmp_path_factory.mktemp("tile-flow")
    listing = slide_list(work / "slides.txt", [*sample_slides.slides, *sample_slides.negatives.values()])
    params = params_for(listing, work / "tiles.zarr", mlflow_tracking, "workers=2")
    return run_flow(params), params


def test_flow_tiles_good_slides_and_records_failures(first_run: tuple[FlowRun, TileParams], sample_slides: Any):
    run, _ = first_run
    good = sorted(p.stem for p in sample_slides.slides)
    assert run.summary["status"] == "ran"
    counts = run.summary["summary"]
    assert {k: counts[k] for k in ("ok", "failed", "skipped")} == {"ok": len(good), "failed": 4, "skipped": 0}
    assert ts.complete_slide_ids(run.root) == good
    assert not any((run.root / ts.INCOMING).iterdir())
    assert (run.root / "config.yaml").is_file()

    entries = {e["slide_id"]: e for e in run.manifest["slides"]}
    assert set(entries) == {*good, *(p.stem for p in sample_slides.negatives.values())}
    stored = 0
    for slide_id in good:
        assert entries[slide_id]["status"] == "ok" and entries[slide_id]["tile_count"] > 0
        stored += ts.read_slide_attrs(run.root, slide_id)["tile_count"]
    assert counts["tiles_total"] == stored
    for kind, path in sample_slides.negatives.items():
        entry = entries[path.stem]
        assert entry["status"] == "failed", kind
        assert path.name in entry["error"], f"{kind}: error does not name the file: {entry['error']}"
    assert sorted(counts["failed_slides"]) == sorted(p.stem for p in sample_slides.negatives.values())
    stage_manifest = json.loads((run.root / "stage_manifest.json").read_text())
    assert stage_manifest["status"] == "complete" and stage_manifest["mlflow_run_id"] == run.summary["mlflow_run_id"]


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
    assert metrics["tiles_total"] == run.summary["summary"]["tiles_total"] > 0
    assert metrics["bytes_per_tile"] > 0
    assert ml.data.params["tile_size"] == "224" and ml.data.params["compressor"] == "jpeg"
    assert ml.data.params["output"] == str(run.root)
    tags = ml.data.tags
    assert tags["wsidino.stage"] == "tile" and tags["prefect.flow_name"] == "tile"
    assert tags["wsidino.output"] == str(run.root.resolve())  # the runner's tags, as every stage has
    assert ml.info.run_name == f"tile/{tags['prefect.flow_run_name']}"
    if "prefect.flow_run_url" in tags:
        assert tags["prefect.flow_run_url"].endswith(f"/flow-runs/flow-run/{run.id}")

    client = MlflowClient(mlflow_tracking.uri)
    top = {a.path for a in client.list_artifacts(ml.info.run_id)}
    assert {"config.yaml", "manifest.json", "qc", "manifest", "config"} <= top
    for slide in sample_slides.slides:
        qc = {Path(a.path).name for a in client.list_artifacts(ml.info.run_id, f"qc/{slide.stem}")}
        assert qc == {"qc_thumbnail.png", "qc_mask.png"}, slide.stem
    assert ml.info.artifact_uri.startswith(mlflow_tracking.artifact_root.as_uri())


def test_flow_publishes_prefect_artifacts(first_run: tuple[FlowRun, TileParams], sample_slides: Any):
    run, _ = first_run
    found = artifacts(run.id)
    assert {"tile-summary", "tile-stage", "tile-progress"} <= set(found)
    table = found["tile-summary"]
    assert table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    by_slide = {r["slide"]: r for r in rows}
    assert len(rows) == 7
    for slide in sample_slides.slides:
        assert by_slide[slide.stem]["status"] == "ok" and by_slide[slide.stem]["tiles"] > 0
    for path in sample_slides.negatives.values():
        assert by_slide[path.stem]["status"] == "failed" and path.name in by_slide[path.stem]["error"]
    report = found["tile-stage"]
    assert report.type == "markdown" and run.summary["mlflow_run_id"] in report.data
    assert found["tile-progress"].type == "progress" and float(found["tile-progress"].data) == 100.0
    (stage_run,) = task_runs(run.id)  # one task: the stage runner; the slides are the engine's work units
    assert stage_run.name == "tile" and stage_run.state.is_completed()


def test_second_run_retries_only_failed_slides(
    first_run: tuple[FlowRun, TileParams],
    mlflow_tracking: MlflowTracking,
    sample_slides: Any,
):
    run, params = first_run
    again = run_flow(params)
    good = {p.stem for p in sample_slides.slides}
    assert again.summary["reason"] == "the last run had 4 failed item(s)"
    counts = again.summary["summary"]
    assert {k: counts[k] for k in ("ok", "failed", "skipped")} == {"ok": 0, "failed": 4, "skipped": len(good)}
    assert again.mtimes == run.mtimes  # no slide directory or file was touched
    statuses = {e["slide_id"]: e["status"] for e in again.manifest["slides"]}
    assert {s for s, status in statuses.items() if status == "skipped"} == good
    (ml,) = mlflow_runs(mlflow_tracking, again.id)
    assert ml.data.metrics["slides_skipped"] == len(good) and ml.data.metrics["tiles_written"] == 0


def test_cli_and_flow_write_identical_stores(prefect_api: str, sample_slides: Any, tmp_path: Path):
    slides = slide_list(tmp_path / "slides.txt", sample_slides.slides)
    overrides = ("workers=2", "tiles_per_shard=8", "compressor=jpeg")
    flow_run = run_flow(params_for(slides, tmp_path / "flow.zarr", None, *overrides))
    cli_store = tmp_path / "cli.zarr"
    argv = ["tile", "--input", str(slides), "--output", str(cli_store), *overrides, "tracking.enabled=false"]
    assert cli_main(argv) == 0
    ids = ts.complete_slide_ids(flow_run.root)
    assert ids == ts.complete_slide_ids(cli_store) == sorted(p.stem for p in sample_slides.slides)
    volatile = {"created", "committed_at", "seconds", "write_seconds", "plan_seconds"}
    for slide_id in ids:
        a, b = (ts.read_slide_attrs(root, slide_id) for root in (flow_run.root, cli_store))
        assert {k: v for k, v in a.items() if k not in volatile} == {k: v for k, v in b.items() if k not in volatile}
        for array in ("tiles", "coords"):
            x = zarr.open_array(str(flow_run.root / ts.SLIDES / slide_id / array), mode="r")[:]
            y = zarr.open_array(str(cli_store / ts.SLIDES / slide_id / array), mode="r")[:]
            assert np.array_equal(x, y), (slide_id, array)


def test_flow_spreads_one_large_slide_over_every_worker(
    prefect_api: str, sample_slides: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    slide = next(p for p in sample_slides.slides if p.name == "tissue_40x.svs")
    # Each shard writer waits until a second worker has written a shard: a slide tiled by one worker alone
    # (one task per slide, as the flow used to) would time out here instead.
    event_hooks.arm(monkeypatch, "shards_from_two_workers", tmp_path / "events")
    run = run_flow(params_for(slide, tmp_path / "tiles.zarr", None, "workers=2", "tiles_per_shard=1"))
    (entry,) = run.manifest["slides"]
    assert entry["status"] == "ok" and entry["tile_count"] > 2
    assert entry["workers"] == 2
    assert len(list((tmp_path / "events").glob("writer-*"))) == 2


def test_flow_fails_fast_on_bad_config_or_locked_store(prefect_api: str, sample_slides: Any, tmp_path: Path):
    params = params_for(sample_slides.slides[0], tmp_path / "tiles.zarr", None, "tile_sise=256")
    state = tile_flow(params, return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match="did you mean 'tile_size'"):
        state.result()
    assert not (tmp_path / "tiles.zarr").exists()  # nothing created for a config that cannot run

    root = ts.init_store(tmp_path / "locked.zarr")
    with ts.store_lock(root):  # another run holds the store
        state = tile_flow(params_for(sample_slides.slides[0], root, None), return_state=True)
    assert state.is_failed()
    with pytest.raises(ts.TileStoreError, match="being written by"):
        state.result()
    assert ts.complete_slide_ids(root) == []
