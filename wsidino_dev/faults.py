"""Deliberate failures for resilience tests and chaos drills, hooked into the stages' events.

`WSIDINO_FAULT=<stage>[@<iteration>][,…]` makes each named stage fail once: a training stage right after its
checkpoint of that iteration (or its first checkpoint), on rank 0 only, as a crashed GPU would; any other stage
as it starts. A marker file in the stage's output directory records that the fault fired, so the retry (or
rerun) succeeds.

`<stage>:oom>N` is a device that is too small: every step of that training stage whose micro-batch is above N
raises `torch.OutOfMemoryError` before its forward, on every rank, as CUDA would.

The ML core knows nothing of this module: `environment("pretrain@1,export")` returns the variables that make
`dinov3_core.events` call `on_event` here (`WSIDINO_HOOKS`) together with the fault list; set them on the
process that runs the stage (a Prefect worker, the CLI) and every torchrun rank inherits them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dinov3_core.events import HOOKS_ENV

ENV = "WSIDINO_FAULT"


class InjectedFault(RuntimeError):
    """Raised by `maybe_fail`; deliberately not a WsidinoError, so it counts as a crash and is retried."""


def environment(faults: str) -> dict[str, str]:
    """The environment that arms `faults` (e.g. ``"pretrain@1,export"``) in every process of a run."""
    return {ENV: faults, HOOKS_ENV: __name__}


def on_event(event: str, **fields: Any) -> None:
    """The `dinov3_core.events` listener: a stage's start, and each training checkpoint on rank 0."""
    if event == "stage.start" and not fields.get("training"):  # training stages fail after a checkpoint instead
        maybe_fail(fields["stage"], fields["output"])
    elif event == "train.checkpoint" and fields.get("rank", 0) == 0:
        maybe_fail(fields["stage"], fields["output_dir"], fields["iteration"])
    elif event == "train.step":
        maybe_out_of_memory(fields["stage"], fields["micro_batch"])


def maybe_out_of_memory(stage: str, micro_batch: int) -> None:
    """Raise `torch.OutOfMemoryError` when `$WSIDINO_FAULT` holds `<stage>:oom>N` and `micro_batch` > N."""
    for spec in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(","))):
        name, _, limit = spec.partition(":oom>")
        if name == stage and limit and micro_batch > int(limit):
            import torch  # only a training process gets here, and it has torch already

            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected: {ENV}={spec}, micro-batch {micro_batch} > {limit})"
            )


def maybe_fail(stage: str, marker_dir: str | os.PathLike[str], iteration: int | None = None) -> None:
    """Raise `InjectedFault` once when `$WSIDINO_FAULT` names this stage (and this iteration, when given)."""
    for spec in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(","))):
        if ":oom>" in spec:
            continue  # a memory fault (maybe_out_of_memory), not a crash
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
