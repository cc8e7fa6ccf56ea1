"""The extract stage as a Prefect flow: features for every tile, slide embeddings and PCA maps into zarr."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.inputs import fails_in_one_line
from tasks.params import ExtractParams
from tasks.stage_task import load_stage_config, run_job_stage


@flow(name="extract")
@fails_in_one_line
def extract_flow(params: ExtractParams) -> dict[str, Any]:
    """Extract features with an ONNX model (ONNX Runtime) or a backbone.pth (PyTorch); slides already extracted
    with the same model are skipped one by one. With `launch.nproc_per_node` > 1 (or several nodes) a torchrun job:
    one rank per GPU, the slides (and row ranges of large slides) split over the ranks.

    Args:
        params: Tile store, model file, feature store, config, launch settings, MLflow.

    Returns:
        The stage outcome (slides extracted / up to date, tiles, throughput).
    """
    cfg = load_stage_config("extract", params.stage.config, params.config_values())
    # More than one process (or named GPUs): a torchrun job, one rank per GPU. A crash is retried either way; the
    # retry extracts only the slides not yet committed.
    return run_job_stage("extract", cfg, params.launch, force=params.force).as_dict()


if __name__ == "__main__":
    extract_flow.serve(name="extract-local")
