"""Atomic file writes: neither a reader nor a rerun after a crash ever sees half a file under its final name."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary sibling of `final` to write; renamed onto `final` only when the block succeeds, removed
    otherwise. The suffix is kept, for writers that choose the format by it (np.savez, PIL)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.stem}.tmp-{os.getpid()}{final.suffix}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


__all__ = ["atomic_path", "write_text_atomic"]
