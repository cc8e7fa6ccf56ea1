"""The promotion gate: does the candidate become `@champion`? Decided from the evaluation, applied to the registry.

The rule, in order (the first that applies decides, and its reason is recorded):

0. a candidate that is already the champion is left as it is;
1. a candidate whose features collapsed (CLS effective rank below `gate.min_effective_rank`) is never promoted;
2. a champion that could not be evaluated blocks promotion (nothing is promoted by accident);
3. without annotations, promotion is off unless `gate.label_free`: then a healthy candidate is promoted when its
   dense-consistency score is not below the champion's (or, for the first model, the baseline's);
4. evidence: the comparison that decides (candidate − champion, or − baseline for the registry's first model) must
   come from at least `gate.min_test_slides` test slides (patient groups with patients=CSV) and have a 95 %
   interval of non-zero width; otherwise not promoted, the reason saying how many more slides to annotate.
   `gate.allow_point_estimate=true` is the explicit opt-in to decide on less (recorded in the reason and in
   `evaluation.json`'s `evidence`): with one slide the interval is a point, and noise weights have won on one slide;
5. a candidate below the baseline on the primary metric is not promoted (a primary metric that was not measured,
   e.g. `dense.miou` without polygons, promotes nothing);
6. with a champion: promoted when the lower 95 % bound of the paired difference (candidate − champion) on the
   primary metric exceeds `gate.margin`;
7. the first model of a registry: promoted when that bound against the baseline exceeds `gate.margin`.

A promotion that the gate allows is applied only when `gate.promote` is on and the candidate is a registered
version; the alias then moves once (a rerun finds the candidate already champion and moves nothing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dinov3_core import tracking
from dinov3_core.evaluate.config import EvaluateConfig


@dataclass
class Decision:
    promote: bool  # the gate's verdict
    reason: str
    applied: bool = False  # the alias was moved by this run
    already_champion: bool = False
    # What the verdict rests on: test slides (or patients), folds, the interval the rule used, and whether the gate
    # was allowed to (and did) decide on less than gate.min_test_slides or a zero-width interval.
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _primary(models: dict[str, Any], role: str, metric: str) -> float | None:
    probe, name = metric.split(".")
    found = models.get(role, {}).get("probes", {}).get(probe, {}).get(name)
    return None if found is None else found["value"]


def _evidence_gap(cfg: EvaluateConfig, evidence: dict[str, Any]) -> tuple[str, str] | None:
    """Why the evidence is too thin to promote on, and what to do (None: enough): too few test groups, or an
    interval of zero width."""
    n, need, unit = evidence["test_groups"], cfg.gate.min_test_slides, evidence["unit"]
    interval = evidence.get("interval") or {}
    if n < need:
        more = need - n
        what = f"slides of at least {more} more patient(s)" if unit == "patient" else f"at least {more} more slide(s)"
        return (f"{n} test {unit}(s), fewer than gate.min_test_slides={need}",
                f"annotate {what} (every annotated slide is tested once)")  # fmt: skip
    low, high = interval.get("ci_low", float("nan")), interval.get("ci_high", float("nan"))
    if not high - low > 0:  # nan too: no interval is no evidence
        return (f"the 95 % interval of {evidence['comparison']} {evidence['metric']} has zero width ({low:+.4f} … "
                f"{high:+.4f}): every resample of the {n} test {unit}s gives the same difference",
                "annotate more slides")  # fmt: skip
    return None


def decide(cfg: EvaluateConfig, evaluation: dict[str, Any]) -> Decision:
    """The gate's verdict on an evaluation (`evaluation.json`'s content without the decision)."""
    gate = cfg.gate
    models = evaluation["models"]
    comparisons = evaluation.get("comparisons", {})
    metric = gate.primary_metric
    cand_health = models["candidate"]["health"]
    # The protocol's side (test groups, folds; evaluation.py) and the gate's (what it needs, what it used).
    evidence: dict[str, Any] = {
        "test_groups": 0,
        "unit": "slide",
        "folds": 0,
        **evaluation.get("evidence", {}),
        "min_test_slides": gate.min_test_slides,
        "allow_point_estimate": gate.allow_point_estimate,
        "sufficient": None,
        "point_estimate": False,
    }  # fmt: skip (None: not assessed)

    def verdict(promote: bool, reason: str, **kw: Any) -> Decision:
        return Decision(promote, reason, evidence=evidence, **kw)

    if evaluation.get("candidate_is_champion"):
        return verdict(False, "the candidate is already the champion", already_champion=True)
    rank = cand_health.get("cls_effective_rank", 0.0)
    if rank < gate.min_effective_rank:
        return verdict(False, f"collapsed features: CLS effective rank {rank:.4f} < gate.min_effective_rank "
                              f"{gate.min_effective_rank}")  # fmt: skip
    champion = models.get("champion")
    if champion is not None and champion.get("error"):
        return verdict(False, f"the champion could not be evaluated ({champion['error']}); nothing is promoted")
    if not evaluation.get("labelled_tiles"):
        if not gate.label_free:
            return verdict(False, "no annotations: promotion is off (annotate slides, or set gate.label_free=true "
                                  "to promote on label-free health)")  # fmt: skip
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
        why = ("the dense probe needs GeoJSON polygons and the same patch grid" if metric.startswith("dense.")
               else "AUROC needs two classes" if metric.endswith(".auroc") else "see the warnings")  # fmt: skip
        return verdict(False, f"gate.primary_metric={metric} was not measured for the candidate vs the {against} "
                              f"({why}); nothing promoted")  # fmt: skip
    diff = comparisons[f"candidate_vs_{against}"][metric]
    evidence.update(comparison=f"candidate_vs_{against}", metric=metric,
                    interval={k: diff[k] for k in ("value", "ci_low", "ci_high")})  # fmt: skip
    gap = _evidence_gap(cfg, evidence)
    evidence["sufficient"] = gap is None
    if gap is not None and not gate.allow_point_estimate:
        fact, fix = gap
        return verdict(False, f"not enough evidence: {fact}; {fix}, or set gate.allow_point_estimate=true to decide "
                              f"on it all the same (demos, smoke runs). Point estimate vs {against}: {metric} "
                              f"{diff['value']:+.4f}")  # fmt: skip
    weak = ""
    if gap is not None:  # the explicit opt-in: decide all the same, and say so
        evidence["point_estimate"] = True
        weak = f"; decided on a point estimate (gate.allow_point_estimate=true) although {gap[0]}"
    if vs_baseline is not None and vs_baseline["value"] < 0:
        return verdict(False, f"{metric} {vs_baseline['value']:+.4f} below the baseline{weak}")
    promote = diff["ci_low"] > gate.margin
    first = "first model: " if champion is None else ""
    return verdict(promote, f"{first}{metric} vs {against} {diff['value']:+.4f} (95 % CI {diff['ci_low']:+.4f} … "
                            f"{diff['ci_high']:+.4f}, {evidence['test_groups']} test {evidence['unit']}s, "
                            f"{evidence['folds']} folds); needs lower bound > margin {gate.margin}{weak}")  # fmt: skip


def apply(cfg: EvaluateConfig, decision: Decision, version: str | None, metrics: dict[str, float]) -> Decision:
    """Tag the candidate's model version with the evaluation and move `@champion` when the gate says so."""
    if version is None or not cfg.tracking.enabled:
        if decision.promote:
            decision.reason += "; not applied: the candidate is not a registered model version (export with tracking)"
        return decision
    # deferred: mlflow costs ~1 s at import, paid only when tracking
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
    client.set_model_version_tag(cfg.register_name, version, "wsidino.promotion", status)
    client.set_model_version_tag(cfg.register_name, version, "wsidino.promotion_reason", decision.reason[:5000])
    return decision


def _evidence_tags(evidence: dict[str, Any]) -> dict[str, str]:
    """The evidence as model-version tags: the registry page alone says what a promotion rested on."""
    if not evidence:
        return {}
    strength = {None: "not assessed", True: "sufficient", False: "insufficient"}[evidence["sufficient"]]
    if evidence["point_estimate"]:
        strength = "point estimate (gate.allow_point_estimate)"
    tags = {"test_slides": str(evidence["test_groups"]), "test_unit": str(evidence["unit"]),
            "folds": str(evidence["folds"]), "allow_point_estimate": str(evidence["allow_point_estimate"]).lower(),
            "evidence": strength}  # fmt: skip
    interval = evidence.get("interval")
    if interval:
        tags["interval"] = (f"{evidence['comparison']} {evidence['metric']} {interval['value']:+.4f} "
                            f"[{interval['ci_low']:+.4f}, {interval['ci_high']:+.4f}]")  # fmt: skip
    return tags


__all__ = ["Decision", "apply", "decide"]
