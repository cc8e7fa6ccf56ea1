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
    client.update_model_version(name, str(version), description=registry_description(card.read_text(), card.name))


DESCRIPTION_LIMIT = 5000  # characters MLflow's SQL registry stores for a version's description


def registry_description(card: str, name: str = "MODEL_CARD.md", limit: int = DESCRIPTION_LIMIT) -> str:
    """The card as it fits the registry: whole, or cut before the first section that does not fit (never inside a
    table or a sentence), with a line saying where the full card is."""
    if len(card) <= limit:
        return card
    note = f"\n\n_The registry keeps {limit:,} characters: the full card is {name} beside the model file._\n"
    room = limit - len(note)
    cut = card.rfind("\n## ", 0, room)
    return card[: cut if cut > 0 else card.rfind("\n", 0, room)].rstrip() + note


def lineage_tags(lineage: dict[str, str]) -> dict[str, str]:
    return {f"wsidino.lineage.{stage}_run_id": run_id for stage, run_id in lineage.items()}
