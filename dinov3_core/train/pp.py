"""Pipeline parallelism (PP) for the student and the EMA teacher, with `torch.distributed.pipelining`
(design: docs/pipeline-parallel.md; the stages themselves: `pp_stages`).

`Pipeline` runs one optimizer step through this process's stages:

1. the teacher: a forward-only pass over the whole step batch; the last stage applies the heads to the merged
   outputs and computes the Sinkhorn-Knopp targets once, over the data-parallel group, exactly as without PP
   (no per-micro-batch drift);
2. [KoLeo] a forward-only pass of the student over the whole step: the neighbour set, gathered on the last stage;
3. the student: `accumulation` schedule steps of `n_mb` micro-batches (1F1B or GPipe). The last stage's loss reads
   the micro-batch's slice of the step's targets: the schedule's `target` is the micro-batch's image indices.
   Each micro-batch loss is scaled by 1/(accumulation steps × PP micro-batches).

After the step, `clip_gradients_pp` clips with norms over every stage and shard; the EMA is local (the teacher is
cut at the same blocks). `embed` runs images through the teacher's stages for the health probe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from dinov3_core.data.masking import IBOTMasks
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.parallel_config import ParallelismConfig, pipeline_microbatches
from dinov3_core.train.pp_stages import PPStage
from dinov3_core.train.ssl_model import SSLMetaArch, TeacherTargets, _local

SUBMODULES = ("backbone", "dino_head", "ibot_head")


@dataclass
class StepContext:
    """What the last stage's loss needs for one optimizer step, computed over the whole step batch."""

    global_crops: Tensor  # [S_g, B, 3, H, W] (the gram term's teacher reads them)
    masks: IBOTMasks  # the step's masks (crop-major)
    targets: TeacherTargets  # Sinkhorn targets over the whole step
    n_microbatches: int  # accumulation steps × PP micro-batches
    koleo_features: Tensor | None
    koleo_base: int
    # Each micro-batch loss × this before backward: 1 / (accumulation steps × PP micro-batches), so the gradients
    # are those of the step's mean loss (docs/reference/distributed.md#loss-scaling). A field, so the tests can break
    # it on purpose.
    loss_scale: float = 0.0

    def __post_init__(self) -> None:
        self.loss_scale = self.loss_scale or 1.0 / self.n_microbatches


class Pipeline:
    """This process's part of the pipelines: the student's `PipelineStage` with its training schedule and a
    forward-only one (the KoLeo neighbour set), the teacher's with a forward-only schedule over the whole step, and
    the loss the last stage computes. Rebuilt when the micro-batch changes (memory re-plans)."""

    def __init__(
        self,
        meta: SSLMetaArch,
        env: DistEnv,
        p: ParallelismConfig,
        *,
        micro_batch: int,
        accumulation: int,
        grids: list[tuple[int, int]],
    ) -> None:
        """`grids`: the patch grids of the [global, local] crops (the teacher sees the global ones)."""
        stage, teacher = meta.student, meta.teacher
        assert isinstance(stage, PPStage) and isinstance(teacher, PPStage), "split the model first (parallelize)"
        self.meta, self.env, self.stage = meta, env, stage
        self.teacher_grids = grids[:1]
        stage.set_grids(grids)
        teacher.set_grids(self.teacher_grids)
        self.patch_size, self.embed_dim = teacher["backbone"].patch_size, teacher["backbone"].embed_dim
        self.n_mb = pipeline_microbatches(p, micro_batch)
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.parts: dict[int, dict[str, Tensor]] = {}  # per-term losses by micro-batch index (last stage)
        self.ctx: StepContext | None = None
        self.pipe_stage = PipelineStage(stage, env.pp_rank, env.pp_size, env.device, group=env.pp_group)
        cls = get_schedule_class(p.pp_schedule)
        assert issubclass(cls, PipelineScheduleSingle), p.pp_schedule  # the config allows no other yet
        chunks = (TensorChunkSpec(1),) * 3  # stage-0 inputs are crop-major: images are dim 1

        def schedule(loss_fn: Callable | None) -> PipelineScheduleSingle:
            # scale_grads=False: the loss is scaled by 1/(accumulation × PP micro-batches); torch's scaling would
            # also divide the gradients earlier accumulation steps left in .grad.
            return cls(
                self.pipe_stage, n_microbatches=self.n_mb, loss_fn=loss_fn, args_chunk_spec=chunks, scale_grads=False
            )

        self.train_schedule = schedule(self._loss if stage.is_last else _no_loss)
        self.forward_schedule = schedule(None)
        # The teacher: the whole step in micro-batches of the student's size, forward only (GPipe = all forwards).
        self.teacher = teacher
        teacher_stage = PipelineStage(teacher, env.pp_rank, env.pp_size, env.device, group=env.pp_group)
        self.teacher_schedule = ScheduleGPipe(
            teacher_stage, n_microbatches=accumulation * self.n_mb, args_chunk_spec=(TensorChunkSpec(1),)
        )
        self.probe_schedules: dict[tuple[int, ...], ScheduleGPipe] = {}  # per probe input shape

    def describe(self) -> str:
        s = self.stage
        blocks = list(s["backbone"].blocks.keys())
        return (
            f"; pipeline stage {s.stage_index + 1}/{s.num_stages} (blocks {blocks[0]}–{blocks[-1]}"
            f"{', patch embedding' if s.is_first else ''}{', heads' if s.is_last else ''}), "
            f"{self.n_mb} pipeline micro-batches of {self.micro_batch // self.n_mb}"
        )

    # The schedule calls this once per micro-batch on the last stage. Careful: on a schedule's first step torch's
    # shape inference calls it once more, with garbage inputs on non-first stages; so nothing here accumulates
    # (per-term losses overwrite `parts[m]`) and nothing raises on non-finite values.
    def _loss(self, output: tuple[Tensor, ...], image_idx: Tensor) -> Tensor:
        c = self.ctx
        assert c is not None
        cls_global, dino_logits, patch_global = output
        b = image_idx.shape[0]
        m = int(image_idx[0]) // b  # image indices live on the host: no device sync
        micro_masks, positions = c.masks.microbatch(m, c.n_microbatches)
        micro = slice(m * b, (m + 1) * b)
        loss, parts = self.meta.loss_from_outputs(
            c.global_crops[:, micro],
            cls_global,
            dino_logits,
            patch_global,
            micro_masks,
            TeacherTargets(dino=c.targets.dino[:, micro], ibot=c.targets.ibot[positions]),
            koleo_features=c.koleo_features,
            koleo_offset=c.koleo_base + m * b,
        )
        self.parts[m] = parts
        return loss * c.loss_scale

    def koleo_features(self, global_crops: Tensor, local_crops: Tensor, masks: IBOTMasks) -> Tensor:
        """The student's CLS features of the whole step [S_g, B, D] (no grad), gathered on the last stage; a
        forward-only pass of the pipeline (empty on other stages)."""
        out: list[Tensor] = []
        with torch.no_grad():
            for chunk in self._chunks(global_crops, local_crops, masks):
                result = self.forward_schedule.step(*chunk) if self.stage.is_first else self.forward_schedule.step()
                if self.stage.is_last:  # micro-batch-major [n_mb·S_g·m, D] → [S_g, b, D]
                    cls = result[0].view(self.n_mb, global_crops.shape[0], -1, result[0].shape[-1])
                    out.append(cls.transpose(0, 1).flatten(1, 2))
        return self.meta._maybe_gather(torch.cat(out, dim=1)) if out else global_crops.new_empty(0)

    @torch.no_grad()
    def teacher_targets(
        self, global_crops: Tensor, masks: IBOTMasks, teacher_temp: float | Tensor
    ) -> TeacherTargets | None:
        """The step's teacher targets on the last stage (None elsewhere): the teacher's stages over all of the
        step's global crops [S_g, B, 3, H, W], then heads and Sinkhorn once on the merged outputs."""
        n_global, batch = global_crops.shape[:2]
        out = self.teacher_schedule.step(global_crops) if self.stage.is_first else self.teacher_schedule.step()
        if not self.stage.is_last:
            return None
        n = self.accumulation * self.n_mb  # merged micro-batch-major → crop-major, as one forward would give
        cls = out[0].view(n, n_global, -1, out[0].shape[-1]).transpose(0, 1).reshape(n_global, batch, -1)
        patch = out[1].view(n, n_global, -1, *out[1].shape[1:]).transpose(0, 1).flatten(0, 2)
        return self.meta.targets_from_features(cls, patch, masks, teacher_temp=teacher_temp)

    @torch.no_grad()
    def embed(self, images: Tensor) -> Tensor:
        """Teacher CLS features of `images` [b, 3, H, W] for the health probe: [b, D] on the last stage, zeros
        elsewhere (the probe takes them from the last stage). Every stage calls it with the same shapes."""
        key = tuple(images.shape)
        self.teacher.set_grids([(images.shape[-2] // self.patch_size, images.shape[-1] // self.patch_size)])
        if key not in self.probe_schedules:  # a stage per input shape: the pipeline infers shapes once
            stage = PipelineStage(
                self.teacher, self.env.pp_rank, self.env.pp_size, self.env.device, group=self.env.pp_group
            )
            self.probe_schedules[key] = ScheduleGPipe(stage, n_microbatches=1, args_chunk_spec=(TensorChunkSpec(1),))
        schedule = self.probe_schedules[key]
        out = schedule.step(images.unsqueeze(0)) if self.stage.is_first else schedule.step()
        self.teacher.set_grids(self.teacher_grids)
        if self.stage.is_last:
            return out[0]
        return images.new_zeros(images.shape[0], self.embed_dim)

    def run(self, ctx: StepContext, local_crops: Tensor) -> list[dict[str, Tensor]]:
        """Forward and backward of the whole step: `accumulation` schedule steps of `n_mb` micro-batches each
        (gradients accumulate in .grad). Returns the per-term losses of every micro-batch (last stage; else [])."""
        self.ctx, self.parts = ctx, {}
        batch = ctx.global_crops.shape[1]
        chunks = self._chunks(ctx.global_crops, local_crops, ctx.masks)
        for g, chunk in enumerate(chunks):
            if self.stage.is_first:
                self.train_schedule.step(*chunk)
            elif self.stage.is_last:
                images = torch.arange(batch)[g * self.micro_batch : (g + 1) * self.micro_batch]
                self.train_schedule.step(target=images)
            else:
                self.train_schedule.step()
        self.ctx = None
        return [self.parts[m] for m in sorted(self.parts)]

    def _chunks(self, global_crops: Tensor, local_crops: Tensor, masks: IBOTMasks) -> list[tuple[Tensor, ...]]:
        """The stage-0 inputs of each accumulation step (crop-major, images along dim 1)."""
        n_global, batch = global_crops.shape[:2]
        grid = masks.masks.view(n_global, batch, -1)
        step = self.micro_batch
        return [
            (
                global_crops[:, g * step : (g + 1) * step],
                local_crops[:, g * step : (g + 1) * step],
                grid[:, g * step : (g + 1) * step],
            )
            for g in range(self.accumulation)
        ]


def _no_loss(output: Tensor, target: Tensor) -> Tensor:
    """Non-last stages: a schedule runs backward only with a loss function, which only the last stage calls."""
    raise AssertionError("only the last pipeline stage computes the loss")


# ------------------------------------------------------------------------------------------- after backward


def clip_gradients_pp(stage: nn.ModuleDict, max_norm: float) -> dict[str, Tensor]:
    """Per-submodule clipping like `optim.clip_gradients`, with norms over every stage and shard: each process's
    squared norms of its local gradient shards (zero for submodules it lacks) are summed over all processes
    (stages hold disjoint blocks, FSDP disjoint shards), then every process scales its own gradients."""
    grads: dict[str, list[Tensor]] = {n: [] for n in SUBMODULES}
    for name, param in stage.named_parameters():
        if param.grad is not None:
            grads[name.split(".", 1)[0]].append(_local(param.grad))
    device = next(stage.parameters()).device
    squares = torch.stack(
        [
            torch.stack([g.detach().float().pow(2).sum() for g in grads[n]]).sum()
            if grads[n]
            else torch.zeros((), device=device)
            for n in SUBMODULES
        ]
    )
    if dist.is_initialized():
        dist.all_reduce(squares)
    norms = squares.sqrt()
    for name, norm in zip(SUBMODULES, norms, strict=True):
        if max_norm > 0 and grads[name]:
            torch._foreach_mul_(grads[name], (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return {f"{name}_grad_norm": norm for name, norm in zip(SUBMODULES, norms, strict=True)}
