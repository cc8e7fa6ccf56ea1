"""Official SSL loss weights and crop-count scales, and the weighted total (facts §6)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .dino import dino_pair_count


@dataclass(frozen=True)
class SSLLossWeights:
    """Weights of the DINOv3 objective, generalised to S_g global and S_l local crops.

    Total = w_dino·(scale_l·λ_local·L_dino_local + scale_g·L_dino_global) + w_koleo·scale_koleo·L_koleo
            + w_ibot·L_ibot + w_gram(it)·L_gram

    with scale_g = T_g/(T_g+T_l), scale_l = T_l/(T_g+T_l), T_g = S_g(S_g−1) (same-crop pairs ignored) or
    S_g², T_l = S_g·S_l, scale_koleo = S_g. Defaults (S_g=2, S_l=8): scale_g = 2/18, scale_l = 16/18,
    scale_koleo = 2.
    """

    n_global_crops: int = 2
    n_local_crops: int = 8
    dino: float = 1.0
    koleo: float = 0.1
    ibot: float = 1.0
    gram: float = 1.0
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
        dino_local_weight: float = 1.0,
        gram_weight: float | None = None,
    ) -> Tensor:
        """Weighted sum of the (already normalised) loss terms.

        Args:
            dino_local_weight: λ_local from the optional local-loss schedule (1 by default).
            gram_weight: w_gram for this iteration (a schedule value); None → `self.gram`. Ignored if `gram`
                is None.
        """
        total = self.dino * (
            self.dino_local_scale * dino_local_weight * dino_local + self.dino_global_scale * dino_global
        )
        total = total + self.koleo * self.koleo_scale * koleo + self.ibot * ibot
        if gram is not None:
            total = total + (self.gram if gram_weight is None else gram_weight) * gram
        return total
