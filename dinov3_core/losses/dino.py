"""DINO loss on CLS tokens: cross-entropy of student crops against Sinkhorn-Knopp teacher targets."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import no_autocast, upcast


def dino_pair_count(n_student_crops: int, n_teacher_crops: int, ignore_diagonal: bool) -> int:
    """Number of (student crop, teacher crop) pairs per image that enter the loss.

    With `ignore_diagonal` the pairs where student and teacher see the same crop are dropped; that only makes
    sense when the student crops ARE the teacher crops (the global term): S_g·(S_g−1) pairs, 2 for S_g = 2.
    """
    pairs = n_student_crops * n_teacher_crops
    return pairs - min(n_student_crops, n_teacher_crops) if ignore_diagonal else pairs


class DINOLoss(nn.Module):
    """−Σ_k p_t[k]·log softmax(z_s/τ_s)[k], averaged over images and (student, teacher) crop pairs
    (docs/reference/dinov3.md#losses).

    The teacher targets are precomputed (`dino_teacher_targets`) so that, under gradient accumulation, they
    come from the whole optimizer-step batch. The normaliser is b·pairs with b the images in THIS call, so for
    equal micro-batches Σ_micro loss/n_micro equals the full-batch loss exactly:

    * global term: student = teacher = S_g global crops, `ignore_diagonal=True`  → ÷ b·S_g·(S_g−1) (= 2b);
    * local term:  student = S_l local crops, teacher = S_g global crops          → ÷ b·S_l·S_g.
    """

    def __init__(self, student_temp: float = 0.1) -> None:
        super().__init__()
        self.student_temp = student_temp

    def forward(self, student_logits: Tensor, teacher_probs: Tensor, *, ignore_diagonal: bool = False) -> Tensor:
        """Mean cross-entropy.

        Args:
            student_logits: [S_s, b, K] student DINO-head outputs (crop-major; images aligned with teacher).
            teacher_probs: [S_t, b, K] targets, each [k]-vector summing to one (no gradient needed).
            ignore_diagonal: skip pairs (i, i) — student crop i vs teacher crop i.
        Returns:
            Scalar fp32 (fp64 for fp64 inputs): Σ over counted pairs and images / (b · `dino_pair_count`).
        """
        n_student, b, _ = student_logits.shape
        n_teacher = teacher_probs.shape[0]
        if teacher_probs.shape[1:] != student_logits.shape[1:]:
            raise ValueError(
                f"student {tuple(student_logits.shape)} and teacher {tuple(teacher_probs.shape)} must agree on [b, K]"
            )
        log_p = F.log_softmax(upcast(student_logits) / self.student_temp, dim=-1)
        teacher = teacher_probs.to(log_p.dtype)
        with no_autocast(log_p):
            pair_ce = -torch.einsum("sbk,tbk->st", log_p, teacher)  # [S_s, S_t], summed over images
        if ignore_diagonal:  # pairs (i, i) of a possibly rectangular [S_s, S_t] matrix, as upstream's diagonal_scatter
            # torch.where, not diagonal_scatter (same values, bit for bit): the latter's backward writes into the
            # sum's expanded gradient, which Inductor reinplaces into a copy_ into a stride-0 tensor and fails to
            # lower ("more than one element ... refers to a single memory location"): whole-step compile.
            diagonal = torch.eye(n_student, n_teacher, dtype=torch.bool, device=pair_ce.device)
            pair_ce = torch.where(diagonal, pair_ce.new_zeros(()), pair_ce)
        return pair_ce.sum() / (b * dino_pair_count(n_student, n_teacher, ignore_diagonal))
