"""Scheduled retraining: one versioned cycle per flow run (`dinov3_core.retrain.cycle.run_cycle`).

    from flows.retrain import retrain_flow
    from tasks.chain_params import RetrainParams
    retrain_flow(RetrainParams(slides="slides/", root="retrain/", config="tiny"))

A retry of the same flow run resumes its cycle (training from its last DCP checkpoint); a new flow run starts a
new cycle. The flow run ends Completed with the cycle's one-line outcome as its message: trained and promoted,
trained and kept, or skipped and why; the `retrain-cycle` artifact has the details.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed

from dinov3_core.retrain.config import load_retrain_config
from dinov3_core.retrain.cycle import run_cycle
from tasks.chain_params import RetrainParams
from tasks.inputs import fails_in_one_line
from tasks.retrain import cycle_markdown
from tasks.stage_task import prefect_stage_runner
from tasks.tracking import prefect_run_tags


@flow(name="retrain")
@fails_in_one_line
def retrain_flow(params: RetrainParams) -> Any:
    """Tile new slides → train from the champion when the cohort grew → evaluate → promote only if better →
    extract with the champion → retention, in `<root>/cycles/<cycle-id>/`.

    Args:
        params: Slides, root, retrain config name and overrides, launch settings, MLflow.

    Returns:
        The cycle record (cycle.json) and its one-line message.
    """
    logger = get_run_logger()
    cfg = load_retrain_config(params.config, params.config_values())
    result = run_cycle(
        cfg,
        prefect_stage_runner(params.launch),
        attempt_key=str(flow_run.id or "prefect-local"),
        log=logger.info,
        tags=prefect_run_tags("retrain"),
        world_size=params.launch.world_size,
    )
    create_markdown_artifact(cycle_markdown(result), key="retrain-cycle", description=result.message[:500])
    logger.info(result.message)
    return Completed(message=result.message[:4000], data=result.as_dict())


if __name__ == "__main__":
    retrain_flow.serve(name="retrain-local")
