"""The promotion gate: does the candidate become `@champion`? Decided from the evaluation, applied to the registry.

The rule, in order (the first that applies decides, and its reason is recorded):

0. a candidate that is already the champion is left as it is;
1. a candidate whose features collapsed (CLS effective rank below `gate.min_effective_rank`) is never promoted;
2. a champion that could not be evaluated blocks promotion (nothing is promoted by accident);
3. without annotations, promotion is off unless `gate.label_free`: then a healthy candidate is promoted when its
   dense-consistency score is not below the champion's (or, for the first model, the baseline's);
4. evidence: the comparison that decides (candidate − champion, or − baseline for the registry's first model) is
   tested by an exact paired permutation test over the test slides (patient groups with patients=CSV;
   `statistics.permutation_test`), whose least p-value on n slides is 2^-n: below `gate.min_test_slides` (default
   the least n with 2^-n ≤ `gate.alpha`: 6 at 0.025) nothing can be promoted, and the reason says so and how many
   slides the measured effect would need. `gate.allow_point_estimate=true` is the explicit opt-out (recorded in the
   reason and in `evaluation.json`'s `evidence`): on fewer slides, decide on the point estimate > margin;
5. a candidate below the baseline on the primary metric is not promoted (a primary metric that was not measured,
   e.g. `dense.miou` without polygons, promotes nothing);
6. with a champion: promoted when the one-sided p-value of (candidate − champion) on the primary metric is at most
   `gate.alpha` and the observed difference exceeds `gate.margin`;
7. the first model of a registry: the same test against the baseline.

The bootstrap interval is reported beside the p-value for display; it decides nothing. `evidence_line(decision)`
is the one line every place prints (the stage log and artifact, the pipeline summary, the retraining cycle).

A promotion that the gate allows is applied only when `gate.promote` is on and the candidate is a registered
version; the alias then moves once (a rerun finds the candidate already champion and moves nothing).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dinov3_core import tracking
from dinov3_core.evaluate import statistics as S
from dinov3_core.evaluate.config import EvaluateConfig
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.evaluate.summary import PROMOTION_TAG


@dataclass
class Evidence:
    """What a verdict rests on: the protocol's side (test groups, folds) and the gate's (the test, what it needed)."""

    unit: str = "slide"  # or patient
    test_groups: int = 0
    folds: int = 0
    min_test_slides: int = 0  # needed before the test can promote (gate.min_test_slides, or derived from alpha)
    alpha: float = 0.025
    allow_point_estimate: bool = False
    sufficient: bool | None = None  # None: not assessed (the verdict came before the evidence rule)
    point_estimate: bool = False  # decided on the point estimate (gate.allow_point_estimate) on too few slides
    comparison: str | None = None  # candidate_vs_champion | candidate_vs_baseline
    metric: str | None = None
    interval: S.Estimate | None = None  # the difference and its bootstrap 95 % interval (display)
    p_value: float | None = None
    test: str | None = None
    slides_needed: int | None = None  # test slides at which the measured effect would reach power 0.8
    slides_needed_note: str = ""  # why there is no number
    effect_mean: float | None = None  # mean and SD of the per-slide differences
    effect_sd: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Evidence:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if isinstance(known.get("interval"), dict):
            known["interval"] = S.Estimate(**known["interval"])
        return cls(**known)


@dataclass
class Decision:
    promote: bool  # the gate's verdict
    reason: str
    applied: bool = False  # the alias was moved by this run
    already_champion: bool = False
    evidence: Evidence = field(default_factory=Evidence)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Decision:
        """A decision from `evaluation.json`."""
        return cls(
            bool(d.get("promote")),
            str(d.get("reason", "")),
            bool(d.get("applied")),
            bool(d.get("already_champion")),
            Evidence.from_dict(d.get("evidence") or {}),
        )


def _primary(models: dict[str, Any], role: str, metric: str) -> float | None:
    probe, name = metric.split(".")
    found = models.get(role, {}).get("probes", {}).get(probe, {}).get(name)
    return None if found is None else found["value"]


def _needed_text(e: Evidence) -> str:
    """'the measured effect +0.040 would need about 11 annotated slides (have 3)', or why there is no number."""
    if e.effect_mean is None or not math.isfinite(e.effect_mean):
        return ""
    have = f"have {e.test_groups}"
    if e.slides_needed is None:
        return f"the measured effect {e.effect_mean:+.3f} per {e.unit}: {e.slides_needed_note} ({have})"
    what = "annotated slides" if e.unit == "slide" else "patients"
    return f"the measured effect {e.effect_mean:+.3f} would need about {e.slides_needed} {what} ({have})"


def _evidence_gap(cfg: EvaluateConfig, e: Evidence) -> tuple[str, str] | None:
    """Why the evidence cannot promote, and what to do (None: the test can decide)."""
    n, need, unit = e.test_groups, e.min_test_slides, e.unit
    more = need - n
    what = f"slides of at least {more} more patient(s)" if unit == "patient" else f"at least {more} more slide(s)"
    needed = _needed_text(e)
    fix = f"annotate {what} (every annotated slide is tested once)" + (f"; {needed}" if needed else "")
    if n < need:
        if cfg.gate.min_test_slides is None:
            floor = 2.0**-n
            return (
                f"{n} test {unit}(s): a permutation test over {n} {unit}(s) cannot give a p-value below "
                f"2^-{n} = {floor:.3g} > gate.alpha {e.alpha}, so nothing can be promoted on fewer than {need}",
                fix,
            )
        return f"{n} test {unit}(s), fewer than gate.min_test_slides={need}", fix
    if e.p_value is None or not math.isfinite(e.p_value):
        return f"no p-value for {e.comparison} {e.metric} (an evaluation from before the permutation test?)", fix
    return None


def decide(cfg: EvaluateConfig, evaluation: EvaluationReport) -> Decision:
    """The gate's verdict on an evaluation (before its decision is recorded)."""
    gate = cfg.gate
    models = evaluation.models
    comparisons = evaluation.comparisons
    metric = gate.primary_metric
    cand_health = models["candidate"]["health"]
    protocol = evaluation.evidence
    evidence = Evidence(
        unit=str(protocol.get("unit", "slide")),
        test_groups=int(protocol.get("test_groups", 0)),
        folds=int(protocol.get("folds", 0)),
        min_test_slides=gate.required_test_slides(),
        alpha=gate.alpha,
        allow_point_estimate=gate.allow_point_estimate,
    )

    def verdict(promote: bool, reason: str, **kw: Any) -> Decision:
        return Decision(promote, reason, evidence=evidence, **kw)

    if evaluation.candidate_is_champion:
        return verdict(False, "the candidate is already the champion", already_champion=True)
    rank = cand_health.get("cls_effective_rank", 0.0)
    if rank < gate.min_effective_rank:
        return verdict(
            False,
            f"collapsed features: CLS effective rank {rank:.4f} < gate.min_effective_rank {gate.min_effective_rank}",
        )
    champion = models.get("champion")
    if champion is not None and champion.get("error"):
        return verdict(False, f"the champion could not be evaluated ({champion['error']}); nothing is promoted")
    if not evaluation.labelled_tiles:
        if not gate.label_free:
            return verdict(
                False,
                "no annotations: promotion is off (annotate slides, or set gate.label_free=true "
                "to promote on label-free health)",
            )
        other = champion or models.get("baseline")
        if other is None:
            return verdict(False, "label-free gate: no champion or baseline to compare the health with")
        mine, theirs = cand_health.get("dense_score", 0.0), other["health"].get("dense_score", 0.0)
        who = "champion" if champion is not None else "baseline"
        if mine >= theirs:
            return verdict(True, f"label-free gate: dense score {mine:.4f} ≥ the {who}'s {theirs:.4f}")
        return verdict(False, f"label-free gate: dense score {mine:.4f} < the {who}'s {theirs:.4f}")
    vs_baseline = comparisons.get("candidate_vs_baseline", {}).get(metric)
    if champion is None and vs_baseline is None:
        return verdict(False, "first model of the registry, but no baseline to beat (set baseline=<weights>|init)")
    against = "champion" if champion is not None else "baseline"
    if _primary(models, "candidate", metric) is None or metric not in comparisons.get(f"candidate_vs_{against}", {}):
        # dense.*: no labelled patch tokens (a CSV of tiles has no polygons) or another patch grid than the other
        # model's; auroc: more than two classes. Nothing measured is nothing promoted.
        why = (
            "the dense probe needs GeoJSON polygons and the same patch grid"
            if metric.startswith("dense.")
            else "AUROC needs two classes"
            if metric.endswith(".auroc")
            else "see the warnings"
        )
        return verdict(
            False,
            f"gate.primary_metric={metric} was not measured for the candidate vs the {against} "
            f"({why}); nothing promoted",
        )
    diff = S.Comparison.from_dict(comparisons[f"candidate_vs_{against}"][metric])
    needed = S.slides_needed(diff.per_group, gate.alpha)
    evidence.comparison, evidence.metric = f"candidate_vs_{against}", metric
    evidence.interval = S.Estimate(diff.value, diff.ci_low, diff.ci_high)
    evidence.p_value, evidence.test = diff.p_value, diff.test
    evidence.slides_needed, evidence.slides_needed_note = needed.groups, needed.why
    evidence.effect_mean = needed.mean if math.isfinite(needed.mean) else None
    evidence.effect_sd = needed.sd if math.isfinite(needed.sd) else None
    gap = _evidence_gap(cfg, evidence)
    evidence.sufficient = gap is None
    if gap is not None and not gate.allow_point_estimate:
        fact, fix = gap
        return verdict(
            False,
            f"not enough evidence: {fact}; {fix}, or set gate.allow_point_estimate=true to decide "
            f"on the point estimate all the same (demos, smoke runs). Point estimate vs {against}: "
            f"{metric} {diff.value:+.4f}",
        )
    weak = ""
    if gap is not None:  # the explicit opt-out: decide on the point estimate, and say so
        evidence.point_estimate = True
        weak = f"; decided on a point estimate (gate.allow_point_estimate=true) although {gap[0]}"
    if vs_baseline is not None and vs_baseline["value"] < 0:
        return verdict(False, f"{metric} {vs_baseline['value']:+.4f} below the baseline{weak}")
    first = "first model: " if champion is None else ""
    measured = (
        f"{first}{metric} vs {against} {diff.value:+.4f} (95 % CI {diff.ci_low:+.4f} … {diff.ci_high:+.4f}, "
        f"{evidence.test_groups} test {evidence.unit}s, {evidence.folds} folds)"
    )
    if evidence.point_estimate:
        return verdict(diff.value > gate.margin, f"{measured}; needs difference > margin {gate.margin}{weak}")
    significant = diff.p_value <= gate.alpha
    promote = significant and diff.value > gate.margin
    reason = (
        f"{measured}, p = {diff.p_value:.4g} ({diff.test}); needs p ≤ gate.alpha {gate.alpha} and difference "
        f"> margin {gate.margin}"
    )
    if not significant and (needed_text := _needed_text(evidence)):
        reason += f"; {needed_text}"
    return verdict(promote, reason)


def evidence_line(decision: Decision) -> str:
    """The decision in one line, the same wherever it is printed: metric, difference, interval, p, slides, verdict."""
    e = decision.evidence
    verdict = (
        "promoted to @champion"
        if decision.applied
        else "already champion"
        if decision.already_champion
        else "promote (not applied)"
        if decision.promote
        else "not promoted"
    )
    if e.interval is None or e.metric is None:
        return f"gate: {verdict}: {decision.reason}"
    against = (e.comparison or "").removeprefix("candidate_vs_")
    i = e.interval
    p = "–" if e.p_value is None or not math.isfinite(e.p_value) else f"{e.p_value:.4g}"
    line = (
        f"gate: {e.metric} candidate − {against} {i.value:+.3f} [95 % CI {i.ci_low:+.3f}, {i.ci_high:+.3f}], "
        f"p = {p} (paired permutation, {e.test_groups} {e.unit}s, α {e.alpha}): {verdict}"
    )
    if e.point_estimate:
        return line + " on a point estimate (gate.allow_point_estimate)"
    if not e.sufficient:
        line += f"; fewer than the {e.min_test_slides} {e.unit}s the test needs"
    if not decision.promote and e.slides_needed is not None:
        line += f"; about {e.slides_needed} {e.unit}s needed for this effect"
    return line


def apply(cfg: EvaluateConfig, decision: Decision, version: str | None, metrics: dict[str, float]) -> Decision:
    """Tag the candidate's model version with the evaluation and move `@champion` when the gate says so."""
    if version is None or not cfg.tracking.enabled:
        if decision.promote:
            decision.reason += "; not applied: the candidate is not a registered model version (export with tracking)"
        return decision
    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    for key, value in metrics.items():
        client.set_model_version_tag(cfg.register_name, version, f"wsidino.eval.{key}", f"{value:.4f}")
    for key, value in _evidence_tags(decision.evidence).items():
        client.set_model_version_tag(cfg.register_name, version, f"wsidino.eval.{key}", value)
    if decision.promote and not cfg.gate.promote:
        decision.reason += "; not applied: gate.promote is off"
    elif decision.promote:
        client.set_registered_model_alias(cfg.register_name, "champion", version)
        decision.applied = True
    status = "promoted" if decision.applied else ("champion" if decision.already_champion else "kept")
    client.set_model_version_tag(cfg.register_name, version, PROMOTION_TAG, status)
    client.set_model_version_tag(cfg.register_name, version, "wsidino.promotion_reason", decision.reason[:5000])
    return decision


def _evidence_tags(evidence: Evidence) -> dict[str, str]:
    """The evidence as model-version tags: the registry page alone says what a promotion rested on."""
    strength = {None: "not assessed", True: "sufficient", False: "insufficient"}[evidence.sufficient]
    if evidence.point_estimate:
        strength = "point estimate (gate.allow_point_estimate)"
    tags = {
        "test_slides": str(evidence.test_groups),
        "test_unit": evidence.unit,
        "folds": str(evidence.folds),
        "allow_point_estimate": str(evidence.allow_point_estimate).lower(),
        "evidence": strength,
        "alpha": str(evidence.alpha),
        "min_test_slides": str(evidence.min_test_slides),
    }
    i = evidence.interval
    if i is not None:
        tags["interval"] = f"{evidence.comparison} {evidence.metric} {i.value:+.4f} [{i.ci_low:+.4f}, {i.ci_high:+.4f}]"
    if evidence.p_value is not None:
        tags["p_value"] = f"{evidence.p_value:.4g}"
        tags["test"] = str(evidence.test)
    if evidence.slides_needed is not None:
        tags["slides_needed"] = str(evidence.slides_needed)
    return tags


__all__ = ["Decision", "Evidence", "apply", "decide", "evidence_line"]
