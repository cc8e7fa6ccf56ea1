"""PROTOTYPE: pipeline parallelism (PP) for the student backbone, with `torch.distributed.pipelining`.

Status: prototype for issue 14 (see docs/pipeline-parallel.md). Parity-tested on 2 gloo ranks
(tests/dist_scripts/pp_student.py); not yet wired into `train/loop.py` or `train/distributed.parallelize`.

The student `ModuleDict(backbone, dino_head, ibot_head)` is cut into `num_stages` `StudentStage` modules:

    stage 0:    patch_embed, cls/storage/mask tokens, rope_embed, blocks[0:k1]
    stage i:    rope_embed, blocks[k_i:k_{i+1}]
    last stage: rope_embed, blocks[k_{n-1}:], norm(s), dino_head, ibot_head

Every stage is an `nn.Module` whose children are named like the student's (`backbone`, `dino_head`, `ibot_head`)
and whose blocks keep their global index (`backbone.blocks.7.*`), so a stage's `state_dict` keys are a subset of
the unsplit student's: DCP, eval files and convert see the same FQNs. `rope_embed.periods` (a constant buffer) is
on every stage.

Stage I/O is tensor-only:
    stage 0 input:     global crops [S_g, B, 3, H, W], local crops [S_l, B, 3, h, w], masks bool [S_g, B, N]
                       (crop-major like `StepBatch`; the schedule splits dim 1 = images into micro-batches)
    between stages:    (x_global [S_g·b, 1+R+N, D], x_local [S_l·b, 1+R+n, D])  — one tensor per crop size
    last stage output: (cls_global [S_g·b, D], dino_logits [(S_g+S_l)·b, K], patch_global [S_g·b, N, D])
Patch grids (for RoPE) are static per step and set on every stage with `set_grids` (all ranks know the crop sizes).
The iBOT head runs in the loss function on the last stage (masked-patch selection has a data-dependent size,
which must not be a stage output): the loss function gets the micro-batch's image indices as its `target` and
slices the step's masks and precomputed teacher targets with them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from dinov3_core.data.masking import IBOTMasks
from dinov3_core.train.ssl_model import SSLMetaArch, TeacherTargets

SINGLE_STAGE_SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


class PPContractError(ValueError):
    """A pipeline-parallel setting that cannot work (checked before any process-group work: exit code 2)."""


def check_pp_contract(
    *, local_batch: int, microbatch_size: int, pp_degree: int, schedule: str, depth: int, stages_per_rank: int = 1
) -> int:
    """The micro-batch contract of distributed-facts §3; returns the number of PP micro-batches."""
    if pp_degree < 1:
        raise PPContractError(f"parallelism.pp_degree must be >= 1, got {pp_degree}")
    if microbatch_size < 1 or local_batch % microbatch_size:
        raise PPContractError(
            f"parallelism.pp_microbatch_size={microbatch_size} must divide the per-rank step batch {local_batch}"
        )
    n_mb = local_batch // microbatch_size
    try:
        cls = get_schedule_class(schedule)
    except ValueError as err:
        raise PPContractError(f"parallelism.pp_schedule: {err}") from None
    n_stages = pp_degree * stages_per_rank
    if issubclass(cls, PipelineScheduleSingle) and stages_per_rank != 1:
        raise PPContractError(f"{schedule} runs one stage per rank")
    if cls is not ScheduleGPipe and n_mb < n_stages:
        raise PPContractError(
            f"{schedule}: {n_mb} micro-batches (batch {local_batch} / pp_microbatch_size {microbatch_size}) "
            f"< {n_stages} stages"
        )
    if depth < n_stages:
        raise PPContractError(f"{n_stages} stages but only {depth} blocks")
    return n_mb


def split_blocks(depth: int, n_stages: int) -> list[range]:
    """Contiguous block ranges per stage, earlier stages one block longer when `depth` does not divide.

    TODO(issue 14): weight the first stage (patch embed) and the last (norm + two heads with K prototypes,
    Sinkhorn-free but 65,536-way logits) like torchtitan's `first/last_stage_less_layers`.
    """
    base, extra = divmod(depth, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


class StageBlocks(nn.ModuleDict):
    """Blocks of one stage, keyed by their index in the unsplit backbone (FQN `blocks.<i>` unchanged).

    Iterates over the blocks (like the `nn.ModuleList` it replaces), so helpers that do `for block in
    model.blocks` (activation checkpointing, per-block compile, `fully_shard` per block) work unchanged."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


class StudentStage(nn.Module):
    """One pipeline stage of the student (see the module docstring for layout and I/O)."""

    def __init__(self, student: nn.ModuleDict, stage_index: int, num_stages: int, blocks: range) -> None:
        super().__init__()
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        backbone = copy.deepcopy(student["backbone"])  # TODO: build on meta and materialise only this stage
        backbone.blocks = StageBlocks({str(i): backbone.blocks[i] for i in blocks})
        if not self.is_first:
            del backbone.patch_embed
            for name in ("cls_token", "storage_tokens", "mask_token"):
                if hasattr(backbone, name):
                    delattr(backbone, name)
        if not self.is_last:
            for name in ("norm", "cls_norm", "local_cls_norm"):
                delattr(backbone, name)
        self.backbone = backbone
        if self.is_last:
            self.dino_head = copy.deepcopy(student["dino_head"])
            self.ibot_head = copy.deepcopy(student["ibot_head"])
        self.grids: list[tuple[int, int]] = []

    def set_grids(self, grids: Sequence[tuple[int, int]]) -> None:
        """Patch grids (H/p, W/p) of [global, local] crops for this step (static: the same for every micro-batch)."""
        self.grids = list(grids)

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        bb = self.backbone
        if self.is_first:
            global_crops, local_crops, masks = args
            xg, grid_g = bb.prepare_tokens_with_masks(global_crops.flatten(0, 1), masks.flatten(0, 1))
            xl, grid_l = bb.prepare_tokens_with_masks(local_crops.flatten(0, 1), None)
            if [grid_g, grid_l] != self.grids:
                raise ValueError(f"stage grids {self.grids} do not match the crops' {[grid_g, grid_l]}: set_grids")
            xs = [xg, xl]
        else:
            xs = list(args)
        xs = bb.run_blocks(xs, self.grids, bb.blocks)
        if not self.is_last:
            return tuple(xs)
        out_global, out_local = bb.norm_outputs(xs, [None, None])
        cls_global = out_global["x_norm_clstoken"]
        dino_logits = self.dino_head(torch.cat([cls_global, out_local["x_norm_clstoken"]]))
        return cls_global, dino_logits, out_global["x_norm_patchtokens"]


def build_stage(student: nn.ModuleDict, pp_rank: int, pp_degree: int) -> StudentStage:
    """This rank's stage (one stage per rank: GPipe / 1F1B). TODO: looped/V schedules (several stages per rank)."""
    ranges = split_blocks(len(student["backbone"].blocks), pp_degree)
    return StudentStage(student, pp_rank, pp_degree, ranges[pp_rank])


@dataclass
class StepContext:
    """What the last stage's loss needs for one optimizer step, precomputed over the whole step batch."""

    masks: IBOTMasks  # the rank's step masks (crop-major)
    targets: TeacherTargets  # Sinkhorn targets over the whole step (teacher run once, not per micro-batch)
    n_microbatches: int
    loss_scale: float  # 1 / (accumulation steps × PP micro-batches)
    koleo_features: Tensor | None = None  # the step's KoLeo neighbour set [S_g, B, D]
    koleo_base: int = 0


def make_loss_fn(
    meta: SSLMetaArch, stage: StudentStage, ctx: Callable[[], StepContext], parts_out: dict[int, dict[str, Tensor]]
) -> Callable[[tuple[Tensor, ...], Tensor], Tensor]:
    """The schedule's `loss_fn(output, target)` for the last stage.

    `target` is the micro-batch's slice of `arange(B)` (image indices): it tells which micro-batch this is, so the
    step's masks and teacher targets can be sliced exactly like `Trainer.train_step` slices them for accumulation.
    Returns the micro-batch loss × `loss_scale` (schedule built with `scale_grads=False`).

    Careful: on a schedule's first step, torch's dynamic shape inference calls this once more, on micro-batch 0's
    target but with stage inputs materialised by `torch.empty` (garbage, possibly NaN) on non-first stages. So the
    per-term losses go into `parts_out[micro-batch index]` (overwritten by the real call that follows), and nothing
    here may raise on non-finite values.
    """

    def loss_fn(output: tuple[Tensor, ...], image_idx: Tensor) -> Tensor:
        c = ctx()
        cls_global, dino_logits, patch_global = output
        n_global = c.masks.n_global_crops
        b = image_idx.shape[0]
        m = int(image_idx[0]) // b  # host tensor (the schedule splits arange(B) on the host): no device sync
        micro_masks, positions = c.masks.microbatch(m, c.n_microbatches)
        micro = slice(m * b, (m + 1) * b)
        micro_targets = TeacherTargets(dino=c.targets.dino[:, micro], ibot=c.targets.ibot[positions])
        n_local = dino_logits.shape[0] // b - n_global
        dino_global, dino_local = dino_logits.split([n_global * b, n_local * b])
        masked = patch_global.flatten(0, 1)[micro_masks.mask_indices]
        ibot_logits = stage.ibot_head(masked)
        loss, parts = meta.loss_from_logits(
            cls_global,
            dino_global,
            dino_local,
            ibot_logits,
            micro_masks,
            micro_targets,
            n_global=n_global,
            n_local=n_local,
            koleo_features=c.koleo_features,
            koleo_offset=c.koleo_base + m * b,
        )
        parts_out[m] = parts
        return loss * c.loss_scale

    return loss_fn


def build_schedule(
    pipeline_stage: PipelineStage, name: str, n_microbatches: int, loss_fn: Callable | None
) -> PipelineScheduleSingle:
    """A single-stage schedule splitting every stage-0 input along dim 1 (images of the crop-major stacks)."""
    cls = SINGLE_STAGE_SCHEDULES[name]
    return cls(
        pipeline_stage,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        args_chunk_spec=(TensorChunkSpec(1), TensorChunkSpec(1), TensorChunkSpec(1)),
        scale_grads=False,  # the loss is scaled by 1/(GA × n_mb); scale_grads would also divide earlier GA grads
    )


# ------------------------------------------------------------------------------------ after backward


def submodule_of(name: str) -> str:
    return name.split(".", 1)[0]


def clip_gradients_pp(
    stage: nn.Module,
    max_norm: float,
    group: dist.ProcessGroup | None,
    names: Sequence[str] = ("backbone", "dino_head", "ibot_head"),
) -> dict[str, Tensor]:
    """Per-submodule clipping like `optim.clip_gradients`, with norms over all stages: each rank's squared norms
    (zeros for submodules it lacks) are summed over the PP group, then every rank scales its own gradients.

    TODO: under PP × FSDP the local squared norm of a sharded grad is `grad.to_local()`'s, summed over the whole
    (pp, dp) mesh instead of the PP group alone.
    """
    grads: dict[str, list[Tensor]] = {n: [] for n in names}
    for pname, p in stage.named_parameters():
        if p.grad is not None:
            grads[submodule_of(pname)].append(p.grad)
    sq = torch.stack(
        [
            torch.stack([g.detach().float().pow(2).sum() for g in grads[n]]).sum() if grads[n] else torch.zeros(())
            for n in names
        ]
    )
    if group is not None:
        dist.all_reduce(sq, group=group)
    norms = sq.sqrt()
    out = {}
    for n, norm in zip(names, norms, strict=True):
        if max_norm > 0 and grads[n]:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads[n], coef)
        out[f"{n}_grad_norm"] = norm
    return out


@torch.no_grad()
def update_teacher_pp(
    teacher: nn.ModuleDict,
    stage: nn.Module,
    momentum: float,
    group: dist.ProcessGroup | None,
    owner: dict[str, int],
) -> None:
    """EMA of a REPLICATED teacher (full copy on every PP rank) from a pipelined student.

    Each rank updates the teacher parameters its stage owns, then each is broadcast from its owner over the PP group
    (one broadcast per stage, flattened). Cost: one teacher-size exchange per step over the PP group.
    `owner`: FQN → PP rank (global rank within `group`).
    """
    teacher_params = dict(teacher.named_parameters())
    student_params = dict(stage.named_parameters())
    mine_t = [teacher_params[n] for n in student_params if student_params[n].requires_grad]
    mine_s = [p for p in student_params.values() if p.requires_grad]
    torch._foreach_mul_(mine_t, momentum)
    torch._foreach_add_(mine_t, mine_s, alpha=1.0 - momentum)
    if group is None:
        return
    ranks = sorted(set(owner.values()))
    for src in ranks:
        params = [teacher_params[n] for n, r in owner.items() if r == src]
        flat = torch.cat([p.flatten() for p in params])
        dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
        for p, new in zip(params, torch._utils._unflatten_dense_tensors(flat, params), strict=True):
            p.copy_(new)


def stage_owners(student: nn.ModuleDict, pp_degree: int) -> dict[str, int]:
    """FQN of every trainable student parameter → the PP rank whose stage holds it (every rank computes the same)."""
    ranges = split_blocks(len(student["backbone"].blocks), pp_degree)
    block_owner = {i: r for r, rng in enumerate(ranges) for i in rng}
    owner: dict[str, int] = {}
    for name, p in student.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        if parts[0] != "backbone":
            owner[name] = pp_degree - 1  # heads
        elif parts[1] == "blocks":
            owner[name] = block_owner[int(parts[2])]
        elif parts[1] in ("patch_embed", "cls_token", "storage_tokens", "mask_token"):
            owner[name] = 0
        else:  # norm, cls_norm, local_cls_norm
            owner[name] = pp_degree - 1
    return owner
