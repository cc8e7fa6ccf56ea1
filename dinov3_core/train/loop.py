"""The pretraining loop, torchtitan style: `Trainer.__init__` builds and checks everything, `train()` runs.

Order of setup, chosen so that bad input fails before anything in output_dir is written or overwritten: config
checks → tile stores → model (fresh or warm start) → batch plan (`batch_plan`) → checkpoint compatibility → pipeline
split, sharding + optimizer → (now writing) config.yaml, logs → resume → data loader (the steps: `trainer_setup`).

`train()` reads top to bottom, one component per concern: `checkpointing` (eval and DCP checkpoints),
`health_schedule` (probe, watch, verdict), `memory_guard` (scheduled GC, memory watch), `metrics_window` (metrics
lines, throughput), `replan` (re-plans on memory pressure or an out-of-memory step). One iteration (`train_step`):
crops → `step.forward_backward` → all-reduced losses, NaN guard (`nonfinite`) → clipping → AdamW → EMA teacher.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dinov3_core import config as core_config
from dinov3_core import events
from dinov3_core.data.augment import MultiCropAugmentation
from dinov3_core.data.masking import IBOTMasks
from dinov3_core.data.stain import CohortStain
from dinov3_core.models import apply_activation_checkpointing
from dinov3_core.train import checkpoint as ckpt
from dinov3_core.train import config as C
from dinov3_core.train import health_probe as HP
from dinov3_core.train import metrics as M
from dinov3_core.train.batch_plan import (
    RunPlan,
    check_batch,
    check_parallelism,
    plan_batch,
    plan_from_checkpoint,
)
from dinov3_core.train.checkpointing import CheckpointSchedule
from dinov3_core.train.distributed import DistEnv, barrier, parallelize
from dinov3_core.train.health import no_information_gaps
from dinov3_core.train.health_schedule import HealthSchedule
from dinov3_core.train.memory import memory_budget_bytes, shape_of
from dinov3_core.train.memory_guard import MemoryGuard
from dinov3_core.train.metrics_window import MetricsWindow, OnMetrics
from dinov3_core.train.nonfinite import NonFiniteGuard
from dinov3_core.train.optim import apply_schedules, build_optimizer, build_schedules, clip_gradients
from dinov3_core.train.pp import Pipeline, clip_gradients_pp
from dinov3_core.train.replan import replan, step_within_memory
from dinov3_core.train.result import PretrainResult
from dinov3_core.train.sampler import SamplerState
from dinov3_core.train.ssl_model import LOSS_NAMES, SIGNAL_NAMES, SSLMetaArch, build_ssl_model
from dinov3_core.train.step import ENTROPY, forward_backward
from dinov3_core.train.step_batches import TORCH_STREAM, StepBatch, augment_step, derive_seed
from dinov3_core.train.trainer_setup import (
    build_step_loader,
    checkpoint_meta,
    checkpoint_to_resume,
    describe_start,
    load_training_state,
    open_tiles,
    uses_bf16,
)

logger = logging.getLogger(__name__)


class Trainer:
    # Stages that add losses (gram anchoring) subclass the meta-architecture and name it here.
    meta_arch: type[SSLMetaArch] = SSLMetaArch
    stage = "pretrain"  # for logs and events
    extra_loss_names: tuple[str, ...] = ()  # terms the meta-architecture adds to `LOSS_NAMES` (gram_loss)

    def __init__(self, cfg: C.PretrainConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        C.validate(cfg)
        self.output_dir = Path(cfg.output_dir)
        self.ckpt_root = self.output_dir / ckpt.CKPT_DIR
        self.total_iterations = C.total_iterations(cfg)
        self.stop_iteration = min(self.total_iterations, cfg.train.stop_at or self.total_iterations)
        self.checkpoints = CheckpointSchedule(cfg, env, self.output_dir, self.stage, self.stop_iteration)
        self.window: MetricsWindow | None = None  # this train()'s metrics lines
        self.bf16 = uses_bf16(cfg, env)

        # Data source (host side). Raises for missing / empty stores before anything is written.
        self.tiles = open_tiles(cfg)

        # Model: identical initialisation on every rank (FSDP shards each rank's full copy).
        torch.manual_seed(cfg.train.seed)
        built = build_ssl_model(cfg, meta_arch=self.meta_arch)
        self.model, self.arch = built.model, built.arch
        self.layout = ckpt.ModelLayout.of(self.model)  # the whole model's keys: pipeline stages hold only some
        # The health probe's tiles; slides it holds out leave the training data (health_probe).
        patch = self.model.student["backbone"].patch_size
        self.probe_set, self.tiles = HP.prepare(cfg, self.tiles, patch, inherit=self.inherited_probe(cfg))

        budget = memory_budget_bytes(cfg, env.device, env.local_world_size)
        self.plan = plan_batch(
            cfg,
            shape_of(self.model.student, cfg),
            world_size=env.world_size,
            budget_bytes=budget,
            device_type=env.device.type,
            tile_size=self.tiles.tile_size,
        )
        self.global_batch = self.plan.global_batch
        check_batch(cfg, len(self.tiles), self.plan)
        check_parallelism(cfg, env.world_size, self.plan.micro_batch)
        # What the memory watch may change mid-run (micro-batch × accumulation stays the rank's step batch).
        self.run_plan = RunPlan.of(self.plan, cfg)
        self.rank_batch = self.plan.rank_batch

        latest = checkpoint_to_resume(cfg, self.ckpt_root, self.layout, self.global_batch, self.stop_iteration)
        self.model.student, self.model.teacher = parallelize(
            self.model.student,
            self.model.teacher,
            env,
            bf16=self.bf16,
            activation_checkpointing=cfg.train.activation_checkpointing,
            compile=cfg.train.compile_blocks,
            parallelism=cfg.parallelism,
        )
        self.model.dp_group = env.dp_group  # Sinkhorn and the KoLeo gather: the processes with other images
        self.pipeline: Pipeline | None = None  # built by set_run_plan under pipeline parallelism
        # train.compile=step: one torch.compile of the whole step (Dynamo follows it into the models, heads and
        # losses; the per-micro-batch backward() is a graph break, so forward_loss is compiled with its backward).
        self.step_fn = torch.compile(forward_backward) if cfg.train.compile_step else forward_backward
        self.optimizer = build_optimizer(self.model.student, cfg)
        self.schedules = build_schedules(cfg, self.global_batch)

        resumed_plan, self.memory_replans = plan_from_checkpoint(latest, self.run_plan, cfg, env.world_size)
        if resumed_plan != self.run_plan and env.is_main:
            logger.info(
                "%s: starts with the memory watch's plan from %s: %s", self.stage, latest, resumed_plan.describe()
            )
        self.set_run_plan(resumed_plan)

        # ---- from here on, output_dir is written
        if env.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            core_config.save_config(cfg, self.output_dir / "config.yaml")
            HP.record(cfg, self.probe_set)
            ckpt.remove_partial(self.ckpt_root)
        barrier(env)
        self.log_handler = M.setup_logging(self.output_dir, env.rank)
        self.metrics = M.MetricsWriter(self.output_dir, enabled=env.is_main)
        logger.info("%s", describe_start(self, latest))

        self.start_iteration, self.start_sample = 0, 0
        self.resumed_from = latest
        try:
            if latest is not None:
                self._resume(latest)
            self.sampler, self.loader = self.build_loader(self.start_iteration, self.start_sample)
        except BaseException:
            self.close()  # in-process callers keep no dangling log handler
            raise
        # The cohort's stain distribution from the slides' recorded statistics, read only when the step is on.
        stain = CohortStain.from_dataset(self.tiles) if cfg.crops.stain_norm_p > 0 else None
        self.augmentation = MultiCropAugmentation(cfg.crops, stain=stain)
        self.probe = HP.HealthProbe(self.probe_set, env, self.bf16) if self.probe_set else None
        self.nonfinite = NonFiniteGuard(cfg.train.nan_patience, self.ckpt_root)

    def build_loader(self, start_iteration: int, start_sample: int) -> tuple[Any, Any]:
        """The step sampler and loader from `start_iteration` on, with the run plan's worker settings."""
        return build_step_loader(
            self.cfg,
            self.env,
            self.tiles,
            patch_size=self.model.student["backbone"].patch_size,
            global_batch=self.global_batch,
            start_iteration=start_iteration,
            start_sample=start_sample,
            stop_iteration=self.stop_iteration,
            num_workers=self.run_plan.num_workers,
            prefetch_factor=self.run_plan.prefetch_factor,
        )

    def set_run_plan(self, plan: RunPlan) -> None:
        """Adopt `plan` for the coming steps (the loader is rebuilt by the caller when its settings changed)."""
        self.run_plan = plan
        self.micro_batch, self.accumulation_steps = plan.micro_batch, plan.accumulation_steps
        if plan.activation_checkpointing:  # a flag on each block: switching it on needs no re-wrapping
            apply_activation_checkpointing(self.model.student["backbone"])
        if self.cfg.parallelism.enabled and (self.pipeline is None or self.pipeline.micro_batch != plan.micro_batch):
            patch = self.model.teacher["backbone"].patch_size
            grids = [(self.cfg.crops.global_size // patch,) * 2, (self.cfg.crops.local_size // patch,) * 2]
            self.pipeline = Pipeline(
                self.model,
                self.env,
                self.cfg.parallelism,
                micro_batch=plan.micro_batch,
                accumulation=plan.accumulation_steps,
                grids=grids,
            )

    def inherited_probe(self, cfg: C.PretrainConfig) -> Path | None:
        """A probe record to reuse when the run has none of its own (the gram stage: its pretraining run's)."""
        return None

    def _resume(self, latest: Path) -> None:
        """Model, optimizer and sampler position from `latest` (resharded to this run's processes)."""
        template = self.train_state(-1, SamplerState(0, 1, 0))
        iteration, sampler_state = load_training_state(
            latest, self.model, self.optimizer, template, self.env, len(self.tiles)
        )
        self.start_iteration, self.start_sample = iteration + 1, sampler_state.consumed_samples
        logger.info("resumed from %s: iteration %d, %s", latest, self.start_iteration, sampler_state.to_dict())
        if self.env.is_main:
            M.truncate_metrics(self.metrics.path, self.start_iteration)

    # ------------------------------------------------------------------------------------------- state

    def train_state(self, iteration: int, sampler: SamplerState) -> dict[str, Any]:
        """What a checkpoint holds besides model and optimizer (non-tensor DCP entries)."""
        return {"iteration": iteration, "sampler": sampler.to_dict(), "rng": {"seed": self.cfg.train.seed}}

    def checkpoint_meta(self) -> dict[str, Any]:
        return checkpoint_meta(self)

    # -------------------------------------------------------------------------------------------- loop

    def train(self, on_metrics: OnMetrics | None = None) -> PretrainResult:
        """Train from `start_iteration` to `stop_iteration`; `on_metrics(record)` is called per log line (rank 0)."""
        result = self.new_result()
        if self.start_iteration >= self.stop_iteration:
            logger.info("nothing to train: at iteration %d, stop at %d", self.start_iteration, self.stop_iteration)
            return result
        health = HealthSchedule(self.cfg, self.env, self.stage, self.probe, self.stop_iteration)
        self.window = MetricsWindow(
            self.cfg,
            self.env,
            self.metrics,
            self.schedules,
            start_iteration=self.start_iteration,
            total_iterations=self.total_iterations,
            end_iteration=self.stop_iteration,
            on_metrics=on_metrics,
        )
        with MemoryGuard(self.cfg, self.env, self.plan.budget_bytes) as memory:
            data_iter = iter(self.loader)
            try:
                for iteration in range(self.start_iteration, self.stop_iteration):
                    last = self.checkpoints.is_last(iteration)
                    start = time.perf_counter()
                    batch: StepBatch = next(data_iter)
                    data_time = time.perf_counter() - start
                    if batch.iteration != iteration:  # the sampler and the loop must never drift apart
                        raise RuntimeError(f"loader returned iteration {batch.iteration}, expected {iteration}")
                    values = step_within_memory(self, iteration, batch)
                    values.update(no_information_gaps(values, self.cfg))
                    iter_time = time.perf_counter() - start  # the probe below is not training throughput
                    due = self.checkpoints.eval_due(iteration)
                    probe = health.observe(iteration, values, probe_due=due, embed=self.teacher_embed)
                    pressure = memory.check(iteration, last=last)
                    self.window.add(iteration, values, iter_time=iter_time, data_time=data_time)
                    result.end_iteration, result.final_losses = iteration + 1, {k: values[k] for k in LOSS_NAMES}
                    memory.collect(iteration)
                    if probe or self.window.line_due(iteration, last=last):
                        self.window.write_line(iteration, {**probe, **memory.window_metrics()}, self.batch_fields())
                    if pressure is not None and not last and replan(self, iteration, *pressure):
                        del data_iter  # stops the old workers; their prefetched steps are read again, identically
                        consumed = self.sampler.state_after(iteration).consumed_samples
                        self.sampler, self.loader = self.build_loader(iteration + 1, consumed)
                        data_iter = iter(self.loader)
                    if not self.nonfinite.streak:  # never save a diverging state: a restart resumes from a good one
                        self.checkpoints.after_step(iteration, self.model.teacher, self.save, result)
            finally:
                del data_iter  # stops loader workers
        result.health = health.finish(self.output_dir, result.end_iteration)
        result.micro_batch, result.accumulation_steps = self.micro_batch, self.accumulation_steps  # as re-planned
        result.memory_replans = self.memory_replans
        result.images_per_second = self.window.images_per_second(self.global_batch, result.end_iteration)
        result.first_step_seconds = self.window.first_step_seconds
        result.loss_curve = self.window.plot(self.output_dir, self.stage)
        return result

    def new_result(self) -> PretrainResult:
        """This invocation's result before its first iteration."""
        return PretrainResult(
            output_dir=self.output_dir,
            start_iteration=self.start_iteration,
            end_iteration=self.start_iteration,
            total_iterations=self.total_iterations,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            accumulation_steps=self.accumulation_steps,
            world_size=self.env.world_size,
            resumed_from=self.resumed_from,
            last_checkpoint=self.resumed_from,
            metrics_path=self.metrics.path,
        )

    def batch_fields(self) -> dict[str, int]:
        """How the step batch is split now (the memory watch may change it mid-run)."""
        return M.batch_fields(self.global_batch, self.micro_batch, self.accumulation_steps)

    def teacher_embed(self, images: torch.Tensor) -> torch.Tensor:
        """The EMA teacher's CLS features of `images` (the health probe): its backbone, or its pipeline stages."""
        if self.pipeline is not None:
            return self.pipeline.embed(images)
        return self.model.teacher["backbone"](images, is_training=True)["x_norm_clstoken"]

    def save(self, iteration: int) -> Path:
        return ckpt.save_checkpoint(
            self.ckpt_root,
            iteration,
            self.model,
            self.optimizer,
            self.train_state(iteration, self.sampler.state_after(iteration)),
            self.checkpoint_meta(),
            self.env,
            max_to_keep=self.cfg.checkpointing.max_to_keep,
            keep_every=self.cfg.checkpointing.keep_every,
        )

    # -------------------------------------------------------------------------------------------- step

    def train_step(self, iteration: int, batch: StepBatch) -> dict[str, float]:
        cfg, env, model = self.cfg, self.env, self.model
        n_micro = self.accumulation_steps
        sched = self.schedules.at(iteration)
        apply_schedules(self.optimizer, sched)
        # Drop path and RoPE jitter draw from the global RNG: reseed per (iteration, rank) so that a resumed
        # run draws exactly what an uninterrupted one would have.
        torch.manual_seed(derive_seed(cfg.train.seed, TORCH_STREAM, iteration, env.rank))

        images = batch.images.to(env.device, non_blocking=True)
        crops = augment_step(
            self.augmentation,
            images,
            seed=cfg.train.seed,
            first_sample=batch.first_sample,
            rank_offset=batch.rank_offset,
            group_size=cfg.crops.rng_group_size,
        )
        masks = IBOTMasks.from_masks(batch.masks.to(env.device, non_blocking=True), cfg.crops.n_global_crops)
        events.emit(
            "train.step",
            stage=self.stage,
            output_dir=str(self.output_dir),
            iteration=iteration,
            micro_batch=self.micro_batch,
            rank=env.rank,
        )
        koleo_base = env.dp_rank * self.rank_batch if cfg.losses.koleo_scope == "global" else 0
        keys = (*LOSS_NAMES, *SIGNAL_NAMES, *self.extra_loss_names)
        temp: float | torch.Tensor = sched.teacher_temp
        if cfg.train.compile_step:  # a tensor: Dynamo would specialise on a float and recompile when it changes
            temp = torch.tensor(temp, device=env.device)
        loss_sum = self.step_fn(
            model,
            self.pipeline,
            env,
            crops,
            masks,
            keys=keys,
            n_micro=n_micro,
            teacher_temp=temp,
            koleo_base=koleo_base,
            bf16=self.bf16,
        )
        del crops

        if env.distributed:  # the mean over data-parallel processes is the loss of the global batch
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
            loss_sum /= env.dp_size
        means = dict(zip((*keys, ENTROPY), loss_sum.tolist(), strict=True))
        losses = {k: means[k] for k in LOSS_NAMES}
        values: dict[str, float] = {**means, **M.schedule_values(sched)}

        finite = all(math.isfinite(v) for v in losses.values())
        if finite:
            if self.pipeline is None:
                norms = clip_gradients(model.student, cfg.optim.clip_grad)
            else:
                norms = clip_gradients_pp(model.student, cfg.optim.clip_grad)
            values.update({k: float(v) for k, v in norms.items()})
            finite = all(math.isfinite(values[k]) for k in norms)
        if finite:
            self.optimizer.step()
            model.update_teacher(sched.momentum)  # by name: under a pipeline, each stage's teacher from its student
        self.nonfinite.observe(iteration, finite, losses)  # raises after train.nan_patience skipped steps in a row
        self.optimizer.zero_grad(set_to_none=True)
        values["skipped_step"] = float(not finite)
        return values

    def close(self) -> None:
        logging.getLogger("dinov3_core").removeHandler(self.log_handler)
        self.log_handler.close()
