"""Runs that a dead process left RUNNING: ended KILLED.

A process that MLflow never hears from again (killed, out of memory, the node rebooted) leaves its runs RUNNING for
ever, and the UI shows them as still going. Two ways out, both here:

* a run opened by this process is recorded (`opened`); SIGTERM ends every recorded run KILLED before the process
  goes on to die as it would have without us (`install_sigterm`);
* every run we open is tagged with its host and process id (`owner_tags`); before a new run opens, runs of the
  same experiment still RUNNING, opened on this host by a process that no longer exists, are ended KILLED with a
  note (`reap_dead`). SIGKILL leaves no chance to do better.

A pid the kernel has since given to another process looks alive: such a run stays RUNNING (never a live run
KILLED by mistake).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Any

HOST_TAG, PID_TAG, NOTE_TAG = "wsidino.host", "wsidino.pid", "wsidino.note"

_lock = threading.Lock()
_open: dict[str, str] = {}  # run id → tracking URI, for the runs this process has open
_killed: set[str] = set()  # ended KILLED by the SIGTERM handler: the closing code must not overwrite it
_installed = False


def owner_tags() -> dict[str, str]:
    """The tags that let a later run tell whether this process is still alive."""
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}


def opened(run_id: str, uri: str) -> None:
    with _lock:
        _open[run_id] = uri


def closed(run_id: str) -> None:
    with _lock:
        _open.pop(run_id, None)


def was_killed(run_id: str) -> bool:
    with _lock:
        return run_id in _killed


def end_open_runs_killed() -> None:
    """End every run this process has open KILLED (the SIGTERM path)."""
    from mlflow import MlflowClient

    with _lock:
        runs = dict(_open)
        _open.clear()
        _killed.update(runs)
    for run_id, uri in runs.items():
        # Dying anyway: a store that cannot be reached must not keep the process from ending.
        with contextlib.suppress(Exception):
            client = MlflowClient(tracking_uri=uri)
            client.set_tag(run_id, NOTE_TAG, f"ended KILLED: process {os.getpid()} received SIGTERM")
            client.set_terminated(run_id, status="KILLED")


def _on_sigterm(previous: Any) -> Any:
    def handler(signum: int, frame: Any) -> None:
        end_open_runs_killed()
        if callable(previous):  # someone else's handler (Prefect, torchrun's agent) still runs
            previous(signum, frame)
            return
        # The default action: die of SIGTERM as before, exit status and all.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    return handler


def install_sigterm() -> None:
    """Install the SIGTERM handler once per process, only where SIGTERM has its default action (a `wsidino`
    command): a process that ignores it keeps ignoring it, and one whose SIGTERM another handler owns keeps that
    one (Prefect acknowledges a cancellation only while its own handler is installed; its flow runs' MLflow runs are
    ended by their context managers, or as KILLED by the next run's sweep). Only the main thread may install it."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _on_sigterm(previous))
    _installed = True


def _gone(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, OverflowError):  # alive under another user, or a tag we did not write
        return False
    return False


def reap_dead(client: Any, experiment_id: str) -> list[str]:
    """End KILLED, with a note, the runs of `experiment_id` still RUNNING whose process on this host is gone."""
    host = socket.gethostname()
    found = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'",
        max_results=1000,
    )
    reaped = []
    for run in found:
        pid = run.data.tags.get(PID_TAG, "")
        if not pid or pid == str(os.getpid()) or not _gone(pid):
            continue
        note = f"ended KILLED by a later wsidino run: process {pid} on {host} was gone and had left it RUNNING"
        client.set_tag(run.info.run_id, NOTE_TAG, note)
        client.set_terminated(run.info.run_id, status="KILLED")
        reaped.append(run.info.run_id)
    return reaped


__all__ = [
    "HOST_TAG",
    "NOTE_TAG",
    "PID_TAG",
    "closed",
    "end_open_runs_killed",
    "install_sigterm",
    "opened",
    "owner_tags",
    "reap_dead",
    "was_killed",
]
