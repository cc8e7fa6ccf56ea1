"""Errors caused by the user's input, phrased for the user: each names the file or key and what to do."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path


class WsidinoError(Exception):
    """Bad input or a bad environment. The CLI prints the message (no traceback) and exits with code 2."""


class OutputBusy(RuntimeError):
    """Another run holds the output's lock. Deliberately not a `WsidinoError`: the rule "bad input: remove what this
    run created" must never touch an output (or a work directory) that the holder is writing; the CLI prints it as
    one line and exits EXIT_FAILED (wait, then rerun), and a Prefect task may retry it."""


# Exit codes of the `wsidino` commands: done, a stage failed (rerun to resume), bad input (fix it first).
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class RunStopped(WsidinoError):
    """A run that stopped itself after saving its state (a checkpoint): diverging, or out of memory with nothing left
    to re-plan. Unlike bad input its output is kept; the CLI exits with EXIT_FAILED (fix the cause, rerun to resume)."""


def exit_code(err: WsidinoError) -> int:
    """EXIT_FAILED for a run that stopped itself (rerun to resume), EXIT_USAGE for bad input (fix it first)."""
    return EXIT_FAILED if isinstance(err, RunStopped) else EXIT_USAGE


# errno of a write the file system refused for want of space: ENOSPC, EFBIG (a file-size limit), EDQUOT (a quota).
_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# HDF5 reports the C errno only inside its message, e.g. "file write failed: … errno = 28, error message = …".
_HDF5_ERRNO = re.compile(r"errno = (\d+)")


class DiskFull(RunStopped):
    """A write refused for want of space. Like a stopped run, what was committed is kept (exit EXIT_FAILED): free
    space, rerun, and the stage resumes."""


def is_disk_full(err: BaseException) -> bool:
    """True for an OSError that says the file system (or a size limit or quota) has no room for the write."""
    if not isinstance(err, OSError):
        return False
    if err.errno in _FULL_ERRNOS:
        return True
    found = _HDF5_ERRNO.search(str(err))
    return found is not None and int(found.group(1)) in _FULL_ERRNOS


def disk_full(err: OSError, path: str | os.PathLike[str], needed: int | None = None) -> DiskFull:
    """One line for a refused write: the path, the bytes it needed and what is free there, and what to do."""
    where = Path(err.filename) if isinstance(err.filename, str) else Path(path)
    reason = os.strerror(err.errno) if err.errno in _FULL_ERRNOS else "no space left for the write"
    probe = next((p for p in (where, *where.parents) if p.exists()), None)
    free = f", {shutil.disk_usage(probe).free} bytes free there" if probe is not None else ""
    size = f"{needed} bytes" if needed else "its data"
    return DiskFull(
        f"{where}: {reason} writing {size}{free}; free at least {size} on that file system (or choose an output on "
        "a larger disk), then rerun: what was committed is kept and the rest is redone"
    )
