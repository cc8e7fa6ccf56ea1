"""`evaluation.json` as a type: `EvaluationReport`, written by the evaluate stage and read back by whoever needs its
numbers (`EvaluationReport.from_json(path.read_text())`).

The top-level keys are fields; what lies below them (a model's probes and health, a comparison, the decision) stays
JSON-shaped dicts, read by `gate.Decision.from_dict` and `statistics.Comparison.from_dict` where typed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from dinov3_core.files import write_text_atomic


@dataclass
class EvaluationReport:
    """What one evaluation found; `to_json` writes the keys in the order the stage has always written them."""

    store: str
    labelled_tiles: int = 0
    mpp: float | None = None
    labels: dict[str, Any] = field(default_factory=dict)  # the label report (`label_report.LabelReport.summary`)
    classes: dict[str, int] = field(default_factory=dict)  # class → labelled tiles
    candidate_is_champion: bool = False
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # role → description, health, probes (or error)
    comparisons: dict[str, Any] = field(default_factory=dict)  # candidate_vs_<other> → metric → Comparison dict
    warnings: list[str] = field(default_factory=list)
    split: dict[str, Any] | None = None  # the cross-validation folds (labelled tiles only)
    # Before the decision: the protocol's counts (unit, test groups, folds) the gate reads; after: the decision's.
    evidence: dict[str, Any] = field(default_factory=dict)
    site_predictability: dict[str, float] | None = None  # role → kNN balanced accuracy of the site (sites= given)
    qupath: str | None = None  # the folder of per-slide GeoJSON predictions (labelled tiles only)
    decision: dict[str, Any] | None = None  # `gate.Decision.as_dict`
    champion_model: str | None = None  # the model that is @champion after this evaluation

    def as_dict(self) -> dict[str, Any]:
        """The JSON document: absent optional parts are left out, and `evidence` sits where the stage first set it
        (after `split` when there were labelled tiles, else after `decision`), so files stay byte-compatible."""
        doc: dict[str, Any] = {
            "store": self.store,
            "mpp": self.mpp,
            "labelled_tiles": self.labelled_tiles,
            "labels": self.labels,
            "classes": self.classes,
            "candidate_is_champion": self.candidate_is_champion,
            "models": self.models,
            "comparisons": self.comparisons,
            "warnings": self.warnings,
        }
        if self.split is not None:
            doc["split"] = self.split
            doc["evidence"] = self.evidence
        for key in ("site_predictability", "qupath", "decision"):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        if self.split is None:
            doc["evidence"] = self.evidence
        doc["champion_model"] = self.champion_model
        return doc

    def to_json(self) -> str:
        return dumps(self.as_dict())

    @classmethod
    def from_json(cls, text: str) -> EvaluationReport:
        doc = json.loads(text)
        unknown = set(doc) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"not an evaluation.json: unknown keys {sorted(unknown)}")
        return cls(**doc)


def dumps(doc: Any) -> str:
    """JSON of an evaluation's records: numpy scalars and arrays as numbers and lists, NaN kept (a metric that could
    not be measured)."""
    return json.dumps(doc, indent=1, default=_jsonable, allow_nan=True)


def write_json(path: Path, doc: Any) -> None:
    """Atomic: a reader never sees half an evaluation."""
    write_text_atomic(path, dumps(doc))


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


__all__ = ["EvaluationReport", "dumps", "write_json"]
