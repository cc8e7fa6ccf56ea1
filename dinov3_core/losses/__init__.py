"""DINOv3 self-supervised losses as pure, separately testable pieces.

Teacher targets are computed apart from the losses (`dino_teacher_targets`, `ibot_teacher_targets`) so that a
trainer with gradient accumulation computes them once over the optimizer-step batch and slices them per
micro-batch. Every loss normalises by the size of the batch it is given (documented per loss), so equal
micro-batches scaled by 1/accumulation_steps sum to the full-batch loss exactly.
"""

from .dino import DINOLoss, dino_pair_count
from .gram import GramLoss, resize_patch_tokens
from .ibot import iBOTPatchLoss
from .koleo import KoLeoLoss, koleo_nearest_neighbours
from .sinkhorn import dino_teacher_targets, ibot_teacher_targets, sinkhorn_knopp
from .weights import LossesConfig, SSLLossWeights

__all__ = [
    "DINOLoss",
    "GramLoss",
    "KoLeoLoss",
    "LossesConfig",
    "SSLLossWeights",
    "dino_pair_count",
    "dino_teacher_targets",
    "iBOTPatchLoss",
    "ibot_teacher_targets",
    "koleo_nearest_neighbours",
    "resize_patch_tokens",
    "sinkhorn_knopp",
]
