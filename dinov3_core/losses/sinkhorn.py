"""Sinkhorn-Knopp centring of teacher logits, and the two teacher-target functions built on it.

Targets depend on the whole batch they are computed over (every prototype must receive equal mass across it),
so with gradient accumulation they must be computed ONCE over the optimizer-step batch and then sliced per
micro-batch (docs/reference/distributed.md#sinkhorn-per-step): computing them per micro-batch silently changes the
objective.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup, ReduceOp

from ._common import all_reduce_

_CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32 per temporary in `_shifted_exp_row_sum`


@torch.no_grad()
def sinkhorn_knopp(
    teacher_logits: Tensor,
    teacher_temp: float | Tensor,
    n_iterations: int = 3,
    n_masked: int | Tensor | None = None,
    *,
    group: ProcessGroup | None = None,
) -> Tensor:
    """Balanced soft assignment of samples to prototypes (DINOv3 / SwAV Sinkhorn-Knopp,
    docs/reference/dinov3.md#losses).

    Official algorithm on Q = exp(z/τ)ᵀ [K, N]: Q /= ΣQ, then `n_iterations` × {rows /= rowsum·K (rowsum
    all-reduced over ranks); cols /= colsum·N}, targets = (N·Q)ᵀ, N = samples over all ranks. This returns
    the same values (tested against a literal transcription) with two deliberate differences:

    * The scalar factors ΣQ, K and N cancel exactly: each row step divides by a sum that absorbs any global
      scale, and the final column step followed by ×N leaves each sample's targets summing to one. N is
      therefore not needed and not all-reduced; only per-prototype quantities are.
    * It cannot overflow. Upstream's exp(z/τ) is inf for z > 88·τ ≈ 3.5 at τ = 0.04 and the targets become
      NaN. Here the first row step is done in the log domain (per-prototype log-sum-exp over all ranks), which
      bounds every entry by its row sum, and each sample's largest entry is shifted to 1 before the column
      step (a per-sample factor that step cancels anyway). Later row steps cannot overflow (entry ≤ row sum).
      A prototype or sample whose mass underflows even so gets zeros instead of NaN.

    Args:
        teacher_logits: [N_local, K] teacher head outputs on this rank (any float dtype; computed in fp32, or
            fp64 if given fp64).
        teacher_temp: τ_t (0.04 → 0.07 in the official schedule); a 0-dim tensor under whole-step compile.
        n_iterations: Sinkhorn iterations (official 3); at least 1.
        n_masked: rows of `teacher_logits` that are real samples on this rank (int or integer tensor); later
            rows are padding (e.g. a static-shape upper bound for iBOT) and get all-zero targets and no mass.
            None: every row is a sample. Ranks may hold different counts.
        group: process group the batch is spread over (the data-parallel group); None = default world.

    Returns:
        [N_local, K] targets in the compute dtype; each real row sums to 1, padding rows are 0.
    """
    if n_iterations < 1:
        raise ValueError(f"n_iterations must be >= 1, got {n_iterations}")
    if teacher_logits.ndim != 2:
        raise ValueError(f"teacher_logits must be [N, K], got shape {tuple(teacher_logits.shape)}")
    dtype = torch.float64 if teacher_logits.dtype == torch.float64 else torch.float32
    n_local = teacher_logits.shape[0]

    # Q is kept as [N, K] (samples × prototypes): the paper's row sums (per prototype) are sums over dim 0.
    log_q = teacher_logits.to(dtype=dtype, copy=True).div_(teacher_temp)  # [N, K]
    padding = None
    if n_masked is not None:
        padding = torch.arange(n_local, device=log_q.device) >= torch.as_tensor(n_masked, device=log_q.device)
        log_q.masked_fill_(padding[:, None], float("-inf"))

    # Row step 1 in the log domain: log_q -= log Σ_b exp(log_q[b]) per prototype, over all ranks.
    proto_max = log_q.amax(dim=0, keepdim=True) if n_local > 0 else log_q.new_full((1, log_q.shape[1]), -torch.inf)
    proto_max = all_reduce_(proto_max, ReduceOp.MAX, group)
    proto_max = torch.where(torch.isfinite(proto_max), proto_max, torch.zeros_like(proto_max))  # no samples
    proto_sum = all_reduce_(_shifted_exp_row_sum(log_q, proto_max), ReduceOp.SUM, group)
    log_q.sub_(proto_max + proto_sum.log())
    # Per-sample shift so each sample's largest entry is exp(0) = 1; the column step cancels it.
    if n_local > 0:
        log_q.sub_(log_q.amax(dim=1, keepdim=True))
    q = log_q.exp_()
    if padding is not None:
        q.masked_fill_(padding[:, None], 0.0)  # their rows are exp(nan) here
    q.div_(_nonzero(q.sum(dim=1, keepdim=True)))

    for _ in range(n_iterations - 1):
        # Row step: every prototype gets equal total mass over all samples on all ranks.
        q.div_(_nonzero(all_reduce_(q.sum(dim=0, keepdim=True), ReduceOp.SUM, group)))
        # Column step: every sample's assignment sums to one (local: samples live on one rank).
        q.div_(_nonzero(q.sum(dim=1, keepdim=True)))
    return q


def _nonzero(sums: Tensor) -> Tensor:
    """Divisor that leaves all-zero rows/columns (padding, underflow) at zero instead of 0/0 = NaN."""
    return sums.masked_fill_(sums == 0, 1.0)


def _shifted_exp_row_sum(log_q: Tensor, shift: Tensor) -> Tensor:
    """Σ_n exp(log_q[n] − shift) as [1, K], in row chunks: a full [N, K] temporary would double the memory of
    the iBOT targets (~1 GB at B=64, K=65536)."""
    chunk = max(1, _CHUNK_ELEMENTS // max(1, log_q.shape[1]))
    out = log_q.new_zeros(1, log_q.shape[1])
    for start in range(0, log_q.shape[0], chunk):
        out += (log_q[start : start + chunk] - shift).exp_().sum(dim=0, keepdim=True)
    return out


@torch.no_grad()
def dino_teacher_targets(
    teacher_cls_logits: Tensor,
    teacher_temp: float | Tensor,
    *,
    n_iterations: int = 3,
    group: ProcessGroup | None = None,
) -> Tensor:
    """Sinkhorn-Knopp targets for the DINO (CLS) loss, jointly over all teacher crops of the batch.

    Args:
        teacher_cls_logits: [S_g, B, K] teacher DINO-head outputs for the global crops (or already flat
            [S_g·B, K]); B is the whole optimizer-step batch on this rank.
    Returns:
        Targets with the input's shape; slice [:, i0:i1] per micro-batch.
    """
    flat = teacher_cls_logits.reshape(-1, teacher_cls_logits.shape[-1])
    return sinkhorn_knopp(flat, teacher_temp, n_iterations, group=group).view(teacher_cls_logits.shape)


@torch.no_grad()
def ibot_teacher_targets(
    teacher_patch_logits: Tensor,
    teacher_temp: float | Tensor,
    n_masked: int | Tensor | None = None,
    *,
    n_iterations: int = 3,
    group: ProcessGroup | None = None,
) -> Tensor:
    """Sinkhorn-Knopp targets for the iBOT loss over the masked patches of the whole step batch.

    Args:
        teacher_patch_logits: [M, K] teacher iBOT-head outputs at the student-masked patch positions, in
            `IBOTMasks.mask_indices` order (optionally padded to a static upper bound).
        n_masked: real rows when padded (see `sinkhorn_knopp`).
    Returns:
        [M, K]; select per micro-batch with the index returned by `IBOTMasks.microbatch`.
    """
    return sinkhorn_knopp(teacher_patch_logits, teacher_temp, n_iterations, n_masked, group=group)
