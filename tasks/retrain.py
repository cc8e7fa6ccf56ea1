"""What a retraining cycle shows in Prefect: the decision as an artifact (its stages run as
`tasks.stage_task.prefect_stage_runner`)."""

from __future__ import annotations

from dinov3_core.retrain.cycle import CycleResult


def cycle_markdown(result: CycleResult) -> str:
    """The cycle as the Prefect UI shows it: what it did, why, and where everything is."""
    r = result.record
    lines = [f"# Retraining cycle {r.id}: {r.status}", "", result.message, ""]
    snap, warm, feats = r.snapshot, r.warm_start, r.features
    rows = {
        "trigger": r.trigger.get("reason"),
        "data snapshot": f"{snap.get('hash')} ({snap.get('n_slides')} slides, {snap.get('tiles')} tiles)",
        "warm start": f"{warm.get('source')} {warm.get('path') or ''}" if warm else None,
        "candidate version": r.decision.get("candidate_version"),
        "evidence": r.decision.get("evidence"),  # gate.evidence_line, as the stage and the pipeline print it
        "decision": r.decision.get("reason"),
        "champion before → after": f"{r.decision.get('champion_before')} → {r.decision.get('champion_after')}",
        "features": f"{feats['store']} ({feats.get('scope')}, {feats.get('slides_extracted')} slide(s) extracted)"
        if feats.get("store")
        else feats.get("reason"),
        "retention": (", ".join(r.retention.get("deleted", [])) or "nothing deleted") if r.retention else None,
        "MLflow cycle run": f"`{r.mlflow_run_id}`" if r.mlflow_run_id else None,
    }
    lines += ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows.items() if v]]
    if r.stages:
        lines += ["", "| stage | status | seconds | MLflow run |", "|---|---|---|---|"]
        lines += [
            f"| {s} | {o.get('status')} | {o.get('seconds', '')} | `{o.get('mlflow_run_id')}` |"
            for s, o in r.stages.items()
        ]
    return "\n".join(lines) + "\n"


__all__ = ["cycle_markdown"]
