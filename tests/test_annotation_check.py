"""The lab's annotations are checked against the real sample slides before anything is trained or written: a file
named for no slide, one exported from a downsampled image, and one of another image's size each stop the pipeline
at once, all in one message; good files are counted in tiles per class."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from dinov3_core import cli
from dinov3_core.chain import cohort
from dinov3_core.config import load_config
from dinov3_core.evaluate.annotation_check import check_annotations
from dinov3_core.tiling.config import TileConfig
from tests.helpers import by_name

SLIDES = ("tissue_20x.svs", "tissue_40x.svs")


@pytest.fixture(scope="module")
def cohort_dir(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("annotated_slides")
    for name in SLIDES:
        (folder / name).symlink_to(by_name(sample_slides, name))
    return folder


def sample_annotation(sample_slides: Any, slide: str) -> dict[str, Any]:
    folder = next(iter(sample_slides.annotations.values())).parent
    return json.loads((folder / f"{Path(slide).stem}.geojson").read_text())


def scaled(doc: dict[str, Any], factor: float) -> dict[str, Any]:
    """The same polygons with every coordinate multiplied by `factor` (an export from another resolution)."""

    def walk(node: Any) -> Any:
        if isinstance(node, list) and node and isinstance(node[0], int | float):
            return [v * factor for v in node]
        if isinstance(node, list):
            return [walk(n) for n in node]
        if isinstance(node, dict):
            return {
                k: walk(v) if k == "coordinates" else (walk(v) if isinstance(v, dict | list) else v)
                for k, v in node.items()
            }
        return node

    return walk(doc)


def tiling(folder: Path) -> TileConfig:
    return load_config(TileConfig, "default", {"input": str(folder), "output": "unused.zarr"}, stage="tile")


def test_good_annotations_are_counted_in_tiles_per_class(sample_slides: Any, cohort_dir: Path, tmp_path: Path) -> None:
    annotations = tmp_path / "annotations"
    annotations.mkdir()
    for slide in SLIDES:
        (annotations / f"{Path(slide).stem}.geojson").write_text(json.dumps(sample_annotation(sample_slides, slide)))
    found = check_annotations(annotations, cohort(tiling(cohort_dir)), tiling(cohort_dir))
    assert found.problems == [] and found.slides == 2
    assert len(found.classes) >= 2 and all(n > 0 for n in found.classes.values()), found.classes
    assert "tiles each class would label" in found.describe()


def test_every_annotation_mistake_stops_the_pipeline_at_once_in_one_message(
    sample_slides: Any, cohort_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    annotations = tmp_path / "annotations"
    annotations.mkdir()
    doc = sample_annotation(sample_slides, "tissue_40x.svs")
    (annotations / "tissue_40.geojson").write_text(json.dumps(doc))  # a typo in the slide id
    (annotations / "tissue_20x.geojson").write_text(
        json.dumps(scaled(sample_annotation(sample_slides, "tissue_20x.svs"), 1 / 4))
    )
    args = [
        "pipeline",
        "--slides",
        str(cohort_dir),
        "--workdir",
        str(tmp_path / "run"),
        "--annotations",
        str(annotations),
    ]
    start = time.perf_counter()
    assert cli.main(args) == cli.EXIT_USAGE
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert "2 problem(s) found before any work" in err, err
    assert f"{annotations / 'tissue_40.geojson'}: names no slide of the cohort (did you mean 'tissue_40x'?)" in err
    assert f"{annotations / 'tissue_20x.geojson'}: the annotations lie mostly off the tissue" in err
    assert "downsampled 4×" in err and "np.str_" not in err
    assert not (tmp_path / "run").exists()
    assert seconds < 60, seconds  # before any stage: the problems are found from the files and thumbnails


def test_annotations_of_another_images_size_are_named(sample_slides: Any, cohort_dir: Path, tmp_path: Path) -> None:
    annotations = tmp_path / "annotations"
    annotations.mkdir()
    big = scaled(sample_annotation(sample_slides, "tissue_20x.svs"), 8)
    (annotations / "tissue_20x.geojson").write_text(json.dumps(big))
    found = check_annotations(annotations, cohort(tiling(cohort_dir)), tiling(cohort_dir))
    (problem,) = found.problems
    assert "beyond slide 'tissue_20x'" in problem and "another image's coordinates" in problem
