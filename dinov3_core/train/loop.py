"""The pretraining loop, torchtitan style: `Trainer.__init__` builds and checks everything, `train()` runs.

Order of setup, chosen so that bad input fails before anything in output_dir is written or overwritten:
config checks → tile stores → model (fresh or warm start) → batch plan → checkpoint compatibility → pipeline split,
sharding + optimizer → (now writing) config.yaml, logs → resume → data loader. The steps themselves live in
`trainer_setup`; what a metrics line holds lives in `metrics`.

One iteration (`train_step`): crops on the device → `step.forward_backward` (teacher targets over the whole step,
[KoLeo neighbour set], the student micro-batch by micro-batch or through its pipeline stages) → all-reduced
losses, NaN guard → per-submodule clipping → AdamW → EMA teacher.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dinov3_core import config as core_config
from dinov3_core import events
from dinov3_core.data.augment import MultiCropAugmentation
from dinov3_core.data.masking import IBOTMasks
from dinov3_core.data.stain import CohortStain
from dinov3_core.errors import RunStopped
from dinov3_core.models import apply_activation_checkpointing
from dinov3_core.train import checkpoint as ckpt
from dinov3_core.train import config as C
from dinov3_core.train import health_probe as HP
from dinov3_core.train import metrics as M
from dinov3_core.train.distributed import DistEnv, barrier, cpu_has_bf16_matmul, parallelize
from dinov3_core.train.health import (
    HEALTH_FILE,
    HealthWatch,
    no_information_gaps,
    schedule_summary,
    schedule_warnings,
)
from dinov3_core.train.memory_watch import MemoryWindow, Pressure, device_peak_bytes, release_freed_memory
from dinov3_core.train.optim import apply_schedules, build_optimizer, build_schedules, clip_gradients
from dinov3_core.train.pp import Pipeline, clip_gradients_pp
from dinov3_core.train.replan import RunPlan, next_plan, out_of_memory, start_watch
from dinov3_core.train.sampler import SamplerState
from dinov3_core.train.ssl_model import LOSS_NAMES, SIGNAL_NAMES, SSLMetaArch, build_ssl_model
from dinov3_core.train.step import ENTROPY, forward_backward
from dinov3_core.train.step_batches import TORCH_STREAM, StepBatch, augment_step, derive_seed
from dinov3_core.train.trainer_setup import (
    build_step_loader,
    check_batch,
    checkpoint_to_resume,
    describe_start,
    load_training_state,
    open_tiles,
    plan_from_checkpoint,
    resolve_batch,
)

logger = logging.getLogger(__name__)


class TrainingDivergedError(RunStopped):
    """Too many consecutive non-finite losses."""


@dataclass
class PretrainResult:
    output_dir: Path
    start_iteration: int  # first iteration trained by this invocation (> 0 after a resume)
    end_iteration: int  # iterations completed in total (the next one to train)
    total_iterations: int  # schedule length
    global_batch: int
    micro_batch: int
    accumulation_steps: int
    world_size: int
    resumed_from: Path | None
    last_checkpoint: Path | None
    eval_checkpoints: list[Path] = field(default_factory=list)
    metrics_path: Path | None = None
    loss_curve: Path | None = None
    final_losses: dict[str, float] = field(default_factory=dict)
    memory_replans: int = 0  # re-plans by the memory watch, this invocation and those it resumed
    # Global batch / iteration time over this invocation's iterations after its first; the first (compile warm-up,
    # loader start-up) is first_step_seconds.
    images_per_second: float = 0.0
    first_step_seconds: float = 0.0
    health: str = ""  # learning / not learning (and why) / not judged yet: dinov3_core.train.health


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
        self.bf16 = cfg.train.uses_bf16(env.device.type)
        if self.bf16 and env.device.type == "cpu" and not cpu_has_bf16_matmul():
            logger.warning(
                "train.precision=bf16 on a CPU without bf16 matrix instructions (AMX / AVX512-BF16): "
                "slower than fp32 here; set train.precision=fp32"
            )

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

        self.plan = resolve_batch(cfg, env, self.model, self.tiles.tile_size)
        self.global_batch = self.plan.global_batch
        check_batch(cfg, len(self.tiles), self.plan)
        C.check_parallelism(cfg, env.world_size, self.plan.micro_batch)
        # What the memory watch may change mid-run (micro-batch × accumulation stays the rank's step batch).
        self.run_plan = RunPlan(
            micro_batch=self.plan.micro_batch,
            accumulation_steps=self.plan.accumulation_steps,
            num_workers=cfg.data.num_workers,
            prefetch_factor=cfg.data.prefetch_factor,
            activation_checkpointing=cfg.train.activation_checkpointing,
        )
        self.rank_batch = self.run_plan.step_batch

        latest = checkpoint_to_resume(cfg, self.ckpt_root, self.layout)
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

        resumed_plan, self.memory_replans = plan_from_checkpoint(latest, self.run_plan, env.world_size)
        if not self.micro_batch_ok(resumed_plan.micro_batch):  # re-planned under another pipeline layout
            resumed_plan = self.run_plan
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
        self.nonfinite_streak = 0

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
        return {
            "arch": self.arch,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "run_plan": self.run_plan.to_dict(),
            "memory_replans": self.memory_replans,
            "config_hash": core_config.config_hash(self.cfg),
            "adaptation": C.adaptation_meta(self.cfg),  # student.lora / freeze_blocks: convert and resume read it
        }

    # -------------------------------------------------------------------------------------------- loop

    def train(self, on_metrics: Any = None) -> PretrainResult:
        """Train from `start_iteration` to `stop_iteration`; `on_metrics(record)` is called per log line (rank 0)."""
        cfg, env = self.cfg, self.env
        result = PretrainResult(
            output_dir=self.output_dir,
            start_iteration=self.start_iteration,
            end_iteration=self.start_iteration,
            total_iterations=self.total_iterations,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            accumulation_steps=self.accumulation_steps,
            world_size=env.world_size,
            resumed_from=self.resumed_from,
            last_checkpoint=self.resumed_from,
            metrics_path=self.metrics.path,
        )
        if self.start_iteration >= self.stop_iteration:
            logger.info("nothing to train: at iteration %d, stop at %d", self.start_iteration, self.stop_iteration)
            return result
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        gc.collect()
        gc.freeze()  # setup objects (model, index arrays) move out of the collected generations
        window = M.WindowMeans()
        watch = HealthWatch(cfg)
        if env.is_main:
            logger.info("%s: %s", self.stage, schedule_summary(cfg))
        for warning in schedule_warnings(cfg, self.stop_iteration) if env.is_main else []:
            logger.warning("%s: %s", self.stage, warning)
        run_time = 0.0
        memory = start_watch(cfg, env, self.plan.budget_bytes)
        memory_seen: MemoryWindow | None = None  # the worst window since the last metrics line
        data_iter = iter(self.loader)
        try:
            for iteration in range(self.start_iteration, self.stop_iteration):
                start = time.perf_counter()
                batch: StepBatch = next(data_iter)
                data_time = time.perf_counter() - start
                if batch.iteration != iteration:  # the sampler and the loop must never drift apart
                    raise RuntimeError(f"loader returned iteration {batch.iteration}, expected {iteration}")
                values = self.step_within_memory(iteration, batch, on_metrics)
                values.update(no_information_gaps(values, cfg))
                iter_time = time.perf_counter() - start  # the probe below is not training throughput
                last = iteration == self.stop_iteration - 1
                period = cfg.evaluation.eval_period_iterations
                eval_due = bool(period and (iteration + 1) % period == 0) or last
                probe = self.probe.measure(self.teacher_embed) if eval_due and self.probe else {}
                alarm = watch.observe(iteration, {**values, **probe})  # raises under health.policy=stop, all ranks
                if alarm is not None and env.is_main:
                    logger.warning("%s: %s", self.stage, alarm)
                pressure = None
                if (iteration + 1) % cfg.train.memory_watch_period == 0 or last:
                    seen, pressure = memory.check()  # collective: same iterations, same verdict on every rank
                    memory_seen = seen if memory_seen is None else memory_seen.worst(seen)
                if iteration == self.start_iteration:
                    result.first_step_seconds = iter_time
                else:
                    run_time += iter_time
                window.add({**values, "iter_time": iter_time, "data_time": data_time})
                result.end_iteration = iteration + 1
                result.final_losses = {k: values[k] for k in LOSS_NAMES}

                if (iteration + 1) % cfg.train.gc_period == 0:
                    gc.collect()  # same iteration on every rank: no rank stalls a collective alone
                if probe or (iteration + 1) % cfg.train.log_period == 0 or iteration == self.start_iteration or last:
                    memory_values = memory_seen.as_metrics() if memory_seen is not None else {}
                    record = self.log_metrics(iteration, {**window.flush(), **probe, **memory_values})
                    memory_seen = None
                    if on_metrics is not None and env.is_main:
                        on_metrics(record)
                if pressure is not None and not last and self.replan(iteration, *pressure, on_metrics=on_metrics):
                    del data_iter  # stops the old workers; their prefetched steps are read again, identically
                    self.sampler, self.loader = self.build_loader(
                        iteration + 1, self.sampler.state_after(iteration).consumed_samples
                    )
                    data_iter = iter(self.loader)
                if self.nonfinite_streak:  # never save a diverging state: a restart resumes from the last good one
                    continue
                if eval_due:
                    result.eval_checkpoints.append(
                        ckpt.save_eval_teacher(self.output_dir, iteration, self.model.teacher, env)
                    )
                if (iteration + 1) % cfg.checkpointing.period == 0 or last:
                    result.last_checkpoint = self.save(iteration)
                    events.emit(
                        "train.checkpoint",
                        stage=self.stage,
                        output_dir=str(self.output_dir),
                        iteration=iteration,
                        rank=env.rank,
                    )
        finally:
            del data_iter  # stops loader workers
            memory.stop()
            gc.unfreeze()  # in-process callers (tests, notebooks) get their collector back as it was
        result.health = watch.verdict()
        result.micro_batch, result.accumulation_steps = self.micro_batch, self.accumulation_steps  # as re-planned
        result.memory_replans = self.memory_replans
        if env.is_main:  # the run's verdict for the stage summary (dinov3_core.runner) and whoever looks at the run
            (self.output_dir / HEALTH_FILE).write_text(
                json.dumps({"iteration": result.end_iteration, "verdict": result.health}) + "\n"
            )
        steady = result.end_iteration - result.start_iteration - 1
        result.images_per_second = (
            self.global_batch * steady / run_time if steady else self.global_batch / result.first_step_seconds
        )
        if env.is_main:
            result.loss_curve = M.plot_loss_curve(
                self.metrics.path,
                self.output_dir / M.LOSS_CURVE_FILE,
                self.stage,
                run_name=f"{self.output_dir.parent.name}/{self.output_dir.name}",
                n_prototypes=self.cfg.heads.dino.n_prototypes,
                min_gap=self.cfg.health.min_gap,
                min_effective_rank=self.cfg.health.min_effective_rank,
            )
        return result

    # ------------------------------------------------------------------------------------------ memory

    def step_within_memory(self, iteration: int, batch: StepBatch, on_metrics: Any = None) -> dict[str, float]:
        """`train_step`; when the device runs out of memory in a one-process run, the next rung of the re-plan
        ladder (smaller micro-batch, then activation checkpointing) and the same step again. The batch planner's
        estimate is a model: this is what keeps `batch_size_per_gpu=auto` from ending a run on its first step.
        The retried step is the same step (same samples, same augmentation and RNG draws); only its micro-batch
        split differs. With several processes an out-of-memory error stops the run as before: the others are
        inside a collective and cannot take the same decision."""
        while True:
            try:
                return self.train_step(iteration, batch)
            except torch.OutOfMemoryError as err:
                if self.env.distributed:
                    raise
                self.optimizer.zero_grad(set_to_none=True)
                first_line = (str(err).strip().splitlines() or [""])[0][:200]
                why = f"out of device memory in iteration {iteration} ({first_line})"
                del err  # its traceback holds the failed step's tensors
                release_freed_memory()
                self.replan(iteration, "device", why, on_metrics=on_metrics, step_done=False)

    def replan(
        self, iteration: int, pressure: Pressure, why: str, *, on_metrics: Any = None, step_done: bool = True
    ) -> bool:
        """Take the next rung of the re-plan ladder after step `iteration` (every rank alike); True when the loader
        must be rebuilt. With nothing left: checkpoint (`step_done`: the step completed, else the last checkpoint
        is the state), then stop with what to change."""
        step = next_plan(self.run_plan, pressure, micro_ok=self.micro_batch_ok)
        if step is None:
            done = step_done and not self.nonfinite_streak
            saved = self.save(iteration) if done else ckpt.latest_checkpoint(self.ckpt_root)
            raise out_of_memory(self.cfg, self.run_plan, why, saved)
        self.memory_replans += 1
        self.set_run_plan(step.after)
        release_freed_memory()  # same iteration on every rank, like the scheduled collections
        # A high-water-mark reset keeps what is reserved at that moment: reset now, after the old plan's cache went
        # back, so the next window judges the new plan rather than counting the old one's peak once more.
        device_peak_bytes(self.env.device)
        event = step.event(iteration, why) | M.batch_fields(
            self.global_batch, self.micro_batch, self.accumulation_steps
        )
        self.metrics.write(event)
        logger.warning(  # every rank: its own log file shows it took the same decision
            "%s: memory pressure after iteration %d (%s): re-planned %s: %s → %s",
            self.stage,
            iteration,
            why,
            step.what,
            step.before.describe(),
            step.after.describe(),
        )
        if on_metrics is not None and self.env.is_main:
            on_metrics(event)
        return step.before.num_workers != step.after.num_workers

    def teacher_embed(self, images: torch.Tensor) -> torch.Tensor:
        """The EMA teacher's CLS features of `images` (the health probe): its backbone, or its pipeline stages."""
        if self.pipeline is not None:
            return self.pipeline.embed(images)
        return self.model.teacher["backbone"](images, is_training=True)["x_norm_clstoken"]

    def micro_batch_ok(self, micro_batch: int) -> bool:
        """Whether a re-plan may use this micro-batch: under pipeline parallelism it must keep the contract."""
        try:
            C.check_parallelism(self.cfg, self.env.world_size, micro_batch)
        except core_config.ConfigError:
            return False
        return True

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
            self.nonfinite_streak = 0
        else:
            self.nonfinite_streak += 1
            logger.warning("iteration %d: non-finite loss or gradient %s; step skipped", iteration, losses)
            if self.nonfinite_streak >= cfg.train.nan_patience:
                raise TrainingDivergedError(
                    f"training diverged: {self.nonfinite_streak} consecutive iterations with non-finite loss or "
                    f"gradients (last: iteration {iteration}, losses {losses}). Lower optim.lr, raise "
                    "optim.warmup_epochs or check the tiles; training resumes from the latest checkpoint in "
                    f"{self.ckpt_root}"
                )
        self.optimizer.zero_grad(set_to_none=True)
        values["skipped_step"] = float(not finite)
        return values

    # ----------------------------------------------------------------------------------------- metrics

    def log_metrics(self, iteration: int, means: dict[str, float]) -> dict[str, Any]:
        """Write one metrics line (collective: every rank calls it at the same iterations) and log it on rank 0."""
        record = M.step_record(
            iteration,
            means,
            self.schedules.at(iteration),
            self.env,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            accumulation_steps=self.accumulation_steps,
        )
        self.metrics.write(record)
        if self.env.is_main:
            logger.info("%s", M.progress_line(record, self.total_iterations))
        return record

    def close(self) -> None:
        logging.getLogger("dinov3_core").removeHandler(self.log_handler)
        self.log_handler.close()
