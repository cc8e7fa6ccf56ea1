"""The gram stage as a Prefect flow: gram anchoring on top of a pretraining run, as a torchrun job.

from flows.gram import gram_flow
from tasks.params import GramParams
gram_flow(GramParams(pretrain_dir="out/pretrain", output_dir="out/gram"))
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.inputs import fails_in_one_line
from tasks.params import GramParams
from tasks.stage_task import load_stage_config, run_job_stage, training_flow_result


@flow(name="gram")
@fails_in_one_line
def gram_flow(params: GramParams) -> Any:
    """Continue a pretraining run with gram anchoring; the gram teacher is a teacher-only eval checkpoint of that
    run, chosen by the config's policy (or given) and recorded in gram_teacher_selection.json.

    Args:
        params: Pretraining run, output directory, optional teacher file, config, launch settings, MLflow.

    Returns:
        The stage outcome, with the chosen gram teacher in its summary.
    """
    cfg = load_stage_config("gram", params.stage.config, params.config_values())
    return training_flow_result(run_job_stage("gram", cfg, params.launch, force=params.force))


if __name__ == "__main__":
    gram_flow.serve(name="gram-local")
