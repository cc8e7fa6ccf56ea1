"""What the evaluate stage's manifest keeps of a run (`EvaluateSummary`): the gate's decision, and the model
`@champion` points at afterwards (the model a chain extracts with)."""

from __future__ import annotations

from dataclasses import dataclass

from dinov3_core.stage import Summary


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


__all__ = ["EvaluateSummary"]
