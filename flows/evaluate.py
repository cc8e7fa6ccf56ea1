"""The evaluate stage as a Prefect flow: probes on the lab's annotations, label-free health, the @champion gate."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.inputs import fails_in_one_line
from tasks.params import EvaluateParams
from tasks.stage_task import load_stage_config, run_stage_task


@flow(name="evaluate")
@fails_in_one_line
def evaluate_flow(params: EvaluateParams) -> dict[str, Any]:
    """Score the candidate, the registry's champion and a baseline on the same labelled tiles and slide split;
    promote the candidate to `@champion` only when it is measurably better (the decision and its reason are in
    the `evaluate-stage` artifact, `evaluation.json` and the model version's tags).

    Args:
        params: Tile store, candidate model, evaluation directory, annotations, config, launch settings (more than
            one process: the labelled tiles are embedded by a torchrun job), MLflow.

    Returns:
        The stage outcome: decision, primary metric, champion model path, MLflow run id.
    """
    cfg = load_stage_config("evaluate", params.stage.config, params.config_values())
    return run_stage_task("evaluate", cfg, force=params.force, launch=params.launch).as_dict()


if __name__ == "__main__":
    evaluate_flow.serve(name="evaluate-local")
