"""The cohort's features, always from the current champion: one feature store per champion model
(`<root>/features/<model-hash>.zarr`), `features/champion.json` naming the current one.

The extract stage skips slides already extracted with the same model, so the scope follows the decision by
itself: when the champion stayed, only the new slides are extracted into its store; when it changed, every slide
goes into the new champion's store. The previous store stays readable until the new one is complete, and is
deleted then (`retention.delete_replaced_features`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core.export.summary import ONNX_SHA_TAG
from dinov3_core.extract.feature_store import pictures_dir
from dinov3_core.extract.summary import ExtractSummary
from dinov3_core.files import write_text_atomic
from dinov3_core.inference.feature_model import file_hash
from dinov3_core.retrain.cycles import CycleLayout, Features, utc_now
from dinov3_core.retrain.registry import Champion

POINTER = "champion.json"


def current_features(features_dir: Path) -> dict[str, Any]:
    path = features_dir / POINTER
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class ChampionStore:
    """The champion's model file, checked against its registered digest, and the feature store it fills."""

    champion: Champion
    onnx: Path
    store: Path


def champion_store(layout: CycleLayout, champion: Champion | None) -> ChampionStore | Features:
    """Where the champion's features go; when there are none to extract, the record saying why."""
    if champion is None:
        return Features("none", "no @champion")
    onnx = champion.onnx
    if onnx is None:
        reason = (
            f"the champion v{champion.version}'s model.onnx is not on this machine (beside "
            f"{champion.weights}); features not extracted"
        )
        return Features("missing", reason)
    champion.verified(onnx, ONNX_SHA_TAG)  # never features from a file that is not the registered champion
    return ChampionStore(champion, onnx, layout.feature_store(file_hash(onnx)))


def record_features(
    layout: CycleLayout, target: ChampionStore, status: str, summary: ExtractSummary, delete_replaced: bool
) -> tuple[Features, str | None]:
    """Point `champion.json` at the champion's store once the extract stage filled it, delete the previous
    champion's store when asked: (the cycle's features record, the store deleted or None)."""
    previous = current_features(layout.features)
    changed = previous.get("store") not in (None, str(target.store))
    record = {
        "store": str(target.store),
        "model": str(target.onnx),
        "model_hash": target.store.stem,
        "version": target.champion.version,
        "cycle": target.champion.cycle,
        "updated_at": utc_now(),
    }
    write_text_atomic(layout.features / POINTER, json.dumps(record, indent=1) + "\n")
    replaced = None
    if changed and delete_replaced and Path(previous["store"]).is_dir():
        replaced = previous["store"]
        shutil.rmtree(replaced)
        shutil.rmtree(pictures_dir(replaced), ignore_errors=True)
    scope = "every slide (new champion)" if changed or not previous else "new slides only (same champion)"
    ran = status == "ran"
    features = Features(
        status,
        scope=scope,
        replaced=replaced,
        slides_extracted=summary.slides_extracted if ran else 0,
        slides_up_to_date=summary.slides_up_to_date if ran else None,
        **record,
    )
    return features, replaced


__all__ = ["POINTER", "ChampionStore", "champion_store", "current_features", "record_features"]
