"""What the evaluate stage records: its manifest's summary (`EvaluateSummary`: the gate's decision, and the model
`@champion` points at afterwards, the model a chain extracts with) and the tag the gate puts on every version it
judges (`PROMOTION_TAG`), by which evaluate and a retraining cycle tell a champion the gate promoted from an alias
moved by hand."""

from __future__ import annotations

from dataclasses import dataclass

from dinov3_core.stage import Summary

PROMOTION_TAG = "wsidino.promotion"  # promoted, champion (already) or kept: set by `gate.apply`


def set_by_gate(tags: dict[str, str]) -> bool:
    """A version the gate promoted (or found already champion): what @champion should point at."""
    return tags.get(PROMOTION_TAG) in ("promoted", "champion")


@dataclass
class EvaluateSummary(Summary):
    labelled_tiles: int | None = None
    promoted: bool | None = None  # the candidate is @champion now
    promote: bool | None = None  # the gate's verdict (applied or not: gate.promote=false only measures)
    decision: str | None = None  # why, in one sentence
    # The gate's evidence line (`gate.evidence_line`): metric, difference, interval, p-value, slides, verdict; what
    # the pipeline summary, the retraining cycle and the Prefect artifacts print.
    evidence: str | None = None
    champion_model: str | None = None  # the model file @champion points at after the evaluation
    primary_metric: str | None = None  # gate.primary_metric, e.g. linear.balanced_accuracy
    primary_value: float | None = None  # the candidate's value of it
    cls_effective_rank: float | None = None
    seconds: float | None = None

    def note(self) -> str:
        return "candidate promoted to @champion" if self.promoted else ""

    def verdict(self) -> str | None:
        return self.evidence


__all__ = ["PROMOTION_TAG", "EvaluateSummary", "set_by_gate"]
