"""One writer at a time: a non-blocking `flock` that names its holder when it is taken."""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import socket
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def exclusive(lock_path: str | os.PathLike[str], busy: Callable[[str], Exception]) -> Iterator[None]:
    """Hold `lock_path` for the block, or raise `busy(holder)` at once when another process holds it.

    The kernel releases a `flock` when its holder dies, even on SIGKILL, so a crashed run never leaves a stale
    lock; the file keeps "pid … on host since …" of the current holder for the error message.
    """
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise busy(handle.read().strip() or "another process") from None
        handle.seek(0)
        handle.truncate()
        since = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {since}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


__all__ = ["exclusive"]
