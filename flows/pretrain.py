"""The pretrain stage as a Prefect flow: DINOv3 self-supervised training as a torchrun job (rank 0 → logs).

from flows.pretrain import pretrain_flow
from tasks.params import PretrainParams
pretrain_flow(PretrainParams(stores=["out/tiles.zarr"], output_dir="out/pretrain"))
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.inputs import fails_in_one_line
from tasks.params import PretrainParams
from tasks.stage_task import load_stage_config, run_job_stage, training_flow_result


@flow(name="pretrain")
@fails_in_one_line
def pretrain_flow(params: PretrainParams) -> Any:
    """Pretrain (or continue pretraining) DINOv3 on tile stores; skipped when the run is complete and unchanged.

    A crash is retried `launch.retries` times, each attempt resuming from the last DCP checkpoint; bad input
    fails at once with a message naming the key or file.

    Args:
        params: Tile stores, run directory, config name/overrides, torchrun launch settings, MLflow.

    Returns:
        The stage outcome: ran/skipped, outputs (checkpoints, eval teacher), MLflow run id, summary figures.
    """
    cfg = load_stage_config("pretrain", params.stage.config, params.config_values())
    return training_flow_result(run_job_stage("pretrain", cfg, params.launch, force=params.force))


if __name__ == "__main__":
    pretrain_flow.serve(name="pretrain-local")
