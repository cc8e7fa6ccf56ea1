"""What export and evaluate both do with the MLflow model registry from the runner's side: the model card as a
version's description."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dinov3_core import tracking


def describe_version(cfg: Any, name: str, version: str | None, card: Path | None) -> None:
    """The model card as the registered version's description (what the MLflow UI shows on its page)."""
    if not version or card is None or not cfg.tracking.enabled:
        return
    from mlflow import MlflowClient  # deferred: mlflow costs ~2 s at import

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    client.update_model_version(name, str(version), description=card.read_text()[:5000])


def lineage_tags(lineage: dict[str, str]) -> dict[str, str]:
    return {f"wsidino.lineage.{stage}_run_id": run_id for stage, run_id in lineage.items()}
