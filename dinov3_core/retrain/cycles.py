"""Cycles on disk: `<root>/cycles/<cycle-id>/` with its own stage directories and `cycle.json`, the record of
what the cycle did (status, trigger, snapshot, warm start, decision, features, retention).

    <root>/tiles.zarr                 the cohort's tile store, shared by all cycles (tiled incrementally)
    <root>/cycles/0003-20261124/      pretrain/ gram/ model/ evaluation/ cycle.json snapshot.json
    <root>/features/<model-hash>.zarr the champion's features (champion.json names the current store)
    <root>/.retrain.lock              held while a cycle runs (names its holder)

A cycle's id is fixed by its attempt key (the Prefect flow run id; "cli" for `wsidino retrain`): a retry of the
same flow run finds its cycle and resumes it, a new flow run starts a new cycle. The CLI resumes the newest
cycle that was interrupted, as every other `wsidino` command does on a rerun.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from dinov3_core.files import write_text_atomic
from dinov3_core.locks import exclusive
from dinov3_core.retrain.config import RetrainError

CYCLE_FILE = "cycle.json"
LOCK_FILE = ".retrain.lock"
CLI_ATTEMPT = "cli"

Status = Literal["running", "skipped", "trained", "failed", "abandoned"]
FINISHED: tuple[str, ...] = ("skipped", "trained", "failed", "abandoned")


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


@dataclass
class CycleLayout:
    root: Path

    @property
    def tile_store(self) -> Path:
        return self.root / "tiles.zarr"

    @property
    def cycles(self) -> Path:
        return self.root / "cycles"

    @property
    def features(self) -> Path:
        return self.root / "features"

    def cycle_dir(self, cycle_id: str) -> Path:
        return self.cycles / cycle_id

    def feature_store(self, model_hash: str) -> Path:
        return self.features / f"{model_hash}.zarr"


def _typed(kind: type[Any], doc: Mapping[str, Any] | None) -> Any:
    """A record's part read back: None for a part not written yet (an empty object in older files)."""
    if not doc:
        return None
    names = {f.name for f in fields(kind)}
    return kind(**{k: v for k, v in doc.items() if k in names})


@dataclass
class Trigger:
    """Whether the cycle trains, and why: the change since the reference (the newest trained cycle's snapshot)."""

    train: bool
    reason: str
    since: str
    change: dict[str, Any] = field(default_factory=dict)  # `snapshot.Change.as_dict()`: added, new, removed …


@dataclass
class SnapshotSummary:
    """The cycle's data (the full slide list is in snapshot.json)."""

    hash: str
    n_slides: int
    tiles: int
    failed_slides: list[str] = field(default_factory=list)


@dataclass
class WarmStart:
    source: Literal["champion", "released", "scratch"]
    path: str | None = None
    version: str | None = None  # the champion's model version
    cycle: str | None = None  # the cycle that trained it
    unvetted: bool = False  # a champion the gate never promoted, trusted by `trust_unvetted_champion`


@dataclass
class StageRun:
    status: str  # running, then the outcome's: ran or skipped
    started_at: str | None = None
    reason: str | None = None
    seconds: float | None = None
    mlflow_run_id: str | None = None


@dataclass
class Decision:
    """The gate's decision on the cycle's candidate (a skipped cycle records only the champion it extracted with)."""

    promoted: bool = False
    reason: str | None = None
    evidence: str | None = None  # gate.evidence_line: the line the stage and the pipeline print
    candidate_version: str | None = None
    champion_before: str | None = None
    champion_after: str | None = None


@dataclass
class Features:
    """The cohort's features after the cycle: the champion's store, or why there are none."""

    status: str  # ran / skipped (the extract stage), none (no champion), missing (its model file is not here)
    reason: str | None = None
    store: str | None = None
    model: str | None = None
    model_hash: str | None = None
    version: str | None = None
    cycle: str | None = None
    updated_at: str | None = None
    scope: str | None = None  # every slide (new champion) or new slides only
    replaced: str | None = None  # the previous champion's store, deleted
    slides_extracted: int | None = None
    slides_up_to_date: int | None = None


@dataclass
class Retention:
    deleted: list[str] = field(default_factory=list)  # relative to the root
    kept: dict[str, str] = field(default_factory=dict)  # cycle id → why it keeps what it keeps


@dataclass
class CycleRecord:
    """`cycle.json`: written when the cycle starts and after every step, atomically. Its parts stay None until the
    step that fills them ran."""

    id: str
    number: int
    attempt_key: str
    status: Status = "running"
    started_at: str = field(default_factory=utc_now)
    finished_at: str | None = None
    attempts: int = 1
    mlflow_run_id: str | None = None
    trigger: Trigger | None = None
    snapshot: SnapshotSummary | None = None
    warm_start: WarmStart | None = None
    stages: dict[str, StageRun] = field(default_factory=dict)
    decision: Decision | None = None
    features: Features | None = None
    retention: Retention | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CycleRecord:
        parts = {
            "trigger": Trigger,
            "snapshot": SnapshotSummary,
            "warm_start": WarmStart,
            "decision": Decision,
            "features": Features,
            "retention": Retention,
        }
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in doc.items() if k in names}
        values |= {k: _typed(kind, doc.get(k)) for k, kind in parts.items()}
        values["stages"] = {name: _typed(StageRun, run) for name, run in (doc.get("stages") or {}).items()}
        return cls(**values)

    def save(self, layout: CycleLayout) -> Path:
        return write_text_atomic(layout.cycle_dir(self.id) / CYCLE_FILE, json.dumps(self.to_json(), indent=1) + "\n")

    def summary_line(self) -> str:
        """The cycle in one line: the flow run's final message and the CLI's last line."""
        reason = self.trigger.reason if self.trigger else None
        if self.status == "skipped":
            return f"cycle {self.id} skipped: {reason}"
        if self.status != "trained":
            return f"cycle {self.id} {self.status}: {self.error or ''}"
        verdict = "promoted to @champion" if self.promoted else "not promoted"
        d = self.decision or Decision()
        return (
            f"cycle {self.id} trained ({reason}; warm start: {self.warm_start.source if self.warm_start else None}); "
            f"candidate v{d.candidate_version} {verdict}: {d.evidence or d.reason}"
        )

    @property
    def promoted(self) -> bool:
        return self.decision is not None and self.decision.promoted


def read_cycle(path: Path) -> CycleRecord | None:
    file = path / CYCLE_FILE
    if not file.is_file():
        return None
    return CycleRecord.from_json(json.loads(file.read_text()))


def list_cycles(layout: CycleLayout) -> list[CycleRecord]:
    """Every cycle under the root, oldest first."""
    if not layout.cycles.is_dir():
        return []
    found = [read_cycle(p) for p in sorted(layout.cycles.iterdir()) if p.is_dir()]
    return sorted((c for c in found if c is not None), key=lambda c: c.number)


def open_cycle(layout: CycleLayout, attempt_key: str) -> tuple[CycleRecord, bool]:
    """The cycle for this attempt: (record, resumed). A cycle of the same attempt key that did not finish is
    resumed; otherwise a new one is created and interrupted older cycles are marked abandoned."""
    cycles = list_cycles(layout)
    for c in reversed(cycles):
        if c.attempt_key == attempt_key and c.status in ("running", "failed"):
            if attempt_key == CLI_ATTEMPT and c is not cycles[-1]:
                break  # the CLI resumes only the newest cycle
            c.status, c.error, c.attempts, c.finished_at = "running", None, c.attempts + 1, None
            c.save(layout)
            return c, True
    # Nothing will resume these any more: a cycle left running by a crashed holder, and (CLI) an older failed one.
    for c in cycles:
        if c.status == "running" or (c.status == "failed" and c.attempt_key == attempt_key):
            c.status, c.finished_at = "abandoned", c.finished_at or utc_now()
            c.save(layout)
    number = (cycles[-1].number + 1) if cycles else 1
    cycle_id = f"{number:04d}-{dt.datetime.now(dt.UTC):%Y%m%d}"
    record = CycleRecord(cycle_id, number, attempt_key)
    layout.cycle_dir(cycle_id).mkdir(parents=True, exist_ok=False)
    record.save(layout)
    return record, False


@contextlib.contextmanager
def root_lock(layout: CycleLayout) -> Iterator[None]:
    """One cycle per root at a time; a second one fails at once, naming the holder."""
    layout.root.mkdir(parents=True, exist_ok=True)

    def busy(holder: str) -> Exception:
        return RetrainError(
            f"another retraining cycle is running under {layout.root} ({holder}); this one did not start. Wait "
            f"for it to finish (the retrain deployment queues runs: concurrency 1) or stop it first"
        )

    with exclusive(layout.root / LOCK_FILE, busy):
        yield


__all__ = [
    "CLI_ATTEMPT",
    "CYCLE_FILE",
    "FINISHED",
    "CycleLayout",
    "CycleRecord",
    "Decision",
    "Features",
    "Retention",
    "SnapshotSummary",
    "StageRun",
    "Trigger",
    "WarmStart",
    "list_cycles",
    "open_cycle",
    "read_cycle",
    "root_lock",
    "utc_now",
]
