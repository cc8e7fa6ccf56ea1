"""The tile stage as a Prefect flow: whole-slide images → zarr tile store, one task per slide, one MLflow run.

Call it without a server (Prefect starts a temporary local one)::

    from flows.tile import TileParams, tile_flow
    tile_flow(TileParams(input="slides/", output="out/tiles.zarr", workers=2))

`python -m flows.tile` serves it against a running server; deployments: see deploy/README.md.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from dinov3_core import faults
from dinov3_core.stages import STAGE_SPECS, manifest_guard
from tasks.stages import record_skip
from tasks.tile import (
    TileParams,
    finalize_tile_run,
    hold_store_lock,
    prepare_tile_store,
    run_slide_tasks,
    select_slides,
)

SPEC = STAGE_SPECS["tile"]


@flow(name="tile")
def tile_flow(params: TileParams) -> dict[str, Any]:
    """Tile whole-slide images into a zarr tile store and log the run to MLflow.

    Slides already complete in the store with the same source file and tiling parameters are skipped; a slide
    that cannot be read is recorded as failed (manifest, `tile-summary` artifact, MLflow metrics) without
    failing the run. When the stage manifest shows the same slides and settings and no failed slide, nothing
    is opened at all (unless `force`). One run per store at a time (the store lock is held for the whole run).

    Args:
        params: Inputs, output store, tiling settings, config name/overrides and MLflow tracking.

    Returns:
        Store path, slide counts per status, tile totals, failed slide ids and the MLflow run id.
    """
    store = prepare_tile_store(params)
    inputs, decision = SPEC.decide(store.cfg)
    if decision.up_to_date and not params.force:
        return {**decision.previous.summary, **record_skip(SPEC, store.cfg, decision)}  # type: ignore[union-attr]
    with hold_store_lock(store.root), manifest_guard(SPEC, store.cfg, inputs) as manifest:
        faults.maybe_fail("tile", store.root)
        plan = select_slides(store)
        outcomes = run_slide_tasks(plan)
        summary = finalize_tile_run(plan, outcomes)
        manifest.mlflow_run_id = summary["mlflow_run_id"]
        manifest.summary = {
            **summary["slides"],
            "tiles_total": summary["tiles_total"],
            "failed_slides": summary["failed_slides"],
        }
    reason = "forced" if decision.up_to_date else decision.reason
    return {"stage": "tile", "status": "ran", "reason": reason, "summary": manifest.summary, **summary}


if __name__ == "__main__":
    # `python -m flows.tile`: serve the flow (runs submitted from the UI/CLI execute in this process).
    tile_flow.serve(name="tile-local")
