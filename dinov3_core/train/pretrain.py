"""The pretrain stage as one plain function, `run_pretrain(cfg) -> PretrainResult`.

    cfg = load_config(PretrainConfig, "tiny", {"data.stores": ["out/tiles.zarr"], "output_dir": "out/pt"},
                      stage="pretrain")
    result = run_pretrain(cfg)            # one process: runs right here

    # several processes: `dinov3_core.runner.run_stage("pretrain", cfg, launch=…)` starts torchrun on
    # `python -m dinov3_core.train`, and every rank calls run_pretrain

MLflow (rank 0 only): joins the run `mlflow_run_id` names (the stage runner's, which `python -m dinov3_core.train`
reads from $MLFLOW_RUN_ID), otherwise opens its own run; curated params, the resolved
config as artifact, metrics at every log line, and the metrics file and loss curve at the end.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dinov3_core import tracking
from dinov3_core.train import config as C
from dinov3_core.train import model_config as MC
from dinov3_core.train.batch_plan import check_parallelism
from dinov3_core.train.distributed import DistEnv, env_world, init_distributed, shutdown
from dinov3_core.train.loop import Trainer
from dinov3_core.train.nonfinite import TrainingDivergedError
from dinov3_core.train.result import PretrainResult

__all__ = [
    "PretrainResult",
    "TrainingDivergedError",
    "mlflow_values",
    "run_pretrain",
    "train_and_log",
    "training_process",
]

logger = logging.getLogger(__name__)

# Metrics sent to MLflow at each log line (the JSON lines file has everything).
MLFLOW_METRICS = (
    "total_loss",
    "dino_global_loss",
    "dino_local_loss",
    "ibot_loss",
    "koleo_loss",
    "lr",
    "wd",
    "momentum",
    "teacher_temp",
    "backbone_grad_norm",
    "dino_head_grad_norm",
    "ibot_head_grad_norm",
    "images_per_s",
    "dino_gap",
    "teacher_entropy",
    "agreement",
    "data_time",
    "iter_time",
    "max_rss_mb",
    "peak_memory_mb",
    # the memory watch's windows and the batch split it may change (dinov3_core.train.memory_watch)
    "memory_process_mb",
    "memory_host_available_mb",
    "memory_swap_in_mb",
    "memory_device_mb",
    "micro_batch_size",
    "accumulation_steps",
)
# The probe's scores (at eval checkpoints only), under the names the issue asks for.
PROBE_METRICS = {
    "effective_rank": "health/effective_rank",
    "invariance": "health/invariance",
    "probe_seconds": "health/probe_seconds",
}


def run_pretrain(cfg: C.PretrainConfig, mlflow_run_id: str | None = None) -> PretrainResult:
    """Train (or resume) per `cfg`. Runs in this process when not launched by torchrun (or with one process);
    under torchrun every rank calls it. Raises `WsidinoError` for bad input before writing anything."""
    with (
        training_process(cfg) as env,
        contextlib.closing(Trainer(cfg, env)) as trainer,
        _mlflow_run(cfg, trainer, mlflow_run_id) as run,
    ):
        return train_and_log(trainer, run, _log_to_mlflow)


@contextlib.contextmanager
def training_process(cfg: C.PretrainConfig) -> Iterator[DistEnv]:
    """One training rank's set-up and teardown, for pretrain and gram alike: torch threads set before any compute
    (docs/reference/distributed.md#cpu-training-with-gloo), the process group, and both restored however training
    ends."""
    check_parallelism(cfg, env_world()[1])  # the pipeline contract, before any process group exists
    threads = torch.get_num_threads()
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    env = init_distributed(cfg.train.device, cfg.parallelism.pp_degree)
    try:
        yield env
    finally:
        shutdown(env)
        torch.set_num_threads(threads)


def train_and_log(trainer: Trainer, run: Any, on_metrics: Callable[[dict[str, Any]], None]) -> PretrainResult:
    """Train; with an MLflow run (rank 0), metrics at every log line and the metrics file and loss curve after."""
    result = trainer.train(on_metrics=on_metrics if run is not None else None)
    if run is not None:
        for path in (result.metrics_path, result.loss_curve):
            if path is not None:
                tracking.log_artifact(path)
        # deferred: mlflow is slow to import, paid only when tracking
        import mlflow

        mlflow.set_tag("wsidino.health", result.health[:5000])
    return result


@contextlib.contextmanager
def _mlflow_run(cfg: C.PretrainConfig, trainer: Trainer, run_id: str | None) -> Iterator[Any]:
    if not trainer.env.is_main or not cfg.tracking.enabled:
        yield None
        return
    tags = {"wsidino.stage": "pretrain", "wsidino.output_dir": str(Path(cfg.output_dir).resolve())}
    params = curated_params(cfg, trainer)
    with tracking.stage_run(cfg.tracking, "pretrain", params=params, tags=tags, run_id=run_id) as run:
        tracking.log_artifact(Path(cfg.output_dir) / "config.yaml")
        yield run


def curated_params(cfg: C.PretrainConfig, trainer: Trainer) -> dict[str, Any]:
    """The handful of settings worth comparing across runs (the full config is the config.yaml artifact)."""
    return {
        "arch": trainer.arch,
        "pretrained_weights": cfg.student.pretrained_weights,
        "tiles": len(trainer.tiles),
        "tile_size": trainer.tiles.tile_size,
        "stores": ",".join(cfg.data.stores),
        "crops": f"{cfg.crops.n_global_crops}x{cfg.crops.global_size}+{cfg.crops.n_local_crops}x{cfg.crops.local_size}",
        "prototypes_dino": cfg.heads.dino.n_prototypes,
        "prototypes_ibot": cfg.heads.ibot.n_prototypes,
        "world_size": trainer.env.world_size,
        "global_batch_size": trainer.global_batch,
        "micro_batch_per_gpu": trainer.micro_batch,
        "accumulation_steps": trainer.accumulation_steps,
        "pipeline": (
            f"{cfg.parallelism.pp_degree} stages, {cfg.parallelism.pp_schedule}, {trainer.pipeline.n_mb} micro-batches"
            if trainer.pipeline is not None
            else "off"
        ),
        "memory_watch": cfg.train.memory_watch,
        "memory_budget_gb": cfg.train.memory_budget_gb,
        "total_iterations": trainer.total_iterations,
        "epochs": cfg.optim.epochs,
        "epoch_length": cfg.train.epoch_length,
        "lr_base": cfg.optim.lr,
        "lr_peak": trainer.schedules.lr.peak,
        "scaling_rule": cfg.optim.scaling_rule,
        "warmup_epochs": cfg.optim.warmup_epochs,
        "weight_decay": f"{cfg.optim.weight_decay}->{cfg.optim.weight_decay_end}",
        "momentum_teacher": cfg.teacher.momentum_teacher,
        "teacher_temp": f"{cfg.teacher.warmup_teacher_temp}->{cfg.teacher.teacher_temp}",
        "drop_path_rate": cfg.student.drop_path_rate,
        "adaptation": MC.adaptation_summary(cfg) or "full fine-tuning",
        "trainable_params": sum(math.prod(trainer.layout.shapes[f"model.{n}"]) for n in trainer.layout.trainable),
        "layer_decay": cfg.optim.layer_decay,
        "koleo_weight": cfg.losses.koleo_weight,
        "koleo_scope": cfg.losses.koleo_scope,
        "device": str(trainer.env.device.type),
        "precision": "bf16" if trainer.bf16 else "fp32",
        "seed": cfg.train.seed,
    }


def mlflow_values(record: dict[str, Any], keys: tuple[str, ...] = MLFLOW_METRICS) -> dict[str, float]:
    """The metrics of one metrics line that go to MLflow (the probe's under `health/…`)."""
    values = {k: record[k] for k in keys if isinstance(record.get(k), int | float)}
    return values | {name: record[k] for k, name in PROBE_METRICS.items() if isinstance(record.get(k), int | float)}


def _log_to_mlflow(record: dict[str, Any]) -> None:
    if record.get("event") == "memory_replan":  # a tag per re-plan: what changed, why, before → after
        text = f"{record['what']}: {record['why']}; {record['before']} -> {record['after']}"
        tracking.set_tag(f"wsidino.memory_replan.{record['iteration']}", text)
    tracking.log_metrics(mlflow_values(record), step=int(record["iteration"]))
