"""Retraining cycles without Prefect: the rules (snapshot changes, retention, cycle ids, overrides) on real files,
and `wsidino retrain`'s bad-input paths, each failing before anything is trained or promoted.

The whole cycle, deployed and scheduled as users run it, is tests/test_retrain_flow.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dinov3_core.config import ConfigError
from dinov3_core.retrain import retention
from dinov3_core.retrain.config import RetentionConfig, RetrainError, load_retrain_config
from dinov3_core.retrain.cycles import CycleLayout, CycleRecord, Decision, list_cycles, open_cycle, root_lock
from dinov3_core.retrain.snapshot import SlideRecord, Snapshot, compare
from tests.helpers import REPO

# ---------------------------------------------------------------------------------------------- the rules


def test_compare_names_new_rescanned_and_removed_slides() -> None:
    before = Snapshot("s", [SlideRecord("a", "f1", 10), SlideRecord("b", "f2", 20), SlideRecord("gone", "f3", 5)])
    now = Snapshot("s", [SlideRecord("a", "f1", 10), SlideRecord("b", "f2-rescan", 25), SlideRecord("c", "f4", 7)])
    change = compare(now, before)
    assert (change.new, change.changed, change.removed, change.new_tiles) == (["c"], ["b"], ["gone"], 32)
    assert change.added == 2 and "1 removed (gone)" in change.describe()
    assert compare(now, None).new == ["a", "b", "c"]
    assert now.hash != before.hash and Snapshot("s", list(reversed(now.slides))).hash == now.hash


def test_stage_keys_go_to_their_stage_and_typos_are_named() -> None:
    cfg = load_retrain_config("tiny", ["pretrain.train.stop_at=4", "trigger.min_new_slides=3", "root=r", "slides=s"])
    assert cfg.stages["pretrain"].config == "cpu" and cfg.stages["pretrain"].overrides == ["train.stop_at=4"]
    assert cfg.trigger.min_new_slides == 3
    with pytest.raises(ConfigError, match=r"did you mean 'trigger\.min_new_slides'"):
        load_retrain_config("tiny", ["triger.min_new_slides=3", "root=r", "slides=s"])
    with pytest.raises(ConfigError, match="warm_start=released needs pretrained_weights"):
        load_retrain_config("tiny", ["warm_start=released", "root=r", "slides=s"])
    with pytest.raises(ConfigError, match=r"stages\.pretrian: 'pretrian' is not a stage \(did you mean 'pretrain'"):
        load_retrain_config("tiny", ["stages.pretrian.config=cpu", "root=r", "slides=s"])


def test_a_config_file_of_the_old_layout_is_told_where_stage_choices_go(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text("pretrain: {config: cpu}\n")
    with pytest.raises(ConfigError, match=r"'pretrain' in config file .*old\.yaml is now 'stages\.pretrain'"):
        load_retrain_config(str(old), ["root=r", "slides=s"])


def test_a_retry_resumes_its_cycle_and_a_new_attempt_abandons_an_interrupted_one(tmp_path: Path) -> None:
    layout = CycleLayout(tmp_path)
    first, resumed = open_cycle(layout, "flow-run-1")
    assert not resumed and first.number == 1
    again, resumed = open_cycle(layout, "flow-run-1")  # the same flow run, retried
    assert resumed and again.id == first.id and again.attempts == 2
    second, resumed = open_cycle(layout, "flow-run-2")  # a new flow run: a new cycle
    assert not resumed and second.number == 2
    assert [c.status for c in list_cycles(layout)] == ["abandoned", "running"]


def test_one_cycle_per_root_at_a_time(tmp_path: Path) -> None:
    layout = CycleLayout(tmp_path)
    busy = pytest.raises(RetrainError, match=r"another retraining cycle is running .*pid \d+")
    with root_lock(layout), busy, root_lock(layout):
        pass
    with root_lock(layout):  # released when its holder ends
        pass


def _cycle(layout: CycleLayout, number: int, status: str, promoted: bool | None = None) -> CycleRecord:
    record = CycleRecord(f"{number:04d}-20261124", number, f"run-{number}", status=status)  # type: ignore[arg-type]
    if promoted is not None:
        record.decision = Decision(promoted)
    d = layout.cycle_dir(record.id)
    for sub in ("pretrain/ckpt/7", "pretrain/eval/training_7", "gram/ckpt/9", "model", "evaluation/cache"):
        (d / sub).mkdir(parents=True)
    files = (
        "model/backbone.pth",
        "model/model.onnx",
        "evaluation/evaluation.json",
        "evaluation/evaluation.md",
        "pretrain/eval/training_7/teacher_checkpoint.pth",
        "pretrain/eval/training_7/probe.json",
    )
    for f in files:
        (d / f).write_text("x")
    (d / "snapshot.json").write_text("{}")
    record.save(layout)
    return record


def test_retention_removes_what_it_should_and_nothing_else(tmp_path: Path) -> None:
    layout = CycleLayout(tmp_path)
    cycles = [
        _cycle(layout, 1, "trained", promoted=True),  # an earlier champion: rollback target
        _cycle(layout, 2, "trained", promoted=False),  # old candidate beyond keep_last: records only
        _cycle(layout, 3, "failed"),  # failed: records only
        _cycle(layout, 4, "trained", promoted=True),  # the champion: whole
        _cycle(layout, 5, "trained", promoted=False),  # recent candidate: models kept, checkpoints go
        _cycle(layout, 6, "running"),  # another cycle not finished (never touched)
        _cycle(layout, 7, "trained", promoted=False),  # the running one (this cycle)
    ]
    plan = retention.plan(
        layout, cycles, RetentionConfig(keep_last=1), running=cycles[6].id, champion_cycle=cycles[3].id
    )
    retention.apply(layout, plan)
    left = {
        c.id: sorted(
            str(p.relative_to(layout.cycle_dir(c.id))) for p in layout.cycle_dir(c.id).rglob("*") if p.is_file()
        )
        for c in cycles
    }
    everything = [
        "cycle.json",
        "evaluation/evaluation.json",
        "evaluation/evaluation.md",
        "model/backbone.pth",
        "model/model.onnx",
        "pretrain/eval/training_7/probe.json",
        "snapshot.json",
    ]
    records = ["cycle.json", "evaluation/evaluation.json", "evaluation/evaluation.md", "snapshot.json"]
    assert left[cycles[0].id] == everything and left[cycles[4].id] == everything
    assert left[cycles[1].id] == records and left[cycles[2].id] == records
    for kept_whole in (3, 5, 6):
        assert (layout.cycle_dir(cycles[kept_whole].id) / "pretrain" / "ckpt" / "7").is_dir()
    assert not (layout.cycle_dir(cycles[0].id) / "pretrain" / "ckpt").exists()
    for whole in (3, 5, 6):
        assert (layout.cycle_dir(cycles[whole].id) / "pretrain/eval/training_7/teacher_checkpoint.pth").is_file()


def test_retention_refuses_paths_outside_a_cycle(tmp_path: Path) -> None:
    layout = CycleLayout(tmp_path / "root")
    (tmp_path / "precious").mkdir()
    plan = retention.RetentionPlan(delete=[tmp_path / "precious"])
    with pytest.raises(RuntimeError, match="refused"):
        retention.apply(layout, plan)
    assert (tmp_path / "precious").is_dir()


def test_a_champion_of_another_architecture_is_named_before_training(tmp_path: Path) -> None:
    from dinov3_core.models.released import save_backbone
    from dinov3_core.models.vision_transformer import backbone_kwargs, build_backbone
    from dinov3_core.retrain.warm_start import check_architecture
    from dinov3_core.train.config import PretrainConfig

    weights = save_backbone(build_backbone("vit_test"), tmp_path / "model" / "backbone.pth")
    (tmp_path / "model" / "config.yaml").write_text(
        yaml.safe_dump({"arch": "inferred", "backbone_kwargs": backbone_kwargs("vit_test")})
    )
    same = PretrainConfig()
    same.student.arch = "vit_test"
    check_architecture(weights, same, "3", "reg")  # fits: nothing raised
    other = PretrainConfig()
    other.student.arch = "vits16"
    with pytest.raises(RetrainError, match=r"reg v3, .*student.arch=vits16: embed_dim 64 vs 384"):
        check_architecture(weights, other, "3", "reg")


# ---------------------------------------------------------------------------------- wsidino retrain, bad input


def _retrain(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "dinov3_core.cli",
        "retrain",
        "--slides",
        str(tmp_path / "slides"),
        "--root",
        str(tmp_path / "root"),
        "--config",
        "tiny",
        *args,
    ]
    return subprocess.run(
        cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300, check=False
    )


def test_a_stage_key_typo_fails_before_anything_runs(tmp_path: Path) -> None:
    done = _retrain(tmp_path, "pretrain.train.stop_att=4", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}")
    assert done.returncode == 2, done.stderr
    assert "pretrain (config cpu)" in done.stderr and "did you mean 'pretrain.train.stop_at'" in done.stderr
    assert not (tmp_path / "root").exists()


def test_an_unreachable_registry_stops_the_cycle_before_it_starts(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    done = _retrain(tmp_path, f"tracking.uri=http://127.0.0.1:{port}", env=env)
    assert done.returncode == 2, done.stderr
    assert f"the MLflow registry at http://127.0.0.1:{port} cannot be reached" in done.stderr
    assert "nothing was promoted" in done.stderr and not (tmp_path / "root" / "cycles").exists()


def test_a_second_cycle_on_a_busy_root_names_the_holder(tmp_path: Path) -> None:
    with root_lock(CycleLayout(tmp_path / "root")):
        done = _retrain(tmp_path, f"tracking.uri=sqlite:///{tmp_path / 'm.db'}")
    assert done.returncode == 2 and f"pid {os.getpid()}" in done.stderr, done.stderr
    assert not (tmp_path / "root" / "cycles").exists()


def test_retention_with_a_real_registry_spares_the_champions_files_cycles_in_use_and_everything_outside(
    tmp_path: Path,
) -> None:
    """The cycle's own retention step (`_Cycle.retain`) against a real MLflow registry: the champion is a version
    registered outside any cycle (no cycle tag) whose files live in an old candidate's cycle; a failed cycle holds a
    link to a folder outside the root. Nothing of the champion, of a running cycle, or outside cycles/ goes."""
    from mlflow import MlflowClient

    from dinov3_core.retrain.config import load_retrain_config
    from dinov3_core.retrain.cycle import _Cycle
    from dinov3_core.retrain.registry import WEIGHTS_TAG
    from tests.helpers import sqlite_uri

    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.pth").write_text("keep me")
    uri = sqlite_uri(tmp_path)
    cfg = load_retrain_config(
        "tiny", {"slides": str(tmp_path / "slides"), "root": str(root), "tracking.uri": uri, "retention.keep_last": 0}
    )
    layout = CycleLayout(root)
    cycles = [
        _cycle(layout, 1, "trained", promoted=False),  # an old candidate: its model folder holds the champion
        _cycle(layout, 2, "failed"),  # records only; it holds a link to a folder outside the root
        _cycle(layout, 3, "running"),  # in use by another attempt: never touched
        _cycle(layout, 4, "trained", promoted=False),  # this cycle, finishing
    ]
    (layout.cycle_dir(cycles[1].id) / "model" / "outside").symlink_to(outside)
    (root / "tiles.zarr").mkdir()
    (root / "tiles.zarr" / "zarr.json").write_text("{}")
    champion_weights = layout.cycle_dir(cycles[0].id) / "model" / "backbone.pth"
    client = MlflowClient(tracking_uri=uri)
    client.create_registered_model(cfg.register_name)
    version = client.create_model_version(
        cfg.register_name, source=str(champion_weights.parent), tags={WEIGHTS_TAG: str(champion_weights)}
    )
    client.set_registered_model_alias(cfg.register_name, "champion", version.version)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink()}

    cycle = _Cycle(cfg, lambda *a, **k: None, log=lambda line: None)  # type: ignore[arg-type]
    cycle.record = cycles[3]
    cycle.retain()

    gone = {p for p in before if not p.exists()}
    assert champion_weights.read_bytes() == before[champion_weights]  # the champion's files, outside its tag's rule
    assert (champion_weights.parent / "model.onnx").is_file()
    assert not any(layout.cycle_dir(cycles[2].id) in p.parents for p in gone)  # the running cycle: untouched
    assert (outside / "precious.pth").read_text() == "keep me"  # the link went, not what it points to
    assert not (layout.cycle_dir(cycles[1].id) / "model").exists()
    assert all(layout.cycles in p.parents for p in gone) and (root / "tiles.zarr" / "zarr.json").is_file()
    assert gone  # and retention did delete something (the failed cycle's files, old checkpoints)
