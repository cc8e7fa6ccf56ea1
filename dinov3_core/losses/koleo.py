"""KoLeo (Kozachenko-Leonenko) entropy regulariser on student CLS features, micro-batch exact."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import no_autocast, upcast


@torch.no_grad()
def koleo_nearest_neighbours(features: Tensor) -> Tensor:
    """Index of each vector's nearest OTHER vector on the unit sphere (max cosine = min L2 after normalising).

    Args:
        features: [..., N, D], N ≥ 2; leading dims (e.g. crops) are independent sets.
    Returns:
        [..., N] int64 indices into the N axis.
    """
    if features.shape[-2] < 2:
        raise ValueError("KoLeo needs at least two vectors per set")
    unit = F.normalize(upcast(features), p=2, dim=-1, eps=1e-8)
    with no_autocast(unit):  # fp32 dot products also under autocast: bf16 can swap near neighbours
        dots = unit @ unit.transpose(-1, -2)  # [..., N, N]
    dots.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))
    return dots.argmax(dim=-1)


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x [S, N, D], index [S, M] → [S, M, D]."""
    return x.gather(1, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


class KoLeoLoss(nn.Module):
    """L = −mean_i log(‖x̂_i − x̂_nn(i)‖ + eps), x̂ = x/‖x‖, nn(i) the nearest other vector of the same set.

    Official use (docs/reference/dinov3.md#losses): student pre-head CLS of each global crop, nearest neighbour
    within that crop's per-GPU batch, averaged over crops; the total weights it by w_koleo·S_g. Pass [S_g, b, D] to
    get exactly that average over crops.

    Gradient accumulation. The neighbour set is the whole optimizer-step batch. Without `step_features` the
    set is whatever `x` holds (official behaviour per micro-batch, which shrinks the set). With
    `step_features` — the detached student features of the whole step, from a no-grad student pass with the
    same weights — the loss reproduces the full-batch value AND gradient: each call returns its images'
    share, normalised by S·b, so Σ_micro loss/n_micro equals the full-batch loss. The gradient of a pair
    (i, nn(i)) that straddles two micro-batches reaches x_i in i's micro-batch (neighbour read from
    `step_features`) and x_nn(i) in the other one through a zero-valued surrogate term (f − f.detach()).
    Exactness assumes the pre-pass features equal the live ones (same weights, no drop-path/dropout
    randomness).
    """

    def __init__(self, eps: float = 1e-8) -> None:
        super().__init__()
        self.eps = eps

    def forward(
        self,
        x: Tensor,
        *,
        step_features: Tensor | None = None,
        neighbours: Tensor | None = None,
        offset: int = 0,
    ) -> Tensor:
        """KoLeo loss of `x`'s images.

        Args:
            x: [S, b, D] (or [b, D]) student features with gradient.
            step_features: [S, B, D] (or [B, D]) features of the whole step batch; `x` is rows
                offset … offset+b of it. None: the neighbour set is `x` itself.
            neighbours: [S, B] precomputed `koleo_nearest_neighbours(step_features)`; computed if None.
            offset: first step-batch row of `x`.
        Returns:
            Scalar fp32 (fp64 for fp64 inputs): −Σ_{i in x} log(dist_i + eps) / (S·b).
        """
        squeeze = x.ndim == 2
        x = x.unsqueeze(0) if squeeze else x
        unit = F.normalize(upcast(x), p=2, dim=-1, eps=1e-8)  # [S, b, D]
        n_sets, b, _ = unit.shape
        if step_features is None:
            nn_index = koleo_nearest_neighbours(unit) if neighbours is None else neighbours.view(n_sets, b)
            dist = (unit - _gather_rows(unit, nn_index)).norm(dim=-1)
            return -torch.log(dist + self.eps).sum() / (n_sets * b)

        step = F.normalize(upcast(step_features.detach()), p=2, dim=-1, eps=1e-8).to(unit.dtype)
        step = step.unsqueeze(0) if squeeze else step  # [S, B, D]
        nn_index = koleo_nearest_neighbours(step) if neighbours is None else neighbours.view(step.shape[:2])
        n_step = step.shape[1]
        if step.shape[0] != n_sets or not 0 <= offset <= n_step - b:
            raise ValueError(f"x {tuple(x.shape)} is not a row block of step_features at offset {offset}")

        # Terms of x's own images: the neighbour is live when it is in this micro-batch, else a constant.
        own_nn = nn_index[:, offset : offset + b]  # [S, b]
        own_local = own_nn - offset
        own_live = (own_local >= 0) & (own_local < b)
        neighbour = torch.where(
            own_live.unsqueeze(-1),
            _gather_rows(unit, own_local.clamp(0, b - 1)),
            _gather_rows(step, own_nn),
        )
        own = torch.log((unit - neighbour).norm(dim=-1) + self.eps).sum()

        # Gradient-only terms: images of other micro-batches whose nearest neighbour is in this one.
        rows = torch.arange(n_step, device=nn_index.device)
        foreign = (rows < offset) | (rows >= offset + b)  # [B]
        target_local = nn_index - offset  # [S, B]
        incoming = foreign & (target_local >= 0) & (target_local < b)
        term = torch.log((step - _gather_rows(unit, target_local.clamp(0, b - 1))).norm(dim=-1) + self.eps)
        surrogate = ((term - term.detach()) * incoming).sum()  # value 0, gradient w.r.t. x only
        return -(own + surrogate) / (n_sets * b)
