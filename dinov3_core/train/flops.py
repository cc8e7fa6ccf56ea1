"""FLOPs of one training step, counted from the model (for MFU), not assumed from a formula.

`step_flops_per_image(cfg, device)` builds the configured SSL model (student, EMA teacher, DINO/iBOT heads), runs
one real `forward_backward` on random crops and masks of the configured sizes under PyTorch's `FlopCounterMode`,
and divides by the images in it. It counts what the step executes: teacher forward on the global crops, Sinkhorn,
student forward and backward on global + local crops, both heads and the losses (matrix products and attention;
element-wise work is not counted, as in every MFU figure). The optimizer step and the EMA update add element-wise
work only.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from dinov3_core.data.augment import MultiCrops
from dinov3_core.data.masking import IBOTMaskSampler
from dinov3_core.train import config as C
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.ssl_model import LOSS_NAMES, SIGNAL_NAMES, build_ssl_model
from dinov3_core.train.step import forward_backward


def step_flops_per_image(cfg: C.PretrainConfig, device: torch.device | str = "cpu", images: int = 2) -> float:
    """Floating-point operations (a multiply-add counts 2) of one training step divided by its images."""
    device = torch.device(device)
    torch.manual_seed(0)
    model = build_ssl_model(cfg).model.to(device)
    model.train()
    patch = model.student["backbone"].patch_size
    crops = MultiCrops(
        global_stack=torch.randn(
            cfg.crops.n_global_crops, images, 3, cfg.crops.global_size, cfg.crops.global_size, device=device
        ),
        local_stack=torch.randn(
            cfg.crops.n_local_crops, images, 3, cfg.crops.local_size, cfg.crops.local_size, device=device
        ),
    )
    masks = IBOTMaskSampler(cfg.crops.global_size // patch)(images, cfg.crops.n_global_crops)
    masks = type(masks).from_masks(masks.masks.to(device), cfg.crops.n_global_crops)
    counter = FlopCounterMode(display=False)
    with counter:
        forward_backward(
            model,
            None,
            DistEnv(device=device),
            crops,
            masks,
            keys=(*LOSS_NAMES, *SIGNAL_NAMES),
            n_micro=1,
            teacher_temp=0.07,
            koleo_base=0,
            bf16=False,
        )
    return counter.get_total_flops() / images
