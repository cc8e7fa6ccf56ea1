"""The promotion gate: does the candidate become `@champion`? Decided from the evaluation, applied to the registry.

The rule, in order (the first that applies decides, and its reason is recorded):

0. a candidate that is already the champion is left as it is;
1. a candidate whose features collapsed (CLS effective rank below `gate.min_effective_rank`) is never promoted;
2. a champion that could not be evaluated blocks promotion (nothing is promoted by accident);
3. without annotations, promotion is off unless `gate.label_free`: then a healthy candidate is promoted when its
   dense-consistency score is not below the champion's (or, for the first model, the baseline's);
4. a candidate below the baseline on the primary metric is not promoted;
5. with a champion: promoted when the lower 95 % bound of the paired difference (candidate − champion) on the
   primary metric exceeds `gate.margin`;
6. the first model of a registry: promoted when that bound against the baseline exceeds `gate.margin`.

A promotion that the gate allows is applied only when `gate.promote` is on and the candidate is a registered
version; the alias then moves once (a rerun finds the candidate already champion and moves nothing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dinov3_core import tracking
from dinov3_core.evaluate.config import EvaluateConfig


@dataclass
class Decision:
    promote: bool  # the gate's verdict
    reason: str
    applied: bool = False  # the alias was moved by this run
    already_champion: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _primary(models: dict[str, Any], role: str, metric: str) -> float | None:
    probe, name = metric.split(".")
    found = models.get(role, {}).get("probes", {}).get(probe, {}).get(name)
    return None if found is None else found["value"]


def decide(cfg: EvaluateConfig, evaluation: dict[str, Any]) -> Decision:
    """The gate's verdict on an evaluation (`evaluation.json`'s content without the decision)."""
    gate = cfg.gate
    models = evaluation["models"]
    comparisons = evaluation.get("comparisons", {})
    metric = gate.primary_metric
    cand_health = models["candidate"]["health"]
    if evaluation.get("candidate_is_champion"):
        return Decision(False, "the candidate is already the champion", already_champion=True)
    rank = cand_health.get("cls_effective_rank", 0.0)
    if rank < gate.min_effective_rank:
        return Decision(False, f"collapsed features: CLS effective rank {rank:.4f} < gate.min_effective_rank "
                               f"{gate.min_effective_rank}")  # fmt: skip
    champion = models.get("champion")
    if champion is not None and champion.get("error"):
        return Decision(False, f"the champion could not be evaluated ({champion['error']}); nothing is promoted")
    if not evaluation.get("labelled_tiles"):
        if not gate.label_free:
            return Decision(False, "no annotations: promotion is off (annotate slides, or set gate.label_free=true "
                                   "to promote on label-free health)")  # fmt: skip
        other = champion or models.get("baseline")
        if other is None:
            return Decision(False, "label-free gate: no champion or baseline to compare the health with")
        mine, theirs = cand_health.get("dense_score", 0.0), other["health"].get("dense_score", 0.0)
        who = "champion" if champion is not None else "baseline"
        if mine >= theirs:
            return Decision(True, f"label-free gate: dense score {mine:.4f} ≥ the {who}'s {theirs:.4f}")
        return Decision(False, f"label-free gate: dense score {mine:.4f} < the {who}'s {theirs:.4f}")
    vs_baseline = comparisons.get("candidate_vs_baseline", {}).get(metric)
    if vs_baseline is not None and vs_baseline["value"] < 0:
        return Decision(False, f"{metric} {vs_baseline['value']:+.4f} below the baseline")
    if champion is not None:
        diff = comparisons["candidate_vs_champion"][metric]
        verdict = diff["ci_low"] > gate.margin
        return Decision(verdict, f"{metric} vs champion {diff['value']:+.4f} (95 % CI {diff['ci_low']:+.4f} … "
                                 f"{diff['ci_high']:+.4f}); needs lower bound > margin {gate.margin}")  # fmt: skip
    if vs_baseline is None:
        return Decision(False, "first model of the registry, but no baseline to beat (set baseline=<weights>|init)")
    verdict = vs_baseline["ci_low"] > gate.margin
    return Decision(verdict, f"first model: {metric} vs baseline {vs_baseline['value']:+.4f} (95 % CI "
                             f"{vs_baseline['ci_low']:+.4f} … {vs_baseline['ci_high']:+.4f}); needs lower bound > "
                             f"margin {gate.margin}")  # fmt: skip


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
    if decision.promote and not cfg.gate.promote:
        decision.reason += "; not applied: gate.promote is off"
    elif decision.promote:
        client.set_registered_model_alias(cfg.register_name, "champion", version)
        decision.applied = True
    status = "promoted" if decision.applied else ("champion" if decision.already_champion else "kept")
    client.set_model_version_tag(cfg.register_name, version, "wsidino.promotion", status)
    client.set_model_version_tag(cfg.register_name, version, "wsidino.promotion_reason", decision.reason[:5000])
    return decision


__all__ = ["Decision", "apply", "decide"]
