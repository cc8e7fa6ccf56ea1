"""iBOT masked-patch loss: student predictions at masked positions against teacher Sinkhorn targets."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ._common import upcast


class iBOTPatchLoss(nn.Module):
    """Per masked patch cross-entropy, weighted 1/(#masked patches in its crop), summed, ÷ number of crops.

    L = −(1/n_crops) Σ_m w_m Σ_k t_m[k]·log softmax(s_m/τ_s)[k]   (n_crops = S_g·B, i.e. 2B)
    (docs/reference/dinov3.md#losses)

    so every masked crop contributes the mean CE over its masked patches and unmasked crops count as zero
    in the average. With gradient accumulation pass the micro-batch's weights and n_crops = S_g·b: for equal
    micro-batches Σ_micro loss/n_micro equals the full-batch loss exactly (the weights are per crop, so
    slicing by image does not change them).
    """

    def __init__(self, student_temp: float = 0.1) -> None:
        super().__init__()
        self.student_temp = student_temp

    def forward(self, student_logits: Tensor, teacher_probs: Tensor, masks_weight: Tensor, n_crops: int) -> Tensor:
        """Weighted masked-patch cross-entropy.

        Args:
            student_logits: [M, K] student iBOT-head outputs at the masked patches (`IBOTMasks.mask_indices`).
            teacher_probs: [M, K] Sinkhorn targets for the same patches, same order.
            masks_weight: [M] 1/(#masked patches in the crop of each patch) (`IBOTMasks.masks_weight`).
            n_crops: global crops in this (micro-)batch, masked or not: S_g·b. The normaliser.
        Returns:
            Scalar fp32 (fp64 for fp64 inputs); 0 when M == 0.
        """
        if student_logits.shape != teacher_probs.shape or masks_weight.shape != student_logits.shape[:1]:
            raise ValueError(
                f"shapes disagree: student {tuple(student_logits.shape)}, "
                f"teacher {tuple(teacher_probs.shape)}, weights {tuple(masks_weight.shape)}"
            )
        log_p = F.log_softmax(upcast(student_logits) / self.student_temp, dim=-1)
        patch_ce = -(teacher_probs.to(log_p.dtype) * log_p).sum(dim=-1)  # [M]
        return (patch_ce * masks_weight.to(patch_ce.dtype)).sum() / n_crops
