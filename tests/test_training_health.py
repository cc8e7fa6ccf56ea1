"""Training health on real runs: the no-information gap is measured, and a run that does not learn says so."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from dinov3_core.train.health import HEALTH_FILE, TrainingInertError, warmups_end
from dinov3_core.train.metrics import read_metrics
from dinov3_core.train.pretrain import run_pretrain
from tests.helpers import pretrain_config

pytestmark = pytest.mark.usefixtures("one_thread")

# Hot teacher targets (temperature 5 against the student's 0.1) carry no information: the student cannot leave ln K.
INERT = {"teacher.teacher_temp": 5.0, "teacher.warmup_teacher_temp": 5.0, "teacher.warmup_teacher_temp_epochs": 0,
         "optim.warmup_epochs": 0, "optim.freeze_last_layer_epochs": 0, "train.stop_at": 12,
         "health.patience": 6, "health.judge_at": 0.0}  # fmt: skip


def test_an_inert_run_is_called_not_learning_and_names_the_keys(small_tile_store: Path, tmp_path: Path) -> None:
    cfg = pretrain_config(small_tile_store, tmp_path / "inert", **INERT)
    assert warmups_end(cfg) == 0
    result = run_pretrain(cfg)
    assert result.health.startswith("not learning") and "teacher.teacher_temp" in result.health
    verdict = json.loads((tmp_path / "inert" / HEALTH_FILE).read_text())
    assert verdict == {"iteration": 12, "verdict": result.health}
    rows = read_metrics(tmp_path / "inert" / "training_metrics.json")
    gaps = [r["dino_gap"] for r in rows]
    assert all(abs(g) < 0.05 for g in gaps)  # ln 256 − loss: the student sits at the no-information level
    assert all(r["teacher_entropy"] > 0.99 for r in rows)  # near-uniform targets: nothing to learn from
    for row in rows:
        assert row["dino_gap"] == pytest.approx(math.log(256) - row["dino_global_loss"])


def test_the_watch_passes_a_learning_run_and_waits_for_the_warmups(tmp_path: Path) -> None:
    from dinov3_core.train.health import HealthWatch

    cfg = pretrain_config(tmp_path / "store", tmp_path / "out", **{**INERT, "optim.warmup_epochs": 2})
    watch = HealthWatch(cfg)
    assert watch.start == warmups_end(cfg) == 10  # 2 epochs × 5 iterations
    for it in range(10):  # during the warm-ups a loss at ln K says nothing
        assert watch.observe(it, {"dino_gap": 0.0}) is None
    assert watch.verdict().startswith("not judged yet")
    for it in range(10, 16):
        assert watch.observe(it, {"dino_gap": 0.4}) is None
    assert watch.judged and watch.verdict() == "learning: the DINO loss left its no-information level by iteration 15"


def test_the_verdict_waits_for_its_deadline_and_corrects_a_late_learner(tmp_path: Path) -> None:
    from dinov3_core.train.health import HealthWatch

    cfg = pretrain_config(tmp_path / "store", tmp_path / "out", **{**INERT, "health.judge_at": 0.5})
    watch = HealthWatch(cfg)
    assert watch.deadline == 10  # half of 20 iterations (later than warm-ups 0 + patience 6)
    for it in range(9):  # flat, but not due yet
        assert watch.observe(it, {"dino_gap": 0.001}) is None
    alarm = watch.observe(9, {"dino_gap": 0.001})
    assert alarm is not None and alarm.startswith("not learning: by iteration 9 (health.judge_at=0.5")
    for it in range(10, 16):  # warn policy: it runs on, and learns after all
        watch.observe(it, {"dino_gap": 0.3})
    assert watch.verdict().startswith("learning late: the DINO loss left its no-information level only by iteration")


def test_a_short_run_is_not_judged(small_tile_store: Path, tmp_path: Path) -> None:
    early = pretrain_config(small_tile_store, tmp_path / "early", **{**INERT, "optim.warmup_epochs": 4})
    assert warmups_end(early) == 20  # 4 epochs × 5 iterations: the run stops at 12, before any verdict
    assert run_pretrain(early).health.startswith("not judged yet")


def test_stop_policy_ends_the_run_with_the_message(small_tile_store: Path, tmp_path: Path) -> None:
    cfg = pretrain_config(small_tile_store, tmp_path / "stop", **{**INERT, "health.policy": "stop"})
    with pytest.raises(
        TrainingInertError, match=r"not learning: by iteration 5 .*over iterations 0…5 .*health.policy=stop"
    ):
        run_pretrain(cfg)
    # Through the CLI (torchrun): bad-input exit code 2, and the rank's own message as the root cause.
    args = [f"{k}={v}" for k, v in {**INERT, "health.policy": "stop", "tracking.enabled": False,
                                    "optim.warmup_epochs": 0, "train.global_batch_size": 8}.items()]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "dinov3_core.cli", "pretrain", "--store", str(small_tile_store), "--output-dir",
         str(tmp_path / "cli"), *args], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "not learning" in done.stderr and "teacher.teacher_temp" in done.stderr


def test_schedules_that_cannot_work_for_the_run_length(tmp_path: Path) -> None:
    from dinov3_core.config import ConfigError
    from dinov3_core.train import config as C
    from dinov3_core.train.health import schedule_warnings

    too_long = r"teacher\.warmup_teacher_temp_epochs=4(\.0)? epochs is 20 iterations, but the run has 20"
    with pytest.raises(ConfigError, match=too_long):
        C.validate(pretrain_config(tmp_path, tmp_path / "a", **{"teacher.warmup_teacher_temp_epochs": 4}))
    with pytest.raises(ConfigError, match=r"optim\.freeze_last_layer_epochs=5(\.0)? epochs"):
        C.validate(pretrain_config(tmp_path, tmp_path / "b", **{"optim.freeze_last_layer_epochs": 5}))
    slow = pretrain_config(tmp_path, tmp_path / "c", **{"teacher.warmup_teacher_temp_epochs": 3,
                                                         "teacher.momentum_teacher": 0.5})  # fmt: skip
    C.validate(slow)  # possible, but most of the run learns from soft targets: said at start
    warnings = schedule_warnings(slow, stop_iteration=20)
    assert any("teacher.warmup_teacher_temp_epochs" in w for w in warnings)
    assert any("no health verdict" in w for w in warnings)  # 0 + 50 > 20
    frozen = pretrain_config(tmp_path, tmp_path / "e", **{"train.epoch_length": 250,
                                                           "teacher.final_momentum_teacher": 1.0})  # fmt: skip
    (warning,) = schedule_warnings(frozen, stop_iteration=1000)
    assert "barely moves after iteration 509 of 1000" in warning and "final_momentum_teacher=auto" in warning
    auto = {
        f"teacher.{k}": "auto" for k in ("momentum_teacher", "final_momentum_teacher", "warmup_teacher_temp_epochs")
    }
    fitted = pretrain_config(tmp_path, tmp_path / "f", **{"train.epoch_length": 250, **auto})
    assert schedule_warnings(fitted, stop_iteration=1000) == []


SHIPPED = sorted((Path(__file__).parents[1] / "configs").glob("*/*.yaml"))


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.parent.name in ("pretrain", "gram")], ids=lambda p: p.stem)
def test_every_shipped_training_recipe_fits_its_length(path: Path, tmp_path: Path) -> None:
    from dinov3_core.config import load_config
    from dinov3_core.gram.config import GramConfig
    from dinov3_core.train import config as C
    from dinov3_core.train.health import schedule_warnings

    schema = GramConfig if path.parent.name == "gram" else C.PretrainConfig
    required = ["data.stores=[x]", f"output_dir={tmp_path}", "student.pretrained_weights=w.pth", "pretrain_dir=p"]
    cfg = load_config(schema, str(path), [o for o in required if o.split("=")[0] in _keys(schema)],
                      stage=path.parent.name)  # fmt: skip
    C.validate(cfg)
    warnings = [w for w in schedule_warnings(cfg, C.total_iterations(cfg)) if "no health verdict" not in w]
    if path.stem == "tiny":  # test-sized (20 iterations): too short for any EMA teacher, and it says so
        assert len(warnings) == 1 and "barely moves" in warnings[0] and "momentum_teacher=auto" in warnings[0]
    else:
        assert warnings == []


def _keys(schema: type) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(schema)} | {"student.pretrained_weights", "data.stores"}
