"""Stain statistics recorded by the tile stage and the RandStainNA-style re-targeting of the augmentation.

Real tile stores of the sample slides, which are stained differently on purpose (wsidino_dev.sample_slides); skimage's
colour conversions are the reference.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from skimage import color

from dinov3_core.data.augment import MultiCropAugmentation
from dinov3_core.data.augment_config import AugmentationConfig
from dinov3_core.data.augment_random import Random
from dinov3_core.data.stain import CohortStain, lab_to_rgb, retarget, rgb_to_lab, stain_norm
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.errors import WsidinoError
from dinov3_core.tiling import stain as tiling_stain
from dinov3_core.tiling import store as ts
from tests import helpers

STAIN_ATTRS = ("stain_lab_mean", "stain_lab_std", "stain_lab_tile_std")


@pytest.fixture(scope="module")
def cohort_store(sample_slides, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three good sample slides (three stains) tiled at 64 px, 2 µm/px into one store."""
    store = tmp_path_factory.mktemp("stain_store") / "tiles.zarr"
    return helpers.tile_store(sample_slides.slides, store, tile_size=64, mpp=2.0, compressor="zstd")


def stored_tiles(store: Path, slide_id: str) -> np.ndarray:
    return zarr.open_array(str(ts.slide_dir(store, slide_id) / "tiles"), mode="r")[:]


def per_slide_tiles(store: Path) -> dict[str, np.ndarray]:
    return {s: stored_tiles(store, s) for s in ts.complete_slide_ids(store)}


# ------------------------------------------------------------------------------------------ the tile stage


def test_lab_conversions_match_skimage_on_tile_pixels(cohort_store: Path) -> None:
    tiles = np.concatenate(list(per_slide_tiles(cohort_store).values()))[:64]
    reference = color.rgb2lab(tiles)
    assert np.abs(tiling_stain.rgb_to_lab(tiles) - reference).max() < 1e-3  # numpy, tiling
    x = torch.from_numpy(tiles).permute(0, 3, 1, 2).double() / 255
    lab = rgb_to_lab(x)  # torch, training
    assert (lab.permute(0, 2, 3, 1).numpy() - reference).__abs__().max() < 1e-3
    back = lab_to_rgb(lab).permute(0, 2, 3, 1).numpy()
    assert np.abs(back - color.lab2rgb(reference)).max() < 1e-3
    assert np.abs(back - tiles / 255).max() < 1e-6  # in-gamut round trip


def test_recorded_slide_stats_match_the_stored_tiles(cohort_store: Path) -> None:
    for slide_id, tiles in per_slide_tiles(cohort_store).items():
        attrs = ts.read_slide_attrs(cohort_store, slide_id)
        lab = color.rgb2lab(tiles[:, :: tiling_stain.STEP, :: tiling_stain.STEP]).reshape(len(tiles), -1, 3)
        np.testing.assert_allclose(attrs["stain_lab_mean"], lab.reshape(-1, 3).mean(0), atol=1e-2)
        np.testing.assert_allclose(attrs["stain_lab_std"], lab.reshape(-1, 3).std(0), atol=1e-2)
        np.testing.assert_allclose(attrs["stain_lab_tile_std"], lab.std(1).mean(0), atol=1e-2)
        # The subsample stands for the whole tile: every pixel gives close statistics (the sample slides' texture
        # is periodic, so the 1/64 grid of a 64-px test tile is off by up to ~2 LAB units, below the stain gaps).
        full = color.rgb2lab(tiles).reshape(-1, 3)
        np.testing.assert_allclose(attrs["stain_lab_mean"], full.mean(0), atol=2.5)
        np.testing.assert_allclose(attrs["stain_lab_std"], full.std(0), rtol=0.1)
        # The units' sum files are gone from the committed slide.
        assert not list(ts.slide_dir(cohort_store, slide_id).glob(f"{tiling_stain.SUMS_PREFIX}*"))


def test_the_sample_slides_have_different_stains(cohort_store: Path) -> None:
    means = np.array(
        [ts.read_slide_attrs(cohort_store, s)["stain_lab_mean"] for s in ts.complete_slide_ids(cohort_store)]
    )
    assert len(means) == 3
    assert np.abs(means[:, 1:, None] - means[:, 1:].T[None]).max() > 2.0  # a/b differ by > 2 LAB units somewhere


# ---------------------------------------------------------------------------------------- the augmentation


@pytest.mark.filterwarnings("ignore:.*negative Z values:UserWarning")
def test_retarget_moves_lab_statistics_to_the_target(cohort_store: Path) -> None:
    tiles = per_slide_tiles(cohort_store)
    cohort = CohortStain.from_dataset(TileDataset([cohort_store]))
    assert cohort is not None and cohort.n_slides == 3
    rgb = np.stack([t[len(t) // 2] for t in tiles.values()]) / 255
    target_mean = np.array([cohort.mean_center] * len(rgb))
    target_std = np.array([cohort.std_center] * len(rgb))
    out = retarget(
        torch.from_numpy(rgb).permute(0, 3, 1, 2), torch.from_numpy(target_mean), torch.from_numpy(target_std)
    )
    out = out.permute(0, 2, 3, 1).numpy()

    # The formula, computed independently with skimage (which clips out-of-gamut colours the same way).
    lab = color.rgb2lab(rgb)
    mu, sigma = lab.mean((1, 2), keepdims=True), lab.std((1, 2), keepdims=True)
    expected_lab = (lab - mu) / sigma * target_std[:, None, None] + target_mean[:, None, None]
    expected = np.stack([color.lab2rgb(e) for e in expected_lab])
    assert np.abs(out - expected).max() < 2e-3

    # Where the target stays in gamut, the tile's LAB mean/std are the target's.
    in_gamut = [i for i in range(len(rgb)) if np.abs(color.rgb2lab(expected[i]) - expected_lab[i]).max() < 0.5]
    assert in_gamut, "no tile whose cohort-typical stain stays in gamut"
    for i in in_gamut:
        got = color.rgb2lab(out[i])
        np.testing.assert_allclose(got.mean((0, 1)), target_mean[i], atol=1e-2)
        np.testing.assert_allclose(got.std((0, 1)), target_std[i], rtol=1e-3)


def test_stain_norm_shrinks_the_spread_between_slides(cohort_store: Path) -> None:
    tiles = per_slide_tiles(cohort_store)
    cohort = CohortStain.from_dataset(TileDataset([cohort_store]))
    cfg = AugmentationConfig(stain_norm_p=1.0, stain_norm_sigma_scale=1.0)
    before, after = [], []
    for t in tiles.values():
        x = torch.from_numpy(t[:16]).permute(0, 3, 1, 2).float() / 255
        before.append(color.rgb2lab(t[:16]).mean((1, 2)).mean(0))
        stain_norm(x, cfg, cohort, Random(torch.Generator().manual_seed(0), x.device))
        after.append(color.rgb2lab(x.permute(0, 2, 3, 1).numpy()).mean((1, 2)).mean(0))
    spread_before, spread_after = np.std(before, axis=0), np.std(after, axis=0)
    assert (spread_after[1:] < 0.6 * spread_before[1:]).all(), (spread_before, spread_after)


def tiny_crops(**overrides: object) -> AugmentationConfig:
    return AugmentationConfig(n_global_crops=2, n_local_crops=2, global_size=64, local_size=32, **overrides)


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (4, 80, 80, 3), generator=g, dtype=torch.uint8)


def test_same_generator_state_same_output_and_p0_draws_nothing() -> None:
    cohort = CohortStain((70.0, 20.0, -10.0), (3.0, 2.0, 2.0), (12.0, 8.0, 6.0), (1.0, 1.0, 1.0), 3)
    aug = MultiCropAugmentation(tiny_crops(stain_norm_p=0.5), stain=cohort)
    a = aug(batch(), torch.Generator().manual_seed(7))
    b = aug(batch(), torch.Generator().manual_seed(7))
    assert torch.equal(a.global_stack, b.global_stack) and torch.equal(a.local_stack, b.local_stack)
    plain = MultiCropAugmentation(tiny_crops())(batch(), torch.Generator().manual_seed(7))
    assert not torch.equal(a.global_stack, plain.global_stack)  # the step did something
    # p = 0 with a cohort: no draw, the output of a run without the step, and the generator where it would be.
    g0, g1 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    off = MultiCropAugmentation(tiny_crops(stain_norm_p=0.0), stain=cohort)(batch(), g0)
    MultiCropAugmentation(tiny_crops())(batch(), g1)
    assert torch.equal(off.global_stack, plain.global_stack) and torch.equal(off.local_stack, plain.local_stack)
    assert torch.equal(g0.get_state(), g1.get_state())


def test_stain_norm_p0_is_the_augmentation_before_the_change() -> None:
    """Figures of the augmentation at the commit before stain re-targeting (same seed, tiny crops, HED on): any
    extra random draw would shift every later parameter and change them completely."""
    cohort = CohortStain((70.0, 20.0, -10.0), (3.0, 2.0, 2.0), (12.0, 8.0, 6.0), (1.0, 1.0, 1.0), 3)
    with helpers.torch_threads(1):
        out = MultiCropAugmentation(tiny_crops(hed_p=1.0), stain=cohort)(batch(), torch.Generator().manual_seed(7))
    expected = {
        "global": (81881.33857964509, [0.157043, 0.270988, -0.287967, 0.868782, 1.057058, 0.398234]),
        "local": (14961.25849052994, [-1.063652, -1.458565, -0.940499, 0.394957, 0.923465, 0.564146]),
    }
    for name, t in (("global", out.global_stack), ("local", out.local_stack)):
        total, samples = expected[name]
        assert float(t.double().abs().sum()) == pytest.approx(total, rel=1e-6)
        np.testing.assert_allclose(t.flatten()[::997][:6].numpy(), samples, atol=1e-5)


def test_config_keys_are_checked() -> None:
    with pytest.raises(WsidinoError, match=r"stain_norm_p: must be in \[0, 1\]"):
        tiny_crops(stain_norm_p=1.5)
    with pytest.raises(WsidinoError, match=r"stain_norm_sigma_scale: must be >= 0"):
        tiny_crops(stain_norm_sigma_scale=-1.0)
    assert dataclasses.replace(tiny_crops(), stain_norm_p=0.3).stain_norm_p == 0.3


def test_a_store_without_stats_is_a_logged_no_op(cohort_store: Path, tmp_path: Path, caplog) -> None:
    """A store tiled before stains were recorded: the cohort is None with one warning, and the augmentation runs."""
    import shutil

    old = tmp_path / "old.zarr"
    shutil.copytree(cohort_store, old)
    for slide_id in ts.complete_slide_ids(old):
        group = zarr.open_group(str(ts.slide_dir(old, slide_id)), mode="r+")
        attrs = dict(group.attrs[ts.ATTRS_KEY])
        for key in STAIN_ATTRS:
            attrs.pop(key)
        group.attrs[ts.ATTRS_KEY] = attrs
    dataset = TileDataset([old])
    with caplog.at_level(logging.WARNING, logger="dinov3_core.data.stain"):
        cohort = CohortStain.from_dataset(dataset)
    assert cohort is None
    assert [r.message for r in caplog.records if "stain statistics" in r.getMessage()].__len__() == 1
    crops = tiny_crops(stain_norm_p=1.0)
    out = MultiCropAugmentation(crops, stain=cohort)(batch(), torch.Generator().manual_seed(7))
    plain = MultiCropAugmentation(tiny_crops())(batch(), torch.Generator().manual_seed(7))
    assert torch.equal(out.global_stack, plain.global_stack)
