"""Named events from inside the stages, for tools that live outside the ML core.

The core emits a handful of events at moments worth reacting to (a stage starts, a checkpoint is on disk, a
shard of tiles is written); listeners are plain functions named in `$WSIDINO_HOOKS`
(``module:function`` or ``module``, meaning ``module:on_event``; comma-separated). Fault drills
(`wsidino_dev.faults`) and tests that must act at an exact point (kill mid-write, cancel mid-training) hook in
this way, so the training loop and the tile engine carry no test code. Unset, `emit` costs one environment
lookup.

Events and their fields:

* ``stage.start``: stage, output (the stage's output directory), training (a torchrun stage: emitted by the runner
  before the job starts, not by its ranks);
* ``train.step``: stage, output_dir, iteration, micro_batch, rank (every rank, before the step's forward; a
  listener raising `torch.OutOfMemoryError` here is a device running out of memory at that micro-batch);
* ``train.checkpoint``: stage, output_dir, iteration, rank (every rank, after the DCP checkpoint is complete);
* ``tile.shard_written``: store, slide_id, start, tiles (in the worker process that wrote the shard);
* ``extract.batch``: output, slide_id, start (first row), rank (before the model runs on a batch, in every rank).

The environment is inherited by torchrun ranks and tile worker processes, so a hook set before a run sees the
events of every process of it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

HOOKS_ENV = "WSIDINO_HOOKS"

Listener = Callable[..., None]
_loaded: dict[str, list[Listener]] = {}  # $WSIDINO_HOOKS value → its listeners (loaded once per process)


def _listeners(spec: str) -> list[Listener]:
    if spec not in _loaded:
        found = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            module, _, name = item.partition(":")
            try:
                found.append(getattr(importlib.import_module(module), name or "on_event"))
            except (ImportError, AttributeError) as err:
                raise RuntimeError(f"{HOOKS_ENV}={spec!r}: cannot load {item!r} ({err})") from err
        _loaded[spec] = found
    return _loaded[spec]


def emit(event: str, **fields: Any) -> None:
    """Call every listener named in `$WSIDINO_HOOKS` with `(event, **fields)`; a listener may raise to fail
    the stage at this point (that is how fault drills crash a run)."""
    spec = os.environ.get(HOOKS_ENV)
    if not spec:
        return
    for listener in _listeners(spec):
        listener(event, **fields)


__all__ = ["HOOKS_ENV", "emit"]
