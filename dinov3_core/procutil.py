"""Process-lifetime helpers for torchrun ranks (standard library and `dinov3_core.errors` only: no Prefect, no torch).

Why this exists: torchrun starts every rank with ``start_new_session=True``, so ranks are outside the process group
that Prefect (or a shell, or a batch scheduler) signals. While torchrun lives it forwards SIGTERM to them, but when
torchrun itself is SIGKILLed — Prefect escalates a cancellation to ``killpg(SIGKILL)`` after a grace period — nothing
is left to stop the ranks, and they run on as orphans holding GPUs, ports and memory. ``PR_SET_PDEATHSIG`` asks the
kernel to signal a process when its parent dies, which closes that gap without any cooperation from torchrun.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

from dinov3_core.errors import WsidinoError, exit_code

__all__ = ["PARENT_PID_ENV", "die_with_parent", "rank_entry"]

T = TypeVar("T")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

#: Set by `dinov3_core.launch.run_torchrun` to torchrun's pid: the exact parent a rank must have. `die_with_parent`
#: reads and removes it, so processes the rank starts later (DataLoader workers, …) do not mistake it for theirs.
PARENT_PID_ENV = "WSIDINO_TORCHRUN_PID"


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent process dies (Linux only).

    Call it first thing in a torchrun entry point, so ranks do not outlive a SIGKILLed torchrun. The setting is
    per process, not inherited by children (``fork`` clears it) and survives ``exec``.

    The race: if the parent died before ``prctl`` ran, the signal never comes (the process was already adopted
    by init or a subreaper). So after ``prctl`` the parent is compared with the expected one — `expected_parent`,
    else ``$WSIDINO_TORCHRUN_PID`` (set by `dinov3_core.launch.run_torchrun`), else the parent seen just before
    ``prctl`` — and on a mismatch `sig` is sent to this process at once, as the kernel would have done; if the
    process survives it (a handler, or an ignored signal) it exits with status ``128 + sig``. "Parent id is 1" is
    deliberately *not* treated as orphaned: torchrun is PID 1 when a container runs it as its entry point.

    Args:
        sig: Signal to receive when the parent dies; SIGTERM lets the rank run its normal shutdown.
        expected_parent: The pid the parent must have; None → ``$WSIDINO_TORCHRUN_PID`` or the current parent.

    Returns:
        True when the parent-death signal is armed; False on other platforms or if ``prctl`` failed (nothing
        else changes then: losing the orphan protection must not stop a training run).
    """
    env_parent = os.environ.pop(PARENT_PID_ENV, None)
    if not sys.platform.startswith("linux"):
        return False
    if expected_parent is None and env_parent and env_parent.isdigit():
        expected_parent = int(env_parent)
    parent_before = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    parent = os.getppid()
    if parent != parent_before or (expected_parent is not None and parent != expected_parent):
        print(
            f"die_with_parent: parent process {expected_parent or parent_before} is gone (the parent is now {parent}); "
            f"exiting with signal {signal.Signals(sig).name}",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), sig)
        os._exit(128 + int(sig))
    return True


def rank_entry(work: Callable[[], T], report: Callable[[T], str | None]) -> int:
    """The body of a torchrun rank's `main` (`python -m dinov3_core.train`, `.gram`, `inference.team.rank_main`):
    run `work`, then print `report(result)` on rank 0 (the other ranks' results need not be complete).

    Bad input (a `WsidinoError`) prints its message and returns its exit code with no traceback: 2 bad input (the
    stage removes what it created), 1 a run that stopped itself (output kept). Any other error propagates to
    `@record`, which hands it to torchrun as this rank's root cause.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a torchrun rank: do not outlive a SIGKILLed torchrun
        die_with_parent()
    try:
        result = work()
    except WsidinoError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return exit_code(err)
    if os.environ.get("RANK", "0") != "0":
        return 0
    line = report(result)
    if line:
        print(line, flush=True)
    return 0
