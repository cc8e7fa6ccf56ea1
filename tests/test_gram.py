"""The gram stage: gram-teacher selection and loading, on a real tiny pretraining run (tile stage on a sample
slide, vit_test, CPU). One pretraining run per session (9 iterations, eval checkpoints after 2, 5, 8)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dinov3_core.config import ConfigError, load_config
from dinov3_core.data.masking import IBOTMasks
from dinov3_core.gram import teacher as T
from dinov3_core.gram.anchoring import GramMetaArch, GramSchedules, _GramState, run_gram
from dinov3_core.gram.config import GramConfig
from dinov3_core.losses.gram import GramLoss
from dinov3_core.models import build_backbone, save_backbone
from dinov3_core.train.metrics import read_metrics
from dinov3_core.train.pretrain import run_pretrain
from dinov3_core.train.ssl_model import TeacherTargets, build_ssl_model
from tests.helpers import flat_tensors, load_dcp, max_diff, pretrain_config, sqlite_uri, torchrun

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5

# The pretraining run the gram teacher is chosen from: 9 iterations, eval checkpoints after 2, 5 and 8.
PRETRAIN: dict[str, Any] = {
    "train.batch_size_per_gpu": 8,
    "train.stop_at": 9,
    "checkpointing.period": 3,
    "checkpointing.max_to_keep": 5,
    "evaluation.eval_period_iterations": 3,
}


@pytest.fixture(scope="module")
def pretrain_dir(small_tile_store, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gram_pretrain") / "run"
    start = time.perf_counter()
    run_pretrain(pretrain_config(small_tile_store, out, **PRETRAIN))
    print(f"tiny pretrain: {time.perf_counter() - start:.1f}s")
    return out


# ------------------------------------------------------------------------------------------ teacher choice


def copy_eval_checkpoints(pretrain_dir: Path, run: Path) -> dict[int, Path]:
    """The run's eval checkpoints copied to `run/eval` (a pretrain dir to select from): iteration → teacher file."""
    shutil.copytree(pretrain_dir / "eval", run / "eval")
    return {c.iteration: c.path for c in T.find_eval_checkpoints(run)}


def collapse(teacher_file: Path) -> None:
    """Zero the patch embedding and every block of an eval teacher: every patch token becomes the same."""
    state = torch.load(teacher_file, weights_only=True)
    for k, v in state["teacher"].items():
        if k.startswith(("backbone.patch_embed", "backbone.blocks")):
            v.zero_()
    torch.save(state, teacher_file)


def test_find_eval_checkpoints(pretrain_dir) -> None:
    found = T.find_eval_checkpoints(pretrain_dir)
    assert [c.iteration for c in found] == [2, 5, 8]
    assert all(c.path.name == "teacher_checkpoint.pth" and c.path.is_file() for c in found)


def test_latest_policy(pretrain_dir, tmp_path) -> None:
    sel = T.select_gram_teacher(pretrain_dir, "latest", output_dir=tmp_path)
    assert sel.chosen.iteration == 8
    saved = json.loads((tmp_path / T.SELECTION_FILE).read_text())
    assert saved["chosen"]["iteration"] == 8 and [c["iteration"] for c in saved["candidates"]] == [2, 5, 8]


def test_iteration_policy(pretrain_dir) -> None:
    assert T.select_gram_teacher(pretrain_dir, "iteration", iteration=4).chosen.iteration == 5
    assert T.select_gram_teacher(pretrain_dir, "iteration", iteration=0).chosen.iteration == 2
    assert T.select_gram_teacher(pretrain_dir, "iteration", iteration=1000).chosen.iteration == 8
    assert T.nearest(T.find_eval_checkpoints(pretrain_dir), 6).iteration == 5
    tie = [T.Candidate(2, Path("a")), T.Candidate(4, Path("b"))]
    assert T.nearest(tie, 3).iteration == 2  # equal distance → the earlier one
    # fraction of the run's schedule: total 20 iterations (tiny: 4 epochs × 5) → 0.25·20 − 1 = 4 → 5
    sel = T.select_gram_teacher(pretrain_dir, "iteration", fraction=0.25)
    assert (sel.target_iteration, sel.chosen.iteration) == (4, 5)
    with pytest.raises(T.GramTeacherError, match="exactly one"):
        T.select_gram_teacher(pretrain_dir, "iteration")


def test_best_dense_policy(pretrain_dir, small_tile_store, tmp_path) -> None:
    run = tmp_path / "run"
    teachers = copy_eval_checkpoints(pretrain_dir, run)
    collapse(teachers[5])  # a collapsed candidate

    sel = T.select_gram_teacher(run, "best_dense", stores=[str(small_tile_store)], n_tiles=8, output_dir=tmp_path)
    scores = {it: s["score"] for it, s in sel.scores.items()}
    assert set(scores) == {2, 5, 8}
    assert scores[5] < min(scores[2], scores[8])
    assert sel.scores[5]["effective_rank"] < 0.05
    assert sel.chosen.iteration == max(scores, key=lambda it: (scores[it], -it))
    for s in sel.scores.values():
        assert 0.0 <= s["effective_rank"] <= 1.0 and -1.0 <= s["agreement"] <= 1.0
    saved = json.loads((tmp_path / T.SELECTION_FILE).read_text())
    assert {c["iteration"]: c["score"] for c in saved["candidates"]} == pytest.approx(scores)


def test_best_dense_ties_go_to_earliest(pretrain_dir, small_tile_store, tmp_path) -> None:
    """Real checkpoints, really scored: training_5 becomes a byte copy of training_8 and training_2 collapses,
    so 5 and 8 tie for the best score. The earlier of the tied (5) wins: not the latest (8), and not simply
    the first candidate (2)."""
    run = tmp_path / "run"
    teachers = copy_eval_checkpoints(pretrain_dir, run)
    shutil.copyfile(teachers[8], teachers[5])
    collapse(teachers[2])
    assert teachers[5].read_bytes() == teachers[8].read_bytes()

    sel = T.select_gram_teacher(run, "best_dense", stores=[str(small_tile_store)], n_tiles=4, output_dir=tmp_path)
    assert sel.scores[5] == sel.scores[8]  # exactly: same weights, same held-out tiles, one thread
    assert sel.scores[2]["score"] < sel.scores[5]["score"]
    assert (sel.chosen.iteration, sel.chosen.path) == (5, teachers[5])
    assert json.loads((tmp_path / T.SELECTION_FILE).read_text())["chosen"]["iteration"] == 5


def test_agreement_is_exact_for_equivariant_features() -> None:
    """The grid mapping is right: a per-patch (pointwise) feature map agrees perfectly with its flipped view."""

    class PerPatch(torch.nn.Module):
        patch_size = 4

        def forward(self, x, is_training=True):
            p = torch.nn.functional.avg_pool2d(x, 4)  # [B, 3, s, s]
            return {"x_norm_patchtokens": p.flatten(2).transpose(1, 2)}

    images = torch.randn(3, 3, 16, 16)
    assert T.dense_scores(PerPatch(), images)["agreement"] == pytest.approx(1.0, abs=1e-6)


def test_no_candidates_names_the_directory(tmp_path) -> None:
    with pytest.raises(T.GramTeacherError, match=str(tmp_path / "eval")):
        T.select_gram_teacher(tmp_path, "latest")


# -------------------------------------------------------------------------------------------------- loading


def test_load_eval_checkpoint_and_released_backbone(pretrain_dir, tmp_path) -> None:
    path = T.find_eval_checkpoints(pretrain_dir)[-1].path
    teacher = T.load_gram_teacher(path)
    state = torch.load(path, weights_only=True)["teacher"]
    assert torch.equal(teacher.cls_token, state["backbone.cls_token"])
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training

    released = save_backbone(build_backbone("vit_test"), tmp_path / "backbone.pth")
    assert T.load_gram_teacher(released).embed_dim == build_backbone("vit_test").embed_dim


def test_training_checkpoint_is_refused_with_the_eval_file(pretrain_dir, tmp_path) -> None:
    ckpt_dir = pretrain_dir / "ckpt" / "5"
    expected = pretrain_dir / "eval" / "training_5" / "teacher_checkpoint.pth"
    with pytest.raises(T.GramTeacherError, match="training checkpoint") as err:
        T.load_gram_teacher(ckpt_dir)
    assert str(expected) in str(err.value)
    # a single-file training checkpoint (student + optimizer) is refused too
    fake = tmp_path / "5" / "checkpoint.pth"
    fake.parent.mkdir()
    torch.save({"model": {"student.backbone.cls_token": torch.zeros(1)}, "optimizer": {}}, fake)
    with pytest.raises(T.GramTeacherError, match="training checkpoint"):
        T.load_gram_teacher(fake)


def test_unreadable_or_missing_teacher(tmp_path) -> None:
    with pytest.raises(T.GramTeacherError, match="not found"):
        T.load_gram_teacher(tmp_path / "nope.pth")
    bad = tmp_path / "bad.pth"
    bad.write_text("not a checkpoint")
    with pytest.raises(T.GramTeacherError, match="cannot be read"):
        T.load_gram_teacher(bad)


# ------------------------------------------------------------------------------------------------ gram stage


def gram_values(store: Path, pretrain: Path, out: Path, **extra: Any) -> dict[str, Any]:
    return {
        "tracking.enabled": False,
        "pretrain_dir": str(pretrain),
        "data.stores": [str(store)],
        "output_dir": str(out),
        **extra,
    }


def gram_config(store: Path, pretrain: Path, out: Path, **extra: Any) -> GramConfig:
    return load_config(GramConfig, "tiny", gram_values(store, pretrain, out, **extra), stage="gram")


@pytest.fixture(scope="module")
def gram_run(small_tile_store, pretrain_dir, tmp_path_factory) -> dict[str, Any]:
    """Uninterrupted tiny gram stage (10 iterations, refreshes after 3 and 7), tracked to a temporary MLflow db."""
    root = tmp_path_factory.mktemp("gram_run")
    uri = sqlite_uri(root)
    cfg = gram_config(small_tile_store, pretrain_dir, root / "run", **{"tracking.enabled": True, "tracking.uri": uri})
    start = time.perf_counter()
    result = run_gram(cfg)
    print(f"tiny gram run: {time.perf_counter() - start:.1f}s")
    return {"out": root / "run", "result": result, "uri": uri}


def test_gram_schedules_count_from_stage_start(gram_run) -> None:
    result = gram_run["result"]
    assert (result.start_iteration, result.end_iteration, result.total_iterations) == (0, 10, 10)
    assert result.gram_updates == 2 and result.teacher_selection["chosen"]["iteration"] == 8
    rows = {r["iteration"]: r for r in read_metrics(gram_run["out"] / "training_metrics.json")}
    # tiny: weight 0 → 2.0 over 4 stage iterations; local weight 1 → 0.5; refreshes after stage its 3 and 7.
    # The pretraining run ended at iteration 8: an absolute-iteration schedule would start at full weight.
    assert [rows[i]["gram_loss_weight"] for i in range(6)] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.0])
    assert [rows[i]["dino_local_loss_weight"] for i in range(5)] == pytest.approx([1.0, 0.875, 0.75, 0.625, 0.5])
    assert [rows[i]["gram_updates"] for i in range(10)] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert all(r["gram_loss"] > 0 for r in rows.values())
    assert (gram_run["out"] / T.SELECTION_FILE).is_file()
    assert (gram_run["out"] / "eval" / "training_9" / "teacher_checkpoint.pth").is_file()
    assert [p.name for p in sorted((gram_run["out"] / "ckpt").iterdir())] == ["4", "9"]


def test_gram_run_is_tracked_in_mlflow(gram_run) -> None:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=gram_run["uri"])
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params["gram_teacher_policy"] == "latest" and run.data.params["gram_teacher_iteration"] == "8"
    assert "gram_loss" in run.data.metrics and "gram_loss_weight" in run.data.metrics
    assert T.SELECTION_FILE in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "health/effective_rank")] == [4, 9]


def test_gram_inherits_the_pretraining_probe(gram_run, pretrain_dir) -> None:
    """Slides held out of pretraining stay out of gram anchoring: the same probe record, not a new draw."""
    from dinov3_core.train.health_probe import PROBE_FILE

    assert json.loads((gram_run["out"] / PROBE_FILE).read_text()) == json.loads((pretrain_dir / PROBE_FILE).read_text())


def test_schedule_units() -> None:
    cfg = load_config(GramConfig, "tiny", {"output_dir": "x", "data.stores": ["s"]}, stage="gram")
    s = GramSchedules.from_config(cfg, 10)
    assert s.weight(0) == 0.0 and s.weight(4) == s.weight(100) == 2.0
    for first in (0, 1, 3, 7):
        for freq in (1, 2, 4, 5):
            for max_updates in (None, 0, 2):
                sch = GramSchedules(s.weight, s.local_weight, True, freq, first, max_updates)
                done = 0
                for it in range(40):
                    assert sch.updates_before(it) == done, (first, freq, max_updates, it)
                    done += sch.update_due(it, done)


def test_local_weight_schedule_starts_at_losses_local_loss_weight() -> None:
    values = {"output_dir": "x", "data.stores": ["s"], "losses.local_loss_weight": 0.8}
    cfg = load_config(GramConfig, "tiny", values, stage="gram")  # tiny: gram.local_weight_end 0.5 over 4 iterations
    s = GramSchedules.from_config(cfg, 10)
    assert [s.local_weight(i) for i in (0, 2, 4, 9)] == pytest.approx([0.8, 0.65, 0.5, 0.5])
    cfg = load_config(GramConfig, "tiny", {**values, "gram.local_weight_end": None}, stage="gram")
    s = GramSchedules.from_config(cfg, 10)
    assert [s.local_weight(i) for i in (0, 2, 9)] == pytest.approx([0.8, 0.8, 0.8])
    with pytest.raises(ConfigError, match=r"'gram\.local_weight_start' .* is now 'losses\.local_loss_weight'"):
        load_config(GramConfig, "tiny", {**values, "gram.local_weight_start": 1.0}, stage="gram")


def test_resume_matches_uninterrupted(small_tile_store, pretrain_dir, gram_run, tmp_path) -> None:
    out = tmp_path / "run"
    first = run_gram(gram_config(small_tile_store, pretrain_dir, out, **{"train.stop_at": 6}))
    assert (first.end_iteration, first.gram_updates) == (6, 1)
    second = run_gram(gram_config(small_tile_store, pretrain_dir, out))
    assert (second.start_iteration, second.end_iteration, second.gram_updates) == (6, 10, 2)
    got, ref = load_dcp(out / "ckpt" / "9"), load_dcp(gram_run["out"] / "ckpt" / "9")
    for section, prefix in (("model", "student."), ("model", "teacher."), ("train_state", "gram_teacher.")):
        assert max_diff(flat_tensors(got[section]), flat_tensors(ref[section]), prefix) < TOL, prefix
    rows = {r["iteration"]: r for r in read_metrics(out / "training_metrics.json")}
    ref_rows = {r["iteration"]: r for r in read_metrics(gram_run["out"] / "training_metrics.json")}
    for it in range(10):
        assert rows[it]["gram_loss"] == pytest.approx(ref_rows[it]["gram_loss"], rel=TOL, abs=1e-7)


@pytest.mark.parametrize(("img_level", "teacher_size"), [(True, None), (False, None), (True, 128)])
def test_stage_gram_loss_equals_gram_loss(small_tile_store, img_level, teacher_size) -> None:
    """The stage adds exactly weight × GramLoss(student global patch tokens, gram teacher's on the same crops)."""
    small = {"n_prototypes": 64, "hidden_dim": 64, "bottleneck_dim": 32}
    values = {"output_dir": "x", "data.stores": [str(small_tile_store)], "student.arch": "vit_test"}
    cfg = load_config(GramConfig, "tiny", {**values, "heads.dino": small, "heads.ibot": small}, stage="gram")
    torch.manual_seed(0)
    model = build_ssl_model(cfg).model
    teacher = build_backbone("vit_test").eval()
    model.__class__ = GramMetaArch
    loss_fn = GramLoss(img_level=img_level)
    model.__dict__["_gram"] = _GramState(teacher=teacher, loss=loss_fn, weight=0.7, crop_size=teacher_size)
    b, p = 2, (64 // 16) ** 2
    g, loc = torch.randn(2, b, 3, 64, 64), torch.randn(2, b, 3, 32, 32)
    masks = IBOTMasks.from_masks(torch.zeros(2 * b, p, dtype=torch.bool).index_fill_(1, torch.tensor([0, 5]), True), 2)
    k = cfg.heads.dino.n_prototypes
    targets = TeacherTargets(
        dino=torch.softmax(torch.randn(2, b, k), -1), ibot=torch.softmax(torch.randn(masks.n_masked_patches, k), -1)
    )
    captured: list[Any] = []
    hook = model.student["backbone"].register_forward_hook(lambda _m, _a, out: captured.append(out))
    torch.manual_seed(1)
    total, parts = model.forward_loss(g, loc, masks, targets)
    hook.remove()
    student_tokens = captured[0][0]["x_norm_patchtokens"]
    teacher_in = g.flatten(0, 1)
    if teacher_size:  # upsampled crops; GramLoss resizes the 8×8 teacher map to the student's 4×4 grid
        teacher_in = torch.nn.functional.interpolate(teacher_in, size=(teacher_size,) * 2, mode="bicubic")
    teacher_tokens = teacher(teacher_in, is_training=True)["x_norm_patchtokens"]
    if img_level:
        expected = GramLoss()(student_tokens, teacher_tokens)
    else:  # one [N×N] Gram over all global-crop patch tokens of the micro-batch
        expected = GramLoss(img_level=False)(student_tokens.flatten(0, 1), teacher_tokens.flatten(0, 1))
    assert parts["gram_loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    model.__class__ = type(model).__mro__[1]  # plain SSLMetaArch, same draws
    torch.manual_seed(1)
    plain_total, _ = model.forward_loss(g, loc, masks, targets)
    assert total.item() == pytest.approx(plain_total.item() + 0.7 * expected.item(), rel=1e-6)


def gram_args(pretrain_dir: Path, store: Path, *settings: str) -> list[str]:
    """`python -m dinov3_core.gram` on the tiny config after `pretrain_dir`, on `store`, no MLflow, plus `settings`."""
    options = ["--pretrain-dir", str(pretrain_dir), "--config", "tiny"]  # the overrides follow every option
    return ["-m", "dinov3_core.gram", *options, "tracking.enabled=false", f"data.stores=[{store}]", *settings]


def test_two_processes_gloo(small_tile_store, pretrain_dir, tmp_path) -> None:
    out = tmp_path / "run"
    args = gram_args(
        pretrain_dir, small_tile_store, f"output_dir={out}", "train.stop_at=5", "train.batch_size_per_gpu=4"
    )
    proc = torchrun(*args, timeout=180)
    assert "gram: iterations 0…4 of 10" in proc.stdout
    assert (out / "ckpt" / "4" / ".metadata").is_file()
    rows = read_metrics(out / "training_metrics.json")
    assert rows[-1]["iteration"] == 4 and rows[-1]["gram_updates"] == 1 and rows[-1]["gram_loss_weight"] == 2.0


def test_two_pipeline_stages_equal_one_process(small_tile_store, pretrain_dir, tmp_path) -> None:
    """Gram anchoring with 2 pipeline stages (the gram term computed by the last stage's loss, the gram teacher
    refreshed from the pipelined EMA teacher after iteration 3) follows the single-process run: same losses, gram
    loss included, and the same parameters after 5 iterations."""
    from tests.helpers import load_dcp, max_diff

    common = gram_args(pretrain_dir, small_tile_store, "train.stop_at=5", "checkpointing.period=5")
    one, two = tmp_path / "one", tmp_path / "two"
    torchrun(*common, f"output_dir={one}", timeout=180, nproc=1)
    torchrun(*common, f"output_dir={two}", "parallelism.pp_degree=2", timeout=180)
    assert "pipeline stage 2/2" in (two / "logs" / "log.txt.rank1").read_text()
    ref, got = read_metrics(one / "training_metrics.json"), read_metrics(two / "training_metrics.json")
    assert [r["iteration"] for r in got] == list(range(5))
    for a, b in zip(ref, got, strict=True):
        for key in ("total_loss", "gram_loss", "dino_global_loss", "ibot_loss", "backbone_grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["iteration"], key)
    assert got[-1]["gram_loss_weight"] == 2.0 and got[-1]["gram_updates"] == 1  # the term counts; one refresh
    assert max_diff(load_dcp(two / "ckpt" / "4")["model"], load_dcp(one / "ckpt" / "4")["model"], "student.") < 1e-5


def test_cli_reports_bad_pretrain_dir(tmp_path) -> None:
    from dinov3_core.gram.__main__ import main

    code = main(
        [
            "--pretrain-dir",
            str(tmp_path / "nope"),
            "--config",
            "tiny",
            f"output_dir={tmp_path / 'o'}",
            "data.stores=[x]",
        ]
    )
    assert code == 2


def test_start_from_released_backbone(small_tile_store, tmp_path) -> None:
    """No pretraining run: student (fresh heads) and gram teacher from a released-layout backbone file."""
    weights = save_backbone(build_backbone("vit_test"), tmp_path / "backbone.pth")
    values = {
        "tracking.enabled": False,
        "data.stores": [str(small_tile_store)],
        "output_dir": str(tmp_path / "run"),
        "student.arch": "vit_test",
        "student.pretrained_weights": str(weights),
        "student.drop_path_rate": 0.0,
        "heads.dino": {"n_prototypes": 64, "hidden_dim": 64, "bottleneck_dim": 32},
        "heads.ibot": {"n_prototypes": 64, "hidden_dim": 64, "bottleneck_dim": 32},
        "train.stop_at": 2,
    }
    result = run_gram(load_config(GramConfig, "tiny", values, stage="gram"))
    assert result.end_iteration == 2 and result.teacher_selection is None
    assert read_metrics(tmp_path / "run" / "training_metrics.json")[-1]["gram_loss"] >= 0


def test_continues_a_run_that_read_its_arch_from_the_weights_file(small_tile_store, tmp_path) -> None:
    """`student.arch=auto` (the cpu-lora recipe's warm start): gram takes the arch the pretraining run resolved from
    its file, recorded in the checkpoint; a file matching no known arch is still refused, naming the key."""
    from dinov3_core.gram.anchoring import prepare_config

    small = {
        "heads.dino": {"n_prototypes": 64, "hidden_dim": 64, "bottleneck_dim": 32},
        "heads.ibot": {"n_prototypes": 64, "hidden_dim": 64, "bottleneck_dim": 32},
        "train.stop_at": 1,
        "checkpointing.period": 1,
        "evaluation.eval_period_iterations": 0,
        "health.probe_tiles": 0,
        "student.arch": "auto",
    }
    for arch, expected in (("vits16", "vits16"), ("vit_test", None)):
        weights = save_backbone(build_backbone(arch), tmp_path / f"{arch}.pth")
        pre = tmp_path / f"pre-{arch}"
        run_pretrain(pretrain_config(small_tile_store, pre, **small, **{"student.pretrained_weights": str(weights)}))
        gram = load_config(
            GramConfig, "tiny", {"pretrain_dir": str(pre), "output_dir": str(tmp_path / "g")}, stage="gram"
        )
        if expected:
            assert prepare_config(gram).student.arch == expected
        else:
            with pytest.raises(ConfigError, match=r"student\.arch=auto and its checkpoint does not name"):
                prepare_config(gram)


def test_named_configs_load() -> None:
    for name in ("tiny", "vitb16"):
        cfg = load_config(GramConfig, name, {"output_dir": "x", "data.stores": ["s"]}, stage="gram")
        assert cfg.gram.rep_update
    cfg = load_config(GramConfig, "vitb16", {"output_dir": "x", "data.stores": ["s"]}, stage="gram")
    assert (cfg.gram.warmup_iterations, cfg.gram.first_update, cfg.optim.epochs * cfg.train.epoch_length) == (
        1000,
        10000,
        25000,
    )


def test_config_errors_name_the_key(small_tile_store, pretrain_dir, tmp_path) -> None:
    from dinov3_core.config import ConfigError

    with pytest.raises(ConfigError, match="pretrain_dir"):
        run_gram(load_config(GramConfig, "tiny", {"output_dir": str(tmp_path), "data.stores": ["s"]}, stage="gram"))
    bad = gram_config(small_tile_store, pretrain_dir, tmp_path / "o", **{"gram.teacher_crop_size": 100})
    with pytest.raises(ConfigError, match=r"gram\.teacher_crop_size"):
        run_gram(bad)


def test_best_dense_selection_is_logged_to_mlflow(pretrain_dir, small_tile_store, tmp_path) -> None:
    import mlflow

    from dinov3_core.tracking import TrackingConfig, stage_run

    uri = sqlite_uri(tmp_path)
    with stage_run(TrackingConfig(uri=uri, experiment="gram-select", system_metrics=False), "select") as run:
        sel = T.select_gram_teacher(
            pretrain_dir, "best_dense", stores=[str(small_tile_store)], n_tiles=4, output_dir=tmp_path
        )
    client = mlflow.MlflowClient(tracking_uri=uri)
    data = client.get_run(run.info.run_id).data
    assert data.params["gram_teacher_policy"] == "best_dense"
    assert data.params["gram_teacher_iteration"] == str(sel.chosen.iteration)
    history = client.get_metric_history(run.info.run_id, "gram_teacher_score")
    assert sorted(m.step for m in history) == [2, 5, 8]
    assert T.SELECTION_FILE in [a.path for a in client.list_artifacts(run.info.run_id)]
