"""Deliberate failures for resilience tests and chaos drills.

`WSIDINO_FAULT=<stage>[@<iteration>][,…]` makes each named stage fail once: a training stage right after its
checkpoint of that iteration (or its first checkpoint), on rank 0 only, as a crashed GPU would; any other stage
as it starts. A marker file in the stage's output directory records that the fault fired, so the retry (or
rerun) succeeds. Unset, this costs one environment lookup.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "WSIDINO_FAULT"


class InjectedFault(RuntimeError):
    """Raised by `maybe_fail`; deliberately not a WsidinoError, so it counts as a crash and is retried."""


def maybe_fail(stage: str, marker_dir: str | os.PathLike[str], iteration: int | None = None) -> None:
    """Raise `InjectedFault` once when `$WSIDINO_FAULT` names this stage (and this iteration, when given)."""
    for spec in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(","))):
        name, _, at = spec.partition("@")
        if name != stage or (at and (iteration is None or int(at) != iteration)):
            continue
        marker = Path(marker_dir) / f".wsidino-fault-{stage}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(spec)
        where = f" after iteration {iteration}" if iteration is not None else ""
        raise InjectedFault(f"injected fault in stage {stage}{where} ({ENV}={spec}); a retry resumes")
