"""pretrain: DINOv3 self-supervised (continued) pretraining on tile stores, always a torchrun job
(`python -m dinov3_core.train` on every rank; rank 0 logs into the stage's MLflow run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dinov3_core.stage import ChainPaths, CliOption, Place, PreflightFacts, Problem, Stage, stores_input
from dinov3_core.train import preflight as training
from dinov3_core.train.summary import TrainingSummary, run_outputs, training_summary

# What pretrain and gram share as stages: a torchrun job writing a run directory (`output_dir`), its summary read
# from what the job wrote, its parallelism checked for the world size before any rank starts.
TRAINING_JOB: dict[str, Any] = {
    "summary_type": TrainingSummary,
    "output": lambda c: c.output_dir,
    "output_is_dir": True,
    "always_job": True,
    "job_dir": lambda c: Path(c.output_dir),
    "job_summary": training_summary,
    "job_check": training.check_job,
    # What changes neither the model nor its checkpoints.
    "volatile": ("tracking.", "progress", "train.num_threads", "data.num_workers", "data.prefetch_factor"),
    "launch_help": "training",
    "default_config": "tiny",  # the CPU-sized recipe unless --config names another
}


def schema() -> type:
    # Imported when a pretrain config is loaded, not with this module: it pulls in torch, which most commands skip.
    from dinov3_core.train.config import PretrainConfig

    return PretrainConfig


def training_duration(cfg: Any, world_size: int, extra_teacher_passes: int = 0) -> Any:
    """The run's duration floor on this machine (`dinov3_core.train.duration`)."""
    from dinov3_core.train.duration import estimate  # torch: imported when a chain asks, not with the stage list

    return estimate(cfg, world_size, extra_teacher_passes)


def _preflight(cfg: Any, facts: PreflightFacts) -> list[Problem]:
    """The training checks, and the warm-start file opened and its keys read before any stage runs: a file that is
    no backbone, or one of another architecture than `student.arch`, fails now and not inside the job."""
    problems = training.preflight(cfg, facts)
    if cfg.student.pretrained_weights:
        problems += weights_problems(Path(cfg.student.pretrained_weights), cfg, facts.key("student.pretrained_weights"))
    return problems


def weights_problems(weights: Path, cfg: Any, key: str) -> list[Problem]:
    """Why `weights` cannot warm-start the pretrain config `cfg` (empty: it can)."""
    from dinov3_core.models.arch_inference import infer_backbone_kwargs
    from dinov3_core.models.released import read_backbone_state_dict
    from dinov3_core.models.state_dict_check import ReleasedWeightsError
    from dinov3_core.train.model_config import structure_mismatch

    give = "give a released DINOv3 backbone .pth (or .safetensors) or a `wsidino convert` backbone.pth"
    if not weights.is_file():
        return [Problem(key, f"{weights} is not a file", give)]
    try:
        name, theirs = infer_backbone_kwargs(read_backbone_state_dict(weights), source=str(weights))
    except (ReleasedWeightsError, OSError) as err:
        return [Problem(key, str(err), give)]
    said = structure_mismatch(theirs, cfg) if cfg.student.arch != "auto" else None
    if said:
        return [
            Problem(
                key,
                f"{weights} ({name or 'not a released variant'}) does not fit the pretrain config's "
                f"student.arch={cfg.student.arch} ({said}, file vs config): the weights do not fit the "
                "pretrain config",
                "choose the --config of that model size (docs/hardware.md) or set pretrain.student.arch=auto",
            )
        ]
    return []


def _chain_values(p: ChainPaths) -> dict[str, Any]:
    values: dict[str, Any] = {"data.stores": [str(p.output("tile"))], "output_dir": str(p.output("pretrain"))}
    if p.weights is not None or p.weights_decided:
        values["student.pretrained_weights"] = p.weights
    if p.slide_ids is not None:
        values["data.slide_ids"] = p.slide_ids
    return values


STAGE: Stage[TrainingSummary] = Stage(
    name="pretrain",
    help="DINOv3 self-supervised (continued) pretraining on tile stores.",
    schema=schema,
    place=Place("pretrain", contents="ckpt/, eval/training_<it>/teacher_checkpoint.pth, loss_curve.png"),
    inputs=lambda c: {**stores_input(c), "pretrained_weights": c.student.pretrained_weights},
    outputs=run_outputs,
    chain_values=_chain_values,
    job_module="dinov3_core.train",
    preflight=_preflight,
    duration=training_duration,
    options=(
        CliOption("--store", "data.stores", "tile store (repeat for several); = data.stores", repeat=True),
        CliOption("--output-dir", "output_dir", "run directory (checkpoints, eval/, metrics); = output_dir"),
    ),
    override_example="optim.epochs=30 train.stop_at=100 train.batch_size_per_gpu=32",
    **TRAINING_JOB,
)
