"""Gram anchoring loss: match the patch-similarity structure of the student to a (gram) teacher."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from ._common import upcast


def resize_patch_tokens(tokens: Tensor, src_hw: tuple[int, int], dst_hw: tuple[int, int]) -> Tensor:
    """Resample a patch-token map to another grid, bicubic, no antialias (official gram-teacher resize, §8).

    Used when the gram teacher sees higher-resolution crops (e.g. 512 px → 32×32 patches) than the student
    (224 px → 14×14): the teacher map is brought to the student grid BEFORE normalisation.

    Args:
        tokens: [B, H_s·W_s, D] row-major patch tokens.
        src_hw: (H_s, W_s) source grid.
        dst_hw: (H_d, W_d) target grid.
    Returns:
        [B, H_d·W_d, D] in fp32 (fp64 for fp64 input).
    """
    b, p, d = tokens.shape
    if p != src_hw[0] * src_hw[1]:
        raise ValueError(f"{p} tokens do not form a {src_hw[0]}×{src_hw[1]} grid")
    grid = upcast(tokens).transpose(1, 2).reshape(b, d, *src_hw)  # [B, D, H_s, W_s]
    grid = F.interpolate(grid, size=dst_hw, mode="bicubic", align_corners=False, antialias=False)
    return grid.flatten(2).transpose(1, 2)  # [B, H_d·W_d, D]


def _square_side(n_tokens: int) -> int:
    side = math.isqrt(n_tokens)
    if side * side != n_tokens:
        raise ValueError(f"{n_tokens} patch tokens are not a square grid; call resize_patch_tokens yourself")
    return side


class GramLoss(nn.Module):
    """MSE between the Gram (cosine-similarity) matrices of student and teacher patch tokens
    (docs/reference/dinov3.md#losses).

    * `img_level=True`: one [P×P] Gram per image; MSE over [B, P, P] = Σ/(B·P²). Per-image, so with equal
      micro-batches Σ_micro loss/n_micro equals the full-batch loss exactly.
    * `img_level=False`: one [N×N] Gram over all N tokens given (B·P, or a pre-selected subset such as only
      masked tokens); MSE = Σ/N². It couples images, so it depends on the (micro-)batch composition, like the
      official per-GPU version.
    * `remove_neg`: negative similarities of BOTH matrices are set to 0.
    * `remove_only_teacher_neg`: teacher negatives are set to 0; the student matrix is left as it is. Upstream
      (facebookresearch/dinov3 `dinov3/loss/gram_loss.py`, HEAD 6876159) also zeroes student entries where both
      are negative, but evaluates that condition after clamping the teacher, so it never fires: this matches what
      upstream computes, and the student is pushed towards 0 wherever it is negative.
    """

    def __init__(
        self,
        *,
        normalize: bool = True,
        img_level: bool = True,
        remove_neg: bool = False,
        remove_only_teacher_neg: bool = False,
    ) -> None:
        super().__init__()
        if remove_neg and remove_only_teacher_neg:
            raise ValueError("remove_neg and remove_only_teacher_neg are mutually exclusive")
        self.normalize = normalize
        self.img_level = img_level
        self.remove_neg = remove_neg
        self.remove_only_teacher_neg = remove_only_teacher_neg

    def forward(self, student_patches: Tensor, teacher_patches: Tensor) -> Tensor:
        """Gram MSE.

        Args:
            student_patches: [B, P, D] student `x_norm_patchtokens` (or [N, D] when `img_level=False`).
            teacher_patches: [B, P_t, D] gram-teacher patch tokens (no gradient needed). If P_t ≠ P both
                grids must be square and the teacher map is resized to the student grid (bicubic, no
                antialias) before normalisation. [N, D] when the student is [N, D].
        Returns:
            Scalar fp32 (fp64 for fp64 inputs).
        """
        student = upcast(student_patches)
        teacher = upcast(teacher_patches.detach()).to(student.dtype)
        if self.img_level and student.ndim != 3:
            raise ValueError("img_level=True needs [B, P, D] inputs")
        if teacher.shape[:-1] != student.shape[:-1]:
            if student.ndim != 3 or teacher.shape[0] != student.shape[0]:
                raise ValueError(f"student {tuple(student.shape)} vs teacher {tuple(teacher.shape)}")
            s_side, t_side = _square_side(student.shape[1]), _square_side(teacher.shape[1])
            teacher = resize_patch_tokens(teacher, (t_side, t_side), (s_side, s_side))
        if self.normalize:
            student = F.normalize(student, p=2, dim=-1)
            teacher = F.normalize(teacher, p=2, dim=-1)
        if not self.img_level:
            student, teacher = student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])

        student_sim = student @ student.transpose(-1, -2)  # [B, P, P] or [N, N]
        teacher_sim = teacher @ teacher.transpose(-1, -2)
        if self.remove_neg:
            student_sim = student_sim.clamp_min(0.0)
            teacher_sim = teacher_sim.clamp_min(0.0)
        elif self.remove_only_teacher_neg:
            teacher_sim = teacher_sim.clamp_min(0.0)
        return F.mse_loss(student_sim, teacher_sim)
