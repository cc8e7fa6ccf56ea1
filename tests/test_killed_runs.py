"""A stage killed mid-run leaves no MLflow run RUNNING for ever: SIGTERM ends its run KILLED at once; after SIGKILL
the next run against the same store ends it KILLED, with a note, before its own run opens. Real `wsidino tile`
processes on a sample slide, held at the stage's start by an event hook and killed there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dinov3_core.tracking_runs import HOST_TAG, NOTE_TAG, PID_TAG
from tests import event_hooks
from tests.helpers import by_name, sqlite_uri

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]


def tile(slide: Path, out: Path, uri: str, events: Path | None = None) -> subprocess.Popen[str]:
    """`wsidino tile` as a user starts it, logging to `uri`; with `events`, held at the stage's start."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(ROOT)}
    if events is not None:
        events.mkdir(parents=True, exist_ok=True)
        env |= {"WSIDINO_HOOKS": "tests.event_hooks:pause_at_stage_start", event_hooks.DIR_ENV: str(events)}
    else:
        env.pop("WSIDINO_HOOKS", None)
    command = [sys.executable, "-m", "dinov3_core.cli", "tile", "--input", str(slide), "--output", str(out)]
    return subprocess.Popen([*command, "tile_size=64", "mpp=2.0"], cwd=ROOT, env=env, text=True)


def runs_of(uri: str) -> list[Any]:
    from mlflow import MlflowClient

    if not Path(uri.removeprefix("sqlite:///")).is_file():  # the stage creates it: a client here would race it
        return []

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("wsidino")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def running_run_of(uri: str, pid: int, timeout: float = 120.0) -> Any:
    """The run the held process has open (it opens beside the work, so it may come a moment after the start)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mine = [r for r in runs_of(uri) if r.data.tags.get(PID_TAG) == str(pid) and r.info.status == "RUNNING"]
        if mine:
            return mine[0]
        time.sleep(0.2)
    raise TimeoutError(f"no RUNNING run of process {pid} in {uri}")


def held(slide: Path, out: Path, uri: str, events: Path) -> tuple[subprocess.Popen[str], Any]:
    proc = tile(slide, out, uri, events)
    try:
        deadline = time.monotonic() + event_hooks.WAIT_S
        while not (events / "stage-started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the held stage never started"
            time.sleep(0.05)
        return proc, running_run_of(uri, proc.pid)
    except BaseException:
        proc.kill()
        raise


def test_sigterm_ends_the_run_killed_at_once(sample_slides: Any, tmp_path: Path) -> None:
    uri = sqlite_uri(tmp_path)
    proc, run = held(by_name(sample_slides, "tissue_20x.svs"), tmp_path / "tiles.zarr", uri, tmp_path / "events")
    assert run.data.tags[HOST_TAG] and run.data.tags[PID_TAG] == str(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # it still dies of SIGTERM, as without the handler
    (after,) = runs_of(uri)
    assert after.info.run_id == run.info.run_id
    assert after.info.status == "KILLED" and "SIGTERM" in after.data.tags[NOTE_TAG]


def test_after_sigkill_the_next_run_ends_the_orphan_killed(sample_slides: Any, tmp_path: Path) -> None:
    uri = sqlite_uri(tmp_path)
    slide = by_name(sample_slides, "tissue_20x.svs")
    proc, run = held(slide, tmp_path / "first.zarr", uri, tmp_path / "events")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    (orphan,) = runs_of(uri)
    assert orphan.info.status == "RUNNING"  # nothing could run on SIGKILL: the next run must notice
    again = tile(slide, tmp_path / "second.zarr", uri)
    assert again.wait(timeout=240) == 0
    runs = {r.info.run_id: r for r in runs_of(uri)}
    assert len(runs) == 2 and not [r for r in runs.values() if r.info.status == "RUNNING"]
    killed = runs[run.info.run_id]
    assert killed.info.status == "KILLED" and f"process {proc.pid}" in killed.data.tags[NOTE_TAG]
    (new,) = [r for r in runs.values() if r.info.run_id != run.info.run_id]
    assert new.info.status == "FINISHED" and new.data.tags[PID_TAG] == str(again.pid)
