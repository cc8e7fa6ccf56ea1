"""One progress mechanism for every stage: a bar on a terminal; in log files and the Prefect run log, a line every
`every_s` seconds with count, rate and ETA (never a carriage return); an optional callback for whoever publishes
progress elsewhere (the Prefect progress artifact).

    with Progress("extract", unit="tile", total=n, callback=hooks.progress) as p:
        for batch in batches:
            ...
            p.update(len(batch))
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import IO, Any

from tqdm import tqdm

logger = logging.getLogger(__name__)


def eta(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class Progress:
    """Counts done out of a total that may grow (tiling plans slides as it goes)."""

    def __init__(
        self,
        label: str,
        *,
        unit: str,
        total: int = 0,
        enabled: bool = True,
        callback: Callable[[int, int], None] | None = None,
        every_s: float = 30.0,
        stream: IO[str] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.label, self.unit, self.total, self.done = label, unit, total, 0
        self.callback, self.every_s = callback, every_s
        self.log = log or logger.info
        self.start = self.last_line = time.monotonic()
        stream = stream or sys.stderr
        self.bar: Any = None
        if enabled and stream.isatty():
            self.bar = tqdm(total=total, unit=unit, desc=label, file=stream, dynamic_ncols=True)
        self.lines = enabled and self.bar is None  # no terminal: periodic log lines

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close(finished=kind is None)

    def set(self, done: int, total: int | None = None) -> None:
        """Absolute position (and total, when it changed)."""
        if total is not None:
            self.total = total
            if self.bar is not None:
                self.bar.total = total
        self.update(done - self.done)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        if self.callback is not None:
            self.callback(self.done, self.total)
        now = time.monotonic()
        if self.lines and now - self.last_line >= self.every_s:
            self.last_line = now
            self.log(self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.start, 1e-9)
        rate = self.done / elapsed
        text = f"{self.label}: {self.done}"
        if self.total:
            text += f"/{self.total} {self.unit}s ({100 * self.done / self.total:.0f} %)"
        else:
            text += f" {self.unit}s"
        text += f", {rate:.1f} {self.unit}s/s"
        if self.total and rate > 0 and self.done < self.total:
            text += f", ETA {eta((self.total - self.done) / rate)}"
        return text

    def close(self, finished: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.lines and finished and self.done:
            self.log(self.line() + f" in {eta(time.monotonic() - self.start)}")
        self.lines = False


class Phase:
    """A named step of a stage in the log: a line when it starts, one when it ends (or fails) with the seconds it
    took, and, through its loops, `tick(what)` lines at most every `every_s` seconds, so a step of minutes that
    shows no bar still says it is alive.

        with Phase("evaluate: tile probes", log=logger.info) as phase:
            for role in models:
                ...
                phase.tick(f"{role} done")
    """

    def __init__(self, label: str, *, log: Callable[[str], None] | None = None, every_s: float = 10.0) -> None:
        self.label, self.every_s = label, every_s
        self.log = log or logger.info
        self.start = self.last_line = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def __enter__(self) -> Phase:
        self.start = self.last_line = time.monotonic()
        self.log(f"{self.label}: started")
        return self

    def tick(self, what: str, *, always: bool = False) -> None:
        """`what` is done; logged when `every_s` passed since the last line (or `always`: a step worth a line)."""
        now = time.monotonic()
        if always or now - self.last_line >= self.every_s:
            self.last_line = now
            self.log(f"{self.label}: {what} ({now - self.start:.1f} s)")

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.log(f"{self.label}: {'done in' if kind is None else 'failed after'} {self.elapsed():.1f} s")


__all__ = ["Phase", "Progress"]
