"""Sample slides: real files checked with real OpenSlide (the "test" preset, generated once per session)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import openslide
import pytest
import shapely
import tifffile

from dinov3_core.tiling.tissue import pen_mask
from wsidino_dev.sample_slides import (
    CLASS_NAMES,
    MARKER_NAME,
    PRESETS,
    SampleSet,
    TissueCanvas,
    make_sample_slides,
    sample_canvas,
    synthesize_background,
    synthesize_tissue_canvas,
    write_generic_tiff,
    write_svs,
)

SPECS = {spec.name: spec for spec in PRESETS["test"]}
GOOD = [name for name, spec in SPECS.items() if spec.negative is None]
SVS = [name for name in GOOD if name.endswith(".svs")]


def _blueish(rgb: np.ndarray) -> np.ndarray:
    """Blue marker ink: far bluer than red and green (hematoxylin-stained tissue hardly ever gets there)."""
    r, g, b = (rgb[..., i].astype(np.int16) for i in range(3))
    return (b - r > 90) & (b - g > 50)  # ink over glass is ~(70, 100, 200); stained nuclei reach b - r ≈ 60


def _tissue_mask(rgb: np.ndarray) -> np.ndarray:
    """Stained or inked pixels: clearly darker than glass, or clearly coloured (HSV-style saturation)."""
    rgb = rgb.astype(np.int16)
    saturation = (rgb.max(-1) - rgb.min(-1)) / np.maximum(rgb.max(-1), 1)
    return (rgb.mean(-1) < 215) | (saturation > 0.12)


def _rgb(slide: openslide.OpenSlide, location: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
    region = np.asarray(slide.read_region(location, level, size))
    assert (region[..., 3] == 255).all(), "a read inside the image must be fully opaque"
    return region[..., :3]


def _jpeg_round_trip_error(rgb: np.ndarray) -> float:
    """Mean absolute error of encoding `rgb` as the sample writers do (JPEG quality 90, YCbCr 4:2:0)."""
    import io

    from PIL import Image

    image = np.clip(np.round(rgb), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", quality=90, subsampling=2)
    decoded = np.asarray(Image.open(buffer)).astype(np.float32)
    return float(np.abs(decoded - image).mean())


def _tissue_window(slide: openslide.OpenSlide, canvas: TissueCanvas, size: int) -> tuple[int, int, np.ndarray]:
    """(x, y, source pixels) of the most tissue-rich size×size level-0 window, located on level 1."""
    downsample = round(slide.level_downsamples[1])
    overview = _rgb(slide, (0, 0), 1, slide.level_dimensions[1])
    cell = size // downsample
    rows, cols = overview.shape[0] // cell, overview.shape[1] // cell
    blocks = _tissue_mask(overview[: rows * cell, : cols * cell]).reshape(rows, cell, cols, cell)
    row, col = np.unravel_index(int(np.argmax(blocks.mean(axis=(1, 3)))), (rows, cols))
    x, y = int(col) * size, int(row) * size
    window = canvas.rows(y, y + size)[:, x : x + size]
    assert _tissue_mask(window).mean() > 0.5, "the chosen window should be mostly tissue"
    return x, y, window


# ----------------------------------------------------------------------------------------------------
# The preset set as OpenSlide sees it
# ----------------------------------------------------------------------------------------------------


def test_sample_set_layout(sample_slides: SampleSet) -> None:
    assert [p.name for p in sample_slides.slides] == [Path(name).name for name in GOOD]
    assert set(sample_slides.negatives) == {"no_mpp", "truncated", "not_a_slide", "no_tissue"}
    assert all(p.parent.name == "negatives" for p in sample_slides.negatives.values())
    assert all(p.is_file() for p in [*sample_slides.slides, *sample_slides.negatives.values()])
    assert (sample_slides.root / MARKER_NAME).is_file()
    info = sample_slides.info["tissue_40x.svs"]
    assert info["format"] == "aperio-svs" and info["mpp"] == 0.25 and info["size"] == [4096, 3072]
    assert info["levels"] == [[4096, 3072], [1024, 768], [256, 192]]
    assert sample_slides.info["negatives/no_mpp.tiff"]["mpp"] is None


@pytest.mark.parametrize("name", SVS)
def test_svs_is_aperio_with_mpp_and_magnification(sample_slides: SampleSet, name: str) -> None:
    spec = SPECS[name]
    with openslide.OpenSlide(sample_slides.root / name) as slide:
        props = slide.properties
        assert props["openslide.vendor"] == "aperio"
        assert slide.level_count >= 3
        assert slide.dimensions == (spec.width, spec.height)
        assert float(props["openslide.mpp-x"]) == pytest.approx(spec.mpp)
        assert float(props["openslide.mpp-y"]) == pytest.approx(spec.mpp)
        assert props["aperio.AppMag"] == str(spec.app_mag)
        assert props["openslide.objective-power"] == str(spec.app_mag)
        assert props["tiff.ImageDescription"].startswith("Aperio Image Library")
        # Not the temporary name the file was written under: output must not depend on it (determinism).
        assert props["aperio.Filename"] == Path(name).stem
        assert set(slide.associated_images) == {"thumbnail", "label", "macro"}
        thumbnail = slide.associated_images["thumbnail"]
        assert thumbnail.width / thumbnail.height == pytest.approx(spec.width / spec.height, rel=0.03)


@pytest.mark.parametrize("name", SVS)
def test_svs_ifd_layout_matches_aperio(sample_slides: SampleSet, name: str) -> None:
    """Tiled JPEG/YCbCr baseline, stripped thumbnail second, tiled levels, stripped label and macro last."""
    with tifffile.TiffFile(sample_slides.root / name) as tif:
        pages = list(tif.pages)
        assert [page.is_tiled for page in pages] == [
            True,
            False,
            *[True] * (SPECS[name].levels - 1),
            False,
            False,
        ]
        assert pages[0].compression == tifffile.COMPRESSION.JPEG
        assert pages[0].photometric == tifffile.PHOTOMETRIC.YCBCR
        assert pages[0].tilewidth == pages[0].tilelength == 256
        assert pages[-2].description.splitlines()[1].startswith("label ")
        assert pages[-1].description.splitlines()[1].startswith("macro ")


def test_generic_tiff_has_mpp(sample_slides: SampleSet) -> None:
    spec = SPECS["tissue_generic.tiff"]
    with openslide.OpenSlide(sample_slides.root / spec.name) as slide:
        assert slide.properties["openslide.vendor"] == "generic-tiff"
        assert slide.properties["tiff.ResolutionUnit"] == "centimeter"
        assert float(slide.properties["openslide.mpp-x"]) == pytest.approx(spec.mpp, rel=1e-4)
        assert float(slide.properties["openslide.mpp-y"]) == pytest.approx(spec.mpp, rel=1e-4)
        assert slide.level_count == spec.levels >= 3
        assert slide.dimensions == (spec.width, spec.height)
        assert slide.dimensions[0] != slide.dimensions[1]


@pytest.mark.parametrize("name", GOOD)
def test_levels_are_consistent_downsamples(sample_slides: SampleSet, name: str) -> None:
    factor = 4 if name.endswith(".svs") else 2
    with openslide.OpenSlide(sample_slides.root / name) as slide:
        width, height = slide.dimensions
        for level, ((w, h), downsample) in enumerate(zip(slide.level_dimensions, slide.level_downsamples, strict=True)):
            assert (w, h) == (width // factor**level, height // factor**level)
            assert downsample == pytest.approx(factor**level, rel=1e-3)
        # Level 1 is the box-filtered level 0: same picture, up to compression error. For JPEG levels that is what
        # a q90 4:2:0 round trip of the reduced picture itself costs (~3 grey levels on H&E, whose eosin-pink
        # collagen against white clefts is rich in chroma detail), plus level 0's own error after averaging.
        size = 256
        fine = _rgb(slide, (0, 0), 0, (size * factor, size * factor)).astype(np.float32)
        coarse = _rgb(slide, (0, 0), 1, (size, size)).astype(np.float32)
        reduced = fine.reshape(size, factor, size, factor, 3).mean(axis=(1, 3))
        lossy = name.endswith(".svs") or SPECS[name].compression == "jpeg"
        limit = (_jpeg_round_trip_error(reduced) if lossy else 0.0) + 1.0
        assert np.abs(reduced - coarse).mean() < limit


@pytest.mark.parametrize("name", GOOD)
def test_read_region_matches_source_canvas(sample_slides: SampleSet, name: str) -> None:
    """OpenSlide decodes what was drawn: exact for zlib, within JPEG error for YCbCr JPEG."""
    canvas = sample_canvas("test", name, seed=sample_slides.seed)
    with openslide.OpenSlide(sample_slides.root / name) as slide:
        x, y, expected = _tissue_window(slide, canvas, 512)
        got = _rgb(slide, (x, y), 0, (512, 512))
    if SPECS[name].compression == "zlib" and name.endswith(".tiff"):
        np.testing.assert_array_equal(got, expected)
    else:
        error = np.abs(got.astype(np.int16) - expected).astype(np.float32)
        assert error.mean() < 5.0, error.mean()  # per-pixel error of JPEG q90 with 4:2:0 chroma on tissue
        # Mean colour per channel: a wrong colour space (RGB read as YCbCr) would shift it by tens of levels.
        assert np.abs(got.mean(axis=(0, 1)) - expected.mean(axis=(0, 1))).max() < 1.5


# ----------------------------------------------------------------------------------------------------
# Negatives
# ----------------------------------------------------------------------------------------------------


def test_no_mpp_slide_opens_without_mpp(sample_slides: SampleSet) -> None:
    with openslide.OpenSlide(sample_slides.negatives["no_mpp"]) as slide:
        assert slide.properties["openslide.vendor"] == "generic-tiff"
        assert "openslide.mpp-x" not in slide.properties
        assert "openslide.mpp-y" not in slide.properties
        assert slide.level_count >= 3
        assert _tissue_mask(_rgb(slide, (0, 0), 2, slide.level_dimensions[2])).mean() > 0.1


def test_truncated_slide_fails_to_open_or_read(sample_slides: SampleSet) -> None:
    """With OpenSlide 4.0.1 the broken IFD chain already fails `OpenSlide()`; a reader must survive either."""
    path = sample_slides.negatives["truncated"]
    with tifffile.TiffFile(path) as tif:  # the cut lies inside level 0's tile data, as documented
        page = tif.pages.first
        assert max(o + n for o, n in zip(page.dataoffsets, page.databytecounts, strict=True)) > path.stat().st_size
    with pytest.raises(openslide.OpenSlideError), openslide.OpenSlide(path) as slide:
        slide.read_region((0, 0), 0, slide.dimensions)


def test_not_a_slide_is_rejected(sample_slides: SampleSet) -> None:
    path = sample_slides.negatives["not_a_slide"]
    assert path.suffix == ".svs"
    with pytest.raises(openslide.OpenSlideUnsupportedFormatError):
        openslide.OpenSlide(path)


def test_no_tissue_slide_is_blank_glass(sample_slides: SampleSet) -> None:
    with openslide.OpenSlide(sample_slides.negatives["no_tissue"]) as slide:
        assert slide.properties["openslide.vendor"] == "aperio"
        assert float(slide.properties["openslide.mpp-x"]) == pytest.approx(0.25)
        pixels = _rgb(slide, (0, 0), 0, slide.dimensions)
    assert pixels.mean() > 225
    assert _tissue_mask(pixels).mean() < 0.001
    assert not _blueish(pixels).any()


# ----------------------------------------------------------------------------------------------------
# Idempotence and determinism
# ----------------------------------------------------------------------------------------------------


def test_second_call_rewrites_nothing(sample_slides: SampleSet) -> None:
    paths = [sample_slides.root / MARKER_NAME, *sample_slides.slides, *sample_slides.negatives.values()]
    before = {p: p.stat().st_mtime_ns for p in paths}
    again = make_sample_slides(sample_slides.root, "test", seed=sample_slides.seed)
    assert {p: p.stat().st_mtime_ns for p in paths} == before
    assert again.slides == sample_slides.slides and again.negatives == sample_slides.negatives


def test_damaged_file_is_regenerated_identically(sample_slides: SampleSet, tmp_path: Path) -> None:
    """Only the damaged file is rewritten, byte for byte as before (generation is deterministic)."""

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    copy = tmp_path / "copy"
    shutil.copytree(sample_slides.root, copy)
    damaged = copy / "tissue_20x.svs"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # size no longer matches the marker
    others = [p for p in copy.rglob("*") if p.is_file() and p.name not in {damaged.name, MARKER_NAME}]
    before = {p: p.stat().st_mtime_ns for p in others}

    rebuilt = make_sample_slides(copy, "test", seed=sample_slides.seed)
    assert digest(damaged) == digest(sample_slides.root / "tissue_20x.svs")
    assert {p: p.stat().st_mtime_ns for p in others} == before
    assert rebuilt.info == sample_slides.info | {"tissue_20x.svs": rebuilt.info["tissue_20x.svs"]}
    assert rebuilt.annotations == {
        stem: copy / p.relative_to(sample_slides.root) for stem, p in sample_slides.annotations.items()
    }

    # A lost annotation file is written again, byte for byte, and nothing else is.
    lost = rebuilt.annotations["tissue_40x"]
    lost.unlink()
    before = {p: p.stat().st_mtime_ns for p in others if p != lost}
    make_sample_slides(copy, "test", seed=sample_slides.seed)
    assert digest(lost) == digest(sample_slides.annotations["tissue_40x"])
    assert {p: p.stat().st_mtime_ns for p in before} == before

    # Asking for the good slides only is satisfied by the existing set: no writes, no negatives listed.
    marker_mtime = (copy / MARKER_NAME).stat().st_mtime_ns
    good_only = make_sample_slides(copy, "test", seed=sample_slides.seed, negatives=False)
    assert good_only.negatives == {} and len(good_only.slides) == 3
    assert (copy / MARKER_NAME).stat().st_mtime_ns == marker_mtime


def test_dev_command_prints_a_line_per_slide_written(
    sample_slides: SampleSet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wsidino_dev.__main__ import main

    marker_mtime = (sample_slides.root / MARKER_NAME).stat().st_mtime_ns
    assert main(["samples", str(sample_slides.root), "--preset", "test"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"{sample_slides.root}: 3 slides, 4 negative cases"), out
    assert (sample_slides.root / MARKER_NAME).stat().st_mtime_ns == marker_mtime  # the same set: reused

    copy = tmp_path / "copy"
    shutil.copytree(sample_slides.root, copy)
    (copy / "tissue_20x.svs").unlink()
    assert main(["samples", str(copy), "--preset", "test", "--no-negatives"]) == 0
    wrote, summary = capsys.readouterr().out.splitlines()
    name, size, seconds = wrote.split("  ")
    assert name == "wrote tissue_20x.svs" and size == "2048×1536 px" and seconds.endswith(" s")
    assert summary.startswith(f"{copy}: 3 slides, annotations under {copy}/annotations")


def test_demo_cohort_appends_small_slides_in_their_own_stains() -> None:
    """The demo has ≥ 9 annotated slides (a paired permutation test over n slides reaches p = 2^-n at best): the test
    preset's files at the same indices (so the first slides keep their random streams and pixels), then small slides
    each stained its own way, none of them like the held-out lab's."""
    from wsidino_dev.sample_slides import presets, texture

    demo, test = PRESETS["demo"], PRESETS["test"]
    assert [s.name for s in demo[: len(test)]] == [s.name for s in test]
    extra = demo[len(test) :]
    assert len([s for s in demo if s.negative is None]) >= 9 and all(s.negative is None for s in extra)
    assert all(s.width * s.height <= 4096 * 3072 and s.stain is not None for s in extra)
    stains = [s.stain for s in extra]
    assert len(set(stains)) == len(stains) and presets.HELDOUT_STAIN not in stains
    assert all(s.eosin_amount < presets.HELDOUT_STAIN.eosin_amount for s in stains if s.eosin == texture.EOSIN_OD)
    assert len({s.eosin for s in stains}) >= 2  # one is not eosin at all (DAB)


@pytest.mark.parametrize("spec", PRESETS["demo"][len(PRESETS["test"]) :], ids=lambda s: s.name)
def test_tile_stage_masks_read_each_demo_stain(spec) -> None:
    """The tile stage's tissue and pen masks on each extra demo stain (a 1 µm/px thumbnail of a small canvas in it):
    the tissue is found, the ink is cut out, and hardly any tissue is taken for ink, not even dense hematoxylin."""
    from dinov3_core.tiling.config import TissueConfig
    from dinov3_core.tiling.tissue import tissue_mask

    def thumbnail(pen_mark: bool) -> np.ndarray:  # the pen is planned last: with or without it, the same tissue
        canvas = TissueCanvas.plan(
            1536,
            2048,
            rng=np.random.default_rng(5),
            mpp=0.5,
            pen_mark=pen_mark,
            pen_color=spec.pen_color,
            stain=spec.stain,
        )
        return canvas.to_array().reshape(768, 2, 1024, 2, 3).mean(axis=(1, 3)).astype(np.uint8)

    thumb, plain = thumbnail(True), thumbnail(False)
    inked = np.abs(thumb.astype(np.int16) - plain).max(-1) > 40
    tissue = _tissue_mask(plain) & ~inked
    ink = pen_mask(thumb, mpp=1.0)
    mask, _ = tissue_mask(thumb, 1.0, TissueConfig(), ink)
    assert inked.sum() > 1000 and ink[inked].mean() > 0.6, "the stroke is found"
    # Under the darkest hematoxylin a few nuclei are as dark as black ink; the old detector took most of such tissue.
    assert pen_mask(plain, mpp=1.0)[tissue].mean() < 1e-3, "hardly any tissue is taken for ink"
    assert mask[tissue].mean() > 0.95 and mask[inked].mean() < 0.2


# ----------------------------------------------------------------------------------------------------
# Annotations: QuPath GeoJSON of the classes each slide was rendered with
# ----------------------------------------------------------------------------------------------------


def _annotations(samples: SampleSet, slide: Path) -> list[tuple[str, shapely.Geometry]]:
    """(class name, geometry) per feature of a good slide's GeoJSON."""
    collection = json.loads(samples.annotations[slide.stem].read_text())
    return [
        (f["properties"]["classification"]["name"], shapely.geometry.shape(f["geometry"]))
        for f in collection["features"]
    ]


def _by_class(features: list[tuple[str, shapely.Geometry]]) -> dict[str, shapely.Geometry]:
    return {name: shapely.union_all([g for n, g in features if n == name]) for name in {n for n, _ in features}}


def test_annotations_are_qupath_geojson(sample_slides: SampleSet) -> None:
    """One file per good slide (none for negatives), QuPath's layout, valid polygons inside the slide."""
    assert list(sample_slides.annotations) == [p.stem for p in sample_slides.slides]
    marker = json.loads((sample_slides.root / MARKER_NAME).read_text())
    assert {
        stem: sample_slides.root / m["file"] for stem, m in marker["annotations"].items()
    } == sample_slides.annotations
    kinds, holes = set(), 0
    for slide in sample_slides.slides:
        path = sample_slides.annotations[slide.stem]
        assert path == sample_slides.root / "annotations" / f"{slide.stem}.geojson"
        collection = json.loads(path.read_text())
        assert collection["type"] == "FeatureCollection" and collection["features"]
        width, height = SPECS[slide.name].width, SPECS[slide.name].height
        names = set()
        for feature in collection["features"]:
            assert feature["type"] == "Feature"
            props = feature["properties"]
            assert props["objectType"] == "annotation"
            assert props["classification"]["name"] in CLASS_NAMES
            assert len(props["classification"]["color"]) == 3
            names.add(props["classification"]["name"])
            geometry = shapely.geometry.shape(feature["geometry"])
            kinds.add(geometry.geom_type)
            assert geometry.geom_type in {"Polygon", "MultiPolygon"} and geometry.is_valid and not geometry.is_empty
            x0, y0, x1, y1 = geometry.bounds
            assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height  # level-0 pixel coordinates
            for polygon in shapely.get_parts(geometry):
                holes += len(polygon.interiors)
                assert shapely.get_num_coordinates(polygon) <= 600, "simplified to a few hundred vertices"
        assert names == set(CLASS_NAMES), slide.name  # every class on every slide
    assert kinds == {"Polygon", "MultiPolygon"} and holes > 0  # what a label reader must handle


def test_annotations_follow_the_rendered_classes(sample_slides: SampleSet) -> None:
    """Away from a boundary (3 level-0 px), the polygons give every pixel the class it was rendered with."""
    rng = np.random.default_rng(0)
    for slide in sample_slides.slides:
        canvas = sample_canvas("test", slide.name, seed=sample_slides.seed)
        labels = np.concatenate([canvas.labels(y, y + 1024) for y in range(0, canvas.height, 1024)])
        features = _annotations(sample_slides, slide)
        xs, ys = rng.integers(0, canvas.width, 40_000), rng.integers(0, canvas.height, 40_000)
        got = np.full(len(xs), -1)
        for name, geometry in features:
            got[shapely.contains_xy(geometry, xs + 0.5, ys + 0.5)] = CLASS_NAMES.index(name)
        edges = shapely.union_all([g.boundary for _, g in features])
        shapely.prepare(edges)
        clear = ~shapely.dwithin(edges, shapely.points(xs + 0.5, ys + 0.5), 3)
        expected = labels[ys, xs]
        assert (expected[clear] >= 0).mean() > 0.2, "a good share of the points should be tissue"
        assert (got[clear] == expected[clear]).mean() > 0.998, slide.name  # specks < 10×10 px are left out


def _class_stain_stats(sample_slides: SampleSet, slide: Path) -> dict[str, tuple[float, float, np.ndarray]]:
    """Per class, from the written slide's level 1 away from the cross-fades: mean hematoxylin (`rgb2hed`), mean
    grey level and mean RGB."""
    from skimage.color import rgb2hed

    with openslide.OpenSlide(slide) as reader:
        width, height = reader.level_dimensions[1]
        downsample = reader.level_downsamples[1]
        rgb = _rgb(reader, (0, 0), 1, (width, height))
    hed = rgb2hed(rgb).reshape(-1, 3)
    yy, xx = np.mgrid[0:height, 0:width]
    centres = ((xx.ravel() + 0.5) * downsample, (yy.ravel() + 0.5) * downsample)
    stats = {}
    for name, geometry in _by_class(_annotations(sample_slides, slide)).items():
        inside = shapely.contains_xy(geometry.buffer(-8), *centres)  # clear of the cross-fades
        assert inside.sum() > 1000, (slide.name, name)
        pixels = rgb.reshape(-1, 3)[inside].astype(np.float64)
        stats[name] = (hed[inside, 0].mean(), pixels.mean(), pixels.mean(axis=0))
    return stats


def test_annotated_pixels_look_like_their_class(sample_slides: SampleSet) -> None:
    """From the written slide: both epithelia are hematoxylin-dense (crowded nuclei), stroma is sparse in nuclei and
    the palest (collagen and clefts). Tumour and squamous epithelium differ in structure, not in stain: on one
    slide their mean colours are close."""
    for slide in sample_slides.slides:
        stats = _class_stain_stats(sample_slides, slide)
        (h_tum, grey_tum, rgb_tum), (h_squ, grey_squ, rgb_squ), (h_str, grey_str, _) = (
            stats[name] for name in CLASS_NAMES
        )
        assert min(h_tum, h_squ) > 2 * h_str, (slide.name, stats)  # seed 0: ≥ 2.9×
        assert grey_str > max(grey_tum, grey_squ) + 15, (slide.name, stats)  # seed 0: ≥ 23 grey levels paler
        assert np.abs(rgb_tum - rgb_squ).max() < 20, (slide.name, stats)  # seed 0: ≤ 14 levels per channel


def test_each_slide_is_stained_its_own_way(sample_slides: SampleSet) -> None:
    """A class's mean colour moves between slides (hematoxylin and eosin strength and hue drawn per slide) by more
    than tumour and squamous epithelium differ on one slide: colour alone does not tell them apart across slides,
    structure does."""
    stats = [_class_stain_stats(sample_slides, slide) for slide in sample_slides.slides]
    tumour, squamous = CLASS_NAMES[0], CLASS_NAMES[1]
    within = max(float(np.abs(s[tumour][2] - s[squamous][2]).max()) for s in stats)
    for name in CLASS_NAMES:
        colours = np.array([s[name][2] for s in stats])
        between = float(np.ptp(colours, axis=0).max())
        assert between > max(within, 20), (name, between, within)  # seed 0: ≥ 26 vs ≤ 15 grey levels


def test_every_class_covers_enough_tiles(sample_slides: SampleSet) -> None:
    """Tiles of 64 px at 0.5 µm/px whose centre lies in a class: at least 15 per class on every slide, so a probe
    that keeps slides apart between train and test has every class on both sides."""
    for slide in sample_slides.slides:
        spec = SPECS[slide.name]
        size = round(64 * 0.5 / spec.mpp)  # level-0 px per tile
        ys, xs = np.mgrid[0 : spec.height - size + 1 : size, 0 : spec.width - size + 1 : size]
        for name, geometry in _by_class(_annotations(sample_slides, slide)).items():
            count = int(shapely.contains_xy(geometry, xs.ravel() + size / 2, ys.ravel() + size / 2).sum())
            assert count >= 15, (slide.name, name, count)


# ----------------------------------------------------------------------------------------------------
# Canvas and writers on their own
# ----------------------------------------------------------------------------------------------------


def test_canvas_has_tissue_and_a_pen_mark() -> None:
    canvas = synthesize_tissue_canvas(1024, 1536, rng=np.random.default_rng(0), pen_color="blue")
    assert canvas.shape == (1024, 1536, 3) and canvas.dtype == np.uint8
    assert 0.2 < _tissue_mask(canvas).mean() < 0.7
    assert _blueish(canvas).mean() > 0.003  # the ink stroke
    # Without the pen, nothing in the tissue or the glass looks like blue ink: at most a stray pixel of a dark
    # nucleus under a hematoxylin-heavy stain, never an area the tile stage's ink detector (8 µm blocks) would see.
    plain = synthesize_tissue_canvas(1024, 1536, rng=np.random.default_rng(0), pen_mark=False)
    assert _blueish(plain).mean() < 1e-5
    assert not pen_mask(plain.reshape(64, 16, 96, 16, 3).mean(axis=(1, 3)).astype(np.uint8)).any()
    corner = canvas[:64, :64].astype(np.int16)  # glass: near-white, barely tinted
    assert corner.mean() > 225 and np.ptp(corner.mean(axis=(0, 1))) < 12


def test_canvas_is_deterministic_per_seed() -> None:
    a = synthesize_tissue_canvas(512, 768, rng=np.random.default_rng(3))
    b = synthesize_tissue_canvas(512, 768, rng=np.random.default_rng(3))
    c = synthesize_tissue_canvas(512, 768, rng=np.random.default_rng(4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_canvas_strips_match_the_whole_image() -> None:
    canvas = TissueCanvas.plan(1000, 900, rng=np.random.default_rng(5))
    whole = canvas.to_array()
    np.testing.assert_array_equal(canvas.rows(123, 611), whole[123:611])


def test_background_is_near_white_glass() -> None:
    glass = synthesize_background(512, 640, rng=np.random.default_rng(1))
    assert glass.mean() > 225 and glass.min() > 200
    assert _tissue_mask(glass).mean() == 0


def test_writers_accept_arrays_and_keep_colours(tmp_path: Path) -> None:
    image = synthesize_tissue_canvas(1024, 1536, rng=np.random.default_rng(11), pen_color="green")
    svs = tmp_path / "array.svs"
    dims = write_svs(svs, image, mpp=0.5, levels=3, description_extra={"Comment": "unit test"})
    assert dims == [(1536, 1024), (384, 256), (96, 64)]
    with openslide.OpenSlide(svs) as slide:
        assert slide.properties["openslide.objective-power"] == "20"  # derived from MPP 0.5
        assert slide.properties["aperio.Comment"] == "unit test"
        got = _rgb(slide, (0, 0), 0, slide.dimensions)
    assert np.abs(got.astype(np.int16) - image).mean() < 5.0

    tiff = tmp_path / "array.tiff"
    write_generic_tiff(tiff, image, mpp=0.5, levels=3, compression="jpeg")
    with openslide.OpenSlide(tiff) as slide:
        assert slide.properties["openslide.vendor"] == "generic-tiff"
        assert float(slide.properties["openslide.mpp-x"]) == pytest.approx(0.5, rel=1e-4)
        got = _rgb(slide, (0, 0), 0, slide.dimensions)
    assert np.abs(got.astype(np.int16) - image).mean() < 5.0


def test_writer_rejects_bad_arguments(tmp_path: Path) -> None:
    image = np.full((256, 256, 3), 240, np.uint8)
    with pytest.raises(ValueError, match="multiple of 16"):
        write_svs(tmp_path / "bad.svs", image, mpp=0.25, tile=100)
    with pytest.raises(ValueError, match="levels"):
        write_generic_tiff(tmp_path / "bad.tiff", image, mpp=0.25, levels=12)
    with pytest.raises(ValueError, match="uint8"):
        write_generic_tiff(tmp_path / "bad.tiff", image.astype(np.float32), mpp=0.25)


def test_module_does_not_import_orchestration() -> None:
    code = (
        "import sys, wsidino_dev.sample_slides\n"
        "sys.exit(any(m.split('.')[0] in {'prefect', 'flows', 'tasks'} for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ----------------------------------------------------------------------------------------------------
# Texture sources and stains
# ----------------------------------------------------------------------------------------------------


def test_he_source_is_the_published_cmu1_region() -> None:
    """The shipped H&E region is OpenSlide's CMU-1-Small-Region.svs byte for byte (CC0; see SOURCES.md), and it
    decodes to the 2220×2967 px, 0.499 µm/px Aperio region."""
    from wsidino_dev.sample_slides import texture

    assert hashlib.sha256(texture.HE_REGION.read_bytes()).hexdigest() == texture.HE_REGION_SHA256
    with openslide.OpenSlide(texture.HE_REGION) as slide:
        assert slide.dimensions == (2220, 2967) and slide.properties["aperio.Filename"] == "CMU-1"
        assert float(slide.properties["openslide.mpp-x"]) == pytest.approx(texture.TEXTURE_MPP, abs=0.002)
    assert texture.he_region().shape == (2967, 2220, 3)


def test_reference_stain_gives_back_the_scanned_colours() -> None:
    """Unmixing on the stain basis and rendering with the reference stain is a round trip (to rounding)."""
    from wsidino_dev.sample_slides import texture

    image = texture.he_region()[1400:1656, 500:756]
    unmix = np.linalg.inv(texture.SlideStain().matrix())
    concentrations = np.einsum("...c,cd->...d", texture.optical_density(image), unmix.astype(np.float32))
    assert np.abs(texture.render(concentrations, texture.SlideStain()).astype(np.int16) - image).max() <= 1


def test_stain_draws_are_deterministic_varied_and_read_as_tissue() -> None:
    """Per-slide stains: the same for the same stream, spread over the configured amounts, and never so blue that
    the tile stage's ink detector takes epithelium for a pen mark."""
    from wsidino_dev.sample_slides import texture

    draws = [texture.SlideStain.draw(np.random.default_rng([7, i])) for i in range(40)]
    assert draws[:5] == [texture.SlideStain.draw(np.random.default_rng([7, i])) for i in range(5)]
    hematoxylin = np.log([d.hematoxylin_amount for d in draws])
    eosin = np.log([d.eosin_amount for d in draws])
    assert np.ptp(hematoxylin) > 0.4 and np.ptp(eosin) > 0.5  # strengths vary by ≥ 1.5×, ≥ 1.6×
    assert len({d.hematoxylin for d in draws}) == len(draws)  # and hues
    assert all(d.pen_like_share() <= texture.MAX_PEN_LIKE for d in draws)
    assert texture.SlideStain(hematoxylin_amount=texture.FALLBACK_HEMATOXYLIN).pen_like_share() <= texture.MAX_PEN_LIKE


def test_heldout_preset_is_stained_outside_the_drawn_range() -> None:
    """The "heldout" slide's stain (paler hematoxylin, stronger eosin than any draw) still reads as tissue, and it
    changes only the colours: the same stream plans the same tissue, classes and pen mark as a drawn stain."""
    from wsidino_dev.sample_slides import presets, texture

    stain = presets.HELDOUT_STAIN
    assert [s.stain for s in PRESETS["heldout"]] == [stain] and stain.pen_like_share() <= texture.MAX_PEN_LIKE
    assert np.log(stain.hematoxylin_amount) < texture.HEMATOXYLIN_AMOUNT[0]
    assert np.log(stain.eosin_amount) > texture.EOSIN_AMOUNT[1]
    fixed = TissueCanvas.plan(512, 768, rng=np.random.default_rng(3), stain=stain)
    drawn = TissueCanvas.plan(512, 768, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(fixed.labels(0, 512), drawn.labels(0, 512))
    a, b = fixed.to_array().astype(np.float32), drawn.to_array().astype(np.float32)
    tissue = _tissue_mask(fixed.to_array())
    assert np.abs(a - b)[tissue].mean() > 5  # grey levels
