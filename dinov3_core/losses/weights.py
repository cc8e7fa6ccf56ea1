"""The `losses` config section (weights and settings), the crop-count scales and the weighted total
(docs/reference/dinov3.md#losses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from dinov3_core.config import require

from .dino import dino_pair_count


@dataclass
class LossesConfig:
    """Loss weights (official defaults) and loss settings: the `losses` section of the pretrain config."""

    dino_weight: float = 1.0
    koleo_weight: float = 0.1
    ibot_weight: float = 1.0
    # λ_local on the DINO local-crop term; the gram stage anneals it from here to gram.local_weight_end.
    local_loss_weight: float = 1.0
    student_temp: float = 0.1
    sinkhorn_iterations: int = 3
    # KoLeo nearest-neighbour set: "rank" = the rank's step batch (official, per GPU); "global" = the global
    # step batch (features all-gathered), which makes the objective independent of the number of ranks.
    koleo_scope: Literal["rank", "global"] = "rank"

    def __post_init__(self) -> None:
        for key in ("dino_weight", "koleo_weight", "ibot_weight", "local_loss_weight"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.student_temp > 0, "student_temp", f"must be > 0, got {self.student_temp}")
        require(self.sinkhorn_iterations >= 1, "sinkhorn_iterations", f"must be >= 1, got {self.sinkhorn_iterations}")


@dataclass(frozen=True)
class SSLLossWeights:
    """Weights of the DINOv3 objective (from `losses`), generalised to S_g global and S_l local crops.

    Total = w_dino·(scale_l·λ_local·L_dino_local + scale_g·L_dino_global) + w_koleo·scale_koleo·L_koleo
            + w_ibot·L_ibot + w_gram(it)·L_gram

    with scale_g = T_g/(T_g+T_l), scale_l = T_l/(T_g+T_l), T_g = S_g(S_g−1) (same-crop pairs ignored) or
    S_g², T_l = S_g·S_l, scale_koleo = S_g. Official crops (S_g=2, S_l=8): scale_g = 2/18, scale_l = 16/18,
    scale_koleo = 2.
    """

    losses: LossesConfig
    n_global_crops: int
    n_local_crops: int
    dino_global_ignore_diagonal: bool = True

    def __post_init__(self) -> None:
        if self.n_global_crops < 1 or self.n_local_crops < 0:
            raise ValueError("need n_global_crops >= 1 and n_local_crops >= 0")
        if self.dino_global_ignore_diagonal and self.n_global_crops < 2:
            raise ValueError("ignoring same-crop pairs needs at least two global crops")

    @property
    def dino_global_terms(self) -> int:
        return dino_pair_count(self.n_global_crops, self.n_global_crops, self.dino_global_ignore_diagonal)

    @property
    def dino_local_terms(self) -> int:
        return dino_pair_count(self.n_local_crops, self.n_global_crops, ignore_diagonal=False)

    @property
    def dino_global_scale(self) -> float:
        return self.dino_global_terms / (self.dino_global_terms + self.dino_local_terms)

    @property
    def dino_local_scale(self) -> float:
        return self.dino_local_terms / (self.dino_global_terms + self.dino_local_terms)

    @property
    def koleo_scale(self) -> float:
        return float(self.n_global_crops)

    def total(
        self,
        *,
        dino_global: Tensor,
        dino_local: Tensor | float,
        koleo: Tensor | float,
        ibot: Tensor | float,
        gram: Tensor | float | None = None,
        dino_local_weight: float | None = None,
        gram_weight: float | None = None,
    ) -> Tensor:
        """Weighted sum of the (already normalised) loss terms.

        Args:
            dino_local_weight: λ_local for this iteration (gram stage schedule); None → `losses.local_loss_weight`.
            gram_weight: w_gram for this iteration (`gram.loss_weight` or its warmup); needed with `gram`.
        """
        w = self.losses
        local = w.local_loss_weight if dino_local_weight is None else dino_local_weight
        total = w.dino_weight * (self.dino_local_scale * local * dino_local + self.dino_global_scale * dino_global)
        total = total + w.koleo_weight * self.koleo_scale * koleo + w.ibot_weight * ibot
        if gram is not None:
            if gram_weight is None:
                raise ValueError("a gram term needs its gram_weight")
            total = total + gram_weight * gram
        return total
