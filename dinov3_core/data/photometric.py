"""Colour and stain steps (2–5) of the multi-crop augmentation, batched on tensors (see `dinov3_core.data.augment`
for the recipe and the deviations from torchvision).

Every op works on crop-major rows [n, 3, h, w] in [0, 1] with parameters drawn per image from the caller's
`Random`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from dinov3_core.data.augment_config import AugmentationConfig
from dinov3_core.data.augment_random import Random
from dinov3_core.data.stain import CohortStain, stain_norm

# Ruifrok & Johnston (2001) stain OD vectors, rows haematoxylin, eosin, DAB — skimage.color.rgb_from_hed.
RGB_FROM_HED = torch.tensor([[0.65, 0.70, 0.29], [0.07, 0.99, 0.11], [0.27, 0.57, 0.78]], dtype=torch.float64)
HED_FROM_RGB = torch.linalg.inv(RGB_FROM_HED)
# skimage scales optical density by −log(1e-6) so that stain values are comparable to its other spaces; our
# HED sigmas are in those units (`skimage.color.rgb2hed`), typical haematoxylin in nuclei ≈ 0.05–0.15.
_HED_LOG_ADJUST = -math.log(1e-6)
_GRAY = (0.2989, 0.587, 0.114)  # torchvision rgb_to_grayscale
_RGB_TO_YIQ = torch.tensor(
    [[0.299, 0.587, 0.114], [0.595716, -0.274453, -0.321263], [0.211456, -0.522591, 0.311135]],
    dtype=torch.float64,
)
_YIQ_TO_RGB = torch.linalg.inv(_RGB_TO_YIQ)  # once, on CPU: no linalg solver initialisation on the GPU


def photometric(
    crops: Tensor,
    blur_p: Tensor,
    solarize_p: Tensor | None,
    cfg: AugmentationConfig,
    rand: Random,
    stain: CohortStain | None = None,
) -> Tensor:
    """[S, B, 3, s, s] in [0, 1] → same shape, augmented and normalised. `blur_p`/`solarize_p`: [S] per crop
    index; `stain`: the cohort's stain distribution (None: no re-targeting). May reuse `crops`' memory."""
    n_crops, b = crops.shape[:2]
    x = crops.reshape(n_crops * b, 3, *crops.shape[-2:])  # crop-major rows, as the parameters

    stain_norm(x, cfg, stain, rand)  # to a cohort-typical stain first, then jitter around it
    _hed_jitter(x, cfg, rand)
    x = _color_jitter(x, cfg, rand)
    _grayscale(x, rand.bernoulli(cfg.grayscale_p, x.shape[0]))
    _gaussian_blur(x, rand.bernoulli(blur_p.repeat_interleave(b), x.shape[0]), cfg, rand)
    if solarize_p is not None:
        _solarize(x, rand.bernoulli(solarize_p.repeat_interleave(b), x.shape[0]), cfg.solarize_threshold)
    mean = torch.tensor(cfg.mean, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(cfg.std, device=x.device).view(1, 3, 1, 1)
    return x.sub_(mean).div_(std).view(crops.shape)


def _affine(x: Tensor, matrix: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """matrix[i] @ x[i] + bias[i] per pixel. x [n, 3, h, w], matrix [n, 3, 3], bias [n, 3]; `out` (not
    aliasing x) receives the result if given."""
    flat = x.view(x.shape[0], 3, -1)
    target = None if out is None else out.view(flat.shape)
    if bias is None:
        result = torch.bmm(matrix, flat, out=target)
    else:
        result = torch.baddbmm(bias.unsqueeze(-1), matrix, flat, out=target)
    return result.view(x.shape)


def hed_jitter(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """Perturb the stains of RGB images: s = (−log rgb)·HED_FROM_RGB / L, s' = scale·s + shift, back to RGB.

    All of it is linear in log-RGB, so each image costs one log, one 3×3 matrix and one exp per pixel:
    log rgb' = log rgb · (HED_FROM_RGB · diag(scale) · RGB_FROM_HED) − L·shift·RGB_FROM_HED. Stains are not
    clipped at 0 (skimage clips), so scale 1 / shift 0 is an exact round trip.

    Args:
        x: [n, 3, h, w] RGB in [0, 1].
        scale, shift: [n, 3] per image, for (haematoxylin, eosin, DAB); shift in skimage `rgb2hed` units.
    Returns:
        [n, 3, h, w] in [0, 1] (new tensor).
    """
    to_hed = HED_FROM_RGB.to(x.device, torch.float32)
    from_hed = RGB_FROM_HED.to(x.device, torch.float32)
    matrix = (to_hed * scale.unsqueeze(1)) @ from_hed  # [n, 3, 3], acting on row vectors
    bias = -_HED_LOG_ADJUST * (shift @ from_hed)  # [n, 3]
    log_rgb = x.clamp_min(1e-6).log_()
    return _affine(log_rgb, matrix.transpose(1, 2), bias, out=log_rgb.new_empty(log_rgb.shape)).exp_().clamp_(0, 1)


def _hed_jitter(x: Tensor, cfg: AugmentationConfig, rand: Random) -> None:
    """In place: `hed_jitter` with probability `hed_p`; scale ~ U(1±σ_scale), shift ~ U(±σ_shift)."""
    n = x.shape[0]
    apply = rand.bernoulli(cfg.hed_p, n)
    scale = rand.uniform(1.0 - cfg.hed_scale_sigma, 1.0 + cfg.hed_scale_sigma, n, 3)
    shift = rand.uniform(-cfg.hed_shift_sigma, cfg.hed_shift_sigma, n, 3)
    index = apply.nonzero().squeeze(1)
    if index.numel():
        x.index_copy_(0, index, hed_jitter(x[index], scale[index], shift[index]))


def _color_jitter(x: Tensor, cfg: AugmentationConfig, rand: Random) -> Tensor:
    """torchvision ColorJitter semantics per image: with p, brightness/contrast/saturation/hue factors from
    their ranges, applied in a random per-image order, clamped after each op. Every op is a per-image affine
    map of RGB, so each of the 4 order slots is one batched matrix multiply (ping-ponging two buffers).
    Returns the result, which may live in `x` or in a new buffer."""
    n, device = x.shape[0], x.device
    apply = rand.bernoulli(cfg.color_jitter_p, n)
    factors = torch.stack(
        [
            rand.uniform(max(0.0, 1 - cfg.brightness), 1 + cfg.brightness, n),
            rand.uniform(max(0.0, 1 - cfg.contrast), 1 + cfg.contrast, n),
            rand.uniform(max(0.0, 1 - cfg.saturation), 1 + cfg.saturation, n),
            rand.uniform(-cfg.hue, cfg.hue, n),
        ]
    )  # [4, n]
    order = rand.permutations(n, 4)  # [n, 4]: op applied in each slot
    if not bool(apply.any()):
        return x
    eye = torch.eye(3, device=device).expand(n, 3, 3)
    gray = torch.tensor(_GRAY, device=device)
    ones_gray = torch.ones(3, 1, device=device) * gray  # [3, 3]: every output channel = luma
    brightness = factors[0].view(n, 1, 1) * eye
    contrast = factors[1].view(n, 1, 1) * eye
    saturation = factors[2].view(n, 1, 1) * eye + (1 - factors[2]).view(n, 1, 1) * ones_gray
    hue = _yiq_hue_rotation(factors[3])
    ops = torch.stack([brightness, contrast, saturation, hue])  # [4, n, 3, 3]
    rows = torch.arange(n, device=device)
    spare = torch.empty_like(x)
    for slot in range(4):
        op = order[:, slot]
        matrix = torch.where(apply.view(n, 1, 1), ops[op, rows], eye)
        # Contrast blends towards the mean luma of the image as it is NOW (after earlier slots).
        is_contrast = apply & (op == 1)
        luma_mean = x.mean(dim=(2, 3)) @ gray
        bias = torch.where(is_contrast, (1 - factors[1]) * luma_mean, 0.0).unsqueeze(1).expand(n, 3)
        x, spare = _affine(x, matrix, bias, out=spare).clamp_(0.0, 1.0), x
    return x


def _yiq_hue_rotation(hue: Tensor) -> Tensor:
    """[n] hue shifts in turns (−0.5…0.5) → [n, 3, 3] RGB matrices rotating the YIQ chroma plane."""
    angle = hue.double() * 2 * math.pi
    cos, sin = torch.cos(angle), torch.sin(angle)
    rot = torch.zeros(hue.shape[0], 3, 3, dtype=torch.float64, device=hue.device)
    rot[:, 0, 0] = 1.0
    rot[:, 1, 1], rot[:, 1, 2], rot[:, 2, 1], rot[:, 2, 2] = cos, -sin, sin, cos
    return (_YIQ_TO_RGB.to(hue.device) @ rot @ _RGB_TO_YIQ.to(hue.device)).float()


def _grayscale(x: Tensor, apply: Tensor) -> None:
    """torchvision RandomGrayscale (3-channel luma) on the selected images, in place."""
    index = apply.nonzero().squeeze(1)
    if index.numel() == 0:
        return
    to_gray = (torch.ones(3, 1) * torch.tensor(_GRAY)).to(x.device).expand(index.numel(), 3, 3)
    x.index_copy_(0, index, _affine(x[index], to_gray))


def _solarize(x: Tensor, apply: Tensor, threshold: float) -> None:
    """Invert pixels >= threshold on the selected images, in place (RandomSolarize(128) on uint8)."""
    index = apply.nonzero().squeeze(1)
    if index.numel() == 0:
        return
    sub = x[index]
    x.index_copy_(0, index, torch.where(sub >= threshold, 1.0 - sub, sub))


def _gaussian_blur(x: Tensor, apply: Tensor, cfg: AugmentationConfig, rand: Random) -> None:
    """torchvision GaussianBlur(kernel, σ ~ U(σ_min, σ_max)) with reflect padding on the selected images, in
    place. Separable, one depthwise convolution per direction with a per-image kernel."""
    sigma = rand.uniform(*cfg.blur_sigma, x.shape[0])
    index = apply.nonzero().squeeze(1)
    if index.numel() == 0:
        return
    k = cfg.blur_kernel_size
    offsets = torch.linspace(-(k - 1) / 2, (k - 1) / 2, k, device=x.device)
    kernel = torch.exp(-0.5 * (offsets / sigma[index].unsqueeze(1)) ** 2)
    kernel = (kernel / kernel.sum(dim=1, keepdim=True)).repeat_interleave(3, dim=0)  # [m·3, k]
    m, (h, w) = index.numel(), x.shape[-2:]
    sub = F.pad(x[index], [k // 2] * 4, mode="reflect").view(1, m * 3, h + k - 1, w + k - 1)
    # Depthwise convolution is faster on CPU with channels-last (one image-channel per lane).
    sub = sub.contiguous(memory_format=torch.channels_last)
    sub = F.conv2d(sub, kernel.view(m * 3, 1, 1, k), groups=m * 3)
    sub = F.conv2d(sub, kernel.view(m * 3, 1, k, 1), groups=m * 3)
    x.index_copy_(0, index, sub.reshape(m, 3, h, w))
