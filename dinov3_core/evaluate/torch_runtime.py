"""Where the probes' torch classifiers run: the device (`evaluate.device`) and the CPU threads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def resolve_device(device: str | None) -> torch.device:
    """`evaluate.device`: null → cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch intra-op threads for the probes (0: leave the library default), restored afterwards."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["resolve_device", "torch_threads"]
