"""Pipeline parallelism (PP) for the student, with `torch.distributed.pipelining` (design: docs/pipeline-parallel.md).

The student `ModuleDict(backbone, dino_head, ibot_head)` is cut in place into this process's `StudentStage`:

    stage 0:    patch_embed, cls/storage/mask tokens, rope_embed, blocks[0:k1]
    stage i:    rope_embed, blocks[k_i:k_{i+1}]
    last stage: rope_embed, blocks[k_{n-1}:], norm(s), dino_head, ibot_head

A stage is still a `ModuleDict` named like the student, and its blocks keep their index (`backbone.blocks.7.*`), so
its keys are a subset of the unsplit student's: DCP checkpoints, eval files and `convert` see the same names, and
a checkpoint resumes on another pipeline layout. The EMA teacher is not split: every process holds it (FSDP-sharded
over its data-parallel peers), and only the last stage runs it, over the whole step, so Sinkhorn-Knopp targets and
the KoLeo neighbour set are computed once per optimizer step exactly as without PP (no per-micro-batch drift).

Stage I/O is tensor-only:
    stage 0 input:     global crops [S_g, b, 3, H, W], local crops [S_l, b, 3, h, w], masks bool [S_g, b, N]
                       (crop-major like `StepBatch`; the schedule splits dim 1 = images into PP micro-batches)
    between stages:    (x_global [S_g·m, 1+R+N, D], x_local [S_l·m, 1+R+n, D]), one tensor per crop size
    last stage output: (cls_global [S_g·m, D], dino_logits [(S_g+S_l)·m, K], patch_global [S_g·m, N, D])
The iBOT head runs in the loss function (the masked-patch count is data-dependent: no stage output may be). The
loss function's `target` is the micro-batch's image indices, which slice the step's masks and teacher targets the
way gradient accumulation does; each micro-batch loss is scaled by 1/(accumulation steps × PP micro-batches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from dinov3_core.data.masking import IBOTMasks
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.parallel_config import ParallelismConfig, pipeline_microbatches, split_blocks
from dinov3_core.train.param_groups import clean_param_name
from dinov3_core.train.ssl_model import SSLMetaArch, TeacherTargets, _local

FIRST_STAGE_ONLY = ("patch_embed", "cls_token", "storage_tokens", "mask_token")
LAST_STAGE_ONLY = ("norm", "cls_norm", "local_cls_norm")
SUBMODULES = ("backbone", "dino_head", "ibot_head")


class StageBlocks(nn.ModuleDict):
    """Blocks of one stage keyed by their index in the unsplit backbone (FQN `blocks.<i>` unchanged). Iterates over
    the blocks like the `nn.ModuleList` it replaces, so activation checkpointing, per-block compile and FSDP's
    per-block wrapping work unchanged."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


class StudentStage(nn.ModuleDict):
    """One pipeline stage of the student (module docstring: layout and I/O)."""

    def __init__(self, student: nn.ModuleDict, stage_index: int, num_stages: int, blocks: range) -> None:
        super().__init__()
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        backbone = student["backbone"]
        backbone.blocks = StageBlocks({str(i): backbone.blocks[i] for i in blocks})  # the others are freed
        for name in () if self.is_first else FIRST_STAGE_ONLY:
            if hasattr(backbone, name):
                delattr(backbone, name)
        for name in () if self.is_last else LAST_STAGE_ONLY:
            if hasattr(backbone, name):
                delattr(backbone, name)
        self["backbone"] = backbone
        if self.is_last:
            self["dino_head"], self["ibot_head"] = student["dino_head"], student["ibot_head"]
        self.grids: list[tuple[int, int]] = []

    def set_grids(self, grids: Sequence[tuple[int, int]]) -> None:
        """Patch grids (H/p, W/p) of the [global, local] crops: fixed by the config, so set once (no host sync)."""
        self.grids = list(grids)

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        bb = self["backbone"]
        if self.is_first:
            global_crops, local_crops, masks = args
            xg, grid_g = bb.prepare_tokens_with_masks(global_crops.flatten(0, 1), masks.flatten(0, 1))
            xl, grid_l = bb.prepare_tokens_with_masks(local_crops.flatten(0, 1), None)
            if [grid_g, grid_l] != self.grids:
                raise ValueError(f"stage grids {self.grids} do not match the crops' {[grid_g, grid_l]}")
            xs = [xg, xl]
        else:
            xs = list(args)
        xs = bb.run_blocks(xs, self.grids, bb.blocks)
        if not self.is_last:
            return tuple(xs)
        out_global, out_local = bb.norm_outputs(xs, [None, None])
        cls_global = out_global["x_norm_clstoken"]
        dino_logits = self["dino_head"](torch.cat([cls_global, out_local["x_norm_clstoken"]]))
        return cls_global, dino_logits, out_global["x_norm_patchtokens"]


def split_student(student: nn.ModuleDict, p: ParallelismConfig, pp_rank: int) -> StudentStage:
    """This process's stage, cut from `student` in place (one stage per process: GPipe, 1F1B)."""
    ranges = split_blocks(p, len(student["backbone"].blocks))
    return StudentStage(student, pp_rank, p.n_stages, ranges[pp_rank])


def stage_owners(names: Sequence[str], p: ParallelismConfig, depth: int) -> dict[str, int]:
    """Student parameter name → the pipeline rank whose stage holds it (every process computes the same)."""
    block_owner = {i: r for r, rng in enumerate(split_blocks(p, depth)) for i in rng}
    owner: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        if parts[0] != "backbone":
            owner[name] = p.pp_degree - 1  # heads
        elif parts[1] == "blocks":
            owner[name] = block_owner[int(parts[2])]
        else:
            owner[name] = 0 if parts[1] in FIRST_STAGE_ONLY else p.pp_degree - 1
    return owner


# ------------------------------------------------------------------------------------------------- the step


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
    # are those of the step's mean loss (distributed-facts §4). A field, so the tests can break it on purpose.
    loss_scale: float = 0.0

    def __post_init__(self) -> None:
        self.loss_scale = self.loss_scale or 1.0 / self.n_microbatches


class Pipeline:
    """This process's part of the pipeline: its `PipelineStage`, the training schedule and a forward-only one (the
    KoLeo neighbour set), and the loss the last stage computes. Rebuilt when the micro-batch changes."""

    def __init__(self, meta: SSLMetaArch, env: DistEnv, p: ParallelismConfig, micro_batch: int) -> None:
        stage = meta.student
        assert isinstance(stage, StudentStage), "split the student first (parallelize)"
        self.meta, self.env, self.stage = meta, env, stage
        self.n_mb = pipeline_microbatches(p, micro_batch)
        self.micro_batch = micro_batch
        self.parts: dict[int, dict[str, Tensor]] = {}  # per-term losses by micro-batch index (last stage)
        self.ctx: StepContext | None = None
        self.pipe_stage = PipelineStage(stage, env.pp_rank, env.pp_size, env.device, group=env.pp_group)
        cls = get_schedule_class(p.pp_schedule)
        assert issubclass(cls, PipelineScheduleSingle), p.pp_schedule  # the config allows no other yet
        chunks = (TensorChunkSpec(1),) * 3  # stage-0 inputs are crop-major: images are dim 1

        def schedule(loss_fn: Callable | None) -> PipelineScheduleSingle:
            # scale_grads=False: the loss is scaled by 1/(accumulation × PP micro-batches); torch's scaling would
            # also divide the gradients earlier accumulation steps left in .grad.
            return cls(self.pipe_stage, n_microbatches=self.n_mb, loss_fn=loss_fn, args_chunk_spec=chunks,
                       scale_grads=False)  # fmt: skip

        self.train_schedule = schedule(self._loss if stage.is_last else _no_loss)
        self.forward_schedule = schedule(None)

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

    def koleo_features(self, global_crops: Tensor, local_crops: Tensor, masks: IBOTMasks, accumulation: int) -> Tensor:
        """The student's CLS features of the whole step [S_g, B, D] (no grad), gathered on the last stage; a
        forward-only pass of the pipeline (empty on other stages)."""
        out: list[Tensor] = []
        with torch.no_grad():
            for chunk in self._chunks(global_crops, local_crops, masks, accumulation):
                result = self.forward_schedule.step(*chunk) if self.stage.is_first else self.forward_schedule.step()
                if self.stage.is_last:  # micro-batch-major [n_mb·S_g·m, D] → [S_g, b, D]
                    cls = result[0].view(self.n_mb, global_crops.shape[0], -1, result[0].shape[-1])
                    out.append(cls.transpose(0, 1).flatten(1, 2))
        return self.meta._maybe_gather(torch.cat(out, dim=1)) if out else global_crops.new_empty(0)

    def run(self, ctx: StepContext, local_crops: Tensor, accumulation: int) -> list[dict[str, Tensor]]:
        """Forward and backward of the whole step: `accumulation` schedule steps of `n_mb` micro-batches each
        (gradients accumulate in .grad). Returns the per-term losses of every micro-batch (last stage; else [])."""
        self.ctx, self.parts = ctx, {}
        batch = ctx.global_crops.shape[1]
        chunks = self._chunks(ctx.global_crops, local_crops, ctx.masks, accumulation)
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

    def _chunks(
        self, global_crops: Tensor, local_crops: Tensor, masks: IBOTMasks, accumulation: int
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """The stage-0 inputs of each accumulation step (crop-major, images along dim 1)."""
        n_global, batch = global_crops.shape[:2]
        grid = masks.masks.view(n_global, batch, -1)
        step = self.micro_batch
        return [
            (global_crops[:, g * step : (g + 1) * step], local_crops[:, g * step : (g + 1) * step],
             grid[:, g * step : (g + 1) * step])
            for g in range(accumulation)
        ]  # fmt: skip


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
    squares = torch.stack([
        torch.stack([g.detach().float().pow(2).sum() for g in grads[n]]).sum() if grads[n]
        else torch.zeros((), device=device)
        for n in SUBMODULES
    ])  # fmt: skip
    if dist.is_initialized():
        dist.all_reduce(squares)
    norms = squares.sqrt()
    for name, norm in zip(SUBMODULES, norms, strict=True):
        if max_norm > 0 and grads[name]:
            torch._foreach_mul_(grads[name], (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return {f"{name}_grad_norm": norm for name, norm in zip(SUBMODULES, norms, strict=True)}


@torch.no_grad()
def update_teacher_pp(meta: SSLMetaArch, momentum: float, env: DistEnv, owner: dict[str, int]) -> None:
    """EMA of the whole teacher from a pipelined student: each process updates the teacher parameters its stage
    holds, then each stage's share is broadcast from its owner to the other stages (same data-parallel shard,
    so local shards line up). Cost: one teacher-size exchange over the pipeline group per step."""
    meta.update_teacher(momentum)
    teacher = {clean_param_name(n): t for n, t in meta.teacher.named_parameters()}
    for src in range(env.pp_size):
        params = [_local(teacher[n]) for n, r in owner.items() if r == src]
        if not params:
            continue
        flat = torch.cat([t.flatten() for t in params])
        dist.broadcast(flat, src=dist.get_global_rank(env.pp_group, src), group=env.pp_group)
        if src != env.pp_rank:
            for t, new in zip(params, torch._utils._unflatten_dense_tensors(flat, params), strict=True):
                t.copy_(new)
