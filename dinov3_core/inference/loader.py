"""Extract's overlap of I/O with the model: tiles read + prepared ahead on reader threads, outputs written behind.

Threads, not processes: zstd / JPEG decoding (imagecodecs), `os.pread` and numpy's arithmetic release the GIL, so
two reader threads decode while the model thread runs ONNX Runtime or PyTorch (which release it too), and nothing is
pickled between processes. Both sides are bounded: at most `depth` batches read ahead and `depth` writes pending,
so memory stays at a few batches whatever the slide size. Results come back in submission order, and an error in
a background job is raised where the main thread reaches that job, so what reaches the output is the same as in
a serial loop. `threads=0` runs everything inline: the serial path.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

__all__ = ["BackgroundWriter", "TileReader", "read_ahead"]

Job = TypeVar("Job")
Result = TypeVar("Result")


def read_ahead(
    jobs: Iterable[Job], fn: Callable[[Job], Result], threads: int, depth: int
) -> Iterator[tuple[Job, Result]]:
    """(job, fn(job)) in the order of `jobs`, with up to `depth` jobs computed ahead on `threads` threads."""
    if threads <= 0:
        for job in jobs:
            yield job, fn(job)
        return
    todo = iter(jobs)
    pending: deque[tuple[Job, Future[Result]]] = deque()
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="extract-read")
    try:
        for job in todo:
            pending.append((job, pool.submit(fn, job)))
            if len(pending) > depth:  # the oldest is the one the model needs next
                done, fut = pending.popleft()
                yield done, fut.result()
        while pending:
            done, fut = pending.popleft()
            yield done, fut.result()
    finally:  # consumer stopped (error, break): drop what has not started, wait for what has
        for _, fut in pending:
            fut.cancel()
        pool.shutdown(wait=True)


class TileReader:
    """`prepare(ds.read_batch(indices))` on any thread: `TileDataset`'s open handles are per object and not
    thread-safe, so each thread reads through its own copy (copying drops the handles; the index is shared)."""

    def __init__(self, ds: Any, prepare: Callable[[np.ndarray], Any]) -> None:
        self.ds, self.prepare = ds, prepare
        self.owner = threading.get_ident()
        self.local = threading.local()

    def __call__(self, indices: np.ndarray) -> Any:
        ds = self.ds if threading.get_ident() == self.owner else getattr(self.local, "ds", None)
        if ds is None:
            ds = self.local.ds = copy.copy(self.ds)
        return self.prepare(ds.read_batch(indices))


class BackgroundWriter:
    """Runs writes in order on one thread (zarr chunks are read-modify-written: concurrent writers could lose
    rows), blocking `submit` while `depth` writes are pending; `threads=0`: inline."""

    def __init__(self, threads: int, depth: int) -> None:
        self.depth = max(1, depth)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="extract-write") if threads > 0 else None
        self.pending: deque[Future[None]] = deque()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self.pool is None:
            fn(*args)
            return
        self.pending.append(self.pool.submit(fn, *args))
        while len(self.pending) > self.depth:
            self.pending.popleft().result()

    def drain(self) -> None:
        """Wait for every pending write; the first failure is raised."""
        while self.pending:
            self.pending.popleft().result()

    def discard(self) -> None:
        """Drop the pending writes that have not started and wait for the one running (its error dropped)."""
        for fut in self.pending:
            fut.cancel()
        for fut in self.pending:
            if not fut.cancelled():
                fut.exception()  # waits; the failure that got us here is already being raised
        self.pending.clear()

    def close(self) -> None:
        self.discard()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
