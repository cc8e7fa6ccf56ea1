"""A cycle's data snapshot: which slides of the cohort's tile store it trained on, so anyone can say which slides
a model saw. Recorded as `snapshot.json` in the cycle directory and as an MLflow dataset input of the cycle's run.

    snap = take_snapshot(root / "tiles.zarr")        # slide id → source fingerprint, tile count
    change = compare(snap, reference)                 # new / changed / removed slides since the reference
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dinov3_core.files import write_text_atomic
from dinov3_core.tiling import store as ts

SNAPSHOT_FILE = "snapshot.json"


@dataclass(frozen=True)
class SlideRecord:
    slide_id: str
    source_fingerprint: str
    tiles: int


@dataclass
class Snapshot:
    store: str
    slides: list[SlideRecord]
    hash: str = ""

    def __post_init__(self) -> None:
        self.slides = sorted(self.slides, key=lambda s: s.slide_id)
        if not self.hash:
            text = json.dumps([asdict(s) for s in self.slides], sort_keys=True)
            self.hash = hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def tiles(self) -> int:
        return sum(s.tiles for s in self.slides)

    @property
    def slide_ids(self) -> list[str]:
        return [s.slide_id for s in self.slides]

    def as_dict(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "hash": self.hash,
            "n_slides": len(self.slides),
            "tiles": self.tiles,
            "slides": [asdict(s) for s in self.slides],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Snapshot:
        return cls(doc["store"], [SlideRecord(**s) for s in doc["slides"]], doc["hash"])


def take_snapshot(store: str | Path, cohort: set[str] | None = None) -> Snapshot:
    """Every complete slide of the tile store that is still in the cohort (`cohort`: the slide ids the slides
    folder names now; None: all), with its source fingerprint and tile count. Slides with no tiles are left out:
    nothing of them can be trained on. A slide removed from the folder keeps its tiles in the shared store, but
    no later snapshot includes it."""
    root = Path(store).resolve()
    slides = []
    for slide_id in ts.complete_slide_ids(root):
        if cohort is not None and slide_id not in cohort:
            continue
        attrs = ts.read_slide_attrs(root, slide_id)
        if int(attrs.get("tile_count") or 0) > 0:
            slides.append(SlideRecord(slide_id, str(attrs.get("source_fingerprint") or ""), int(attrs["tile_count"])))
    return Snapshot(str(root), slides)


def write_snapshot(snapshot: Snapshot, cycle_dir: Path) -> Path:
    return write_text_atomic(cycle_dir / SNAPSHOT_FILE, json.dumps(snapshot.as_dict(), indent=1) + "\n")


def read_snapshot(cycle_dir: Path) -> Snapshot | None:
    path = cycle_dir / SNAPSHOT_FILE
    return Snapshot.from_dict(json.loads(path.read_text())) if path.is_file() else None


@dataclass
class CohortChange:
    """What changed between a reference snapshot (the last trained cycle's) and now."""

    new: list[str] = field(default_factory=list)  # slide ids not in the reference
    changed: list[str] = field(default_factory=list)  # same id, another source file (re-scanned)
    removed: list[str] = field(default_factory=list)  # in the reference, gone from the cohort now
    new_tiles: int = 0  # tiles of new and changed slides

    @property
    def added(self) -> int:
        return len(self.new) + len(self.changed)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "added": self.added}

    def describe(self) -> str:
        parts = [f"{len(self.new)} new slide(s)", f"{len(self.changed)} re-scanned", f"{self.new_tiles} new tiles"]
        if self.removed:
            more = " …" if len(self.removed) > 5 else ""
            parts.append(f"{len(self.removed)} removed ({', '.join(self.removed[:5])}{more})")
        return ", ".join(parts)


def compare(now: Snapshot, reference: Snapshot | None) -> CohortChange:
    if reference is None:
        return CohortChange(new=now.slide_ids, new_tiles=now.tiles)
    before = {s.slide_id: s for s in reference.slides}
    current = {s.slide_id: s for s in now.slides}
    new = [i for i in current if i not in before]
    changed = [i for i in current if i in before and current[i].source_fingerprint != before[i].source_fingerprint]
    removed = sorted(set(before) - set(current))
    return CohortChange(new, changed, removed, sum(current[i].tiles for i in new + changed))


def log_dataset_input(snapshot: Snapshot, run_id: str, tracking_uri: str) -> None:
    """The snapshot as an MLflow dataset input of `run_id` (one row per slide; digest = the snapshot hash)."""
    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    import mlflow
    import pandas as pd
    from mlflow import MlflowClient
    from mlflow.entities import DatasetInput, InputTag

    frame = pd.DataFrame([asdict(s) for s in snapshot.slides], columns=["slide_id", "source_fingerprint", "tiles"])
    client = MlflowClient(tracking_uri=tracking_uri)
    tags = [InputTag(key="mlflow.data.context", value="training")]
    with warnings.catch_warnings():  # source-type and integer-schema hints: this table is no model input
        warnings.simplefilter("ignore", UserWarning)
        dataset = mlflow.data.from_pandas(
            frame, source=snapshot.store, name=f"cohort-{snapshot.hash}", digest=snapshot.hash
        )
        client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags)])


__all__ = [
    "SNAPSHOT_FILE",
    "CohortChange",
    "SlideRecord",
    "Snapshot",
    "compare",
    "log_dataset_input",
    "read_snapshot",
    "take_snapshot",
    "write_snapshot",
]
