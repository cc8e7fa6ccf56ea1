"""Several µm/px per slide in one tile store (tile.mpp a list): layout, provenance, skip rule, readers, the training
level mix (proportions, resume determinism), extract at a further level, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from dinov3_core.config import ConfigError, load_config
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.data.tile_levels import LevelTiles
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.engine import run_tile
from dinov3_core.train.sampler import LEVEL_BLOCK, LevelMix, StepSampler
from tests import helpers

SLIDE = "tissue_20x"  # the 20× sample slide: 0.5 µm/px at level 0
# What a single-level store held before stores had levels (written by the code before this feature, same config).
SINGLE_FILES = [
    "blur_score/c/0",
    "blur_score/zarr.json",
    "coords/c/0/0",
    "coords/zarr.json",
    "pen_fraction/c/0",
    "pen_fraction/zarr.json",
    "qc_mask.png",
    "qc_thumbnail.png",
    "tiles/c/0/0/0/0",
    "tiles/c/1/0/0/0",
    "tiles/zarr.json",
    "tissue_fraction/c/0",
    "tissue_fraction/zarr.json",
    "zarr.json",
]
SINGLE_ATTRS = sorted(
    [
        "bytes_per_tile",
        "bytes_stored",
        "candidate_count",
        "complete",
        "compressor",
        "created",
        "dropped_by_filters",
        "filters",
        "input_path",
        "level0_height",
        "level0_mpp",
        "level0_width",
        "level_count",
        "level_downsamples",
        "level_mpp",
        "level_used",
        "mpp_effective",
        "mpp_requested",
        "mpp_source",
        "objective_power",
        "openslide_python_version",
        "openslide_version",
        "params_hash",
        "plan_seconds",
        "read_size",
        "reader",
        "slide_id",
        "source_fingerprint",
        "source_size",
        "source_path",
        "stain_lab_mean",
        "stain_lab_std",
        "stain_lab_tile_std",
        "stride",
        "stride_level0",
        "tile_count",
        "tile_size",
        "tile_size_level0",
        "tissue",
        "vendor",
    ]
)
# tile_size=64, compressor=zstd, the rest default; the tissue mask's version (2: the pen mask's hue test) is in it, so
# a store tiled with the former mask re-tiles
SINGLE_PARAMS_HASH = "14157bd1b91d4b0a"


def _files(slide: Path) -> list[str]:
    return sorted(str(p.relative_to(slide)) for p in slide.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def stores(sample_slides, tmp_path_factory):
    """The 20× slide at 64 px: a single-level store (0.5 µm/px), then the same store asked for [0.5, 1.0]."""
    slide = helpers.by_name(sample_slides, f"{SLIDE}.svs")
    root = tmp_path_factory.mktemp("mpp")
    single = root / "single.zarr"
    run_tile(helpers.tile_config(slide, single, tile_size=64, compressor="zstd"))
    single_snapshot = {p: (single / "slides" / SLIDE / p).read_bytes() for p in _files(single / "slides" / SLIDE)}
    two = root / "two.zarr"
    first = run_tile(helpers.tile_config(slide, two, tile_size=64, compressor="zstd"))
    again = run_tile(helpers.tile_config(slide, two, tile_size=64, compressor="zstd", mpp=[0.5, 1.0]))
    rerun = run_tile(helpers.tile_config(slide, two, tile_size=64, compressor="zstd", mpp=[0.5, 1.0]))
    return {
        "slide": slide,
        "single": single,
        "single_snapshot": single_snapshot,
        "two": two,
        "statuses": [r.outcomes[0].status for r in (first, again, rerun)],
    }


def test_a_single_level_store_keeps_its_layout(stores) -> None:
    slide = stores["single"] / "slides" / SLIDE
    assert _files(slide) == SINGLE_FILES
    attrs = ts.read_slide_attrs(stores["single"], SLIDE)
    assert sorted(attrs) == SINGLE_ATTRS and attrs["params_hash"] == SINGLE_PARAMS_HASH
    assert json.loads((stores["single"] / "manifest.json").read_text())["tiling"]["mpp"] == 0.5


def test_two_levels_have_provenance_and_the_geometrys_tile_counts(stores) -> None:
    two, slide = stores["two"], stores["two"] / "slides" / SLIDE
    attrs = ts.read_slide_attrs(two, SLIDE)
    first, second = attrs["levels"]
    assert (first["path"], second["path"]) == ("", "levels/1")
    assert second["mpp_requested"] == 1.0 and second["mpp_effective"] == pytest.approx(1.0)
    assert second["level_used"] == 0 and second["read_size"] == 128 and second["tile_size"] == 64
    assert second["tile_size_level0"] == 128 and second["stride_level0"] == 128 and second["stride"] == 64
    group = zarr.open_group(str(slide / "levels" / "1"), mode="r")
    assert group.attrs[ts.ATTRS_KEY]["mpp_requested"] == 1.0
    n0, n1 = attrs["tile_count"], second["tile_count"]
    assert group["tiles"].shape == (n1, 64, 64, 3) and group["coords"].shape == (n1, 2)
    # The same tissue mask: a 1 µm/px tile covers 2×2 tiles of 0.5 µm/px, so about a quarter as many tiles.
    assert abs(n1 - n0 / 4) <= 0.15 * n0 / 4
    coords1 = np.asarray(group["coords"][...])
    assert not (coords1 % 128).any()  # on the 128-px level-0 grid
    # The first level is where a single-level store keeps it, byte for byte.
    for name, data in stores["single_snapshot"].items():
        if name != "zarr.json" and not name.endswith(".png"):  # the slide's attrs differ: `levels`, times
            assert (slide / name).read_bytes() == data, name
    # A pixel check of the second level: the box average of the 0.5 µm/px tiles it covers.
    ds0, ds1 = TileDataset(two, image_format="numpy"), TileDataset(two, mpp=1.0, image_format="numpy")
    assert len(ds0) == n0 and len(ds1) == n1 and ds1.slide_attrs(0)["tile_size_level0"] == 128
    where0 = {tuple(c): i for i, c in enumerate(ds0.slide_coords(0))}
    x, y = ds1.slide_coords(0)[0]
    quad = [where0.get((x + dx, y + dy)) for dy in (0, 64) for dx in (0, 64)]
    if None not in quad:
        t = ds0.read_batch(quad).astype(np.float64)
        big = np.concatenate([np.concatenate(t[:2], axis=1), np.concatenate(t[2:], axis=1)], axis=0)
        down = big.reshape(64, 2, 64, 2, 3).mean(axis=(1, 3))
        assert np.abs(down - ds1.read_batch([0])[0]).mean() < 3.0


def test_asking_for_a_level_the_slide_lacks_retiles_it_and_a_rerun_skips(stores) -> None:
    assert stores["statuses"] == ["ok", "ok", "skipped"]


def test_reading_a_level_a_store_lacks_names_it_and_the_levels_there(stores) -> None:
    with pytest.raises(ts.TileStoreError, match=r"no level at 2 µm/px \(its levels: 0.5, 1 µm/px\)"):
        TileDataset(stores["two"], mpp=2.0)
    with pytest.raises(ts.TileStoreError, match=r"no level at 1 µm/px \(its levels: 0.5 µm/px\)"):
        TileDataset(stores["single"], mpp=1.0)


def test_the_tile_config_takes_a_list_and_refuses_bad_ones(tmp_path) -> None:
    assert helpers.tile_config("x.svs", tmp_path / "t.zarr", mpp=[0.5]).mpp == 0.5  # one level: a plain number
    assert helpers.tile_config("x.svs", tmp_path / "t.zarr", mpp=[0.5, 2]).mpp_levels == [0.5, 2.0]
    for bad in ([], [0.5, 0.5], [0.5, -1.0]):
        with pytest.raises(ConfigError, match="mpp"):
            helpers.tile_config("x.svs", tmp_path / "t.zarr", mpp=bad)


def test_the_level_mix_draws_by_weight_and_resumes_exactly(stores) -> None:
    two = stores["two"]
    levels = LevelTiles([TileDataset(two, mpp=m, image_format="numpy") for m in (0.5, 1.0)], [0.5, 1.0])
    mix = LevelMix(levels.sizes, [0.7, 0.3], seed=5)
    whole = StepSampler(len(levels.datasets[0]), 32, seed=5, stop_iteration=2 * LEVEL_BLOCK // 32, levels=mix)
    keys = list(whole)
    drawn = np.concatenate([k.indices for k in keys])
    share = np.bincount(levels.level_of(drawn), minlength=2) / len(drawn)
    assert share == pytest.approx([0.7, 0.3], abs=1 / LEVEL_BLOCK)
    # Level 1's first draws are a permutation of its tiles (each seen once per its own epoch).
    first = drawn[levels.level_of(drawn) == 1][: levels.sizes[1]]
    assert sorted(first - levels.offsets[1]) == list(range(levels.sizes[1]))
    # A run resumed at step 17 (a fresh mix, as in a new process) sees exactly what the uninterrupted one did.
    resumed = StepSampler(
        len(levels.datasets[0]),
        32,
        seed=5,
        start_iteration=17,
        start_sample=17 * 32,
        stop_iteration=len(keys),
        levels=LevelMix(levels.sizes, [0.7, 0.3], seed=5),
    )
    for a, b in zip(keys[17:], resumed, strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
    batch = levels.read_batch(keys[0].indices[:6])
    for i, idx in enumerate(keys[0].indices[:6]):
        k = int(levels.level_of([idx])[0])
        np.testing.assert_array_equal(batch[i], levels.datasets[k].read_batch([idx - levels.offsets[k]])[0])


def test_pretrain_opens_the_weighted_levels_and_names_a_missing_one(stores, tmp_path) -> None:
    from dinov3_core.train.trainer_setup import open_levels, open_tiles

    cfg = helpers.pretrain_config(stores["two"], tmp_path / "run", **{"data.mpp_weights": {0.5: 0.6, 1.0: 0.4}})
    tiles = open_tiles(cfg)
    levels, mix = open_levels(cfg, tiles)
    assert levels.sizes == [len(tiles), len(TileDataset(stores["two"], mpp=1.0))]
    assert list(mix.quotas) == [614, 410]
    assert open_levels(helpers.pretrain_config(stores["two"], tmp_path / "run"), tiles) is None
    bad = helpers.pretrain_config(stores["two"], tmp_path / "run", **{"data.mpp_weights": {0.5: 0.5, 1.1: 0.5}})
    with pytest.raises(ConfigError, match=r"data.mpp_weights: 1.1 µm/px is not a level .*did you mean 1\?"):
        open_levels(bad, tiles)
    with pytest.raises(ConfigError, match=r"data\.mpp_weights"):
        helpers.pretrain_config(stores["two"], tmp_path / "run", **{"data.mpp_weights": {0.5: -1}})


def test_extract_at_the_second_level_records_it(stores, converted, tmp_path) -> None:
    from dinov3_core.errors import WsidinoError
    from dinov3_core.extract.config import ExtractConfig
    from dinov3_core.extract.extract import ATTRS_KEY, read_run_record, run_extract

    def cfg(**values):
        return load_config(ExtractConfig, "default", {"progress": False, "pca_map": False, **values}, stage="extract")

    out = tmp_path / "features.zarr"
    result = run_extract(cfg(store=str(stores["two"]), model=str(converted), output=str(out), mpp=1.0))
    n1 = len(TileDataset(stores["two"], mpp=1.0))
    assert result.tiles == n1 and result.mpp == 1.0 and read_run_record(out)["mpp"] == 1.0
    g = zarr.open_group(str(out / "slides" / SLIDE), mode="r")
    assert g["cls"].shape[0] == n1 and g.attrs[ATTRS_KEY]["mpp_requested"] == 1.0
    assert g.attrs[ATTRS_KEY]["tile_size_level0"] == 128
    # The first level is not the second's features: asked for it, the slide is extracted again.
    again = run_extract(cfg(store=str(stores["two"]), model=str(converted), output=str(out)))
    assert again.extracted == [SLIDE] and again.mpp == 0.5
    with pytest.raises(WsidinoError, match=r"no level at 4 µm/px \(its levels: 0.5, 1 µm/px\)"):
        run_extract(cfg(store=str(stores["two"]), model=str(converted), output=str(out), mpp=4.0))


@pytest.mark.usefixtures("one_thread")
def test_a_pretrain_run_trains_on_both_levels_and_resumes(stores, tmp_path) -> None:
    """The training loop itself over a two-level store with weights: it runs, its batches hold tiles of both levels
    (the loader's step indices fall in both halves of the concatenated dataset), and a resumed run ends where an
    uninterrupted one does."""
    import json

    import torch

    from dinov3_core.train.pretrain import run_pretrain
    from dinov3_core.train.trainer_setup import open_levels, open_tiles

    run = {
        "data.mpp_weights": {0.5: 0.5, 1.0: 0.5},
        "train.batch_size_per_gpu": 8,
        "checkpointing.period": 2,
        "evaluation.eval_period_iterations": 0,
        "health.probe_tiles": 0,
    }
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    with helpers.torch_threads():
        run_pretrain(helpers.pretrain_config(stores["two"], straight, **run, **{"train.stop_at": 4}))
        run_pretrain(helpers.pretrain_config(stores["two"], resumed, **run, **{"train.stop_at": 2}))
        run_pretrain(helpers.pretrain_config(stores["two"], resumed, **run, **{"train.stop_at": 4}))
    lines = [json.loads(x) for x in (straight / "training_metrics.json").read_text().splitlines() if x.strip()]
    assert [r["iteration"] for r in lines if "event" not in r] == [0, 1, 2, 3]

    cfg = helpers.pretrain_config(stores["two"], straight, **run)
    tiles = open_tiles(cfg)
    _, mix = open_levels(cfg, tiles)
    drawn = mix.stream(0, 4 * 8)  # the 4 steps of 8 images the run trained on
    assert (drawn < len(tiles)).any() and (drawn >= len(tiles)).any()

    want = helpers.flat_tensors(helpers.load_dcp(straight / "ckpt" / "3"))
    got = helpers.flat_tensors(helpers.load_dcp(resumed / "ckpt" / "3"))
    assert want.keys() == got.keys() and any(k.startswith("model.student.") for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ[:10]
    # … and the mix is what the loop trained on: the first level alone ends elsewhere.
    first_only = tmp_path / "first-only"
    with helpers.torch_threads():
        run_pretrain(
            helpers.pretrain_config(
                stores["two"], first_only, **{**run, "data.mpp_weights": None}, **{"train.stop_at": 4}
            )
        )
    other = helpers.flat_tensors(helpers.load_dcp(first_only / "ckpt" / "3"))
    assert any(not torch.equal(want[k], other[k]) for k in want if k.startswith("model.student."))
