"""PP stages (pipeline parallelism): the student and the EMA teacher cut into consecutive PP stages, one per
process, in place.

    stage 0:    patch_embed, cls/storage/mask tokens, rope_embed, blocks[0:k1]
    stage i:    rope_embed, blocks[k_i:k_{i+1}]
    last stage: rope_embed, blocks[k_{n-1}:], norm(s), dino_head, ibot_head

A `PPStage` is still a `ModuleDict(backbone, dino_head, ibot_head)` named like the model it was cut from, and its
blocks keep their index (`backbone.blocks.7.*`), so its keys are a subset of the unsplit model's: DCP checkpoints,
the EMA (paired by name) and `convert` see the same names, and a checkpoint resumes on another pipeline layout. The
student and the teacher are cut at the same blocks, so each process's EMA is local.

Stage I/O is tensor-only (crop-major, images along dim 1 at stage 0, which the schedule splits into micro-batches):

    student  stage 0 in:  global crops [S_g, b, 3, H, W], local crops [S_l, b, 3, h, w], masks bool [S_g, b, N]
             between:     (x_global [S_g·m, 1+R+N, D], x_local [S_l·m, 1+R+n, D]), one tensor per crop size
             last out:    (cls_global [S_g·m, D], dino_logits [(S_g+S_l)·m, K], patch_global [S_g·m, N, D])
    features stage 0 in:  images [S, b, 3, H, W] (the teacher's global crops, or probe tiles with S = 1)
             last out:    (cls [S·m, D], patch tokens [S·m, N, D]): the heads run on the merged step outputs

`distributed.gather_pp_state` puts a pipelined module back together (the eval teacher file, the gram teacher refresh).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from dinov3_core.train.parallel_config import ParallelismConfig, split_blocks

FIRST_STAGE_ONLY = ("patch_embed", "cls_token", "storage_tokens", "mask_token")
LAST_STAGE_ONLY = ("norm", "cls_norm", "local_cls_norm")
HEADS = ("dino_head", "ibot_head")


class StageBlocks(nn.ModuleDict):
    """Blocks of one stage keyed by their index in the unsplit backbone (FQN `blocks.<i>` unchanged). Iterates over
    the blocks like the `nn.ModuleList` it replaces, so activation checkpointing, per-block compile and FSDP's
    per-block wrapping work unchanged."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


class PPStage(nn.ModuleDict):
    """One pipeline stage of the student (`features_only=False`: the SSL outputs) or of the teacher (`True`: the
    normed CLS and patch tokens, heads applied outside). The module docstring has the layout and I/O."""

    def __init__(
        self, model: nn.ModuleDict, stage_index: int, num_stages: int, blocks: range, *, features_only: bool = False
    ) -> None:
        super().__init__()
        self.stage_index, self.num_stages, self.features_only = stage_index, num_stages, features_only
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        backbone = model["backbone"]
        backbone.blocks = StageBlocks({str(i): backbone.blocks[i] for i in blocks})  # the others are freed
        for name in (() if self.is_first else FIRST_STAGE_ONLY) + (() if self.is_last else LAST_STAGE_ONLY):
            if hasattr(backbone, name):
                delattr(backbone, name)
        self["backbone"] = backbone
        if self.is_last:
            for name in HEADS:
                self[name] = model[name]
        self.grids: list[tuple[int, int]] = []

    def set_grids(self, grids: Sequence[tuple[int, int]]) -> None:
        """Patch grids (H/p, W/p) of the inputs ([global, local] crops, or [images]): fixed by the config, so they
        are set, not sent (no host sync)."""
        self.grids = list(grids)

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        bb = self["backbone"]
        if self.is_first:
            if self.features_only:
                (images,) = args
                xs, grids = bb.prepare_tokens_with_masks(images.flatten(0, 1), None)
                xs, grids = [xs], [grids]
            else:
                global_crops, local_crops, masks = args
                xg, grid_g = bb.prepare_tokens_with_masks(global_crops.flatten(0, 1), masks.flatten(0, 1))
                xl, grid_l = bb.prepare_tokens_with_masks(local_crops.flatten(0, 1), None)
                xs, grids = [xg, xl], [grid_g, grid_l]
            if grids != self.grids:
                raise ValueError(f"stage grids {self.grids} do not match the inputs' {grids}")
        else:
            xs = list(args)
        xs = bb.run_blocks(xs, self.grids, bb.blocks)
        if not self.is_last:
            return tuple(xs)
        outputs = bb.norm_outputs(xs, [None] * len(xs))
        cls_global, patch_global = outputs[0]["x_norm_clstoken"], outputs[0]["x_norm_patchtokens"]
        if self.features_only:
            return cls_global, patch_global
        dino_logits = self["dino_head"](torch.cat([cls_global, outputs[1]["x_norm_clstoken"]]))
        return cls_global, dino_logits, patch_global


def split_model(model: nn.ModuleDict, p: ParallelismConfig, pp_rank: int, *, features_only: bool = False) -> PPStage:
    """This process's stage, cut from `model` in place (one stage per process: GPipe, 1F1B)."""
    ranges = split_blocks(p, len(model["backbone"].blocks))
    return PPStage(model, pp_rank, p.n_stages, ranges[pp_rank], features_only=features_only)
