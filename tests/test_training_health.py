"""Training health on real runs: the no-information gap is measured, and a run that does not learn says so."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dinov3_core.config import packaged_config_dir
from dinov3_core.train.health import HEALTH_FILE, TrainingInertError, warmups_end
from dinov3_core.train.metrics import read_metrics
from dinov3_core.train.pretrain import run_pretrain
from tests.helpers import pretrain_config

pytestmark = pytest.mark.usefixtures("one_thread")

# Hot teacher targets (temperature 5 against the student's 0.1) carry no information: the student cannot leave ln K.
INERT = {
    "teacher.teacher_temp": 5.0,
    "teacher.warmup_teacher_temp": 5.0,
    "teacher.warmup_teacher_temp_epochs": 0,
    "optim.warmup_epochs": 0,
    "optim.freeze_last_layer_epochs": 0,
    "train.stop_at": 12,
    "health.patience": 6,
    "health.judge_at": 0.0,
}


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
    args = [
        f"{k}={v}"
        for k, v in {
            **INERT,
            "health.policy": "stop",
            "tracking.enabled": False,
            "optim.warmup_epochs": 0,
            "train.global_batch_size": 8,
        }.items()
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dinov3_core.cli",
            "pretrain",
            "--store",
            str(small_tile_store),
            "--output-dir",
            str(tmp_path / "cli"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    slow = pretrain_config(
        tmp_path, tmp_path / "c", **{"teacher.warmup_teacher_temp_epochs": 3, "teacher.momentum_teacher": 0.5}
    )
    C.validate(slow)  # possible, but most of the run learns from soft targets: said at start
    warnings = schedule_warnings(slow, stop_iteration=20)
    assert any("teacher.warmup_teacher_temp_epochs" in w for w in warnings)
    assert any("no health verdict" in w for w in warnings)  # 0 + 50 > 20
    frozen = pretrain_config(
        tmp_path, tmp_path / "e", **{"train.epoch_length": 250, "teacher.final_momentum_teacher": 1.0}
    )
    (warning,) = schedule_warnings(frozen, stop_iteration=1000)
    assert "barely moves after iteration 509 of 1000" in warning and "final_momentum_teacher=auto" in warning
    auto = {
        f"teacher.{k}": "auto" for k in ("momentum_teacher", "final_momentum_teacher", "warmup_teacher_temp_epochs")
    }
    fitted = pretrain_config(tmp_path, tmp_path / "f", **{"train.epoch_length": 250, **auto})
    assert schedule_warnings(fitted, stop_iteration=1000) == []


SHIPPED = sorted(packaged_config_dir().glob("*/*.yaml"))


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.parent.name in ("pretrain", "gram")], ids=lambda p: p.stem)
def test_every_shipped_training_recipe_fits_its_length(path: Path, tmp_path: Path) -> None:
    from dinov3_core.config import load_config
    from dinov3_core.gram.config import GramConfig
    from dinov3_core.train import config as C
    from dinov3_core.train.health import schedule_warnings

    schema = GramConfig if path.parent.name == "gram" else C.PretrainConfig
    required = ["data.stores=[x]", f"output_dir={tmp_path}", "student.pretrained_weights=w.pth", "pretrain_dir=p"]
    cfg = load_config(
        schema, str(path), [o for o in required if o.split("=")[0] in _keys(schema)], stage=path.parent.name
    )
    C.validate(cfg)
    warnings = [w for w in schedule_warnings(cfg, C.total_iterations(cfg)) if "no health verdict" not in w]
    if path.stem == "tiny":  # test-sized (20 iterations): too short for any EMA teacher, and it says so
        assert len(warnings) == 1 and "barely moves" in warnings[0] and "momentum_teacher=auto" in warnings[0]
    else:
        assert warnings == []


def _keys(schema: type) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(schema)} | {"student.pretrained_weights", "data.stores"}


# ------------------------------------------------------------------------------- the probe: rank, invariance


def test_invariance_is_one_for_identical_views_and_chance_for_unrelated_ones() -> None:
    import torch

    from dinov3_core.train.label_free import effective_rank, invariance

    g = torch.Generator().manual_seed(0)
    a = torch.randn(256, 64, generator=g)
    assert invariance(a, a) == 1.0
    assert invariance(a, a + 0.3 * torch.randn(256, 64, generator=g)) > 0.95  # views that keep the tile
    assert invariance(a, torch.randn(256, 64, generator=g)) < 0.03  # unrelated views: chance is 1/256
    assert invariance(a, a.roll(1, dims=0)) == 0.0  # every tile's other view is another tile's
    constant = torch.ones(256, 64)
    assert invariance(constant, constant) == 0.0 and effective_rank(constant) == 0.0  # collapse scores nothing
    assert effective_rank(constant + 1e-6 * a) == 0.0  # …rounding noise around one vector included
    assert 0.5 < effective_rank(a) <= 1.0


def test_agreement_counts_the_loss_pairs() -> None:
    """Student crop i is compared with the teacher's target for crop j ≠ i, as the DINO global loss pairs them."""
    import torch

    from dinov3_core.train.ssl_model import dino_agreement

    teacher = torch.softmax(torch.randn(2, 32, 256, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert float(dino_agreement(teacher.flip(0).log(), teacher)) == 1.0  # predicts the other crop's target
    assert float(dino_agreement(teacher.log(), teacher)) < 0.1  # predicts its own crop's: not what is scored


def test_probe_scores_are_logged_at_eval_checkpoints_and_match_the_checkpoint_files(
    small_tile_store: Path, tmp_path: Path
) -> None:
    """The teacher in memory (training) and its eval checkpoint file (evaluate.checkpoints) give the same scores:
    one implementation, the same tiles and views."""
    from dinov3_core.evaluate.checkpoints import probe_scores
    from dinov3_core.gram.teacher import find_eval_checkpoints
    from dinov3_core.train.health_probe import PROBE_FILE

    out = tmp_path / "probe"
    cfg = pretrain_config(small_tile_store, out, **{"train.stop_at": 4, "evaluation.eval_period_iterations": 2})
    run_pretrain(cfg)
    rows = {r["iteration"]: r for r in read_metrics(out / "training_metrics.json")}
    assert all(0.0 <= r["agreement"] <= 1.0 for r in rows.values())
    probed = {it: r for it, r in rows.items() if "effective_rank" in r}
    assert sorted(probed) == [1, 3]  # the eval checkpoints' iterations
    for r in probed.values():
        assert 0.1 < r["effective_rank"] <= 1.0  # a random-init teacher spreads its features
        assert 0.0 <= r["invariance"] < 0.2  # …but barely recognises a tile under strong augmentation
        assert r["probe_seconds"] < 10
    record = json.loads((out / PROBE_FILE).read_text())
    assert record["n_tiles"] == 256 and record["holdout_slides"] == [] and len(record["hash"]) == 16
    for c in find_eval_checkpoints(out):
        again = probe_scores(out, c.path)
        assert again is not None and again["invariance"] == probed[c.iteration]["invariance"]
        assert again["effective_rank"] == pytest.approx(probed[c.iteration]["effective_rank"], abs=1e-5)


def test_probe_scores_do_not_depend_on_the_number_of_processes(small_tile_store: Path, tmp_path: Path) -> None:
    """2 gloo ranks embed alternate tile groups through the sharded teacher; the gathered scores are those of one
    process scoring the same eval checkpoint alone (40 tiles: 3 groups, one of them padding on rank 1)."""
    from dinov3_core.evaluate.checkpoints import probe_scores
    from tests.helpers import PRETRAIN_RUNS_SCRIPT, pretrain_values, torchrun

    out = tmp_path / "two"
    values = pretrain_values(
        small_tile_store, out, **{"train.stop_at": 2, "train.batch_size_per_gpu": 4, "health.probe_tiles": 40}
    )
    torchrun(str(PRETRAIN_RUNS_SCRIPT), json.dumps(values), timeout=300)
    (logged,) = [r for r in read_metrics(out / "training_metrics.json") if "effective_rank" in r]
    alone = probe_scores(out, out / "eval" / "training_1" / "teacher_checkpoint.pth")
    assert alone is not None and alone["invariance"] == logged["invariance"]
    assert alone["effective_rank"] == pytest.approx(logged["effective_rank"], abs=1e-5)


def test_collapsed_teacher_features_raise_the_alarm(small_tile_store: Path, tmp_path: Path) -> None:
    """Warm-started from a backbone whose patch embedding and blocks are zero, the teacher gives every tile its CLS
    token: zero blocks attend to nothing and get no gradient, so it stays so (a learning rate of 1e-9 for the rest)."""
    import torch

    from dinov3_core.train.ssl_model import build_ssl_model

    base = {"train.stop_at": 2, "evaluation.eval_period_iterations": 2, "optim.lr": 1e-9}
    teacher = build_ssl_model(pretrain_config(small_tile_store, tmp_path / "x", **base)).model.teacher.state_dict()
    for key, value in teacher.items():
        if key.startswith(("backbone.patch_embed", "backbone.blocks")):
            value.zero_()
    weights = tmp_path / "collapsed" / "teacher_checkpoint.pth"
    weights.parent.mkdir()
    torch.save({"teacher": teacher}, weights)
    collapsed = {**base, "student.pretrained_weights": str(weights), "health.policy": "stop"}
    with pytest.raises(TrainingInertError, match=r"features collapsed: at iteration 1, .*effective rank of 0\.0000"):
        run_pretrain(pretrain_config(small_tile_store, tmp_path / "stop", **collapsed))
    warn = {**collapsed, "health.policy": "warn"}
    result = run_pretrain(pretrain_config(small_tile_store, tmp_path / "warn", **warn))
    assert result.health.startswith("not learning: features collapsed") and "losses.koleo_weight" in result.health
    (probed,) = [r for r in read_metrics(tmp_path / "warn" / "training_metrics.json") if "effective_rank" in r]
    assert probed["effective_rank"] == 0.0 and probed["invariance"] == 0.0


# ---------------------------------------------------------------------------------------- held-out slides


@pytest.fixture(scope="module")
def three_slides(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three good sample slides tiled at 64 px, 2 µm/px into one store (tens of tiles each)."""
    from tests.helpers import tile_store

    return tile_store(sample_slides.slides, tmp_path_factory.mktemp("three") / "tiles.zarr", tile_size=64, mpp=2.0)


def test_held_out_slides_leave_training_and_are_recorded(three_slides: Path, tmp_path: Path) -> None:
    from dinov3_core.config import ConfigError
    from dinov3_core.data import TileDataset
    from dinov3_core.train.distributed import DistEnv
    from dinov3_core.train.health_probe import PROBE_FILE
    from dinov3_core.train.loop import Trainer

    everything = TileDataset(three_slides)
    out = tmp_path / "held"
    cfg = pretrain_config(
        three_slides, out, **{"health.holdout_slides": 1, "train.stop_at": 2, "evaluation.eval_period_iterations": 2}
    )
    trainer = Trainer(cfg, DistEnv())
    try:
        record = json.loads((out / PROBE_FILE).read_text())
        (held,) = record["holdout_slides"]
        assert held in everything.slide_ids and held not in trainer.tiles.slide_ids
        assert sorted(trainer.tiles.slide_ids) == sorted(set(everything.slide_ids) - {held})
        size = int(everything.tile_counts[everything.slide_ids.index(held)])
        assert len(trainer.tiles) == len(everything) - size
        assert {slide for _, slide, _ in record["tiles"]} == {held} and record["n_tiles"] == size  # < 256 tiles
        trainer.train()
    finally:
        trainer.close()
    # A resumed run keeps the recorded probe, whatever the config now says.
    resumed = pretrain_config(three_slides, out, **{"health.holdout_slides": 2, "train.stop_at": 4})
    run_pretrain(resumed)
    assert json.loads((out / PROBE_FILE).read_text()) == record
    with pytest.raises(ConfigError, match=r"health\.holdout_slides=3 keeps every slide"):
        run_pretrain(pretrain_config(three_slides, tmp_path / "all", **{"health.holdout_slides": 3}))


# ------------------------------------------------------------------------------------------------- Prefect


def test_prefect_flow_follows_the_run_and_ends_with_the_verdict(
    prefect_api: str, small_tile_store: Path, tmp_path: Path
) -> None:
    """pretrain flow → torchrun job: a progress artifact over the iterations, a health table with the probe's
    figures and the verdict, and a completed flow run (health.policy=warn) whose message is that verdict."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.pretrain import pretrain_flow
    from tasks.launch_params import LocalLaunch
    from tasks.params import PretrainParams, StageOptions, TrackingParams

    inert = {**INERT, "evaluation.eval_period_iterations": 6, "train.global_batch_size": 8}
    params = PretrainParams(
        stores=[str(small_tile_store)],
        output_dir=str(tmp_path / "run"),
        tracking=TrackingParams(enabled=False),
        stage=StageOptions(config="tiny", overrides=[f"{k}={json.dumps(v)}" for k, v in inert.items()]),
        launch=LocalLaunch(nproc_per_node=1),  # one process on any host (the form's default follows the host)
    )
    state = pretrain_flow(params, return_state=True)
    assert state.is_completed() and state.message.startswith("pretrain: not learning: by iteration 5")
    outcome = state.result()
    assert outcome["status"] == "ran" and outcome["summary"]["health"].startswith("not learning")
    assert 0 <= outcome["summary"]["effective_rank"] <= 1 and "invariance" in outcome["summary"]

    with get_client(sync_client=True) as client:
        flow_run = ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=flow_run))
    # One health table per stage, updated in place (the flow run's timeline showed one per checkpoint).
    assert [a.key for a in found].count("pretrain-health") == 1, [a.key for a in found]
    latest = {a.key: a for a in sorted(found, key=lambda a: a.created) if a.key}
    assert latest["pretrain-progress"].type == "progress" and float(latest["pretrain-progress"].data) == 100.0
    table = latest["pretrain-health"].data
    assert latest["pretrain-health"].type == "markdown" and "not learning: by iteration 5" in table
    assert "| iteration | 11 of 12 |" in table and "| probe measured at | iteration 11 |" in table
    rank = next(line for line in table.splitlines() if line.startswith("| effective_rank |"))
    assert 0 < float(rank.split("|")[2]) <= 1
