"""Per-rank memory estimate of a pretraining step (`estimate_memory`) and the memory budget it must fit;
`batch_plan.plan_batch` picks the micro-batch / accumulation split from them.

The model (all in bytes, per rank; P = parameter counts, W = ranks sharing the weights under FSDP):

* weights, grads, AdamW: student fp32 params 4P/W, grads 4T/W (4T when accumulating under FSDP: unsharded
  gradients are kept between micro-batches), AdamW 8T/W; EMA teacher 4P/W, or 4T in one process (it shares the
  student's frozen weights there). T = trainable parameters: all of P by default, fewer with `student.lora`
  (adapters + heads) or `student.freeze_blocks` (frozen ones get neither gradients nor optimizer state).
* activations of one micro-batch image: Σ_crops tokens × depth' × what a block saves per token. On CPU (fp32):
  4 bytes × (17.3·D + 125·heads), measured with saved-tensor hooks (19.3·D per token-block for ViT-S); with
  activation checkpointing each block's input (4·D) plus one block recomputed. On CUDA in bf16, fit to measured
  peaks of ViT-L/B/S on an H100 and an H200: 39.7·D·(1 − drop_path_rate) bytes per token-block compiled (flash
  attention keeps no per-head matrix), 1.18× that eager; 3·D with checkpointing plus one block recomputed.
  Heads: per DINO row 4·hidden + 3·bottleneck + 2·K elements, DINO rows = S_g + S_l per image, iBOT rows =
  expected masked patches; 4 bytes in fp32, 2.5 on average in bf16.
  depth' = the blocks backward reaches: depth − K when blocks < K and everything before them are frozen
  (freeze_blocks with freeze_patch_embed, or LoRA from block K), else depth. LoRA's own r-wide activations are
  left out (r ≪ D).
* step buffers (whole rank step, whatever the micro-batch): crops, uint8 tiles, teacher logits and Sinkhorn
  targets (fp32, ×2 for the transient), KoLeo features.
* loader workers (host budget only): a Python+torch process each plus its prefetched step batches.
* workspace: CUDA context and allocator slack (1.5 GiB) or the process baseline on CPU (0.5 GiB).

Pipeline parallelism (`parallelism.pp_degree` > 1, `pp_memory`): each process holds one stage of the student
(its blocks; the first also the embedding, the last also the norms and heads) FSDP-sharded over the dp =
world_size / pp_degree processes holding it, and a whole teacher sharded over dp. Activations are the stage's
share of the blocks for the images in flight (all PP micro-batches with GPipe, at most pp_degree − stage with
1F1B), heads and teacher targets only on the last stage; the estimate is that of the stage needing the most
(`MemoryEstimate.stage`). `batch_plan.plan_batch` then splits global / dp and tries only micro-batches the
pipeline contract accepts. With pp_degree 1 none of this applies.

The estimate is deliberately simple and errs high; `measure_activation_bytes` measures the real thing for
calibration (tests compare the two).
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch
from torch import nn

from dinov3_core.models import DINOHead, DinoVisionTransformer, backbone_kwargs
from dinov3_core.models.adaptation import EMBEDDINGS, apply_adaptation
from dinov3_core.train import config as C
from dinov3_core.train import model_config as MC
from dinov3_core.train.memory_terms import (
    GIB,
    SAFETY,
    MemoryEstimate,
    ModelShape,
    activation_bytes_per_image,
    loader_bytes,
    step_buffer_bytes,
)
from dinov3_core.train.pp_memory import pp_stage_estimates

# Top-level backbone parts a pipeline's first / last stage holds besides its blocks (`pp_stages.PPStage`).
FIRST_STAGE_PARTS = ("patch_embed", "cls_token", "storage_tokens", "mask_token")
LAST_STAGE_PARTS = ("norm", "cls_norm", "local_cls_norm")
HEADS = ("dino_head", "ibot_head")


def part_params(student: nn.Module, depth: int) -> dict[str, tuple[int, int]]:
    """(params, trainable) per part of the student: "embed", "block.<i>", "last", "other" (by parameter name)."""
    parts = {"embed": (0, 0), **{f"block.{i}": (0, 0) for i in range(depth)}, "last": (0, 0), "other": (0, 0)}
    for name, p in student.named_parameters():
        top, sub, *rest = (*name.split("."), "", "")
        if top in HEADS or (top == "backbone" and sub in LAST_STAGE_PARTS):
            key = "last"
        elif top == "backbone" and sub in FIRST_STAGE_PARTS:
            key = "embed"
        elif top == "backbone" and sub == "blocks":
            key = f"block.{rest[0]}"
        else:
            key = "other"
        n, t = parts[key]
        parts[key] = (n + p.numel(), t + p.numel() * p.requires_grad)
    return parts


def shape_of(student: nn.ModuleDict, cfg: C.PretrainConfig) -> ModelShape:
    """Sizes of a built student (`ModuleDict(backbone, dino_head, ibot_head)`); the teacher is its copy."""
    vit = student["backbone"]
    params = sum(p.numel() for p in student.parameters())
    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    parts = part_params(student, len(vit.blocks))
    return ModelShape(
        embed_dim=vit.embed_dim,
        depth=len(vit.blocks),
        num_heads=vit.num_heads,
        patch_size=vit.patch_size,
        n_storage_tokens=vit.n_storage_tokens,
        student_params=params,
        teacher_params=params,
        trainable_params=trainable,
        trained_depth=len(vit.blocks) - frozen_prefix(vit),
        dino_prototypes=cfg.heads.dino.n_prototypes,
        ibot_prototypes=cfg.heads.ibot.n_prototypes,
        head_hidden=max(cfg.heads.dino.hidden_dim, cfg.heads.ibot.hidden_dim),
        head_bottleneck=max(cfg.heads.dino.bottleneck_dim, cfg.heads.ibot.bottleneck_dim),
        embed_params=parts["embed"],
        block_params=tuple(parts[f"block.{i}"] for i in range(len(vit.blocks))),
        last_params=parts["last"],
    )


def frozen_prefix(vit: nn.Module) -> int:
    """Leading blocks backward never enters: K when blocks < K and everything before them (patch embedding,
    tokens) need no gradient, else 0."""
    if any(p.requires_grad for name, p in vit.named_parameters() if name.split(".")[0] in EMBEDDINGS):
        return 0
    for i, block in enumerate(vit.blocks):
        if any(p.requires_grad for p in block.parameters()):
            return i
    return len(vit.blocks)


def model_shape(cfg: C.PretrainConfig, backbone: dict | None = None) -> ModelShape:
    """Sizes of the configured model, built on the meta device (no memory), with its `student.freeze_blocks` /
    `student.lora` applied (peft injects adapters on the meta device too), so the trainable count is exact.
    `backbone`: constructor kwargs when already known (a warm start reads them from the file)."""
    kwargs = backbone if backbone is not None else backbone_kwargs(cfg.student.arch, **MC.backbone_overrides(cfg))
    with torch.device("meta"):
        vit = DinoVisionTransformer(**kwargs)
        student = nn.ModuleDict(
            {
                "backbone": vit,
                "dino_head": DINOHead(vit.embed_dim, **MC.head_kwargs(cfg.heads.dino)),
                "ibot_head": DINOHead(vit.embed_dim, **MC.head_kwargs(cfg.heads.ibot)),
            }
        )
        s = cfg.student
        apply_adaptation(vit, freeze_blocks=s.freeze_blocks, freeze_patch_embed=s.freeze_patch_embed, lora=s.lora)
    return shape_of(student, cfg)


def estimate_memory(
    cfg: C.PretrainConfig,
    shape: ModelShape,
    *,
    micro_batch: int,
    step_batch: int,
    world_size: int,
    device_type: str,
    tile_size: int = 224,
) -> MemoryEstimate:
    """Bytes per process; with pipeline parallelism those of its worst stage (`pp_memory`)."""
    if cfg.parallelism.enabled:
        stages = pp_stage_estimates(
            cfg,
            shape,
            micro_batch=micro_batch,
            step_batch=step_batch,
            world_size=world_size,
            device_type=device_type,
            tile_size=tile_size,
        )
        return max(stages, key=lambda e: e.total)  # every process must fit: the stage needing the most
    bf16 = cfg.train.uses_bf16(device_type)
    shard = world_size  # FSDP shards over every rank (one process: world_size 1)
    accumulating = step_batch > micro_batch
    p_s, p_t, p_train = shape.student_params, shape.teacher_params, shape.trainable_params
    activations = micro_batch * activation_bytes_per_image(
        cfg, shape, bf16=bf16, checkpointing=cfg.train.activation_checkpointing
    )
    return MemoryEstimate(
        weights=int(4 * p_s / shard),
        grads=int(4 * p_train / (1 if accumulating and world_size > 1 else shard)),
        optimizer=int(8 * p_train / shard),
        teacher=int(4 * (p_train if world_size == 1 else p_t) / shard),  # one process: frozen weights shared
        activations=int(SAFETY * activations),
        step_buffers=int(step_buffer_bytes(cfg, shape, step_batch, world_size)),
        loader=int(loader_bytes(cfg, step_batch, tile_size)) if device_type == "cpu" else 0,
        workspace=int(1.5 * GIB) if device_type == "cuda" else int(0.5 * GIB),
        micro_batch=micro_batch,
        step_batch=step_batch,
    )


def memory_budget_bytes(cfg: C.PretrainConfig, device: torch.device, local_world_size: int) -> int:
    """`train.memory_budget_gb`, else 90 % of the GPU's memory, else a share of host RAM per local rank."""
    if cfg.train.memory_budget_gb is not None:
        return int(cfg.train.memory_budget_gb * GIB)
    if device.type == "cuda":
        return int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    return int(psutil.virtual_memory().total * cfg.train.host_memory_fraction / local_world_size)


def measure_activation_bytes(module: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct tensors autograd saves during `forward()` (parameters and buffers excluded)."""
    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())
