"""The forward and backward of one optimizer step, with and without a pipeline.

    teacher over the whole step (Sinkhorn once) → [KoLeo neighbour set over the whole step] → the student:
    micro-batch by micro-batch (loss × 1/n, FSDP gradient sync on the last one only), or through its pipeline stages
    (`pp.Pipeline`: loss × 1/(n × pipeline micro-batches))

Returns the per-term losses summed over micro-batches, not yet averaged over processes; the trainer does that,
then clips, steps AdamW and updates the EMA teacher.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dinov3_core.data.augment import MultiCrops
from dinov3_core.data.masking import IBOTMasks
from dinov3_core.train.distributed import DistEnv, autocast, set_gradient_sync
from dinov3_core.train.pp import Pipeline, StepContext
from dinov3_core.train.ssl_model import SSLMetaArch, TeacherTargets, microbatch_splits

ENTROPY = "teacher_entropy"  # the last entry of the returned vector: a health signal, not a loss


def forward_backward(
    model: SSLMetaArch,
    pipeline: Pipeline | None,
    env: DistEnv,
    crops: MultiCrops,
    masks: IBOTMasks,
    *,
    keys: Sequence[str],
    n_micro: int,
    teacher_temp: float | Tensor,
    koleo_base: int,
    bf16: bool,
) -> Tensor:
    """Gradients of the step's mean loss in `.grad`; returns [len(keys) + 1]: the mean over micro-batches of each
    `keys` term, then the teacher's normalised entropy (zeros on pipeline stages that compute no loss)."""
    values = torch.zeros(len(keys) + 1, device=env.device)
    b = crops.global_stack.shape[1] // n_micro
    splits = microbatch_splits(masks, n_micro) if pipeline is None else []
    with autocast(env, bf16):
        if pipeline is None:
            targets = model.teacher_targets(
                crops.global_stack, masks, n_micro=n_micro, teacher_temp=teacher_temp, splits=splits
            )
        else:  # the teacher's stages over the whole step; the targets exist on the last stage
            targets = pipeline.teacher_targets(crops.global_stack, masks, teacher_temp)
        if targets is not None:
            # 16 images a crop estimate it at a fraction of the cost for 65,536 prototypes.
            q = targets.dino[:, :16].float()
            values[-1] = -(q * q.clamp_min(1e-12).log()).sum(-1).mean() / math.log(q.shape[-1])
        koleo_features = None
        if pipeline is not None and model.needs_koleo:  # pipeline micro-batches split the step: whole-step set
            koleo_features = pipeline.koleo_features(crops.global_stack, crops.local_stack, masks)
        elif n_micro > 1 and model.needs_koleo:
            koleo_features = model.student_step_features(crops.global_stack, masks, n_micro=n_micro, splits=splits)
        if pipeline is not None:
            ctx = StepContext(crops.global_stack, masks, targets, n_micro * pipeline.n_mb, koleo_features, koleo_base)
            for parts in pipeline.run(ctx, crops.local_stack):
                values[:-1] += torch.stack([parts[k] for k in keys]) / ctx.n_microbatches
            return values
    assert targets is not None
    for m in range(n_micro):
        micro = slice(m * b, (m + 1) * b)
        micro_masks, positions = splits[m]
        micro_targets = TeacherTargets(dino=targets.dino[:, micro], ibot=targets.ibot[positions])
        if env.distributed:
            set_gradient_sync(model.student, m == n_micro - 1)
        with autocast(env, bf16):
            loss, parts = model.forward_loss(
                crops.global_stack[:, micro],
                crops.local_stack[:, micro],
                micro_masks,
                micro_targets,
                koleo_features=koleo_features,
                koleo_offset=koleo_base + m * b,
            )
        (loss / n_micro).backward()
        values[:-1] += torch.stack([parts[k] for k in keys]) / n_micro
    return values
