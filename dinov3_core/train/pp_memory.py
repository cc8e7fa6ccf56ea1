"""Per-process memory of a pipeline-parallel step (`parallelism.pp_degree` > 1):
`memory.estimate_memory` comes here when pipelining is on (the micro-batches such a step accepts:
`batch_plan`).

world_size = pp_degree × dp processes. Each holds one stage of the student (`parallel_config.split_blocks`; the
first stage also the patch embedding and tokens, the last also the norms and both heads), FSDP-sharded over the
dp processes holding that stage, and the same stage of the EMA teacher, sharded alike (nothing shared with the
student). The micro-batch is cut into n_mb PP micro-batches (`pipeline_microbatches`). For stage s, with
P_s / T_s the parameters / trainable parameters it holds (`ModelShape.*_params`):

* weights 4P_s/dp, plus the stage's unsharded weights (2 bytes each in bf16, else 4) when dp > 1 and n_mb > 1:
  the schedule keeps FSDP from resharding between PP micro-batches; grads 4T_s/dp, or 4T_s when dp > 1 and
  gradients accumulate unsharded (gradient accumulation, or n_mb > 1); AdamW 8T_s/dp; teacher 4P_s/dp.
* activations: the stage's trained blocks × the per-block activations of one image × the images in flight =
  PP micro-batch size × (n_mb with GPipe, min(n_mb, pp_degree − s) with 1F1B). With checkpointing: block inputs
  of the images in flight plus one block of one PP micro-batch recomputed. The last stage adds the heads' rows
  of its PP micro-batches in flight (one with 1F1B).
* step buffers: crops on every process; on the last stage also teacher targets, KoLeo features (over dp) and the
  teacher stages' merged outputs over the whole step (normed CLS and patch tokens, fp32), which the heads read.
* loader and workspace as without pipelining (every process loads the step's images).

The estimate is the largest stage's (every process must fit); `MemoryEstimate.stage` says which.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import ScheduleGPipe, get_schedule_class

from dinov3_core.errors import WsidinoError
from dinov3_core.train import config as C
from dinov3_core.train.memory_terms import (
    GIB,
    SAFETY,
    MemoryEstimate,
    ModelShape,
    block_bytes_per_token,
    crop_bytes,
    head_activation_elements,
    loader_bytes,
    step_buffer_bytes,
    tokens_per_image,
)
from dinov3_core.train.parallel_config import check_pipeline_contract, pipeline_microbatches, split_blocks


def pp_stage_params(shape: ModelShape, blocks: range, *, first: bool, last: bool) -> tuple[int, int]:
    """(parameters, trainable parameters) a stage holds: its blocks, the embedding on the first, the norms and
    heads on the last, and anything outside those parts (none in this backbone) on every stage."""
    if len(shape.block_params) != shape.depth:
        raise WsidinoError(
            "this ModelShape has no per-block parameter counts, which pipeline parallelism needs: build it with "
            "memory.shape_of or memory.model_shape"
        )
    parts = [shape.embed_params, *shape.block_params, shape.last_params]
    other = (shape.student_params - sum(n for n, _ in parts), shape.trainable_params - sum(t for _, t in parts))
    held = [shape.block_params[i] for i in blocks] + [other]
    held += [shape.embed_params] * first + [shape.last_params] * last
    return sum(n for n, _ in held), sum(t for _, t in held)


def images_in_flight(cfg: C.PretrainConfig, micro_batch: int, stage: int) -> float:
    """Images whose activations stage `stage` holds at once."""
    p = cfg.parallelism
    n_mb = pipeline_microbatches(p, micro_batch)
    gpipe = get_schedule_class(p.pp_schedule) is ScheduleGPipe
    in_flight = n_mb if gpipe else min(n_mb, p.pp_degree - stage)  # 1F1B: backward after pp_degree − s forwards
    return in_flight * micro_batch / n_mb


def pp_stage_estimates(
    cfg: C.PretrainConfig,
    shape: ModelShape,
    *,
    micro_batch: int,
    step_batch: int,
    world_size: int,
    device_type: str,
    tile_size: int = 224,
) -> list[MemoryEstimate]:
    """Bytes per process of every pipeline stage, first to last."""
    p = cfg.parallelism
    check_pipeline_contract(p, world_size=world_size, micro_batch=None, depth=shape.depth)
    dp = world_size // p.pp_degree
    bf16 = cfg.train.uses_bf16(device_type)  # the one reading of train.precision
    elem = 2.5 if bf16 else 4.0
    n_mb = pipeline_microbatches(p, micro_batch)
    grads_unsharded = dp > 1 and (step_batch > micro_batch or n_mb > 1)
    tokens = sum(tokens_per_image(cfg, shape))
    block, checkpointed_input = block_bytes_per_token(cfg, shape, bf16=bf16)
    first_trained = shape.depth - shape.trained_depth  # frozen leading blocks save nothing
    ranges = split_blocks(p, shape.depth)
    estimates = []
    for s, blocks in enumerate(ranges):
        first, last = s == 0, s == len(ranges) - 1
        params, trainable = pp_stage_params(shape, blocks, first=first, last=last)
        unsharded = (2 if bf16 else 4) * params if dp > 1 and n_mb > 1 else 0
        images = images_in_flight(cfg, micro_batch, s)
        trained = sum(i >= first_trained for i in blocks)
        if cfg.train.activation_checkpointing:
            recompute = block * micro_batch / n_mb if trained else 0.0
            backbone = tokens * (trained * checkpointed_input * images + recompute)
        else:
            backbone = tokens * trained * block * images
        heads = head_activation_elements(cfg, shape) * elem * images if last else 0.0
        if last:
            tokens_global = 1 + (cfg.crops.global_size // shape.patch_size) ** 2
            teacher_out = 4 * cfg.crops.n_global_crops * step_batch * tokens_global * shape.embed_dim
            buffers = step_buffer_bytes(cfg, shape, step_batch, dp) + teacher_out
        else:
            buffers = crop_bytes(cfg, step_batch)
        estimates.append(
            MemoryEstimate(
                weights=int(4 * params / dp + unsharded),
                grads=int(4 * trainable / (1 if grads_unsharded else dp)),
                optimizer=int(8 * trainable / dp),
                teacher=int(4 * params / dp),  # the teacher's same stage, nothing shared with the student
                activations=int(SAFETY * (backbone + heads)),
                step_buffers=int(buffers),
                loader=int(loader_bytes(cfg, step_batch, tile_size)) if device_type == "cpu" else 0,
                workspace=int(1.5 * GIB) if device_type == "cuda" else int(0.5 * GIB),
                micro_batch=micro_batch,
                step_batch=step_batch,
                stage=s,
            )
        )
    return estimates
