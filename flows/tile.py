"""The tile stage as a Prefect flow: whole-slide images → zarr tile store, one MLflow run.

The tile engine (`dinov3_core.tiling.engine.run_tile`) is the CLI's: slides and their shard ranges are spread over
`workers` processes, so one large slide uses every worker. With `dask` set it fans out instead: one Prefect task
per slide group on a Dask cluster (prefect-dask; an existing scheduler, or a temporary local cluster), the store
manifest written once at the end (`tasks.tile_groups`). Progress and a per-slide table appear as artifacts.
Call it without a server (Prefect starts a temporary local one)::

    from flows.tile import tile_flow
    from tasks.params import StageOptions, TileParams
    tile_flow(TileParams(input="slides/", output="out/tiles.zarr",
                         stage=StageOptions(config="default", overrides=["workers=2"])))
    tile_flow(TileParams(..., dask=DaskParams(address="tcp://10.0.0.5:8786")))  # on a Dask cluster

`python -m flows.tile` serves it against a running server; deployments: see deploy/README.md.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.inputs import fails_in_one_line
from tasks.params import DaskParams, TileParams
from tasks.stage_task import load_stage_config, run_stage_task
from tasks.tile_groups import DaskSlideGroups


@flow(name="tile")
@fails_in_one_line
def tile_flow(params: TileParams) -> dict[str, Any]:
    """Tile whole-slide images into a zarr tile store and log the run to MLflow.

    Slides already complete in the store with the same source file and tiling parameters are skipped; a slide
    that cannot be read is recorded as failed (store manifest, `tile-summary` artifact, MLflow metrics) without
    failing the run. When the stage manifest shows the same slides and settings and no failed slide, nothing
    is opened at all (unless `force`). One run per store at a time. On a Dask cluster each worker tiles whole
    slides (one slide group per worker thread); the tiles are byte-identical to the process pool's.

    Args:
        params: Slides, tile store, config name/overrides, MLflow tracking and, optionally, a Dask cluster.

    Returns:
        The stage outcome: ran/skipped, why, the store, MLflow run id and per-status slide counts (`summary`).
    """
    cfg = load_stage_config("tile", params.stage.config, params.config_values())
    return run_stage_task("tile", cfg, force=params.force, run_groups=slide_groups(params.dask)).as_dict()


def slide_groups(dask: DaskParams) -> DaskSlideGroups | None:
    """Where the slides are tiled: None is the tile engine's own process pool (`workers`)."""
    if not dask.enabled:
        return None
    return DaskSlideGroups(address=dask.address, n_workers=dask.n_workers)


if __name__ == "__main__":
    # `python -m flows.tile`: serve the flow (runs submitted from the UI/CLI execute in this process).
    tile_flow.serve(name="tile-local")
