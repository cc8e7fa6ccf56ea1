"""What a retraining cycle shows in Prefect: the decision as an artifact (its stages run as
`tasks.stage_task.prefect_stage_runner`)."""

from __future__ import annotations

from dinov3_core.retrain.cycle import CycleResult


def cycle_markdown(result: CycleResult) -> str:
    """The cycle as the Prefect UI shows it: what it did, why, and where everything is."""
    r = result.record
    lines = [f"# Retraining cycle {r.id}: {r.status}", "", result.message, ""]
    snap, warm, feats, d = r.snapshot, r.warm_start, r.features, r.decision
    rows = {
        "trigger": r.trigger.reason if r.trigger else None,
        "data snapshot": f"{snap.hash} ({snap.n_slides} slides, {snap.tiles} tiles)" if snap else None,
        "warm start": f"{warm.source} {warm.path or ''}" if warm else None,
        "candidate version": d.candidate_version if d else None,
        "evidence": d.evidence if d else None,  # gate.evidence_line, as the stage and the pipeline print it
        "decision": d.reason if d else None,
        "champion before → after": f"{d.champion_before} → {d.champion_after}" if d else None,
        "features": (
            f"{feats.store} ({feats.scope}, {feats.slides_extracted} slide(s) extracted)"
            if feats and feats.store
            else feats.reason
            if feats
            else None
        ),
        "retention": (", ".join(r.retention.deleted) or "nothing deleted") if r.retention else None,
        "MLflow cycle run": f"`{r.mlflow_run_id}`" if r.mlflow_run_id else None,
    }
    lines += ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows.items() if v]]
    if r.stages:
        lines += ["", "| stage | status | seconds | MLflow run |", "|---|---|---|---|"]
        lines += [f"| {s} | {o.status} | {o.seconds or ''} | `{o.mlflow_run_id}` |" for s, o in r.stages.items()]
    return "\n".join(lines) + "\n"


__all__ = ["cycle_markdown"]
