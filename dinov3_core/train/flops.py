"""FLOPs of one training step, counted from the model (for MFU), not assumed from a formula.

`step_flops_per_image(cfg, device)` builds the configured SSL model (student, EMA teacher, DINO/iBOT heads), runs
one real `forward_backward` on random crops and masks of the configured sizes under PyTorch's `FlopCounterMode`,
and divides by the images in it. It counts what the step executes: teacher forward on the global crops, Sinkhorn,
student forward and backward on global + local crops, both heads and the losses (matrix products and attention;
element-wise work is not counted, as in every MFU figure). The optimizer step and the EMA update add element-wise
work only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from dinov3_core.data.augment import MultiCrops
from dinov3_core.data.masking import IBOTMaskSampler
from dinov3_core.train import config as C
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.ssl_model import LOSS_NAMES, SIGNAL_NAMES, SSLMetaArch, build_ssl_model
from dinov3_core.train.step import forward_backward


def random_step(cfg: C.PretrainConfig, images: int, patch_size: int, device: torch.device) -> tuple[MultiCrops, Any]:
    """Random global and local crops of the configured sizes and iBOT masks for `images` images, on `device`."""
    c = cfg.crops
    crops = MultiCrops(
        global_stack=torch.randn(c.n_global_crops, images, 3, c.global_size, c.global_size, device=device),
        local_stack=torch.randn(c.n_local_crops, images, 3, c.local_size, c.local_size, device=device),
    )
    masks = IBOTMaskSampler(c.global_size // patch_size)(images, c.n_global_crops)
    return crops, type(masks).from_masks(masks.masks.to(device), c.n_global_crops)


def one_step(model: SSLMetaArch, env: DistEnv, crops: MultiCrops, masks: Any, *, bf16: bool) -> torch.Tensor:
    """`forward_backward` of a whole step as one micro-batch, at a fixed teacher temperature and no KoLeo offset:
    the step the FLOP count and the step benchmarks run."""
    return forward_backward(
        model,
        None,
        env,
        crops,
        masks,
        keys=(*LOSS_NAMES, *SIGNAL_NAMES),
        n_micro=1,
        teacher_temp=0.07,
        koleo_base=0,
        bf16=bf16,
    )


def step_flops_per_image(cfg: C.PretrainConfig, device: torch.device | str = "cpu", images: int = 2) -> float:
    """Floating-point operations (a multiply-add counts 2) of one training step divided by its images."""
    device = torch.device(device)
    torch.manual_seed(0)
    model = build_ssl_model(cfg).model.to(device)
    model.train()
    crops, masks = random_step(cfg, images, model.student["backbone"].patch_size, device)
    counter = FlopCounterMode(display=False)
    with counter:
        one_step(model, DistEnv(device=device), crops, masks, bf16=False)
    return counter.get_total_flops() / images
