"""The export stage as a Prefect flow: backbone → ONNX, checked with ONNX Runtime, registered in MLflow."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.inputs import fails_in_one_line
from tasks.params import ExportParams
from tasks.stage_task import load_stage_config, run_stage_task


@flow(name="export")
@fails_in_one_line
def export_flow(params: ExportParams) -> dict[str, Any]:
    """Export to ONNX with dynamic batch and image size, compare with PyTorch, register the model with an alias.

    Args:
        params: Backbone weights, ONNX path, registry alias, config, MLflow.

    Returns:
        The stage outcome (ONNX path, parity error, registered model version).
    """
    cfg = load_stage_config("export", params.stage.config, params.config_values())
    return run_stage_task("export", cfg, force=params.force).as_dict()


if __name__ == "__main__":
    export_flow.serve(name="export-local")
