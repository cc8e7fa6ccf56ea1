"""The memory watch: real process memory, judged over windows, and the re-plan it drives mid-run.

The end-to-end test gives a run a budget between its real peaks at micro-batch 8 and micro-batch 1 (each measured
by its own training process first). The run must then re-plan itself down, keep the global batch, and end with
the parameters of a run that never re-planned (the teacher's targets span the step, so the objective is the same).
Training runs as `python -m dinov3_core.train` processes so that each one's memory is its own, not pytest's.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from dinov3_core.config import ConfigError
from dinov3_core.runner import run_stage
from dinov3_core.train.batch_plan import RunPlan, next_plan
from dinov3_core.train.memory_watch import MemorySampler, MemoryWindow, PressureJudge, PressureLimits, pressure_limits
from dinov3_core.train.metrics import read_metrics
from dinov3_core.train.pretrain import run_pretrain
from tests.helpers import WIDE, load_dcp, max_diff, pretrain_config, replanned_and_reference, train_process

pytestmark = pytest.mark.usefixtures("one_thread")

MIB = 2**20

# The wide step, checkpoints every 2 iterations, and a watch that judges every window.
WIDE_WATCHED: dict[str, Any] = {
    **WIDE,
    "checkpointing.period": 2,
    "checkpointing.max_to_keep": 5,
    "train.memory_watch_period": 1,
    "train.memory_watch_patience": 2,
}


def train_metrics(store: Path, out: Path, **extra: Any) -> list[dict[str, Any]]:
    """One `python -m dinov3_core.train` process (its own memory); its metrics lines."""
    train_process(store, out, env={"OMP_NUM_THREADS": "1"}, **{**WIDE_WATCHED, **extra})
    return read_metrics(out / "training_metrics.json")


def peak_mb(rows: list[dict[str, Any]]) -> float:
    return max(r["memory_process_mb"] for r in rows if "memory_process_mb" in r)


# ------------------------------------------------------------------------------------------------ pieces


def test_the_ladder_frees_loader_memory_first_then_splits_the_step_then_recomputes() -> None:
    plan = RunPlan(
        micro_batch=8, accumulation_steps=1, num_workers=2, prefetch_factor=2, activation_checkpointing=False
    )
    steps, current = [], plan
    while (step := next_plan(current, "host")) is not None:
        steps.append((step.what, step.after.micro_batch, step.after.accumulation_steps, step.after.num_workers))
        current = step.after
    assert steps == [
        ("loader", 8, 1, 1),
        ("loader", 8, 1, 0),
        ("micro_batch", 4, 2, 0),
        ("micro_batch", 2, 4, 0),
        ("micro_batch", 1, 8, 0),
        ("activation_checkpointing", 1, 8, 0),
    ]
    assert current.activation_checkpointing and current.step_batch == plan.step_batch
    # GPU pressure: loader workers live in host memory, so freeing them would not help.
    gpu = next_plan(plan, "device")
    assert gpu is not None and gpu.what == "micro_batch" and gpu.after.num_workers == 2
    # The micro-batch must divide the step batch: 12 → 6 → 3 → 1.
    odd = RunPlan(12, 1, 0, 2, False)
    micro = []
    while (step := next_plan(odd, "device")) is not None and step.what == "micro_batch":
        micro.append(step.after.micro_batch)
        odd = step.after
    assert micro == [6, 3, 1]


def window(process_mb: float, *, available_mb: float = 10_000.0, swap_in_mb: float = 0.0) -> MemoryWindow:
    return MemoryWindow(process_mb, available_mb, swap_in_mb, 0.0, 0.0, seconds=1.0)


def test_pressure_must_be_sustained_and_each_kind_is_named() -> None:
    judge = PressureJudge(PressureLimits(process_mb=1000, device_mb=0, min_available_mb=500), patience=3)
    spikes = [window(1500), window(900), window(1500), window(1500), window(900)]
    assert [judge.observe(w) for w in spikes] == [None] * 5  # never three in a row
    decisions = [judge.observe(window(1200)) for _ in range(3)]
    assert decisions[:2] == [None, None]
    assert decisions[2] is not None and decisions[2][0] == "host" and "1200 MiB > 1000 MiB" in decisions[2][1]
    assert judge.observe(window(1200)) is None  # the next decision needs fresh evidence

    limits = PressureLimits(process_mb=1000, device_mb=0, min_available_mb=500)
    assert "available memory fell to 300 MiB" in limits.judge(window(100, available_mb=300))[1]
    assert "swapped in 50.0 MiB/s" in limits.judge(window(100, swap_in_mb=50))[1]
    assert limits.judge(window(999, swap_in_mb=1)) == (None, "")

    # The limit: an explicit budget × threshold; without one, this rank's share of the machine.
    cpu, ram = torch.device("cpu"), psutil.virtual_memory().total / MIB
    set_budget = pressure_limits(
        budget_bytes=2 * 1024 * MIB, explicit_budget=True, device=cpu, local_world_size=2, threshold=0.5
    )
    planned = pressure_limits(
        budget_bytes=2 * 1024 * MIB, explicit_budget=False, device=cpu, local_world_size=2, threshold=1.0
    )
    assert set_budget.process_mb == 1024 and set_budget.device_mb == 0
    assert planned.process_mb == pytest.approx(ram / 2) and planned.min_available_mb == pytest.approx(
        max(256, ram / 20)
    )


def _hold_memory(mib: int, ready: Any, done: Any) -> None:
    block = torch.ones(mib * MIB // 4)  # written, so the pages are resident
    ready.set()
    done.wait(30)
    del block


def test_the_sampler_sees_a_transient_peak_and_the_loader_workers() -> None:
    sampler = MemorySampler(torch.device("cpu"), interval=0.02, children_interval=0.05).start()
    try:
        baseline = sampler.window().process_mb
        block = torch.ones(300 * MIB // 4)
        time.sleep(0.3)
        del block  # gone before the window is read: only the background thread saw it
        seen = sampler.window()
        assert seen.process_mb > baseline + 250, (baseline, seen)
        assert seen.host_available_mb > 0 and seen.seconds > 0.2

        ctx = multiprocessing.get_context("fork")  # how loader workers start on Linux
        ready, done = ctx.Event(), ctx.Event()
        worker = ctx.Process(target=_hold_memory, args=(200, ready, done))
        worker.start()
        try:
            assert ready.wait(30)
            time.sleep(0.3)
            with_worker = sampler.window()
        finally:
            done.set()
            worker.join(30)
        # The worker's own 200 MiB count; the pages it shares with this process (torch, Python) do not.
        assert baseline + 180 < with_worker.process_mb < baseline + 400, (baseline, with_worker)
    finally:
        sampler.stop()


# ---------------------------------------------------------------------------------------------- training


def test_a_run_over_its_budget_replans_to_the_same_parameters_and_resumes_with_the_new_plan(
    small_tile_store, tmp_path
) -> None:
    store = small_tile_store
    big = train_metrics(store, tmp_path / "micro8", **{"train.batch_size_per_gpu": 8, "train.stop_at": 6})
    small = train_metrics(store, tmp_path / "micro1", **{"train.batch_size_per_gpu": 1, "train.stop_at": 2})
    assert not any("event" in r for r in big + small)  # no budget set: the machine is the limit
    gap = peak_mb(big) - peak_mb(small)
    assert gap > 120, f"micro-batch 8 vs 1 peak at {peak_mb(big):.0f} vs {peak_mb(small):.0f} MiB"
    budget_gb = (peak_mb(big) + peak_mb(small)) / 2 / 1024  # micro-batch 8 does not fit, 1 does

    out = tmp_path / "watched"
    extra = {"train.batch_size_per_gpu": 8, "train.stop_at": 6, "train.memory_budget_gb": budget_gb}
    rows = train_metrics(store, out, **extra)
    events = [r for r in rows if r.get("event") == "memory_replan"]
    steps = [r for r in rows if "event" not in r]
    assert events, f"no re-plan under {budget_gb * 1024:.0f} MiB: {[round(r['memory_process_mb']) for r in steps]}"
    first = events[0]
    assert first["what"] == "micro_batch" and "process memory peaked at" in first["why"]
    assert (first["before"]["micro_batch"], first["after"]["micro_batch"]) == (8, 4)
    assert first["iteration"] == 1  # two windows over the limit (patience 2), then at the step boundary
    for row in rows:  # every line says how the step is split; the global batch never changes
        assert row["global_batch_size"] == 8
        assert row["micro_batch_size"] * row["accumulation_steps"] == 8
    final_micro = events[-1]["after"]["micro_batch"]
    assert steps[-1]["micro_batch_size"] == final_micro < 8
    assert steps[-1]["memory_process_mb"] < budget_gb * 1024  # the re-plan relieved the pressure

    # Same objective: the parameters after the re-planned steps are the never-re-planned run's.
    got, ref = load_dcp(out / "ckpt" / "5")["model"], load_dcp(tmp_path / "micro8" / "ckpt" / "5")["model"]
    assert max_diff(got, ref, "student.") < 1e-5 and max_diff(got, ref, "teacher.") < 1e-5
    assert max_diff(got, load_dcp(out / "ckpt" / "1")["model"], "student.") > 1e-3  # they did move

    meta = json.loads((out / "ckpt" / "5" / "meta.json").read_text())
    assert meta["run_plan"]["micro_batch"] == final_micro and meta["memory_replans"] == len(events)

    # A resumed run starts with the re-planned settings (and keeps counting re-plans).
    result = run_pretrain(pretrain_config(store, out, **{**WIDE_WATCHED, **extra, "train.stop_at": 7}))
    assert result.start_iteration == 6 and result.micro_batch <= final_micro
    assert result.memory_replans >= len(events)


def test_every_rank_replans_alike_under_fsdp2(small_tile_store, tmp_path) -> None:
    """2 gloo processes, FSDP2, every window over the budget: both re-plan after iterations 0 and 1 (4 → 2 → 1 per
    rank) and end with the parameters of one process that never re-planned."""
    out = tmp_path / "two"
    squeezed = {
        "train.batch_size_per_gpu": 4,
        "train.memory_budget_gb": 0.05,
        "train.memory_watch_period": 1,
        "train.memory_watch_patience": 1,
    }
    rows, got, ref = replanned_and_reference(small_tile_store, out, tmp_path / "one", 3, squeezed)
    assert [(r["iteration"], r["after"]["micro_batch"]) for r in rows if "event" in r] == [(0, 2), (1, 1)]
    for log in ("log.txt", "log.txt.rank1"):
        text = (out / "logs" / log).read_text()
        assert text.count("re-planned micro_batch") == 2, log
    assert max_diff(got, ref, "student.") < 1e-5 and max_diff(got, ref, "teacher.") < 1e-5


def test_nothing_left_to_replan_stops_with_a_checkpoint_and_keeps_the_output(small_tile_store, tmp_path) -> None:
    """A budget below any plan: every rung is taken (the loader is rebuilt mid-run twice), then the run checkpoints
    and stops, its output kept."""
    out = tmp_path / "squeezed"
    extra = {
        "data.num_workers": 2,
        "train.memory_budget_gb": 0.05,  # the tiny model fits; no process fits
        "train.memory_watch_period": 1,
        "train.memory_watch_patience": 1,
        "train.stop_at": 12,
        "checkpointing.period": 100,
        "evaluation.eval_period_iterations": 0,
        "health.probe_tiles": 0,
    }
    cfg = pretrain_config(small_tile_store, out, **extra)
    with pytest.raises(Exception, match="does not fit its memory") as info:
        run_stage("pretrain", cfg)
    message = str(info.value)
    assert "train.memory_budget_gb=0.05" in message and "micro-batch 1 × 8" in message
    assert "activation checkpointing on" in message and "0 loader worker(s)" in message
    assert "student.lora.rank" in message
    rows = read_metrics(out / "training_metrics.json")
    rungs = [r["what"] for r in rows if r.get("event") == "memory_replan"]
    assert rungs == ["loader", "loader", "micro_batch", "micro_batch", "micro_batch", "activation_checkpointing"]
    steps = [r["iteration"] for r in rows if "event" not in r]
    assert steps == list(range(len(steps)))  # the rebuilt loaders went on at the right step
    stopped_at = rows[-1]["iteration"]
    assert (out / "ckpt" / str(stopped_at) / ".metadata").is_file()  # saved before stopping: nothing lost
    # The stage ran it as a torchrun job: rank exit 1 (stopped, rerun to resume), not 2 (bad input, output removed).
    manifest = json.loads((out / "stage_manifest.json").read_text())
    assert manifest["status"] == "failed" and "rank 0 exit code 1" in manifest["error"]


def test_a_budget_below_the_model_itself_is_refused_before_anything_is_written(small_tile_store, tmp_path) -> None:
    out = tmp_path / "never"
    with pytest.raises(ConfigError, match=r"train.memory_budget_gb=0.001 GiB is smaller than the model itself"):
        run_pretrain(pretrain_config(small_tile_store, out, **{"train.memory_budget_gb": 0.001}))
    assert not out.exists()


# ------------------------------------------------------------------------ out of device memory mid-step


def test_a_step_out_of_device_memory_is_retried_smaller_to_the_same_parameters(
    small_tile_store, tmp_path, monkeypatch
) -> None:
    """A device that only fits micro-batches of 2 (`wsidino_dev.faults`: `pretrain:oom>2` raises the
    `torch.OutOfMemoryError` CUDA raises, before the step's forward): the first step is retried at 4, then 2, and
    the run ends with the parameters of one that was planned at 2 from the start. Nothing fits at all: the run
    stops naming the rungs it took and that no checkpoint exists yet."""
    from wsidino_dev import faults

    common = {
        "train.stop_at": 3,
        "checkpointing.period": 3,
        "evaluation.eval_period_iterations": 0,
        "health.probe_tiles": 0,
        "train.batch_size_per_gpu": 8,
    }
    reference = run_pretrain(pretrain_config(small_tile_store, tmp_path / "planned", **common))
    for key, value in faults.environment("pretrain:oom>2").items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "oom"
    result = run_pretrain(pretrain_config(small_tile_store, out, **common))
    rows = read_metrics(out / "training_metrics.json")
    replans = [r for r in rows if r.get("event") == "memory_replan"]
    assert [(r["iteration"], r["before"]["micro_batch"], r["after"]["micro_batch"]) for r in replans] == [
        (0, 8, 4),
        (0, 4, 2),
    ]
    assert all("out of device memory in iteration 0" in r["why"] and "injected" in r["why"] for r in replans)
    assert [r["iteration"] for r in rows if "event" not in r] == [0, 1, 2]  # no step lost or repeated
    assert result.micro_batch == 2 and result.memory_replans == 2  # planned at 8, ran at 2
    got = load_dcp(out / "ckpt" / "2")["model"]
    ref = load_dcp(tmp_path / "planned" / "ckpt" / "2")["model"]
    assert reference.end_iteration == result.end_iteration == 3
    assert max_diff(got, ref, "student.") < 1e-5 and max_diff(got, ref, "teacher.") < 1e-5

    monkeypatch.setenv(faults.ENV, "pretrain:oom>0")
    with pytest.raises(Exception, match="does not fit its memory") as info:
        run_pretrain(pretrain_config(small_tile_store, tmp_path / "never", **common))
    message = str(info.value)
    assert "out of device memory in iteration 0" in message and "micro-batch 1 × 8" in message
    assert "No checkpoint yet" in message
    assert not (tmp_path / "never" / "ckpt" / "0").exists()  # a step that never ran is never saved
