"""`wsidino pipeline` as a newcomer runs it: the whole chain on the sample slides from a fresh directory, nothing
written outside --workdir (MLflow included), a second call skips every stage, bad input named before anything is
written, and `--print-config` that reproduces the run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dinov3_core import cli
from dinov3_core.config import ConfigError, config_dir
from dinov3_core.pipeline.config import load_pipeline_config, resolve_weights
from dinov3_core.pipeline.run import stage_config
from dinov3_core.stages import STAGE_NAMES as STAGES
from tests.browser import needs_chromium, page_text
from tests.helpers import by_name, read_json
from wsidino_dev.short_run import SHORT_RUN

MANIFESTS = [
    "tiles.zarr/stage_manifest.json",
    "pretrain/stage_manifest.json",
    "gram/stage_manifest.json",
    "model/stage_manifest.json",
    "model/model.onnx.stage_manifest.json",
    "evaluation/stage_manifest.json",
    "features.zarr/stage_manifest.json",
]


def wsidino(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The console command as a user types it, without a tracking URI in the environment."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    command = [sys.executable, "-m", "dinov3_core.cli", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def tree(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def good_slides(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of the three good sample slides and their annotations (symlinks: the files stay shared)."""
    folder = tmp_path_factory.mktemp("my_slides")
    for name in ("tissue_20x.svs", "tissue_40x.svs", "tissue_generic.tiff"):
        (folder / name).symlink_to(by_name(sample_slides, name))
    (folder / "annotations").symlink_to(next(iter(sample_slides.annotations.values())).parent)
    return folder


@pytest.fixture(scope="module")
def first_run(good_slides: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`wsidino pipeline` on the sample slides from a fresh directory: its home, args and result."""
    home = tmp_path_factory.mktemp("fresh")
    slides_before = tree(good_slides)
    args = [
        "pipeline",
        "--slides",
        str(good_slides),
        "--workdir",
        "run",
        "--annotations",
        str(good_slides / "annotations"),
        *SHORT_RUN,
    ]
    done = wsidino(*args, cwd=home)
    return {"home": home, "args": args, "done": done, "slides_before": slides_before}


@pytest.mark.timeout(900)
def test_one_command_runs_every_stage_inside_the_workdir_and_a_rerun_skips_all(
    first_run: dict[str, Any], good_slides: Path
) -> None:
    from mlflow import MlflowClient

    home, args, first = first_run["home"], first_run["args"], first_run["done"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert tree(home) == {Path("run"), *(Path("run") / p for p in tree(home / "run"))}  # nothing beside it
    assert tree(good_slides) == first_run["slides_before"]
    work = home / "run"
    assert {"mlflow.db", "mlartifacts", "tiles.zarr", "pretrain", "gram", "model", "evaluation", "features.zarr"} <= {
        p.name for p in work.iterdir()
    }
    manifests = {rel: read_json(work / rel) for rel in MANIFESTS}
    assert {m["status"] for m in manifests.values()} == {"complete"}
    out = first.stdout
    assert "Pipeline finished" in out and "mlflow ui --app-name wsidino --backend-store-uri sqlite:///" in out
    assert "#/experiments/" in out  # the printed link opens the experiment, not the UI's landing tab
    assert (work / "model" / "MODEL_CARD.md").is_file()

    # One MLflow run for the pipeline, in the workdir's store, with one child per stage.
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("wsidino")
    (parent,) = client.search_runs([experiment.experiment_id], "tags.`wsidino.pipeline` = 'true'")
    children = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["wsidino.stage"] for c in children) == sorted(STAGES)
    assert parent.data.params["stages.pretrain.config"] == "tiny"

    second = wsidino(*args, cwd=home)
    assert second.returncode == 0, second.stderr[-3000:]
    for stage in STAGES:
        assert f"{stage}: up to date" in second.stdout, stage
    assert {rel: read_json(work / rel) for rel in MANIFESTS} == manifests


@pytest.mark.timeout(300)
def test_a_folder_without_a_readable_slide_leaves_nothing(sample_slides: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    for name in ("not_a_slide", "truncated"):
        (unreadable / f"{name}.svs").symlink_to(sample_slides.negatives[name])
    for folder, said in ((empty, "no slides found"), (unreadable, "could be tiled")):
        done = wsidino("pipeline", "--slides", str(folder), "--workdir", str(tmp_path / "run"), cwd=tmp_path)
        assert done.returncode == 2, done.stderr[-2000:]
        assert said in done.stderr and str(folder) in done.stderr
        assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def small_backbone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A vit_test backbone file: weights of another architecture than the GPU configs train."""
    from dinov3_core.models.released import save_backbone
    from dinov3_core.models.vision_transformer import build_backbone

    return save_backbone(build_backbone("vit_test"), tmp_path_factory.mktemp("weights") / "vit_test.pth")


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--workdir", "{file}/run"], "is not a writable directory"),
        (["--weights", "vitb17"], "did you mean 'vitb16'"),
        (["--weights", "vitb16"], "set weights_dir=DIR"),
        (["--config", "vitb16-1gpu"], "continues released DINOv3 weights: give --weights"),
        (["--weights", "{backbone}", "--config", "vitb16-1gpu"], "do not fit the pretrain config"),
        (["--weights", "{file}"], "weights: {file}: cannot be read as a weights file"),  # opened before any stage
        (["pretrain.train.stopat=3"], "did you mean 'pretrain.train.stop_at'"),
        (["gram_anchorin=false"], "did you mean 'gram_anchoring'"),
        (["--to", "tile", "--from", "gram"], "comes after"),
    ],
)
def test_bad_input_is_named_before_anything_is_written(
    extra: list[str],
    said: str,
    good_slides: Path,
    small_backbone: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    extra = [e.format(file=a_file, backbone=small_backbone) for e in extra]
    args = ["pipeline", "--slides", str(good_slides), "--workdir", str(tmp_path / "run"), *extra]
    assert cli.main(args) == cli.EXIT_USAGE
    assert said.format(file=a_file) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.timeout(300)
def test_every_batch_and_crop_problem_is_named_at_once_before_training(
    good_slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found once the tiles exist, before pretrain starts: every training stage's problem with the key as the user
    types it in the pipeline and a value that works; then the same check for `wsidino pretrain` alone."""
    work = tmp_path / "run"
    args = [
        "pipeline",
        "--slides",
        str(good_slides),
        "--workdir",
        str(work),
        "--to",
        "gram",
        "tile.tile_size=64",
        "tile.mpp=2.0",
        "tile.workers=1",
        "pretrain.config=tiny",
        "gram.config=tiny",
        "pretrain.train.global_batch_size=4096",
        "pretrain.train.batch_size_per_gpu=8",
        "gram.train.batch_size_per_gpu=5000",
        "gram.crops.global_size=96",
    ]
    assert cli.main(args) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "3 problem(s) found before any work once the tile stage ran" in err, err
    for key in ("pretrain.train.global_batch_size", "gram.train.batch_size_per_gpu", "gram.crops.global_size"):
        assert f"  {key}: " in err
    assert "tile store holds" in err and "larger than the store's 64 px tiles" in err
    assert "Traceback" not in err and not (work / "pretrain").exists()  # no training job was started
    tiles = int(err.split("the tile store holds ")[1].split(";")[0])
    assert f"gram.train.batch_size_per_gpu={tiles} (or fewer)" in err  # a value that works
    # The same rule for the stage alone, in its own keys, before a run directory is made or a rank started.
    alone = wsidino(
        "pretrain",
        "--store",
        str(work / "tiles.zarr"),
        "--output-dir",
        str(tmp_path / "alone"),
        "train.global_batch_size=4096",
        "train.batch_size_per_gpu=8",
        cwd=tmp_path,
    )
    assert alone.returncode == 2, alone.stderr[-2000:]
    assert "  train.global_batch_size: one batch is 4096 tiles" in alone.stderr
    assert "Traceback" not in alone.stderr and not (tmp_path / "alone").exists()


def test_unreadable_annotations_are_named_before_anything_is_written(
    good_slides: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    annotations = tmp_path / "annotations"
    annotations.mkdir()
    (annotations / "tissue_20x.geojson").write_text('{"type": "FeatureCollection", "features": [')  # cut off
    (annotations / "tissue_40x.geojson").write_bytes(b"\x93not json")
    args = [
        "pipeline",
        "--slides",
        str(good_slides),
        "--workdir",
        str(tmp_path / "run"),
        "--annotations",
        str(annotations),
    ]
    assert cli.main(args) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "2 problem(s) found before any work" in err, err
    for name in ("tissue_20x.geojson", "tissue_40x.geojson"):
        assert f"  annotations: {annotations / name}" in err or str(annotations / name) in err
    assert not (tmp_path / "run").exists()


def test_print_config_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # as on a user's machine
    args = [
        "--slides",
        "s/",
        "--workdir",
        str(tmp_path / "w"),
        "--from",
        "convert",
        "--force",
        "export",
        "pretrain.train.stop_at=9",
        "tile.config=cohort-jpeg",
    ]
    assert cli.main(["pipeline", *args, "--print-config"]) == cli.EXIT_OK
    printed = capsys.readouterr().out
    doc = yaml.safe_load(printed)
    assert (
        doc["start_at"] == "convert" and doc["force"] == ["export"] and doc["stages"]["tile"]["config"] == "cohort-jpeg"
    )
    assert doc["stages"]["pretrain"]["overrides"] == ["train.stop_at=9"]
    assert doc["tracking"]["uri"] == f"sqlite:///{tmp_path / 'w' / 'mlflow.db'}"  # the store is in the workdir
    (tmp_path / "resolved.yaml").write_text(printed)
    assert cli.main(["pipeline", "--config", str(tmp_path / "resolved.yaml"), "--print-config"]) == cli.EXIT_OK
    assert capsys.readouterr().out == printed


@pytest.mark.parametrize("name", sorted(p.stem for p in (config_dir() / "pipeline").glob("*.yaml")))
def test_every_pipeline_config_builds_every_stage(name: str, tmp_path: Path) -> None:
    cfg = load_pipeline_config(name, {"slides": "s/", "workdir": str(tmp_path)})
    weights = None if name == "cpu" else tmp_path / "dinov3_released.pth"  # the GPU recipes continue released weights
    configs = {stage: stage_config(cfg, stage, weights) for stage in STAGES}
    assert configs["pretrain"].data.stores == [str(tmp_path / "tiles.zarr")]
    assert configs["extract"].model == str(tmp_path / "model" / "model.onnx")
    expected_device = "cpu" if name == "cpu" else "cuda"
    assert configs["pretrain"].train.device == configs["gram"].train.device == expected_device


def test_a_stage_key_adds_to_the_named_configs_overrides(tmp_path: Path) -> None:
    cfg = load_pipeline_config("cpu", {"slides": "s/", "workdir": str(tmp_path), "tile.filters.pen_filter": True})
    assert cfg.stages["tile"].overrides == ["workers=2", "filters.pen_filter=true"]
    cfg = load_pipeline_config("cpu", {"slides": "s/", "workdir": str(tmp_path), "tile.workers": 1})
    assert stage_config(cfg, "tile").workers == 1  # the user's value wins over the named config's
    with pytest.raises(ConfigError, match=r"the pipeline .* sets these itself"):
        stage_config(load_pipeline_config("cpu", {"slides": "s/", "workdir": "w", "tile.output": "x"}), "tile")


def test_a_weights_preset_is_found_in_the_weights_folder(tmp_path: Path) -> None:
    released = tmp_path / "dinov3_vitb16_pretrain_lvd1689m-73cec8be.pth"
    released.write_bytes(b"")
    cfg = load_pipeline_config(
        "cpu", {"slides": "s/", "workdir": "w", "weights": "vitb16", "weights_dir": str(tmp_path)}
    )
    assert resolve_weights(cfg) == released
    cfg.weights = "vitl16"
    with pytest.raises(ConfigError, match=r"no dinov3_vitl16_pretrain_\*\.pth in .* never downloaded|download it"):
        resolve_weights(cfg)


def test_a_stage_alone_logs_to_the_store_of_its_work_directory(
    good_slides: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dinov3_core.config import load_config
    from dinov3_core.export.config import ExportConfig
    from dinov3_core.runner import default_tracking_store
    from dinov3_core.stages import get_stage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    started_in = tmp_path / "elsewhere"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    work = tmp_path / "work"
    args = [
        "tile",
        "--input",
        str(good_slides / "tissue_20x.svs"),
        "--output",
        str(work / "tiles.zarr"),
        "tile_size=64",
        "mpp=2.0",
    ]
    assert cli.main(args) == cli.EXIT_OK
    assert (work / "mlflow.db").is_file() and (work / "mlartifacts").is_dir()
    assert not list(started_in.iterdir())  # nothing where the command was started
    # export writes into work/model/: it finds the store one folder up, so its run joins the same registry.
    values = {"weights": str(work / "model" / "backbone.pth"), "output": str(work / "model" / "model.onnx")}
    export = load_config(ExportConfig, None, values, stage="export")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # mlflow.set_tracking_uri exported it for children
    default_tracking_store(get_stage("export"), export)
    assert export.tracking.uri == f"sqlite:///{work / 'mlflow.db'}"


@needs_chromium
@pytest.mark.timeout(300)
def test_the_printed_mlflow_link_opens_the_pipelines_runs_in_a_browser(first_run: dict[str, Any]) -> None:
    """What a newcomer does next: starts the MLflow UI on the workdir's store and opens the printed link."""
    from wsidino_dev.serve.servers import start_mlflow_server

    work = first_run["home"] / "run"
    (link,) = [line.split("→ ")[1].strip() for line in first_run["done"].stdout.splitlines() if "mlflow ui" in line]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_mlflow_server(work, port)  # the workdir's mlflow.db and mlartifacts/, as `mlflow ui` serves them
    try:
        text = page_text(link.replace("127.0.0.1:5000", f"127.0.0.1:{port}"))
    finally:
        server.stop()
    assert "Run Name" in text and "pipeline" in text, text[:2000]  # the runs table of the experiment
    assert "No data available for the selected time range" not in text  # not the GenAI traces overview
