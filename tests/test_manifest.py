"""Stage manifests, input fingerprints, lineage, stage specs, fault injection and the flow parameter forms."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dinov3_core import manifest as mf
from dinov3_core.config import ConfigError, load_config
from dinov3_core.errors import OutputBusy
from dinov3_core.export.config import ExportConfig
from dinov3_core.launch.training import LaunchSettings
from dinov3_core.pipeline.config import load_pipeline_config
from dinov3_core.stages import get_stage
from tasks.chain_params import PipelineParams
from tasks.params import StageOptions, merge_values
from tests.helpers import by_name, read_json, slide_list
from wsidino_dev import faults


def complete(
    stage: str,
    outputs: dict[str, str],
    run_id: str,
    lineage: dict[str, str] | None = None,
    inputs: dict[str, Any] | None = None,
) -> mf.StageManifest:
    m = mf.StageManifest(
        stage=stage,
        status="complete",
        config_hash="h",
        inputs=inputs or {},
        outputs=outputs,
        mlflow_run_id=run_id,
        lineage=lineage or {},
        finished_at=mf.now(),
    )
    m.output_fingerprint = mf.completion_fingerprint(m)
    return m


# ------------------------------------------------------------------------------------------------ fingerprints


def test_file_fingerprint_follows_content_not_mtime(tmp_path: Path):
    a = tmp_path / "a.bin"
    a.write_bytes(b"x" * 5_000_000)
    first = mf.fingerprint(a)
    a.touch()
    assert mf.fingerprint(a) == first  # a touched file is the same input
    a.write_bytes(b"y" + b"x" * 4_999_999)
    assert mf.fingerprint(a) != first  # changed head
    a.write_bytes(b"x" * 4_999_999 + b"y")
    assert mf.fingerprint(a) != first  # changed tail
    a.write_bytes(b"x" * 5_000_001)
    assert mf.fingerprint(a) != first  # changed size


def test_missing_input_names_the_key(tmp_path: Path):
    with pytest.raises(mf.ManifestError, match=r"pretrain_dir: .*missing.* does not exist; .*run the stage"):
        mf.fingerprint_inputs({"pretrain_dir": tmp_path / "missing", "teacher": None})


def test_directory_and_glob_fingerprints(tmp_path: Path):
    slides = tmp_path / "slides"
    slides.mkdir()
    (slides / "a.svs").write_bytes(b"1")
    tree = mf.fingerprint(slides)
    pattern = mf.fingerprint(slides / "*.svs")
    (slides / "b.svs").write_bytes(b"2")  # a new slide arrived
    assert mf.fingerprint(slides) != tree and mf.fingerprint(slides / "*.svs") != pattern
    assert mf.fingerprint_inputs({"slides": slides, "unused": None}).keys() == {"slides"}


def test_a_slide_list_is_fingerprinted_with_its_slides(tmp_path: Path):
    from dinov3_core.tiling.config import TileConfig

    slide = tmp_path / "a.svs"
    slide.write_bytes(b"1")
    listing = slide_list(tmp_path / "slides.txt", [slide])
    cfg = load_config(TileConfig, None, {"input": str(listing), "output": str(tmp_path / "t.zarr")})
    first = mf.fingerprint_inputs(get_stage("tile").inputs(cfg))
    assert first["listed_slides"]["path"].endswith("a.svs (+0 more)")
    slide.write_bytes(b"22")  # the slide was replaced at the same path; the list file is unchanged
    assert mf.fingerprint_inputs(get_stage("tile").inputs(cfg))["listed_slides"] != first["listed_slides"]


def test_tile_store_fingerprint_ignores_timings(tmp_path: Path):
    store = tmp_path / "tiles.zarr"
    store.mkdir()
    slide = {"slide_id": "a", "status": "ok", "tile_count": 10, "source_path": "/a.svs", "seconds": 1.0}
    doc = {"format": "tile-store-manifest", "updated": "t0", "tiling": {"mpp": 0.5}, "slides": [slide]}
    (store / "manifest.json").write_text(json.dumps(doc))
    first = mf.fingerprint(store)
    doc["updated"], doc["slides"][0]["seconds"] = "t1", 2.5  # a rerun that skipped every slide
    (store / "manifest.json").write_text(json.dumps(doc))
    assert mf.fingerprint(store) == first
    doc["slides"][0]["tile_count"] = 11
    (store / "manifest.json").write_text(json.dumps(doc))
    assert mf.fingerprint(store) != first


def test_producer_manifest_for_directory_file_and_listed_outputs(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    backbone, onnx, other = model / "backbone.pth", model / "model.onnx", model / "notes.txt"
    for p in (backbone, onnx, other):
        p.write_bytes(b"w")
    convert = complete("convert", {"backbone": str(backbone)}, "run-convert")
    mf.write_manifest(mf.manifest_path(model, is_dir=True), convert)
    export = complete("export", {"onnx": str(onnx)}, "run-export")
    mf.write_manifest(mf.manifest_path(onnx, is_dir=False), export)

    assert mf.producer_manifest(model).stage == "convert"
    assert mf.producer_manifest(backbone).stage == "convert"  # listed among the directory stage's outputs
    assert mf.producer_manifest(onnx).stage == "export"  # its own <file>.stage_manifest.json
    assert mf.producer_manifest(other) is None  # in the directory, but not an output
    assert mf.fingerprint(backbone) == f"stage:convert:{convert.output_fingerprint}"
    assert not list(model.glob(".*tmp*"))  # atomic writes leave no temporary files


def test_incomplete_producer_is_not_trusted(tmp_path: Path):
    run = tmp_path / "pretrain"
    run.mkdir()
    (run / "x").write_text("1")
    m = complete("pretrain", {"run_dir": str(run)}, "r")
    m.status = "running"
    mf.write_manifest(run / mf.MANIFEST_NAME, m)
    assert mf.producer_manifest(run) is None
    assert mf.fingerprint(run).startswith("tree:")


def test_lineage_collects_every_upstream_run(tmp_path: Path):
    store, run = tmp_path / "tiles.zarr", tmp_path / "pretrain"
    store.mkdir()
    run.mkdir()
    mf.write_manifest(store / mf.MANIFEST_NAME, complete("tile", {"store": str(store)}, "run-tile"))
    pretrain = complete("pretrain", {"run_dir": str(run)}, "run-pt", {"tile": "run-tile"})
    mf.write_manifest(run / mf.MANIFEST_NAME, pretrain)
    assert mf.lineage_of([run, None]) == {"tile": "run-tile", "pretrain": "run-pt"}
    assert mf.lineage_of([tmp_path / "unknown"]) == {}


def test_up_to_date_decision(tmp_path: Path):
    out = tmp_path / "features.zarr"
    out.mkdir()
    path = out / mf.MANIFEST_NAME
    inputs = {"model": {"path": "/m.onnx", "fingerprint": "f1"}}
    assert mf.check_up_to_date(path, "h", inputs).reason.startswith("no manifest")
    m = complete("extract", {"features": str(out)}, "r", inputs=inputs)
    m.status = "failed"
    mf.write_manifest(path, m)
    assert mf.check_up_to_date(path, "h", inputs).reason == "the last run is failed"
    m.status = "complete"
    mf.write_manifest(path, m)
    assert mf.check_up_to_date(path, "h", inputs).up_to_date
    m.summary = {"failed": 2}  # unreadable slides: a rerun must retry them
    mf.write_manifest(path, m)
    failed = get_stage("tile").failed_items
    assert mf.check_up_to_date(path, "h", inputs, failed).reason == "the last run had 2 failed item(s)"
    m.summary = {"failed": 0}
    mf.write_manifest(path, m)
    assert mf.check_up_to_date(path, "other", inputs).reason == "the config changed"
    changed = {"model": {"path": "/m.onnx", "fingerprint": "f2"}}
    assert mf.check_up_to_date(path, "h", changed).reason == "inputs changed: model"
    assert mf.check_up_to_date(path, "h", {**inputs, "extra": changed["model"]}).reason == "inputs changed: extra"
    m.outputs["pca"] = str(out / "gone.png")
    mf.write_manifest(path, m)
    assert mf.check_up_to_date(path, "h", inputs).reason == "outputs missing: pca"


def test_one_run_per_output(tmp_path: Path):
    from dinov3_core.runner import manifest_guard

    spec = get_stage("export")
    cfg = load_config(ExportConfig, None, {"weights": "/w.pth", "output": str(tmp_path / "model.onnx")})
    busy = rf"{tmp_path} is being written by pid \d+ on .*cancel it"
    with (
        mf.output_lock(spec.manifest_path(cfg)),  # another run is exporting to the same file
        pytest.raises(OutputBusy, match=busy),
        manifest_guard(spec, cfg, {}),
    ):
        pytest.fail("must not run")
    assert not spec.manifest_path(cfg).exists()  # the other run's manifest would not have been touched
    with pytest.raises(RuntimeError, match="boom"), manifest_guard(spec, cfg, {}):  # released: runs, fails
        raise RuntimeError("boom")
    assert mf.read_manifest(spec.manifest_path(cfg)).error == "RuntimeError: boom"


@pytest.mark.parametrize("content", [b"{not json", b"\x93 not UTF-8 \x94", b"[1, 2]"])
def test_unreadable_manifest_says_what_to_do(tmp_path: Path, content: bytes):
    path = tmp_path / mf.MANIFEST_NAME
    path.write_bytes(content)
    with pytest.raises(mf.ManifestError, match=rf"^{path}: .*delete it to rerun the stage$"):
        mf.read_manifest(path)


# ------------------------------------------------------------------------------------------------- stage specs


def test_config_hash_ignores_tracking_but_not_settings():
    spec = get_stage("export")
    base = {"weights": "/w/backbone.pth", "output": "/o/model.onnx"}
    a = load_config(ExportConfig, None, {**base, "tracking.uri": "sqlite:///a.db"})
    b = load_config(ExportConfig, None, {**base, "tracking.uri": "http://mlflow:5000", "tracking.enabled": False})
    c = load_config(ExportConfig, None, {**base, "pooled": True})
    assert spec.config_hash(a) == spec.config_hash(b) != spec.config_hash(c)
    assert spec.manifest_path(a) == Path("/o/model.onnx.stage_manifest.json")
    assert spec.inputs(a) == {"weights": "/w/backbone.pth"}


def test_every_stage_has_a_spec_with_a_loadable_schema():
    from dinov3_core.config import ConfigError
    from dinov3_core.stages import STAGE_NAMES, STAGES, StageName

    assert STAGE_NAMES == ("tile", "pretrain", "gram", "convert", "export", "evaluate", "extract")
    assert StageName.__args__ == STAGE_NAMES  # the forms' choices come from the one list
    assert [s.name for s in STAGES if s.always_job] == ["pretrain", "gram"]
    for stage in STAGES:
        assert isinstance(stage.schema(), type)
        assert (stage.work is not None) or (stage.job_module is not None), stage.name  # it can run somehow
    with pytest.raises(ConfigError, match="did you mean 'export'"):
        get_stage("exprot")


# ------------------------------------------------------------------------------------------------------ faults


def test_fault_fires_once_per_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(faults.ENV, "pretrain@3, export")
    faults.maybe_fail("pretrain", tmp_path, iteration=1)  # another iteration
    faults.maybe_fail("gram", tmp_path, iteration=3)  # another stage
    with pytest.raises(faults.InjectedFault, match="pretrain after iteration 3"):
        faults.maybe_fail("pretrain", tmp_path, iteration=3)
    faults.maybe_fail("pretrain", tmp_path, iteration=3)  # fired already: the retry goes through
    with pytest.raises(faults.InjectedFault, match="export"):
        faults.maybe_fail("export", tmp_path)
    monkeypatch.delenv(faults.ENV)
    faults.maybe_fail("convert", tmp_path)


def test_fault_fires_through_the_runner_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The core only emits `stage.start`; the fault drill hooks in from outside through $WSIDINO_HOOKS."""
    from dinov3_core import events
    from dinov3_core.runner import run_stage

    weights = tmp_path / "w.pth"
    weights.write_bytes(b"not a model")
    cfg = load_config(
        ExportConfig, None, {"weights": str(weights), "output": str(tmp_path / "model.onnx"), "tracking.enabled": False}
    )
    for key, value in faults.environment("export").items():
        monkeypatch.setenv(key, value)
    assert os.environ[events.HOOKS_ENV] == "wsidino_dev.faults"
    with pytest.raises(faults.InjectedFault, match="injected fault in stage export"):
        run_stage("export", cfg)
    m = mf.read_manifest(tmp_path / "model.onnx.stage_manifest.json")
    assert m.status == "failed" and "InjectedFault" in m.error  # recorded like a crash, so a retry reruns it
    monkeypatch.setenv(events.HOOKS_ENV, "no_such_module_xyz")
    with pytest.raises(RuntimeError, match="WSIDINO_HOOKS='no_such_module_xyz': cannot load"):
        events.emit("stage.start", stage="export")


# ------------------------------------------------------------------------------------------------ flow forms


def test_pipeline_params_validate_the_stage_range():
    p = PipelineParams(
        slides="s", workdir="w", start_at="pretrain", stop_after="export", overrides=["gram_anchoring=false"]
    )
    assert load_pipeline_config(p.config, p.config_values()).selected() == ["pretrain", "convert", "export"]
    with pytest.raises(ValidationError, match="comes after"):
        PipelineParams(slides="s", workdir="w", start_at="export", stop_after="tile")
    with pytest.raises(ValidationError):
        PipelineParams(slides="s", workdir="w", force=["tiles"])  # not a stage
    with pytest.raises(ValidationError, match="rdzv_endpoint"):
        LaunchSettings(nnodes=2)
    assert LaunchSettings(nnodes=2, rdzv_endpoint="node001:29400").nnodes == 2


def test_a_key_set_twice_is_refused():
    options = StageOptions(overrides=["output=/a.onnx", "pooled=true"])
    assert merge_values(options.overrides, {"weights": "/w.pth", "pooled": True}, "export")["pooled"] is True
    with pytest.raises(ConfigError, match="export: 'output' is set both as a parameter"):
        merge_values(options.overrides, {"output": "/b.onnx"}, "export")


@pytest.mark.parametrize("name", ["pipeline", "pretrain", "gram", "convert", "export", "extract"])
def test_every_flow_form_is_titled_and_ordered(name: str):
    import importlib

    flow = getattr(importlib.import_module(f"flows.{name}"), f"{name}_flow")
    schema = flow.parameters.model_dump()
    assert schema["required"] == ["params"]
    model = schema["definitions"][schema["properties"]["params"]["$ref"].rsplit("/", 1)[-1]]
    assert model["additionalProperties"] is False and model["description"]
    positions = [prop["position"] for prop in model["properties"].values()]
    assert sorted(positions) == list(range(len(positions)))  # a deliberate order in the UI form
    for key, prop in model["properties"].items():  # a nested section may carry its title on its own model
        ref = prop.get("$ref", "").rsplit("/", 1)[-1]
        assert prop.get("title") or schema["definitions"].get(ref, {}).get("title"), key


# ---------------------------------------------------------------------------------------------------------- CLI


def test_cli_rerun_skips_an_up_to_date_stage(sample_slides: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from dinov3_core.cli import main as cli_main

    slide = by_name(sample_slides, "tissue_20x.svs")
    store = tmp_path / "tiles.zarr"
    argv = [
        "tile",
        "--input",
        str(slide),
        "--output",
        str(store),
        "tile_size=64",
        "mpp=2.0",
        "progress=false",
        "tracking.enabled=false",
    ]
    assert cli_main(argv) == 0
    first = read_json(store / mf.MANIFEST_NAME)
    assert first["status"] == "complete" and first["summary"]["ok"] == 1
    capsys.readouterr()
    assert cli_main(argv) == 0
    assert "tile: up to date" in capsys.readouterr().out
    assert read_json(store / mf.MANIFEST_NAME) == first  # nothing was rewritten
    assert cli_main([*argv, "tile_size=32"]) == 0  # a new config is a new run (the slide is re-tiled)
    changed = read_json(store / mf.MANIFEST_NAME)
    assert changed["config_hash"] != first["config_hash"]
    assert changed["output_fingerprint"] != first["output_fingerprint"]  # downstream stages will rerun
    written = (store / mf.MANIFEST_NAME).stat().st_mtime_ns
    assert cli_main([*argv, "tile_size=32", "--force"]) == 0
    assert (store / mf.MANIFEST_NAME).stat().st_mtime_ns != written  # forced: ran (and found the slide done)
    forced = read_json(store / mf.MANIFEST_NAME)
    assert forced["output_fingerprint"] == changed["output_fingerprint"]  # same tiles: downstream stays valid


def test_training_fault_without_iteration_waits_for_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(faults.ENV, "pretrain")
    faults.on_event("stage.start", stage="pretrain", output=str(tmp_path), training=True)  # not at the start
    with pytest.raises(faults.InjectedFault, match="pretrain after iteration 4"):
        faults.on_event("train.checkpoint", stage="pretrain", output_dir=str(tmp_path), iteration=4, rank=0)
    faults.on_event("train.checkpoint", stage="gram", output_dir=str(tmp_path), iteration=4, rank=1)


def test_atomic_path_replaces_only_on_success(tmp_path: Path):
    from dinov3_core.files import atomic_path

    target = tmp_path / "sub" / "out.json"
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp.suffix == ".json" and not target.exists()
        tmp.write_text("v1")
    assert target.read_text() == "v1"
    with pytest.raises(RuntimeError, match="crash"), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    assert target.read_text() == "v1" and sorted(p.name for p in target.parent.iterdir()) == ["out.json"]
