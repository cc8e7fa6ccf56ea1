"""Listeners for `dinov3_core.events` that let a test act at an exact point of a real run.

Armed with `arm(monkeypatch, "name", directory)`, which sets `$WSIDINO_HOOKS=tests.event_hooks:<name>` and the
directory the listener signals through; tile worker processes and torchrun ranks inherit both.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from dinov3_core.events import HOOKS_ENV

DIR_ENV = "WSIDINO_TEST_EVENTS_DIR"
WAIT_S = 120.0


def arm(monkeypatch: Any, name: str, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv(HOOKS_ENV, f"{__name__}:{name}")
    monkeypatch.setenv(DIR_ENV, str(directory))
    return directory


def wait_for(path: Path, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _dir() -> Path:
    return Path(os.environ[DIR_ENV])


def shards_from_two_workers(event: str, **fields: Any) -> None:
    """Each writer of a shard waits until a second process has written one too: the slide's shards are then
    provably spread over (at least) two workers, however fast the first worker would have been alone."""
    if event != "tile.shard_written":
        return
    (_dir() / f"writer-{os.getpid()}").touch()
    deadline = time.monotonic() + WAIT_S
    while len(list(_dir().glob("writer-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)


def pause_at_stage_start(event: str, **fields: Any) -> None:
    """Signal that a stage has started (its MLflow run opens beside it), then hold it there (the test kills it)."""
    if event != "stage.start":
        return
    (_dir() / "stage-started").touch()
    time.sleep(WAIT_S)


def pause_after_first_shard(event: str, **fields: Any) -> None:
    """Signal that a shard is on disk, then hold the worker there (the test kills the run mid-write)."""
    if event != "tile.shard_written":
        return
    (_dir() / "shard-written").touch()
    time.sleep(WAIT_S)


def kill_worker_once(event: str, **fields: Any) -> None:
    """The process writing a shard of a slide whose id starts with "crash" dies on the spot (as a crashing reader
    would kill it), once per events directory: a rerun then tiles the slide normally."""
    if event != "tile.shard_written" or not str(fields.get("slide_id", "")).startswith("crash"):
        return
    marker = _dir() / "killed"
    if marker.exists():
        return
    marker.touch()
    os._exit(1)


def kill_rank_mid_slide(event: str, **fields: Any) -> None:
    """Rank 1 of an extract job dies by SIGKILL at the second batch of a slide it writes (as the OOM killer
    would end it), once per events directory: the job fails and a rerun finishes the store."""
    if event != "extract.batch" or fields.get("rank") != 1:
        return
    seen = _dir() / f"rank1-{fields['slide_id']}"
    if not seen.exists():
        seen.touch()  # its first batch of this slide
        return
    marker = _dir() / "killed"
    if marker.exists():
        return
    marker.touch()
    os.kill(os.getpid(), signal.SIGKILL)


def hold_at_stage_start(event: str, **fields: Any) -> None:
    """Signal that a stage has started (inside its output lock), then hold it until the test writes `release`:
    a second run into the same output meets the lock while this one provably holds it."""
    if event != "stage.start":
        return
    (_dir() / f"stage-started-{os.getpid()}").touch()
    wait_for(_dir() / "release")
