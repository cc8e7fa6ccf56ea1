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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dinov3_core.extract.extract import pictures_dir
from dinov3_core.files import write_text_atomic
from dinov3_core.inference.feature_model import file_hash
from dinov3_core.retrain import stage_configs as sc
from dinov3_core.retrain.cycles import utc_now
from dinov3_core.retrain.registry import Champion
from dinov3_core.stages.export import ONNX_SHA_TAG

if TYPE_CHECKING:
    from dinov3_core.retrain.cycle import _Cycle
    from dinov3_core.runner import StageOutcome
    from dinov3_core.stages.extract import ExtractSummary

POINTER = "champion.json"


def current_features(features_dir: Path) -> dict[str, Any]:
    path = features_dir / POINTER
    return json.loads(path.read_text()) if path.is_file() else {}


def extract_with_champion(cycle: _Cycle, champion: Champion | None, slide_ids: list[str]) -> dict[str, Any]:
    """Features of the cohort's slides (`slide_ids`: the cycle's snapshot) with the champion."""
    layout, log, cid = cycle.layout, cycle.log, cycle.record.id
    if champion is None:
        log(f"retrain {cid}: no @champion yet, so no features are extracted")
        return {"status": "none", "reason": "no @champion"}
    onnx = champion.onnx
    if onnx is None:
        reason = (
            f"the champion v{champion.version}'s model.onnx is not on this machine (beside "
            f"{champion.weights}); features not extracted"
        )
        log(f"retrain {cid}: {reason}")
        return {"status": "missing", "reason": reason}

    champion.verified(onnx, ONNX_SHA_TAG)  # never features from a file that is not the registered champion
    model_hash = file_hash(onnx)
    store = layout.feature_store(model_hash)
    previous = current_features(layout.features)
    cfg = sc.build(cycle.cfg, "extract", layout, cid, model=onnx, output=store, slide_ids=slide_ids)
    outcome: StageOutcome[ExtractSummary] = cycle.stage("extract", cfg)
    summary = outcome.summary
    changed = previous.get("store") not in (None, str(store))
    record = {
        "store": str(store),
        "model": str(onnx),
        "model_hash": model_hash,
        "version": champion.version,
        "cycle": champion.cycle,
        "updated_at": utc_now(),
    }
    write_text_atomic(layout.features / POINTER, json.dumps(record, indent=1) + "\n")
    replaced = None
    if changed and cycle.cfg.retention.delete_replaced_features and Path(previous["store"]).is_dir():
        replaced = previous["store"]
        shutil.rmtree(replaced)
        shutil.rmtree(pictures_dir(replaced), ignore_errors=True)
        log(f"retrain {cid}: features of the previous champion ({replaced}) replaced by {store}")
    scope = "every slide (new champion)" if changed or not previous else "new slides only (same champion)"
    ran = outcome.status == "ran"
    return {
        **record,
        "status": outcome.status,
        "scope": scope,
        "replaced": replaced,
        "slides_extracted": summary.slides_extracted if ran else 0,
        "slides_up_to_date": summary.slides_up_to_date if ran else None,
    }


__all__ = ["POINTER", "current_features", "extract_with_champion"]
