"""Batched multi-crop augmentation: shapes, normalisation, determinism, exact D4 permutations, effective
blur/solarize/grayscale probabilities (upstream #286 inversion), HED identity, colour-jitter invariants."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dinov3_core.data.augment import MultiCropAugmentation, _crop_boxes
from dinov3_core.data.augment_config import IMAGENET_MEAN, IMAGENET_STD, AugmentationConfig
from dinov3_core.data.augment_random import Random
from dinov3_core.data.photometric import HED_FROM_RGB, hed_jitter

# Everything photometric off, no normalisation, crops = the whole tile at its own size: output == input up
# to the D4 transform. Tests switch single features back on.
IDENTITY = AugmentationConfig(
    n_local_crops=2,
    global_size=16,
    local_size=16,
    global_scale=(1.0, 1.0),
    local_scale=(1.0, 1.0),
    hed_p=0.0,
    color_jitter_p=0.0,
    grayscale_p=0.0,
    blur_p_global=(0.0, 0.0),
    blur_p_local=0.0,
    solarize_p_global=(0.0, 0.0),
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _all_crops(out) -> torch.Tensor:
    """[S_g + S_l, B, 3, s, s] when global and local sizes agree."""
    return torch.cat([out.global_stack, out.local_stack])


def test_shapes_dtypes_and_normalisation() -> None:
    cfg = AugmentationConfig(global_size=32, local_size=16, n_local_crops=3)
    images = torch.randint(0, 256, (4, 40, 40, 3), dtype=torch.uint8, generator=_gen(0))
    out = MultiCropAugmentation(cfg)(images, _gen(1))
    assert len(out.global_crops) == 2 and len(out.local_crops) == 3
    assert all(c.shape == (4, 3, 32, 32) and c.dtype == torch.float32 for c in out.global_crops)
    assert all(c.shape == (4, 3, 16, 16) for c in out.local_crops)
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    for crop in out.global_crops + out.local_crops:
        pixels = crop * std + mean
        assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5

    # Normalisation is exactly (x − mean)/std: compare against the un-normalised identity pipeline.
    plain = dataclasses.replace(IDENTITY, global_size=40, local_size=40)
    float_images = images.permute(0, 3, 1, 2).float() / 255
    raw = MultiCropAugmentation(plain)(images, _gen(2)).global_stack
    normed = MultiCropAugmentation(dataclasses.replace(plain, mean=IMAGENET_MEAN, std=IMAGENET_STD))(
        float_images, _gen(2)
    ).global_stack
    torch.testing.assert_close(normed, (raw - mean) / std, rtol=1e-5, atol=1e-5)


def test_uint8_and_float_inputs_agree_and_large_tiles_are_prescaled() -> None:
    images = torch.randint(0, 256, (2, 24, 24, 3), dtype=torch.uint8, generator=_gen(3))
    aug = MultiCropAugmentation(AugmentationConfig(global_size=16, local_size=8, n_local_crops=2))
    a = aug(images, _gen(4))
    b = aug(images.permute(0, 3, 1, 2).float() / 255, _gen(4))
    torch.testing.assert_close(a.global_stack, b.global_stack)
    big = MultiCropAugmentation(AugmentationConfig(global_size=16, local_size=8, n_local_crops=1))(
        torch.rand(2, 3, 100, 100), _gen(5)
    )
    assert big.global_stack.shape == (2, 2, 3, 16, 16)
    with pytest.raises(ValueError):
        aug(torch.zeros(2, 3, 8, 8, dtype=torch.uint8))


def test_determinism_with_a_generator() -> None:
    images = torch.randint(0, 256, (3, 48, 48, 3), dtype=torch.uint8, generator=_gen(6))
    aug = MultiCropAugmentation(AugmentationConfig(global_size=32, local_size=16, n_local_crops=2))
    a, b, c = aug(images, _gen(7)), aug(images, _gen(7)), aug(images, _gen(8))
    assert torch.equal(a.global_stack, b.global_stack) and torch.equal(a.local_stack, b.local_stack)
    assert not torch.equal(a.global_stack, c.global_stack)


def _d4(image: torch.Tensor) -> list[torch.Tensor]:
    rots = [torch.rot90(image, k, dims=(-2, -1)) for k in range(4)]
    return rots + [torch.flip(r, dims=(-1,)) for r in rots]


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
def test_flips_and_rotations_are_exact_permutations(interpolation: str) -> None:
    side, batch = 16, 12
    base = (torch.arange(side * side, dtype=torch.float32) + 0.5) / (side * side)  # unique values
    images = torch.stack([base.view(side, side) + 0.0 * c for c in range(3)])[None].repeat(batch, 1, 1, 1)
    cfg = dataclasses.replace(IDENTITY, interpolation=interpolation)
    out = _all_crops(MultiCropAugmentation(cfg)(images, _gen(9)))  # [4, B, 3, 16, 16]
    found = set()
    for crop in out.flatten(0, 1):
        errors = [(crop - t).abs().max().item() for t in _d4(images[0])]
        best = int(np.argmin(errors))
        assert errors[best] < 1e-5, f"not a D4 permutation of the tile (max err {errors[best]})"
        found.add(best)
    assert found == set(range(8))  # all eight orientations occur

    # Official mode: horizontal flip only.
    hflip_only = MultiCropAugmentation(dataclasses.replace(cfg, dihedral=False))(images, _gen(10))
    kinds = set()
    for crop in _all_crops(hflip_only).flatten(0, 1):
        if torch.allclose(crop, images[0], atol=1e-5):
            kinds.add("identity")
        elif torch.allclose(crop, images[0].flip(-1), atol=1e-5):
            kinds.add("hflip")
        else:
            pytest.fail("dihedral=False produced something other than identity or a horizontal flip")
    assert kinds == {"identity", "hflip"}


def test_crop_boxes_follow_random_resized_crop() -> None:
    rand = Random(_gen(11), torch.device("cpu"))
    top, left, h, w = _crop_boxes(4000, 224, 224, (0.05, 0.32), (3 / 4, 4 / 3), rand)
    area = h * w / 224**2
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 224).all() and (left + w <= 224).all()
    assert area.min() >= 0.045 and area.max() <= 0.33
    assert (w / h).min() >= 0.72 and (w / h).max() <= 1.39
    assert (top == top.round()).all() and (w == w.round()).all()  # integer pixel boxes, like torchvision
    assert area.std() > 0.05 and (left / (224 - w).clamp_min(1)).mean() == pytest.approx(0.5, abs=0.03)
    # Impossible ratios fall back to the centred, ratio-clamped whole image.
    top, left, h, w = _crop_boxes(5, 100, 300, (0.9, 1.0), (1.0, 1.0), rand)
    assert (h == 100).all() and (w == 100).all() and (left == 100).all() and (top == 0).all()


def _checkerboard(batch: int, side: int) -> torch.Tensor:
    grid = (torch.arange(side)[:, None] + torch.arange(side)[None, :]) % 2
    return grid.float().expand(batch, 3, side, side).clone()


def test_blur_probabilities_are_the_intended_ones() -> None:
    """Upstream (#286) blurs crop 1 with p 0.0 and crop 2 with p 0.9; intended and ours: 1.0 / 0.1 / 0.5."""
    batch, side = 300, 16
    cfg = dataclasses.replace(
        IDENTITY,
        n_local_crops=8,
        blur_p_global=(1.0, 0.1),
        blur_p_local=0.5,
        blur_sigma=(1.0, 2.0),  # every applied blur is clearly visible on a checkerboard
    )
    out = MultiCropAugmentation(cfg)(_checkerboard(batch, side), _gen(12))

    def blurred(crops: torch.Tensor) -> torch.Tensor:
        variation = (crops[..., 1:] - crops[..., :-1]).abs().mean(dim=(-3, -2, -1))
        return variation < 0.5  # sharp checkerboard: 1.0; σ ≥ 1 blur: < 0.3

    rate_1 = blurred(out.global_stack[0]).float().mean().item()
    rate_2 = blurred(out.global_stack[1]).float().mean().item()
    rate_local = blurred(out.local_stack).float().mean().item()
    assert rate_1 == 1.0
    assert rate_2 == pytest.approx(0.1, abs=0.06)  # 5σ for n=300
    assert rate_local == pytest.approx(0.5, abs=0.05)  # 5σ for n=2400


def test_solarize_only_on_second_global_crop_and_grayscale_rate() -> None:
    batch = 400
    images = torch.tensor([0.8, 0.6, 0.9]).view(1, 3, 1, 1).expand(batch, 3, 8, 8).clone()
    cfg = dataclasses.replace(
        IDENTITY, global_size=8, local_size=8, solarize_p_global=(0.0, 0.2), grayscale_p=0.2, n_local_crops=2
    )
    out = MultiCropAugmentation(cfg)(images, _gen(13))
    first, second = out.global_stack[0, :, 0, 0, 0], out.global_stack[1, :, 0, 0, 0]
    # Solarize maps ≥ 128/255 to 1 − x: red 0.8 → 0.2; grayscale gives luma ≈ 0.696 (→ 0.304 if solarized).
    assert (first > 0.5).all() and (out.local_stack[:, :, 0, 0, 0] > 0.5).all()
    assert (second < 0.5).float().mean().item() == pytest.approx(0.2, abs=0.06)
    crops = _all_crops(out).flatten(0, 1)
    gray = (crops.amax(dim=1) - crops.amin(dim=1)).amax(dim=(-2, -1)) < 1e-6
    assert gray.float().mean().item() == pytest.approx(0.2, abs=0.04)


def test_hed_matrix_and_zero_sigma_identity() -> None:
    skimage_color = pytest.importorskip("skimage.color")
    np.testing.assert_allclose(HED_FROM_RGB.numpy(), skimage_color.hed_from_rgb, rtol=1e-12)

    images = torch.randint(0, 256, (6, 20, 20, 3), dtype=torch.uint8, generator=_gen(14))
    base = dataclasses.replace(IDENTITY, global_size=20, local_size=20)
    reference = MultiCropAugmentation(base)(images, _gen(15))
    zero = dataclasses.replace(base, hed_p=1.0, hed_scale_sigma=0.0, hed_shift_sigma=0.0)
    jittered = MultiCropAugmentation(zero)(images, _gen(15))  # same draws: params are drawn regardless of p
    torch.testing.assert_close(_all_crops(jittered), _all_crops(reference), atol=2e-5, rtol=0)
    strong = dataclasses.replace(base, hed_p=1.0, hed_scale_sigma=0.3, hed_shift_sigma=0.05)
    assert (_all_crops(MultiCropAugmentation(strong)(images, _gen(15))) - _all_crops(reference)).abs().max() > 0.05


def test_hed_jitter_matches_skimage_formula() -> None:
    """Independent numpy restatement of skimage's separate/combine_stains (without the clip at 0)."""
    skimage_color = pytest.importorskip("skimage.color")
    gen = _gen(16)
    x = torch.rand(2, 3, 5, 5, generator=gen) * 0.9 + 0.05
    scale = torch.tensor([[1.1, 0.9, 1.0], [0.95, 1.05, 1.2]])
    shift = torch.tensor([[0.01, -0.02, 0.0], [-0.01, 0.015, 0.005]])
    got = hed_jitter(x, scale, shift)
    log_adjust = np.log(1e-6)
    for i in range(2):
        rgb = x[i].permute(1, 2, 0).double().numpy()
        stains = (np.log(np.maximum(rgb, 1e-6)) / log_adjust) @ skimage_color.hed_from_rgb
        stains = stains * scale[i].double().numpy() + shift[i].double().numpy()
        back = np.clip(np.exp(-(stains * -log_adjust) @ skimage_color.rgb_from_hed), 0, 1)
        np.testing.assert_allclose(got[i].permute(1, 2, 0).numpy(), back, atol=1e-5)


def test_color_jitter_invariants() -> None:
    gen = _gen(17)
    images = torch.rand(64, 3, 8, 8, generator=gen) * 0.4 + 0.2  # mid-range: no clamping below
    base = dataclasses.replace(IDENTITY, global_size=8, local_size=8, dihedral=False, color_jitter_p=1.0)
    no_flip = dataclasses.replace(base, color_jitter_p=0.0)

    def run(**changes):
        off = {"brightness": 0.0, "contrast": 0.0, "saturation": 0.0, "hue": 0.0}
        cfg = dataclasses.replace(base, **{**off, **changes})
        out = MultiCropAugmentation(cfg)(images, _gen(18)).global_stack[0]
        ref = MultiCropAugmentation(no_flip)(images, _gen(18)).global_stack[0]  # same flips, no jitter
        return out, ref

    out, ref = run(brightness=0.4)  # a single factor per image in [0.6, 1.4]
    ratio = out / ref
    assert (ratio.amax(dim=(1, 2, 3)) - ratio.amin(dim=(1, 2, 3))).max() < 1e-4
    assert ratio.min() >= 0.6 - 1e-4 and ratio.max() <= 1.4 + 1e-4 and ratio.std() > 0.1

    luma = torch.tensor([0.2989, 0.587, 0.114]).view(1, 3, 1, 1)
    out, ref = run(saturation=0.2)  # blends with luma: luma unchanged
    torch.testing.assert_close((out * luma).sum(1), (ref * luma).sum(1), atol=1e-4, rtol=0)
    assert (out - ref).abs().max() > 1e-3

    out, ref = run(contrast=0.4)  # blends with the mean luma: mean luma unchanged
    torch.testing.assert_close((out * luma).sum(1).mean((1, 2)), (ref * luma).sum(1).mean((1, 2)), atol=1e-4, rtol=0)

    yiq_y = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    out, ref = run(hue=0.1)  # rotates chroma: YIQ luma unchanged
    unclamped = ((out > 1e-6) & (out < 1 - 1e-6)).all(dim=(1, 2, 3))
    torch.testing.assert_close((out * yiq_y).sum(1)[unclamped], (ref * yiq_y).sum(1)[unclamped], atol=1e-4, rtol=0)
    assert (out - ref).abs().max() > 1e-3


@pytest.mark.parametrize("group", [1, 2, 6])
def test_one_call_over_groups_draws_what_each_group_draws_alone(group: int) -> None:
    """A list of generators splits the batch into groups of consecutive images: the crops are those of one call
    per group (the stream-position rule of the training step), computed in one batched call. Every colour and
    stain step on, cohort re-targeting included."""
    from dinov3_core.data.stain import CohortStain

    cfg = AugmentationConfig(
        n_local_crops=3, global_size=32, local_size=16, hed_p=0.7, stain_norm_p=0.6, solarize_p_global=(0.5, 0.5)
    )
    cohort = CohortStain.from_slide_stats([[60.0, 12.0, -8.0], [70.0, 8.0, -4.0]], [[12.0, 5.0, 4.0], [9.0, 4.0, 3.0]])
    aug = MultiCropAugmentation(cfg, stain=cohort)
    images = torch.randint(0, 256, (6, 48, 48, 3), dtype=torch.uint8, generator=_gen(5))
    seeds = range(100, 100 + 6 // group)
    batched = aug(images, [_gen(s) for s in seeds])
    alone = [aug(images[k * group : (k + 1) * group], _gen(s)) for k, s in enumerate(seeds)]
    for got, want in (
        (batched.global_stack, [c.global_stack for c in alone]),
        (batched.local_stack, [c.local_stack for c in alone]),
    ):
        want_all = torch.cat(want, dim=1)
        # Same draws; pixels to float rounding (a lone image takes other reduction kernels than a batch).
        assert got.shape == want_all.shape
        torch.testing.assert_close(got, want_all, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="equal groups"):
        aug(images, [_gen(1)] * 4)
