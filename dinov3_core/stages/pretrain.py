"""pretrain: DINOv3 self-supervised (continued) pretraining on tile stores, always a torchrun job
(`python -m dinov3_core.train` on every rank; rank 0 logs into the stage's MLflow run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dinov3_core.stages import training
from dinov3_core.stages.base import ChainPaths, CliOption, Stage, stores_input
from dinov3_core.stages.training import TrainingSummary

# What changes neither the model nor its checkpoints.
TRAINING_VOLATILE = ("tracking.", "progress", "train.num_threads", "data.num_workers", "data.prefetch_factor")


def schema() -> type:
    # Imported when a pretrain config is loaded, not with this module: it pulls in torch (~2 s of every command).
    from dinov3_core.train.config import PretrainConfig

    return PretrainConfig


def _chain_values(p: ChainPaths) -> dict[str, Any]:
    values: dict[str, Any] = {"data.stores": [str(p.tile_store)], "output_dir": str(p.pretrain)}
    if p.weights is not None or p.weights_decided:
        values["student.pretrained_weights"] = p.weights
    if p.slide_ids is not None:
        values["data.slide_ids"] = p.slide_ids
    return values


STAGE: Stage[TrainingSummary] = Stage(
    name="pretrain",
    help="DINOv3 self-supervised (continued) pretraining on tile stores.",
    schema=schema,
    summary_type=TrainingSummary,
    output=lambda c: c.output_dir,
    output_is_dir=True,
    inputs=lambda c: {**stores_input(c), "pretrained_weights": c.student.pretrained_weights},
    outputs=training.run_outputs,
    chain_values=_chain_values,
    job_module="dinov3_core.train",
    always_job=True,
    job_dir=lambda c: Path(c.output_dir),
    job_summary=training.training_summary,
    job_check=training.check_job,
    volatile=TRAINING_VOLATILE,
    preflight=training.preflight,
    options=(
        CliOption("--store", "data.stores", "tile store (repeat for several); = data.stores", repeat=True),
        CliOption("--output-dir", "output_dir", "run directory (checkpoints, eval/, metrics); = output_dir"),
    ),
    launch_help="training",
    default_config="tiny",  # the CPU-sized recipe unless --config names another
    override_example="optim.epochs=30 train.stop_at=100 train.batch_size_per_gpu=32",
)
