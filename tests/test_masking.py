"""iBOT block masking: per-batch ratios and counts, block shapes, bundle fields, micro-batch slicing,
determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dinov3_core.data.masking import IBOTMasks, IBOTMaskSampler, MaskingGenerator, as_numpy_rng


def test_batch_counts_and_ratios_follow_the_official_scheme() -> None:
    grid, batch, n_global = 14, 16, 2
    masks = IBOTMaskSampler(grid)(batch, n_global, rng=0)
    n_patches = grid * grid
    assert masks.masks.shape == (n_global * batch, n_patches) and masks.masks.dtype == torch.bool
    per_crop = masks.masks.sum(dim=1).tolist()
    n_masked_crops = int(n_global * batch * 0.5)
    ratios = np.linspace(0.1, 0.5, n_masked_crops + 1)[1:]
    # Exactly one crop per ratio, with exactly int(N·ratio) patches; the rest unmasked.
    assert sorted(per_crop) == sorted([0] * (n_global * batch - n_masked_crops) + [int(n_patches * r) for r in ratios])
    assert max(per_crop) <= 0.5 * n_patches
    # Shuffled: the masked crops are not simply the first rows.
    assert [c > 0 for c in per_crop] != [True] * n_masked_crops + [False] * (n_global * batch - n_masked_crops)


def test_configurable_ratio_and_probability() -> None:
    masks = IBOTMaskSampler(8, mask_ratio=(0.2, 0.3), mask_probability=1.0)(5, 2, rng=1)
    counts = masks.masks.sum(dim=1)
    assert (counts >= int(64 * 0.2)).all() and (counts <= int(64 * 0.3)).all()
    assert IBOTMaskSampler(8, mask_probability=0.0)(5, 2, rng=1).n_masked_patches == 0
    with pytest.raises(ValueError):
        IBOTMaskSampler(8, mask_ratio=(0.5, 0.1))


def test_blocks_are_rectangles_within_limits() -> None:
    gen = MaskingGenerator(14)
    rng = np.random.default_rng(2)
    areas, aspects = [], []
    for _ in range(300):
        mask = np.zeros((14, 14), dtype=bool)
        added = gen.add_block(mask, max_new=gen.max_block_patches, rng=rng)
        assert added == mask.sum() > 0
        rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
        h, w = np.ptp(rows) + 1, np.ptp(cols) + 1
        assert added == h * w  # a filled axis-aligned rectangle
        assert h < 14 and w < 14 and added <= gen.max_block_patches == 98
        areas.append(added)
        aspects.append(w / h)
    # Target area ≥ 4 (rounding of h, w can give 3), aspect in [0.3, 1/0.3] up to rounding of small blocks.
    assert min(areas) >= 3 and np.mean(np.array(areas) >= 4) > 0.95
    assert min(aspects) >= 0.2 and max(aspects) <= 5.0
    assert np.mean([(1 / 3.5) <= a <= 3.5 for a in aspects]) > 0.95


def test_masks_are_blocky_not_random() -> None:
    """Block masks have far fewer mask/unmask boundaries than random masks with the same count."""
    gen, rng = MaskingGenerator(14), np.random.default_rng(3)

    def boundaries(m: np.ndarray) -> int:
        return int((m[1:] != m[:-1]).sum() + (m[:, 1:] != m[:, :-1]).sum())

    block = [boundaries(gen(60, rng)) for _ in range(20)]
    random = []
    for _ in range(20):
        m = np.zeros(196, dtype=bool)
        m[rng.choice(196, 60, replace=False)] = True
        random.append(boundaries(m.reshape(14, 14)))
    assert np.mean(block) < 0.6 * np.mean(random)


def test_generator_hits_exact_counts_including_edge_cases() -> None:
    gen, rng = MaskingGenerator(4, max_block_patches=8), np.random.default_rng(4)
    for n in (0, 1, 2, 3, 7, 8, 15, 16):
        assert gen(n, rng).sum() == n
    with pytest.raises(ValueError):
        gen(17, rng)


def test_bundle_indices_and_weights() -> None:
    masks = IBOTMaskSampler(6)(4, 2, rng=5)
    flat = masks.masks.flatten()
    assert torch.equal(masks.mask_indices, flat.nonzero().flatten())
    assert masks.n_masked_patches == int(flat.sum()) and masks.n_crops == 8 and masks.batch_size == 4
    crop_of_patch = masks.mask_indices // 36
    per_crop = masks.masks.sum(dim=1)
    torch.testing.assert_close(masks.masks_weight, 1.0 / per_crop[crop_of_patch].float())
    # Each masked crop's weights sum to one, so iBOT averages per crop.
    sums = torch.zeros(8).index_add_(0, crop_of_patch, masks.masks_weight)
    torch.testing.assert_close(sums, (per_crop > 0).float())
    assert masks.masks_weight.dtype == torch.float32


def test_microbatch_slices_masks_and_target_positions() -> None:
    masks = IBOTMaskSampler(5, mask_probability=1.0)(8, 2, rng=6)
    step_targets = torch.arange(masks.n_masked_patches)  # stand-in for per-masked-patch teacher targets
    grid = masks.masks.view(2, 8, 25)
    seen = []
    for i in range(4):
        micro, positions = masks.microbatch(i, 4)
        assert torch.equal(micro.masks, grid[:, 2 * i : 2 * i + 2].reshape(4, 25))
        assert micro.n_global_crops == 2 and micro.batch_size == 2
        # Position p of the step's masked patches is crop c, image b, patch q: check it maps back exactly.
        step_flat = masks.mask_indices[step_targets[positions]]
        crop, image, patch = step_flat // (8 * 25), (step_flat // 25) % 8, step_flat % 25
        micro_flat = micro.mask_indices
        assert torch.equal(crop, micro_flat // (2 * 25))
        assert torch.equal(image - 2 * i, (micro_flat // 25) % 2)
        assert torch.equal(patch, micro_flat % 25)
        seen.append(positions)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(masks.n_masked_patches))
    with pytest.raises(ValueError):
        masks.microbatch(0, 3)


def test_determinism_and_random_sources() -> None:
    sampler = IBOTMaskSampler(14)
    a, b = sampler(8, 2, rng=7), sampler(8, 2, rng=7)
    assert torch.equal(a.masks, b.masks)
    assert not torch.equal(a.masks, sampler(8, 2, rng=8).masks)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert torch.equal(sampler(8, 2, rng=g1).masks, sampler(8, 2, rng=g2).masks)
    assert torch.equal(sampler(8, 2, rng=g1).masks, sampler(8, 2, rng=g2).masks)  # generators advanced alike
    np_rng = np.random.default_rng(10)
    assert as_numpy_rng(np_rng) is np_rng


def test_from_masks_validation_and_to() -> None:
    with pytest.raises(ValueError):
        IBOTMasks.from_masks(torch.zeros(3, 4, dtype=torch.bool), n_global_crops=2)
    with pytest.raises(ValueError):
        IBOTMasks.from_masks(torch.zeros(4, 4), n_global_crops=2)
    masks = IBOTMasks.from_masks(torch.eye(4, dtype=torch.bool), n_global_crops=2)
    moved = masks.to("cpu")
    assert torch.equal(moved.masks, masks.masks) and moved.n_global_crops == 2
    assert math.isclose(float(masks.masks_weight.sum()), 4.0)
