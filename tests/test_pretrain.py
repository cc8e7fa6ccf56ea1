"""The pretrain stage end to end on a real tile store (tile stage on a sample slide), tiny model, CPU.

One uninterrupted reference run (1 process, full batch of 8, 8 iterations, checkpoints after iterations 1, 3,
5, 7) is the yardstick: gradient accumulation (1 and 2 processes), resumption after SIGKILL, and resumption on
another number of processes must all end with its parameters (fp32, tolerance 1e-5). KoLeo uses the global
neighbour set here, so the objective does not depend on the number of processes (official "rank" scope would
differ by design across world sizes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dinov3_core.config import ConfigError
from dinov3_core.errors import WsidinoError
from dinov3_core.models import build_backbone, save_backbone
from dinov3_core.progress import eta
from dinov3_core.tiling import store as ts
from dinov3_core.train.checkpoint import CheckpointError
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.memory import estimate_memory, model_shape
from dinov3_core.train.metrics import read_metrics
from dinov3_core.train.pretrain import TrainingDivergedError, run_pretrain
from dinov3_core.train.ssl_model import build_ssl_model
from tests.helpers import (
    PRETRAIN_RUNS_SCRIPT,
    REPO,
    load_dcp,
    max_diff,
    pretrain_config,
    pretrain_values,
    sqlite_uri,
    torchrun,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
LOSSES = ("total_loss", "dino_global_loss", "dino_local_loss", "ibot_loss", "koleo_loss")
NORMS = ("backbone_grad_norm", "dino_head_grad_norm", "ibot_head_grad_norm")

# On top of tests.helpers.TINY_PRETRAIN (no lr warmup, no frozen last layer: every compared step moves every
# weight): checkpoints every 2 iterations so runs can be compared (and resumed) mid-way.
BASE: dict[str, Any] = {
    "losses.koleo_scope": "global",
    "train.batch_size_per_gpu": 8,
    "train.stop_at": 8,
    "checkpointing.period": 2,
    "checkpointing.max_to_keep": 10,
    "evaluation.eval_period_iterations": 4,
}


def overrides(store: Path, out: Path, **extra: Any) -> dict[str, Any]:
    return pretrain_values(store, out, **{**BASE, **extra})


def config(store: Path, out: Path, **extra: Any) -> PretrainConfig:
    return pretrain_config(store, out, **{**BASE, **extra})


def assert_same_params(ckpt: Path, reference: Path) -> None:
    got, ref = load_dcp(ckpt)["model"], load_dcp(reference)["model"]
    assert max_diff(got, ref, "student.") < TOL
    assert max_diff(got, ref, "teacher.") < TOL


def assert_same_metrics(out: Path, reference: Path, iterations: range) -> None:
    got = {r["iteration"]: r for r in read_metrics(out / "training_metrics.json")}
    ref = {r["iteration"]: r for r in read_metrics(reference / "training_metrics.json")}
    for it in iterations:
        for key in LOSSES + NORMS:  # grad norms catch loss-scaling errors that Adam's update would hide
            assert got[it][key] == pytest.approx(ref[it][key], rel=TOL, abs=1e-7), (it, key)


@pytest.fixture(scope="module")
def reference(small_tile_store, tmp_path_factory) -> dict[str, Any]:
    """The uninterrupted single-process full-batch run, with MLflow tracking to a temporary SQLite db."""
    root = tmp_path_factory.mktemp("pretrain_reference")
    uri = sqlite_uri(root)
    extra = {"tracking.enabled": True, "tracking.uri": uri, "tracking.experiment": "pretrain-test"}
    cfg = config(small_tile_store, root / "run", **extra)
    result = run_pretrain(cfg)
    return {"out": root / "run", "result": result, "uri": uri, "cfg": cfg}


# ------------------------------------------------------------------------------------------- one process


def test_reference_run_writes_every_output(reference) -> None:
    out, result = reference["out"], reference["result"]
    assert (result.start_iteration, result.end_iteration, result.total_iterations) == (0, 8, 20)
    assert (result.global_batch, result.micro_batch, result.accumulation_steps) == (8, 8, 1)
    assert (out / "config.yaml").is_file() and "vit_test" in (out / "config.yaml").read_text()
    log = (out / "logs" / "log.txt").read_text()
    assert "it 7/20 (stops at 8) " in log
    # The threads the rank computes with, in its first line (benchmarks/deploy_vs_cli.py reads it from there).
    threads = reference["cfg"].train.num_threads or torch.get_num_threads()
    assert f" on cpu ({threads} torch threads): " in log

    rows = read_metrics(out / "training_metrics.json")
    assert [r["iteration"] for r in rows] == list(range(8))
    expected = {*LOSSES, *NORMS, "lr", "wd", "momentum", "teacher_temp", "images_per_s", "data_time"}
    assert expected | {"rss_mb", "max_rss_mb", "peak_memory_mb", "global_batch_size"} <= set(rows[0])
    assert all(r["skipped_step"] == 0 for r in rows)
    # train.stop_at=8 of 20: each line's ETA is the iterations left before 8, at that line's iteration time
    lines = {int(m[1]): m[0] for m in re.finditer(r"\bit (\d+)/20 .*", log)}
    for r in rows:
        assert f"it {r['iteration']}/20 (stops at 8) " in lines[r["iteration"]]
        assert f"eta {eta((7 - r['iteration']) * r['iter_time'])} " in lines[r["iteration"]]
    assert rows[0]["teacher_temp"] == pytest.approx(0.04) and rows[7]["teacher_temp"] > rows[0]["teacher_temp"]
    assert rows[7]["momentum"] > rows[0]["momentum"] and rows[7]["lr"] < rows[0]["lr"]

    assert sorted(int(p.name) for p in (out / "ckpt").iterdir()) == [1, 3, 5, 7]
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["training_3", "training_7"]
    teacher = torch.load(out / "eval" / "training_7" / "teacher_checkpoint.pth", weights_only=True)
    assert set(teacher) == {"teacher"}
    state = teacher["teacher"]
    assert {k.split(".")[0] for k in state} == {"backbone", "dino_head", "ibot_head"}
    assert "dino_head.last_layer.weight" in state and "backbone.cls_token" in state
    assert all(v.device.type == "cpu" for v in state.values())
    ckpt = load_dcp(out / "ckpt" / "7")
    teacher_in_ckpt = {k.removeprefix("teacher."): v for k, v in ckpt["model"].items() if k.startswith("teacher.")}
    assert max_diff(teacher_in_ckpt, state) == 0.0
    assert ckpt["train_state"]["iteration"] == 7 and ckpt["train_state"]["sampler"]["consumed_samples"] == 64
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.images_per_second > 0


def test_reference_run_is_tracked_in_mlflow(reference) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=reference["uri"])
    experiment = client.get_experiment_by_name("pretrain-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["global_batch_size"] == "8" and run.data.params["arch"] == "vit_test"
    history = client.get_metric_history(run.info.run_id, "total_loss")
    assert sorted(m.step for m in history) == list(range(8))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "training_metrics.json", "loss_curve.png"} <= artifacts
    assert len(client.get_metric_history(run.info.run_id, "dino_gap")) == 8  # the health signal, every log line
    assert len(client.get_metric_history(run.info.run_id, "agreement")) == 8
    probe = client.get_metric_history(run.info.run_id, "health/effective_rank")
    assert [m.step for m in probe] == [3, 7] and all(0 < m.value <= 1 for m in probe)  # at the eval checkpoints
    assert [m.step for m in client.get_metric_history(run.info.run_id, "health/invariance")] == [3, 7]
    verdict = json.loads((reference["out"] / "health.json").read_text())["verdict"]
    assert run.data.tags["wsidino.health"] == verdict and verdict.startswith("not judged yet")  # 8 its < patience


def test_gradient_accumulation_matches_the_full_batch(reference, small_tile_store, tmp_path) -> None:
    """2 micro-batches of 4 = one batch of 8, step for step (same crops, masks, Sinkhorn targets, KoLeo set)."""
    out = tmp_path / "accum"
    result = run_pretrain(config(small_tile_store, out, **{"train.batch_size_per_gpu": 4, "train.stop_at": 2}))
    assert (result.micro_batch, result.accumulation_steps) == (4, 2)
    ref = reference["out"]
    assert_same_params(out / "ckpt" / "1", ref / "ckpt" / "1")
    assert_same_metrics(out, ref, range(2))

    # The comparison is meaningful: two steps move the student far more than the tolerance (~lr per step).
    torch.manual_seed(0)
    initial = {f"student.{k}": v for k, v in build_ssl_model(reference["cfg"]).model.student.state_dict().items()}
    assert max_diff(load_dcp(ref / "ckpt" / "1")["model"], initial, "student.") > 30 * TOL


def test_auto_batch_size_plans_accumulation_to_fit_the_budget(reference, small_tile_store, tmp_path) -> None:
    """Also: activation checkpointing changes no number; retention keeps the newest checkpoint + keep_every."""
    extra = {
        "train.batch_size_per_gpu": "auto",
        "train.stop_at": 2,
        "train.activation_checkpointing": True,
        "checkpointing.period": 1,
        "checkpointing.max_to_keep": 1,
        "checkpointing.keep_every": 1,
    }
    cfg = config(small_tile_store, tmp_path / "auto", **extra)
    shape = model_shape(cfg)

    def total(micro: int) -> int:
        kw = {"micro_batch": micro, "step_batch": 8, "world_size": 1, "device_type": "cpu", "tile_size": 64}
        return estimate_memory(cfg, shape, **kw).total

    cfg.train.memory_budget_gb = (total(4) + total(8)) / 2 / 2**30  # fits 4 images of activations, not 8
    result = run_pretrain(cfg)
    assert (result.micro_batch, result.accumulation_steps, result.global_batch) == (4, 2, 8)
    rows = read_metrics(cfg_out(cfg) / "training_metrics.json")
    assert rows[-1]["micro_batch_size"] == 4 and rows[-1]["accumulation_steps"] == 2
    assert_same_params(cfg_out(cfg) / "ckpt" / "1", reference["out"] / "ckpt" / "1")
    assert sorted(p.name for p in (cfg_out(cfg) / "ckpt").iterdir()) == ["0_keep", "1", "1_keep"]


def cfg_out(cfg: PretrainConfig) -> Path:
    return Path(cfg.output_dir)


def test_sigkill_then_restart_ends_like_an_uninterrupted_run(reference, small_tile_store, tmp_path) -> None:
    out = tmp_path / "killed"
    argv = [f"{k}={json.dumps(v)}" for k, v in overrides(small_tile_store, out).items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dinov3_core.train", "--config", "tiny", *argv],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 180
    while not (out / "ckpt" / "1" / ".metadata").exists():
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "eval" / "training_7").exists(), "the run finished before it was killed"

    result = run_pretrain(config(small_tile_store, out))
    assert result.resumed_from is not None and result.start_iteration >= 2
    assert not list((out / "ckpt").glob(".tmp-*"))  # a checkpoint the kill interrupted is cleaned up
    final = torch.load(out / "eval" / "training_7" / "teacher_checkpoint.pth", weights_only=True)["teacher"]
    expected = torch.load(reference["out"] / "eval" / "training_7" / "teacher_checkpoint.pth", weights_only=True)
    assert max_diff(final, expected["teacher"]) < TOL
    assert_same_params(out / "ckpt" / "7", reference["out"] / "ckpt" / "7")
    assert [r["iteration"] for r in read_metrics(out / "training_metrics.json")] == list(range(8))


# ------------------------------------------------------------------------------------- several processes


def test_two_processes_and_changing_world_size(reference, small_tile_store, tmp_path) -> None:
    """torchrun, 2 gloo processes, FSDP2: (a) 2 × 2 micro-batches of 2 from scratch = the full batch of 8;
    (b) the 1-process reference checkpoint resumed on 2 processes (1 → 2); then (c) the 2-process checkpoint
    of (a) resumed in 1 process (2 → 1). All end with the reference's parameters."""
    ref = reference["out"]
    two = tmp_path / "two"
    one_to_two = tmp_path / "one_to_two"
    shutil.copytree(ref, one_to_two)
    for path in (one_to_two / "ckpt").iterdir():
        if int(path.name) > 1:
            shutil.rmtree(path)  # as if the reference had stopped after iteration 1
    runs = [
        overrides(small_tile_store, two, **{"train.batch_size_per_gpu": 2, "train.stop_at": 2}),
        overrides(small_tile_store, one_to_two, **{"train.batch_size_per_gpu": 4, "train.stop_at": 4}),
    ]
    proc = torchrun(str(PRETRAIN_RUNS_SCRIPT), *(json.dumps(r) for r in runs), timeout=400)
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"run"')]
    assert [s["world_size"] for s in summaries] == [2, 2]
    assert (summaries[0]["micro_batch"], summaries[0]["accumulation_steps"]) == (2, 2)
    assert summaries[0]["resumed_from"] is None
    assert Path(summaries[1]["resumed_from"]).name == "1"

    assert_same_params(two / "ckpt" / "1", ref / "ckpt" / "1")  # (a)
    assert_same_metrics(two, ref, range(2))
    gathered = torch.load(two / "eval" / "training_1" / "teacher_checkpoint.pth", weights_only=True)["teacher"]
    sharded = {k.removeprefix("teacher."): v for k, v in load_dcp(two / "ckpt" / "1")["model"].items()}
    assert max_diff(gathered, {k: v for k, v in sharded.items() if k in gathered}) == 0.0  # full, unsharded
    assert_same_params(one_to_two / "ckpt" / "3", ref / "ckpt" / "3")  # (b)
    assert_same_metrics(one_to_two, ref, range(2, 4))

    result = run_pretrain(config(small_tile_store, two, **{"train.stop_at": 4}))  # (c): 2 → 1
    assert result.resumed_from == two / "ckpt" / "1" and result.world_size == 1
    assert_same_params(two / "ckpt" / "3", ref / "ckpt" / "3")


def test_pipeline_by_data_parallel_trains_resumes_and_converts(reference, small_tile_store, tmp_path) -> None:
    """torchrun, 4 gloo processes = 2 pipeline stages × 2 data-parallel (FSDP) processes, 1F1B, 2 pipeline
    micro-batches of 2 per process: (a) from scratch to iteration 2 and (b) resumed on the same layout to 4 equal
    the single-process full-batch reference; (c) its checkpoint resumed without a pipeline (pp 2 → 1) still does,
    and (d) converts to a backbone that loads strictly; (e) the reference's own checkpoint resumes on the pipeline."""
    from dinov3_core.config import load_config
    from dinov3_core.convert.config import ConvertConfig
    from dinov3_core.convert.convert import run_convert
    from dinov3_core.models import load_released_backbone

    ref, out, from_one = reference["out"], tmp_path / "pp", tmp_path / "from_one"
    shutil.copytree(ref, from_one)
    for path in (from_one / "ckpt").iterdir():
        if int(path.name) > 1:
            shutil.rmtree(path)  # as if the single-process reference had stopped after iteration 1
    pp = {"parallelism.pp_degree": 2, "parallelism.pp_microbatch_size": 2, "train.batch_size_per_gpu": 4}
    runs = [
        overrides(small_tile_store, out, **pp, **{"train.stop_at": 2}),
        overrides(small_tile_store, out, **pp, **{"train.stop_at": 4}),
        overrides(small_tile_store, from_one, **pp, **{"train.stop_at": 4}),  # (e) no pipeline → 2 stages
    ]
    proc = torchrun(str(PRETRAIN_RUNS_SCRIPT), *(json.dumps(r) for r in runs), timeout=600, nproc=4)
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"run"')]
    assert [(s["world_size"], s["micro_batch"], s["accumulation_steps"]) for s in summaries] == [(4, 4, 1)] * 3
    assert Path(summaries[1]["resumed_from"]).name == Path(summaries[2]["resumed_from"]).name == "1"
    assert_same_params(from_one / "ckpt" / "3", ref / "ckpt" / "3")  # (e)
    log = (out / "logs" / "log.txt.rank3").read_text()
    assert "pipeline stage 2/2 (blocks 1–1, heads), 2 pipeline micro-batches of 2" in log
    assert "global batch 8 = 2 data-parallel process(es)" in log
    for it in (1, 3):  # (a), (b)
        assert_same_params(out / "ckpt" / str(it), ref / "ckpt" / str(it))
    assert_same_metrics(out, ref, range(4))
    teacher = torch.load(out / "eval" / "training_3" / "teacher_checkpoint.pth", weights_only=True)["teacher"]
    expected = torch.load(ref / "eval" / "training_3" / "teacher_checkpoint.pth", weights_only=True)["teacher"]
    assert max_diff(teacher, expected) < TOL

    result = run_pretrain(config(small_tile_store, out, **{"train.stop_at": 6}))  # (c) pp 2 → 1, one process
    assert result.resumed_from == out / "ckpt" / "3" and result.world_size == 1
    assert_same_params(out / "ckpt" / "5", ref / "ckpt" / "5")

    values = {"input": str(out / "ckpt" / "3"), "output_dir": str(tmp_path / "converted"), "tracking.enabled": False}
    converted = run_convert(load_config(ConvertConfig, "default", values, stage="convert"))  # (d)
    backbone = load_released_backbone(converted.backbone)
    got = torch.load(converted.backbone, weights_only=True)
    assert set(got) == set(backbone.state_dict())
    assert max_diff({f"backbone.{k}": v for k, v in got.items()}, teacher, "backbone.") == 0.0


# --------------------------------------------------------------------------------- warm start, bad input


def test_warm_start_from_a_released_backbone_joins_the_given_mlflow_run(
    reference, small_tile_store, tmp_path, monkeypatch
) -> None:
    from mlflow.tracking import MlflowClient

    torch.manual_seed(3)
    released = build_backbone("vit_test", n_storage_tokens=4, layerscale_init=1e-5, mask_k_bias=True)
    weights = save_backbone(released, tmp_path / "released_vit_test.pth")
    client = MlflowClient(tracking_uri=reference["uri"])
    run_id = client.create_run(client.get_experiment_by_name("pretrain-test").experiment_id).info.run_id

    out = tmp_path / "warm"
    extra = {
        "student.arch": "auto",
        "student.pretrained_weights": str(weights),
        "optim.warmup_epochs": 1,  # lr 0 in iteration 0: the teacher after it is still the released backbone
        "train.stop_at": 1,
        "tracking.enabled": True,
        "tracking.uri": reference["uri"],
    }
    result = run_pretrain(config(small_tile_store, out, **extra), mlflow_run_id=run_id)  # as its __main__ does
    assert result.end_iteration == 1
    teacher = torch.load(out / "eval" / "training_0" / "teacher_checkpoint.pth", weights_only=True)["teacher"]
    backbone = {k.removeprefix("backbone."): v for k, v in teacher.items() if k.startswith("backbone.")}
    assert set(backbone) == set(released.state_dict())
    assert max_diff(backbone, released.state_dict()) < 1e-6
    assert {"dino_head.last_layer.weight", "ibot_head.last_layer.weight"} <= set(teacher)
    run = client.get_run(run_id)
    assert run.data.params["pretrained_weights"] == str(weights)
    assert [m.step for m in client.get_metric_history(run_id, "total_loss")] == [0]


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


def test_bad_input_fails_clearly_and_writes_nothing(reference, small_tile_store, tmp_path) -> None:
    out = tmp_path / "never"

    empty = ts.init_store(tmp_path / "empty.zarr")
    with pytest.raises(WsidinoError, match="empty tile store"):
        run_pretrain(config(empty, out))
    with pytest.raises(WsidinoError, match="fewer than one global batch"):
        run_pretrain(
            config(small_tile_store, out, **{"train.global_batch_size": 4096, "train.batch_size_per_gpu": 4096})
        )

    with pytest.raises(ConfigError, match="KoLeo needs at least 2 images"):
        run_pretrain(config(small_tile_store, out, **{"train.global_batch_size": 1, "train.batch_size_per_gpu": 1}))

    other = build_backbone("vit_test", n_storage_tokens=4)  # the student below has no storage tokens
    weights = save_backbone(other, tmp_path / "other.pth")
    with pytest.raises(WsidinoError, match="n_storage_tokens") as err:
        run_pretrain(config(small_tile_store, out, **{"student.pretrained_weights": str(weights)}))
    assert "student.pretrained_weights" in str(err.value)
    assert not out.exists()

    # An output_dir whose checkpoints belong to another architecture: refused, nothing touched.
    existing = tmp_path / "existing"
    shutil.copytree(reference["out"], existing)
    before = snapshot(existing)
    with pytest.raises(CheckpointError, match="different architecture") as err:
        run_pretrain(config(small_tile_store, existing, **{"heads.dino.n_prototypes": 128}))
    assert "student.dino_head.last_layer.weight" in str(err.value)
    with pytest.raises(WsidinoError, match="resume=false"):
        run_pretrain(config(small_tile_store, existing, **{"checkpointing.resume": False}))
    assert snapshot(existing) == before


def test_cli_reports_bad_input_without_traceback(tmp_path) -> None:
    argv = ["--config", "tiny", f"data.stores=[{tmp_path / 'missing.zarr'}]", f"output_dir={tmp_path / 'o'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "dinov3_core.train", *argv], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 2
    assert "error: tile store" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------ bf16 on CPU


def assert_close_to_fp32(out: Path, reference: Path, iterations: range, rel: float) -> float:
    """Every loss of `out` within `rel` of the fp32 reference's; returns the largest relative difference."""
    got = {r["iteration"]: r for r in read_metrics(out / "training_metrics.json")}
    ref = {r["iteration"]: r for r in read_metrics(reference / "training_metrics.json")}
    worst = 0.0
    for it in iterations:
        for key in LOSSES:
            if abs(ref[it][key]) > 1e-3:  # KoLeo can sit near 0, where a relative difference means nothing
                worst = max(worst, abs(got[it][key] - ref[it][key]) / abs(ref[it][key]))
    assert worst < rel, f"bf16 losses left the fp32 run by {worst:.3f} (relative) within {iterations}"
    return worst


def test_bf16_on_cpu_tracks_the_fp32_run(reference, small_tile_store, tmp_path) -> None:
    """train.precision=bf16 on CPU (autocast; attention kept in fp32, `layers.attention`): one process, then the
    same on 2 FSDP processes (MixedPrecisionPolicy over gloo). Both follow the fp32 reference within bf16's
    precision, and bf16 is really in effect (the losses are not the fp32 ones)."""
    one = tmp_path / "bf16"
    run_pretrain(config(small_tile_store, one, **{"train.precision": "bf16", "train.stop_at": 4}))
    assert assert_close_to_fp32(one, reference["out"], range(4), rel=0.01) > 1e-5

    two = tmp_path / "bf16_two"
    run = overrides(
        small_tile_store, two, **{"train.precision": "bf16", "train.batch_size_per_gpu": 4, "train.stop_at": 2}
    )
    torchrun(str(PRETRAIN_RUNS_SCRIPT), json.dumps(run), timeout=400)
    assert assert_close_to_fp32(two, reference["out"], range(2), rel=0.01) > 1e-5


# ------------------------------------------------------------------------------------ robustness, memory


def test_nan_guard_stops_after_consecutive_nonfinite_losses(small_tile_store, tmp_path) -> None:
    out = tmp_path / "nan"
    extra = {"optim.lr": 1e30, "train.nan_patience": 2, "train.stop_at": 10}  # the first step blows up the weights
    with pytest.raises(TrainingDivergedError, match="2 consecutive iterations with non-finite"):
        run_pretrain(config(small_tile_store, out, **extra))
    rows = read_metrics(out / "training_metrics.json")
    assert [r["skipped_step"] for r in rows] == [0.0, 1.0]  # iteration 2 raised before logging
    assert not (out / "ckpt").exists()  # nothing saved from a diverged state


def test_rss_stays_bounded_over_many_iterations(small_tile_store, tmp_path) -> None:
    out = tmp_path / "long"
    extra = {
        "optim.epochs": 20,  # 100-iteration schedule
        "train.stop_at": 90,
        "train.global_batch_size": 4,
        "train.batch_size_per_gpu": 4,
        "train.log_period": 10,
        "train.gc_period": 10,
        "data.num_workers": 2,  # real forked loader workers, whose memory is watched too
        "checkpointing.period": 1000,
        "evaluation.eval_period_iterations": 0,
    }
    run_pretrain(config(small_tile_store, out, **extra))
    rows = {r["iteration"]: r for r in read_metrics(out / "training_metrics.json")}
    assert set(rows) >= {19, 89}
    for key in ("rss_mb", "loader_rss_mb"):  # after warm-up (allocator pools, worker imports)
        growth = rows[89][key] - rows[19][key]
        assert growth < 16, f"{key} grew {growth:.1f} MiB over 70 iterations: {[r[key] for r in rows.values()]}"
    assert rows[89]["loader_rss_mb"] > 50  # the workers were alive and measured
