"""The MLflow side of a cycle: one parent run per cycle (stage runs nest under it), reopened when the cycle
resumes; tags say what the cycle did, and the data snapshot is the run's dataset input."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from typing import Any

from dinov3_core import tracking
from dinov3_core.retrain.config import RetrainConfig
from dinov3_core.retrain.cycles import CycleRecord

RETRAIN_TAG = "wsidino.retrain"


@contextlib.contextmanager
def cycle_mlflow_run(cfg: RetrainConfig, record: CycleRecord, tags: Mapping[str, str]) -> Iterator[str | None]:
    """The cycle's parent run (None when tracking is off): FINISHED at the end, FAILED when the block raises."""
    all_tags = {**dict(tags), RETRAIN_TAG: "true", "wsidino.cycle": record.id, "wsidino.stage": "retrain"}
    with tracking.parent_run(cfg.tracking, f"retrain/{record.id}", all_tags, reopen=record.mlflow_run_id) as run_id:
        tracking.log_config_params(cfg.tracking, run_id, cfg)
        yield run_id


def set_tags(cfg: RetrainConfig, run_id: str | None, tags: Mapping[str, Any]) -> None:
    if run_id is None:
        return
    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    for key, value in tags.items():
        if value is not None:
            client.set_tag(run_id, key, str(value)[:5000])


def log_record(cfg: RetrainConfig, run_id: str | None, record: CycleRecord) -> None:
    """cycle.json as an artifact and the cycle's headline figures as metrics."""
    if run_id is None:
        return

    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    client.log_dict(run_id, asdict(record), "cycle.json")
    figures = {
        "snapshot_slides": record.snapshot.n_slides if record.snapshot else None,
        "snapshot_tiles": record.snapshot.tiles if record.snapshot else None,
        "new_slides": record.trigger.change.get("added") if record.trigger else None,
        "promoted": float(record.promoted) if record.decision else None,
    }
    for key, value in figures.items():
        if isinstance(value, int | float):
            client.log_metric(run_id, key, float(value))


def summary_tags(r: CycleRecord) -> dict[str, Any]:
    """The cycle's outcome as tags of its MLflow run (what the runs table can filter on)."""
    d = r.decision
    return {
        "wsidino.cycle": r.id,
        "wsidino.cycle_status": r.status,
        "wsidino.trigger": r.trigger.reason if r.trigger else None,
        "wsidino.snapshot": r.snapshot.hash if r.snapshot else None,
        "wsidino.warm_start": r.warm_start.source if r.warm_start else None,
        "wsidino.decision": d.reason if d else None,
        "wsidino.evidence": d.evidence if d else None,
        "wsidino.promoted": d.promoted if d and d.reason else None,
    }


__all__ = ["RETRAIN_TAG", "cycle_mlflow_run", "log_record", "set_tags", "summary_tags"]
