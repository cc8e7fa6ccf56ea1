"""The tile stage on real slide files (OpenSlide), real zarr stores, through the CLI and the stage function."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import openslide
import pytest
import zarr
from PIL import Image

from dinov3_core.cli import main as cli_main
from dinov3_core.config import ConfigError
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.discovery import discover_slides
from dinov3_core.tiling.engine import run_tile
from dinov3_core.tiling.slide import file_fingerprint
from tests import event_hooks
from tests.helpers import by_name, slide_list, sqlite_uri, tile_config


@pytest.fixture(scope="module")
def tiled(sample_slides, tmp_path_factory):
    """One run over the good slides and every negative case, through the CLI with MLflow on."""
    tmp = tmp_path_factory.mktemp("tiled")
    missing = tmp / "does_not_exist.svs"
    inputs = [*sample_slides.slides, *sample_slides.negatives.values(), missing]
    listing = slide_list(tmp / "slides.txt", inputs)
    store = tmp / "tiles.zarr"
    uri = sqlite_uri(tmp)
    code = cli_main(["tile", "--input", str(listing), "--output", str(store), "progress=false", f"tracking.uri={uri}"])
    manifest = json.loads((store / "manifest.json").read_text())
    entries = {e["slide_id"]: e for e in manifest["slides"]}
    return {"code": code, "store": store, "entries": entries, "uri": uri, "samples": sample_slides}


def test_good_slides_are_committed_with_provenance(tiled):
    store, entries = tiled["store"], tiled["entries"]
    good = [p.stem for p in tiled["samples"].slides]
    assert sorted(good) == ts.complete_slide_ids(store)
    for slide_id in good:
        assert entries[slide_id]["status"] == "ok", entries[slide_id]
        attrs = ts.read_slide_attrs(store, slide_id)
        assert attrs["complete"] is True
        assert attrs["openslide_version"] == openslide.__library_version__
        assert attrs["vendor"] in {"aperio", "generic-tiff"}
        assert attrs["mpp_requested"] == 0.5
        assert abs(attrs["mpp_effective"] - 0.5) / 0.5 <= 0.05
        size, fingerprint = file_fingerprint(attrs["source_path"])
        assert (attrs["source_size"], attrs["source_fingerprint"]) == (size, fingerprint)
        group = zarr.open_group(str(store / "slides" / slide_id), mode="r")
        n = attrs["tile_count"]
        assert n > 0
        assert group["tiles"].shape == (n, 224, 224, 3) and group["tiles"].chunks == (1, 224, 224, 3)
        assert group["coords"].shape == (n, 2) and group["coords"].dtype == np.int64
        assert group["tissue_fraction"].shape == (n,)
        assert (group["tissue_fraction"][:] >= 0.5).all()
        for qc in entries[slide_id]["qc"].values():
            assert (store / qc).is_file()
    assert not list((store / ts.INCOMING).iterdir())


def test_vendor_is_recorded_per_slide(tiled, sample_slides):
    svs = by_name(sample_slides, "tissue_40x.svs").stem
    tiff = by_name(sample_slides, "tissue_generic.tiff").stem
    assert ts.read_slide_attrs(tiled["store"], svs)["vendor"] == "aperio"
    assert ts.read_slide_attrs(tiled["store"], tiff)["vendor"] == "generic-tiff"


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        ("no_mpp", "mpp_overrides"),
        ("truncated", "truncated"),
        ("not_a_slide", "not a whole-slide image"),
        ("no_tissue", "no tissue found"),
    ],
)
def test_bad_slides_fail_alone_with_a_clear_message(tiled, key, needle):
    path = tiled["samples"].negatives[key]
    entry = tiled["entries"][path.stem]
    assert entry["status"] == "failed"
    assert str(path) in entry["error"] or path.name in entry["error"]
    assert needle in entry["error"]
    assert path.stem not in ts.complete_slide_ids(tiled["store"])


def test_missing_path_is_recorded_and_exit_code_reports_failures(tiled):
    entry = tiled["entries"]["does_not_exist"]
    assert entry["status"] == "failed" and "file not found" in entry["error"]
    assert tiled["code"] == 1  # some slides failed; everything else completed


def _openslide_reference(path, attrs, coords) -> np.ndarray:
    """The tile as OpenSlide reads it: the level read, area-reduced to 224 px when the level is finer."""
    slide = openslide.OpenSlide(str(path))
    x, y = (int(v) for v in coords)
    size = attrs["read_size"]
    region = slide.read_region((x, y), attrs["level_used"], (size, size)).convert("RGB")
    return np.asarray(region.reduce(size // 224) if size != 224 else region)


def test_lossless_tiles_are_micron_exact(sample_slides, tmp_path):
    """With lossless storage and full decoding, stored tiles equal an area-downsample of the level-0 read
    (0.25 µm/px slide) / a native read (0.5 µm/px slide), pixel for pixel."""
    slides = [by_name(sample_slides, n) for n in ("tissue_40x.svs", "tissue_20x.svs")]
    store = tmp_path / "exact.zarr"
    run_tile(tile_config(slide_list(tmp_path / "s.txt", slides), store, compressor="zstd", scaled_decode=False))
    for path in slides:
        attrs = ts.read_slide_attrs(store, path.stem)
        assert attrs["reader"] == "tifffile" and attrs["compressor"] == "zstd"
        group = zarr.open_group(str(store / "slides" / path.stem), mode="r")
        for i in (0, attrs["tile_count"] // 2, attrs["tile_count"] - 1):
            np.testing.assert_array_equal(group["tiles"][i], _openslide_reference(path, attrs, group["coords"][i]))
        if path.name == "tissue_20x.svs":
            assert attrs["read_size"] == 224 and attrs["level_used"] == 0
        else:
            assert attrs["read_size"] == 448 and attrs["tile_size_level0"] == 448


def test_default_tiles_stay_close_to_the_exact_pixels(tiled, sample_slides):
    """The defaults (JPEG storage; the 40× slide decoded at half scale in the IDCT) stay within JPEG-q90 error of
    OpenSlide's exact pixels, tile for tile."""
    store = tiled["store"]
    for name, reader in (("tissue_40x.svs", "tifffile-dct"), ("tissue_20x.svs", "tifffile")):
        path = by_name(sample_slides, name)
        attrs = ts.read_slide_attrs(store, path.stem)
        assert (attrs["reader"], attrs["compressor"]) == (reader, "jpeg")
        group = zarr.open_group(str(store / "slides" / path.stem), mode="r")
        for i in (0, attrs["tile_count"] // 2, attrs["tile_count"] - 1):
            diff = np.abs(group["tiles"][i].astype(int) - _openslide_reference(path, attrs, group["coords"][i]))
            psnr = 10 * np.log10(255**2 / (diff.astype(float) ** 2).mean())
            assert diff.mean() < 4.0 and psnr > 33, (name, i, diff.mean(), psnr)


def test_coords_are_level0_row_major_and_inside_the_slide(tiled):
    store = tiled["store"]
    for slide_id in ts.complete_slide_ids(store):
        attrs = ts.read_slide_attrs(store, slide_id)
        coords = zarr.open_array(str(store / "slides" / slide_id / "coords"), mode="r")[:]
        order = np.lexsort((coords[:, 0], coords[:, 1]))
        assert (order == np.arange(len(coords))).all()
        assert (coords % attrs["stride_level0"] == 0).all()
        assert coords[:, 0].max() + attrs["tile_size_level0"] <= attrs["level0_width"]
        assert coords[:, 1].max() + attrs["tile_size_level0"] <= attrs["level0_height"]


def test_mlflow_run_holds_counts_and_qc_pictures(tiled):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tiled["uri"])
    experiment = client.get_experiment_by_name("wsidino")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.metrics["slides_ok"] == 3 and run.data.metrics["slides_failed"] == 5
    assert run.data.params["tile_size"] == "224"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "manifest.json", "qc"} <= artifacts


def test_rerun_skips_unchanged_retries_failed_and_redoes_changed(sample_slides, tmp_path):
    good = [by_name(sample_slides, "tissue_40x.svs")]
    copy = tmp_path / "copy_of_20x.svs"  # the only input with this content (a second copy would be a duplicate)
    shutil.copy(by_name(sample_slides, "tissue_20x.svs"), copy)
    inputs = slide_list(tmp_path / "slides.txt", [*good, copy, sample_slides.negatives["no_mpp"]])
    store = tmp_path / "tiles.zarr"
    first = run_tile(tile_config(inputs, store))
    assert first.counts == {"ok": 2, "failed": 1, "skipped": 0}
    mtimes = {sid: (store / "slides" / sid / "zarr.json").stat().st_mtime_ns for sid in ts.complete_slide_ids(store)}

    second = run_tile(tile_config(inputs, store))
    assert second.counts == {"ok": 0, "failed": 1, "skipped": 2}
    assert second.tiles_written == 0
    for sid, mtime in mtimes.items():
        assert (store / "slides" / sid / "zarr.json").stat().st_mtime_ns == mtime

    # A changed file is redone, a µm/px override fixes the failed slide, others stay skipped.
    shutil.copy(by_name(sample_slides, "tissue_generic.tiff"), copy)
    overrides = tmp_path / "mpp.csv"
    overrides.write_text("slide,mpp\nno_mpp.tiff,0.25\n")
    third = run_tile(tile_config(inputs, store, mpp_overrides=str(overrides)))
    status = {o.slide_id: o.status for o in third.outcomes}
    assert status == {good[0].stem: "skipped", "copy_of_20x": "ok", "no_mpp": "ok"}
    assert ts.read_slide_attrs(store, "copy_of_20x")["level0_mpp"] == pytest.approx(0.25)
    assert ts.read_slide_attrs(store, "no_mpp")["mpp_source"] == "override"
    assert ts.read_slide_attrs(store, "no_mpp")["level0_mpp"] == pytest.approx(0.25)

    # Changing a tiling parameter redoes every slide.
    fourth = run_tile(tile_config(inputs, store, mpp_overrides=str(overrides), tile_size=160))
    assert fourth.counts == {"ok": 3, "failed": 0, "skipped": 0}
    assert zarr.open_array(str(store / "slides" / "no_mpp" / "tiles"), mode="r").shape[1:] == (160, 160, 3)


def test_mpp_from_config_mapping_and_default(sample_slides, tmp_path):
    no_mpp = sample_slides.negatives["no_mpp"]
    mapped = run_tile(tile_config(no_mpp, tmp_path / "a.zarr", **{"mpp_by_slide": {"no_mpp": 0.5}}))
    assert mapped.counts["ok"] == 1
    attrs = ts.read_slide_attrs(tmp_path / "a.zarr", "no_mpp")
    assert (attrs["level0_mpp"], attrs["mpp_source"], attrs["read_size"]) == (0.5, "override", 224)
    defaulted = run_tile(tile_config(no_mpp, tmp_path / "b.zarr", default_mpp=0.25))
    assert ts.read_slide_attrs(tmp_path / "b.zarr", "no_mpp")["mpp_source"] == "default"
    assert defaulted.outcomes[0].tile_count > 0


def test_two_workers_write_the_same_tiles_as_one(sample_slides, tmp_path):
    slide = by_name(sample_slides, "tissue_40x.svs")
    one = run_tile(tile_config(slide, tmp_path / "one.zarr", workers=1, tiles_per_shard=2))
    two = run_tile(tile_config(slide, tmp_path / "two.zarr", workers=2, tiles_per_shard=2))
    assert one.tiles_written == two.tiles_written > 4  # several shards, so both workers wrote
    a = zarr.open_array(str(tmp_path / "one.zarr" / "slides" / slide.stem / "tiles"), mode="r")[:]
    b = zarr.open_array(str(tmp_path / "two.zarr" / "slides" / slide.stem / "tiles"), mode="r")[:]
    np.testing.assert_array_equal(a, b)


def test_jpeg_store_reads_with_plain_zarr_and_is_smaller(sample_slides, tmp_path):
    slide = by_name(sample_slides, "tissue_20x.svs")
    lossless = run_tile(tile_config(slide, tmp_path / "zstd.zarr", compressor="zstd"))
    lossy = run_tile(tile_config(slide, tmp_path / "jpeg.zarr", compressor="jpeg", jpeg_quality=90))
    assert lossy.outcomes[0].bytes_per_tile < lossless.outcomes[0].bytes_per_tile / 2
    code = (
        "import sys, zarr, numpy as np; a = zarr.open_array(sys.argv[1], mode='r'); "
        "print(a.shape[0], int(np.asarray(a[0]).mean()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "jpeg.zarr" / "slides" / slide.stem / "tiles")],
        capture_output=True,
        text=True,
        check=True,
    )
    n, mean = (int(v) for v in out.stdout.split())
    assert n == lossy.outcomes[0].tile_count and 30 < mean < 250
    exact = zarr.open_array(str(tmp_path / "zstd.zarr" / "slides" / slide.stem / "tiles"), mode="r")[0]
    approx = zarr.open_array(str(tmp_path / "jpeg.zarr" / "slides" / slide.stem / "tiles"), mode="r")[0]
    assert np.abs(exact.astype(int) - approx.astype(int)).mean() < 6


def test_pen_filter_drops_inked_tiles_and_scores_are_stored(sample_slides, tmp_path):
    slide = by_name(sample_slides, "tissue_40x.svs")
    # Ink is never tissue, so inked tiles only pass a low tissue threshold; the filter then drops them.
    loose = {"tissue.min_tissue_fraction": 0.2}
    kept_all = run_tile(tile_config(slide, tmp_path / "all.zarr", **loose))
    strict = {**loose, "filters.pen_filter": True, "filters.pen_max_fraction": 0.05}
    filtered = run_tile(tile_config(slide, tmp_path / "pen.zarr", **strict))
    group = zarr.open_group(str(tmp_path / "all.zarr" / "slides" / slide.stem), mode="r")
    pen = group["pen_fraction"][:]
    assert (pen > 0.05).any(), "the sample slide carries a pen stroke across tissue"
    assert filtered.outcomes[0].tile_count == kept_all.outcomes[0].tile_count - int((pen > 0.05).sum())
    assert np.isnan(group["blur_score"][:]).all()  # not computed unless the blur filter is on


def test_blur_filter_scores_and_drops_blurred_tiles(sample_slides, tmp_path):
    slide = by_name(sample_slides, "tissue_40x.svs")
    scored = run_tile(
        tile_config(slide, tmp_path / "s.zarr", **{"filters.blur_filter": True, "filters.blur_min_score": 0})
    )
    blur = zarr.open_array(str(tmp_path / "s.zarr" / "slides" / slide.stem / "blur_score"), mode="r")[:]
    assert (blur > 0).all() and blur.std() > 0
    threshold = float(np.median(blur))
    strict = run_tile(
        tile_config(slide, tmp_path / "b.zarr", **{"filters.blur_filter": True, "filters.blur_min_score": threshold})
    )
    assert strict.outcomes[0].tile_count == int((blur >= threshold).sum()) < scored.outcomes[0].tile_count


def test_unwritable_output_fails_clearly(sample_slides, tmp_path, capsys):
    # Below a regular file nothing can be created, not even by root (chmod would not stop root).
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    code = cli_main(["tile", "--input", str(sample_slides.slides[0]), "--output", str(blocker / "t.zarr")])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot write the tile store" in err and str(blocker / "t.zarr") in err


def test_output_that_is_a_file_or_foreign_directory_is_refused(sample_slides, tmp_path, capsys):
    not_a_dir = tmp_path / "file.zarr"
    not_a_dir.write_text("x")
    assert cli_main(["tile", "--input", str(sample_slides.slides[0]), "--output", str(not_a_dir)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    assert cli_main(["tile", "--input", str(sample_slides.slides[0]), "--output", str(foreign)]) == 2
    assert "not a tile store" in capsys.readouterr().err
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_an_input_without_slides_leaves_nothing_behind(tmp_path, capsys):
    empty = tmp_path / "no-slides"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a slide")
    out = tmp_path / "run" / "tiles.zarr"
    assert cli_main(["tile", "--input", str(empty), "--output", str(out), "tracking.enabled=false"]) == 2
    assert f"no slides found for input '{empty}'" in capsys.readouterr().err
    assert not out.exists() and not out.parent.exists()


def test_invalid_config_values_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"tissue\.min_tissue_fraction"):
        tile_config("x", tmp_path / "t.zarr", **{"tissue.min_tisue_fraction": 0.3})
    with pytest.raises(ConfigError, match=r"'tile_size'.*int"):
        tile_config("x", tmp_path / "t.zarr", tile_size="large")
    with pytest.raises(ConfigError, match="compressor"):
        tile_config("x", tmp_path / "t.zarr", compressor="lzma")
    with pytest.raises(ConfigError, match="does not exist"):
        discover_slides(str(tmp_path / "nowhere"), [".svs"])


def test_a_second_concurrent_run_is_refused(sample_slides, tmp_path):
    store = ts.init_store(tmp_path / "t.zarr")
    with ts.store_lock(store), pytest.raises(ts.TileStoreError, match="being written by pid"):
        run_tile(tile_config(sample_slides.slides[0], store))


def test_sigkill_never_leaves_an_incomplete_slide_marked_complete(sample_slides, tmp_path, monkeypatch):
    """Kill the CLI with SIGKILL while it writes; whatever is under slides/ must be whole, and a rerun finishes."""
    slide = by_name(sample_slides, "tissue_40x.svs")
    store = tmp_path / "t.zarr"
    args = [
        sys.executable,
        "-m",
        "dinov3_core.cli",
        "tile",
        "--input",
        str(slide),
        "--output",
        str(store),
        "tiles_per_shard=1",
        "progress=false",
        "tracking.enabled=false",
        "compressor=none",
    ]
    # The worker signals when its first shard is on disk and then holds still: the kill lands mid-write.
    signals = event_hooks.arm(monkeypatch, "pause_after_first_shard", tmp_path / "events")
    proc = subprocess.Popen(args, start_new_session=True)
    event_hooks.wait_for(signals / "shard-written")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    monkeypatch.delenv(event_hooks.HOOKS_ENV)
    incoming = store / ts.INCOMING
    # Half a slide is on disk, and none of it is visible as a complete slide.
    assert any(incoming.glob("*/tiles/c/*"))
    assert ts.complete_slide_ids(store) == []
    result = run_tile(tile_config(slide, store, tiles_per_shard=1, compressor="none"))
    assert result.counts["failed"] == 0
    assert ts.complete_slide_ids(store) == [slide.stem]
    assert not list(incoming.iterdir())
    tiles = zarr.open_array(str(store / "slides" / slide.stem / "tiles"), mode="r")[:]
    assert len(tiles) == ts.read_slide_attrs(store, slide.stem)["tile_count"] > 0
    assert (tiles.reshape(len(tiles), -1).max(axis=1) > 0).all(), "every committed tile was written"


def test_qc_picture_shows_tiles(tiled, sample_slides):
    slide_id = by_name(sample_slides, "tissue_40x.svs").stem
    picture = np.asarray(Image.open(tiled["store"] / "slides" / slide_id / "qc_thumbnail.png"))
    assert picture.shape[2] == 3 and max(picture.shape[:2]) == 1024
    drawing, legend = picture[:-18], picture[-18:]
    blue = (drawing[..., 0] == 30) & (drawing[..., 1] == 90) & (drawing[..., 2] == 255)
    assert blue.sum() > 100, "kept-tile outlines are drawn"
    for colour in ((0, 200, 0), (255, 0, 255), (30, 90, 255)):  # a swatch per legend entry
        assert (legend == colour).all(axis=-1).sum() >= 100, colour
    assert not (legend == (255, 140, 0)).all(axis=-1).any(), "no filter on, nothing dropped: no orange entry"


@pytest.mark.parametrize("pen_filter", [False, True])
def test_qc_legend_lists_exactly_what_is_drawn(sample_slides, tmp_path, pen_filter):
    """The QC picture as the tile stage draws it (`draw_qc`, into the slide's `.incoming/` folder): a legend swatch
    for each colour drawn on the slide and for no other."""

    from dinov3_core.tiling import qc
    from dinov3_core.tiling.plan import SlideTask, plan_slide

    slide = by_name(sample_slides, "tissue_40x.svs")
    filters = {"filters.pen_filter": True, "filters.pen_max_fraction": 0.05} if pen_filter else {}
    cfg = tile_config(slide, tmp_path / "tiles.zarr", **{"tissue.min_tissue_fraction": 0.2, **filters})
    plan = plan_slide(SlideTask(slide.stem, slide), cfg, {})
    picture, entries = qc.draw_qc_picture(plan, pen_filter=pen_filter)
    drawing, legend = np.asarray(picture)[:-18], np.asarray(picture)[-18:]
    outlines = (qc.TISSUE_CONTOUR, qc.TILE_OUTLINE, qc.DROPPED_OUTLINE)
    drawn = {c for c in outlines if (drawing == c).all(axis=-1).any()}
    listed = {colour for _, colour in entries}
    swatches = {c for c in (*outlines, qc.PEN_TINT) if (legend == c).all(axis=-1).sum() >= 100}
    assert swatches == listed, "the legend's swatches are its entries"
    assert listed - {qc.PEN_TINT} == drawn
    assert (qc.DROPPED_OUTLINE in drawn) == pen_filter, "only the pen filter drops tiles of this slide"
    assert (qc.PEN_TINT in listed) == bool(plan.pen_mask.any()) and plan.pen_mask.any()
    assert qc.pen_label(pen_filter).endswith(f"pen filter {'on' if pen_filter else 'off'})")


def test_pen_mask_takes_marker_ink_not_hematoxylin():
    """Ink over glass and over tissue is pen; dense violet nuclei (b ≈ r ≫ g) and eosin are not: they were taken for
    blue ink, which cut holes in the tissue mask of small slides (fine thumbnails) with the pen filter off."""
    from dinov3_core.tiling.tissue import pen_mask
    from wsidino_dev.sample_slides.canvas import GLASS_RGB, INK_RGB

    glass, pink, violet = np.array(GLASS_RGB), np.array([200.0, 120, 170]), np.array([110.0, 60, 150])
    ink = [np.array(rgb, float) for rgb in INK_RGB.values()]
    inked = [a * i + (1 - a) * glass for i in ink for a in (0.8, 0.9)]  # over glass, streaky
    inked += [i * under / 255 for i in ink for under in (pink, violet)]  # over tissue: ink and stain both absorb
    tissue = [(57, 21, 57), (115, 69, 118), (77, 40, 120), pink, violet, (230, 150, 190), glass]

    def blocks(colours) -> np.ndarray:  # 4×4 px per colour: the mask opens away single pixels
        return np.repeat(np.asarray(colours, float)[None, :, None, :], 4, axis=2).repeat(4, axis=0).reshape(4, -1, 3)

    assert pen_mask(blocks(inked).astype(np.uint8)).reshape(4, -1, 4).all(axis=(0, 2)).tolist() == [True] * len(inked)
    assert not pen_mask(blocks(tissue).astype(np.uint8)).any()


def test_channel_max_min_are_numpys_reductions():
    """The tissue and pen masks take a pixel's channel max and min without numpy's slow reduction over an axis of 3
    (over a quarter of the planning time on a 1024² thumbnail): the values must be exactly `.max(-1)`, `.min(-1)`."""
    from dinov3_core.tiling.tissue import channel_max_min

    rng = np.random.default_rng(0)
    for rgb in (rng.integers(0, 256, (37, 53, 3), dtype=np.uint8), rng.random((37, 53, 3)).astype(np.float32)):
        vmax, vmin = channel_max_min(rgb)
        assert vmax.dtype == rgb.dtype and np.array_equal(vmax, rgb.max(axis=-1))
        assert np.array_equal(vmin, rgb.min(axis=-1))


def test_stores_tiled_before_scaled_decoding_keep_their_slide_hash_but_not_their_old_mask(tmp_path):
    """Slides tiled before `scaled_decode` existed (zstd, full decoding) hash as they did apart from the tissue mask's
    version: pinning those settings would skip them, but their mask (version 1, before the key) took dense nuclei for
    pen ink, so they are tiled again; the new default decoding is a further change."""
    from dinov3_core.tiling import plan
    from dinov3_core.tiling.config import TISSUE_MASK_VERSION

    old = tile_config("x", tmp_path / "t.zarr", compressor="zstd", scaled_decode=False)
    params = plan.tiling_params(old)
    # What decides which tiles exist, and how they are stored; not `scaled_decode` (how a region is decoded).
    which = {"mpp", "mpp_tolerance", "tile_size", "stride", "tissue", "filters", "reader", "tissue_mask_version"}
    how = {"compressor", "jpeg_quality", "compression_level"}
    assert set(params) == which | how
    assert params["tissue_mask_version"] == TISSUE_MASK_VERSION >= 2
    new = tile_config("x", tmp_path / "t.zarr", compressor="zstd")
    assert plan.slide_params_hash(new, None) != plan.slide_params_hash(old, None)


def test_a_slide_tiled_with_an_older_tissue_mask_is_tiled_again(sample_slides, tmp_path):
    """A store whose slide was tiled by the version-1 mask (its hash made without `tissue_mask_version`, as the code
    before the key wrote it) is tiled again on a rerun with the same settings; once redone, it is skipped."""
    import hashlib

    from dinov3_core.tiling import plan

    slide = by_name(sample_slides, "tissue_20x.svs")
    store = tmp_path / "tiles.zarr"
    cfg = tile_config(slide, store)
    assert run_tile(cfg).counts == {"ok": 1, "failed": 0, "skipped": 0}
    current = ts.read_slide_attrs(store, slide.stem)["params_hash"]
    assert current == plan.slide_params_hash(cfg, None)
    v1 = {k: v for k, v in plan.tiling_params(cfg).items() if k != "tissue_mask_version"}
    payload = {"params": v1, "mpp_override": None, "default_mpp": cfg.default_mpp}
    v1_hash = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]
    meta_path = store / "slides" / slide.stem / "zarr.json"
    meta_path.write_text(meta_path.read_text().replace(current, v1_hash))
    assert ts.read_slide_attrs(store, slide.stem)["params_hash"] == v1_hash != current
    assert run_tile(cfg).counts == {"ok": 1, "failed": 0, "skipped": 0}
    assert ts.read_slide_attrs(store, slide.stem)["params_hash"] == current
    assert run_tile(cfg).counts == {"ok": 0, "failed": 0, "skipped": 1}
