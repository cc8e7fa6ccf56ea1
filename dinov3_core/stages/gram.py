"""gram: gram anchoring, continuing a pretraining run with a frozen gram teacher picked from its teacher-only
eval checkpoints; a torchrun job like pretrain (`python -m dinov3_core.gram`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dinov3_core.stage import ChainPaths, CliOption, Place, Stage, stores_input
from dinov3_core.stages.pretrain import TRAINING_JOB, training_duration
from dinov3_core.train import preflight as training
from dinov3_core.train.summary import TrainingSummary, run_outputs


def schema() -> type:
    from dinov3_core.gram.config import GramConfig

    return GramConfig


def _duration(cfg: Any, world_size: int) -> Any:
    """As pretrain's, with the frozen gram teacher's pass; the model is the pretraining run's (`inherit_model`),
    known once that run wrote its config (None before)."""
    if cfg.pretrain_dir and cfg.inherit_model:
        if not (Path(cfg.pretrain_dir) / "config.yaml").is_file():
            return None
        from dinov3_core.config import ConfigError
        from dinov3_core.gram.anchoring import prepare_config

        try:
            cfg = prepare_config(cfg)
        except ConfigError:  # named by the stage when it runs
            return None
    return training_duration(cfg, world_size, extra_teacher_passes=1)


def _inputs(cfg: Any) -> dict[str, str | None]:
    return {"pretrain_dir": cfg.pretrain_dir, "teacher_path": cfg.gram.teacher_path, **stores_input(cfg)}


def _outputs(cfg: Any) -> dict[str, str]:
    out = run_outputs(cfg)
    selection = Path(cfg.output_dir) / "gram_teacher_selection.json"
    if selection.is_file():
        out["teacher_selection"] = str(selection)
    return out


def _chain_values(p: ChainPaths) -> dict[str, Any]:
    values: dict[str, Any] = {"pretrain_dir": str(p.output("pretrain")), "output_dir": str(p.output("gram"))}
    if p.slide_ids is not None:  # a snapshot's slides: the store they are in is named with them
        values |= {"data.stores": [str(p.output("tile"))], "data.slide_ids": p.slide_ids}
    return values


STAGE: Stage[TrainingSummary] = Stage(
    name="gram",
    help="Gram anchoring: continue a pretraining run with a frozen, auto-selected gram teacher.",
    schema=schema,
    place=Place("gram", contents="gram_teacher_selection.json names the chosen teacher"),
    inputs=_inputs,
    outputs=_outputs,
    chain_values=_chain_values,
    job_module="dinov3_core.gram",
    preflight=training.preflight,
    duration=_duration,
    options=(
        CliOption(
            "--pretrain-dir", "pretrain_dir", "the pretraining run directory to continue (its eval/ holds the teachers)"
        ),
        CliOption("--output-dir", "output_dir", "the gram stage's own run directory; = output_dir"),
    ),
    override_example="gram.teacher_policy=best_dense train.stop_at=50",
    **TRAINING_JOB,
)
