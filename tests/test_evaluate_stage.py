"""The evaluate stage end to end: a real tile store, real GeoJSON, real ONNX models registered in a real MLflow
registry, and the `@champion` alias moved (or not) by the gate.

The annotations are drawn from the tissue itself: each tile is classed by its DAB-channel optical density from
scikit-image's colour deconvolution (on the H&E sample slides a plain colour measure, no stain), and written as
QuPath-style polygons, so the classes mean something in the image. Two models share one architecture: a randomly
initialised ViT (colour reaches its features) and the same ViT made colour-blind (every patch-embedding kernel has
zero mean per input channel, so a flat stain shift does not change its output). The first is known to be better
on these labels, the second known to be worse.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dinov3_core.config import load_config
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.runner import run_stage
from tests.helpers import by_name, eval_backbone, export_registered, tile_store

ARCH = "vit_test"
NAME = "wsidino-backbone-evaltest"
DAB_RED = [200, 0, 0]  # the colour the "lab" gives Tumor (DAB+) in its annotations; Tumor (DAB-) has none


def backbone(root: Path, colour_blind: bool) -> Path:
    return eval_backbone(root, ARCH, colour_blind=colour_blind)


def dab_annotations(store: Path, out: Path) -> dict[str, int]:
    """One GeoJSON per slide: tiles classed by their mean DAB optical density (terciles over the store)."""
    from shapely import box, union_all
    from skimage.color import rgb2hed

    from dinov3_core.data.tile_dataset import TileDataset
    from wsidino_dev.sample_slides.annotations import class_collection

    ds = TileDataset(store, image_format="numpy")
    dab = np.array([rgb2hed(t)[..., 2].mean() for t in ds.read_batch(np.arange(len(ds)))])
    lo, hi = np.quantile(dab, [1 / 3, 2 / 3])
    names = np.where(dab >= hi, "Tumor (DAB+)", np.where(dab <= lo, "Tumor (DAB-)", "Intermediate"))
    out.mkdir(parents=True)
    counts: dict[str, int] = {}
    start = 0
    for s, slide_id in enumerate(ds.slide_ids):
        coords = ds.slide_coords(s)
        size = float(ds.slide_attrs(s)["tile_size_level0"])
        shapes = {}
        for cls in ("Tumor (DAB+)", "Tumor (DAB-)"):  # the middle tercile stays unlabelled, as in real annotation
            rows = np.flatnonzero(names[start : start + len(coords)] == cls)
            counts[cls] = counts.get(cls, 0) + len(rows)
            shapes[cls] = union_all([box(x, y, x + size, y + size) for x, y in coords[rows]])
        doc = class_collection(shapes)
        for feature in doc["features"]:
            if feature["properties"]["classification"]["name"] == "Tumor (DAB+)":
                feature["properties"]["classification"]["color"] = DAB_RED
        (out / f"{slide_id}.geojson").write_text(json.dumps(doc))
        start += len(coords)
    return counts


@pytest.fixture(scope="module")
def setup(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("evaluate")
    slides = [by_name(sample_slides, n) for n in ("tissue_40x.svs", "tissue_20x.svs", "tissue_generic.tiff")]
    store = tile_store(slides, root / "tiles.zarr", tile_size=32, mpp=2.0)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    return {
        "root": root,
        "store": store,
        "uri": uri,
        "counts": dab_annotations(store, root / "annotations"),
        "better": export_registered(backbone(root / "better", colour_blind=False), NAME, uri)[0],
        "worse": export_registered(backbone(root / "worse", colour_blind=True), NAME, uri)[0],
    }


def evaluate(setup: dict[str, Any], candidate: str, output: str, force: bool = False, **values: Any) -> Any:
    from dinov3_core.evaluate.config import EvaluateConfig

    cfg = load_config(
        EvaluateConfig,
        None,
        {
            "store": str(setup["store"]),
            "candidate": str(setup[candidate]),
            "output": str(setup["root"] / output),
            "annotations": str(setup["root"] / "annotations"),
            "register_name": NAME,
            "tracking.uri": setup["uri"],
            "probe.bootstrap": 200,
            "probe.few_shot": [1, 4],
            "probe.few_shot_draws": 2,
            "progress": False,
            **values,
        },
    )
    return run_stage("evaluate", cfg, force=force)


def champion_version(setup: dict[str, Any]) -> str | None:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return str(MlflowClient(setup["uri"]).get_model_version_by_alias(NAME, "champion").version)
    except MlflowException:
        return None


def version_of(model: Path) -> str:
    from dinov3_core import manifest as mf

    return str(mf.producer_manifest(model).summary["model_version"])


def test_worse_first_model_is_not_promoted_over_the_baseline(setup: dict[str, Any]) -> None:
    assert min(setup["counts"].values()) > 20
    out = evaluate(setup, "worse", "eval-worse", baseline=str(setup["better"].parent / "backbone.pth"))
    ev = EvaluationReport.from_json((setup["root"] / "eval-worse" / "evaluation.json").read_text())
    assert set(ev.models) == {"candidate", "baseline"}  # no champion in the registry yet
    assert not ev.decision["promote"] and champion_version(setup) is None
    assert ev.comparisons["candidate_vs_baseline"]["linear.balanced_accuracy"]["value"] < 0
    assert out.manifest.summary["promoted"] is False


def test_better_first_model_becomes_champion_once(
    setup: dict[str, Any], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dinov3_core.evaluate import evaluation

    baseline = str(setup["worse"].parent / "backbone.pth")
    # Three slides: a permutation test reaches p = 1/8 at best, so alpha 0.125 (the default 0.025 needs 6 slides).
    gate = {"gate.alpha": 0.125}
    monkeypatch.setattr(evaluation, "PROGRESS_EVERY_S", 0.0)  # every progress line is due: the loops' lines show
    caplog.set_level(logging.INFO, logger="dinov3_core")
    out = evaluate(setup, "better", "eval-better", baseline=baseline, progress=True, **gate)
    # Every step of minutes says when it starts and ends, and its loops (models, folds) say where they are.
    log = caplog.text
    for phase in (
        "labelling tiles from the annotations",
        "candidate model: health, stain invariance, embedding",
        "baseline model: health, stain invariance, embedding",
        "tile probes of 2 model(s) on 3 slides",
        "dense probe of 2 model(s)",
        "pictures and QuPath predictions",
        "gate, evaluation.json and MLflow",
    ):
        assert f"evaluate: {phase}: started" in log and re.search(rf"evaluate: {re.escape(phase)}: done in \d", log)
    for step in (
        "candidate model: health, stain invariance, embedding: stain invariance done (",
        "evaluate: embedding baseline: ",
        "tile probes of 2 model(s) on 3 slides: candidate: linear probe fold 3/3 (",
        "tile probes of 2 model(s) on 3 slides: baseline: few-shot kNN fold 3/3 (",
        "tile probes of 2 model(s) on 3 slides: paired comparisons (200 bootstrap resamples",
        "dense probe of 2 model(s): baseline: ",
    ):
        assert step in log, step
    ev = EvaluationReport.from_json((setup["root"] / "eval-better" / "evaluation.json").read_text())
    split = ev.split
    assert split["folds"] == 3 and split["test_groups"] == ["tissue_20x", "tissue_40x", "tissue_generic"]
    for fold in split["per_fold"]:  # every slide tested once, never by a probe trained on it
        assert not set(fold["train_groups"]) & set(fold["test_groups"])
    assert ev.evidence["test_groups"] == 3 and ev.evidence["sufficient"] is True
    assert ev.evidence["p_value"] == 0.125 and ev.decision["applied"], ev.decision
    assert champion_version(setup) == version_of(setup["better"])
    assert out.manifest.summary["champion_model"] == str(setup["better"])
    pictures = ("confusion_candidate.png", "embedding_candidate.png", "embedding_candidate_by_slide.png")
    for picture in (*pictures, "evaluation.md"):
        assert (setup["root"] / "eval-better" / picture).is_file()
    # The probe's out-of-fold predictions as QuPath detections, one file per annotated slide, read back with the
    # reader of QuPath exports: every annotated tile once, classified by its predicted class.
    from dinov3_core.evaluate.geojson import read_geojson

    files = sorted((setup["root"] / "eval-better" / "qupath").glob("*.geojson"))
    assert [f.stem for f in files] == split["test_groups"] and ev.qupath.endswith("qupath")
    shapes = [shape for f in files for shape in read_geojson(f).shapes]
    assert len(shapes) == ev.labelled_tiles and {c for c, _ in shapes} <= set(ev.classes)
    doc = json.loads(files[0].read_text())
    measured = doc["features"][0]["properties"]["measurements"]
    assert {"confidence", "correct"} <= set(measured) and 0 <= measured["confidence"] <= 1
    correct = np.mean(
        [f["properties"]["measurements"]["correct"] for p in files for f in json.loads(p.read_text())["features"]]
    )
    assert correct > 0.5  # the better model's probe is right on most tiles (its balanced accuracy is > 0.5)
    # A predicted class is drawn in its annotations' colour; a class annotated without one, in the palette's.
    from dinov3_core.qupath import PALETTE

    drawn = {
        f["properties"]["classification"]["name"]: f["properties"]["classification"]["color"]
        for p in files
        for f in json.loads(p.read_text())["features"]
    }
    assert drawn == {"Tumor (DAB+)": DAB_RED, "Tumor (DAB-)": list(PALETTE[1])}
    assert ev.labels["colours"] == {"Tumor (DAB+)": DAB_RED}
    from mlflow import MlflowClient

    # The evaluate run holds the pictures (both embedding maps) and the QuPath predictions, one file per slide.
    client = MlflowClient(setup["uri"])
    logged = {a.path for a in client.list_artifacts(out.mlflow_run_id)}
    assert set(pictures) <= logged and "qupath" in logged
    qupath = {a.path for a in client.list_artifacts(out.mlflow_run_id, "qupath")}
    assert qupath == {f"qupath/{f.name}" for f in files}
    tags = client.get_model_version(NAME, version_of(setup["better"])).tags
    assert tags["wsidino.promotion"] == "promoted" and float(tags["wsidino.eval.linear.balanced_accuracy"]) > 0.5
    # A rerun skips (stage manifest); a forced rerun finds the candidate already champion and moves nothing.
    assert evaluate(setup, "better", "eval-better", baseline=baseline, **gate).status == "skipped"
    again = evaluate(setup, "better", "eval-better", force=True, baseline=baseline, **gate)
    assert again.result.decision.already_champion and not again.result.decision.applied
    assert champion_version(setup) == version_of(setup["better"])


def test_worse_candidate_does_not_replace_the_champion(setup: dict[str, Any]) -> None:
    assert champion_version(setup) == version_of(setup["better"])  # from the test above
    evaluate(setup, "worse", "eval-worse-2", baseline=None)
    ev = EvaluationReport.from_json((setup["root"] / "eval-worse-2" / "evaluation.json").read_text())
    assert set(ev.models) == {"candidate", "champion"}
    diff = ev.comparisons["candidate_vs_champion"]["linear.balanced_accuracy"]
    assert diff["ci_low"] <= diff["value"] < 0 and not ev.decision["promote"]
    assert champion_version(setup) == version_of(setup["better"])
    assert ev.champion_model and Path(ev.champion_model).is_file()  # the champion's ONNX, downloaded
    # The first evaluation of this model faced no champion: with the same inputs it reruns, because one exists now.
    again = evaluate(setup, "worse", "eval-worse", baseline=str(setup["better"].parent / "backbone.pth"))
    assert (again.status, again.reason) == ("ran", "inputs changed: champion")
    assert again.manifest.inputs["champion"]["path"] == f"models:/{NAME}@champion"
    assert not again.result.decision.promote and champion_version(setup) == version_of(setup["better"])


def test_no_annotations_measures_health_and_promotes_nothing(setup: dict[str, Any]) -> None:
    out = evaluate(setup, "worse", "eval-health", annotations=None, baseline="init")
    ev = EvaluationReport.from_json((setup["root"] / "eval-health" / "evaluation.json").read_text())
    assert ev.labelled_tiles == 0 and "promotion is off" in ev.decision["reason"]
    for model in ev.models.values():
        assert 0 < model["health"]["cls_effective_rank"] <= 1 and -1 <= model["health"]["dense_agreement"] <= 1
    assert out.status == "ran" and champion_version(setup) == version_of(setup["better"])


@pytest.mark.usefixtures("one_thread")
def test_convert_picks_the_eval_checkpoint_with_the_best_knn(setup: dict[str, Any]) -> None:
    from dinov3_core.config import ConfigError
    from dinov3_core.convert.config import ConvertConfig
    from dinov3_core.models.released import unwrap_backbone_state_dict
    from dinov3_core.train.pretrain import run_pretrain
    from tests.helpers import pretrain_config

    run = setup["root"] / "run"
    run_pretrain(
        pretrain_config(
            setup["store"],
            run,
            **{"train.stop_at": 6, "checkpointing.period": 2, "evaluation.eval_period_iterations": 2},
        )
    )
    values = {
        "input": str(run),
        "output_dir": str(setup["root"] / "model-knn"),
        "select": "best_knn",
        "store": str(setup["store"]),
        "annotations": str(setup["root"] / "annotations"),
        "tracking.enabled": False,
    }
    outcome = run_stage("convert", load_config(ConvertConfig, None, values))
    curve = json.loads((run / "eval" / "knn_curve.json").read_text())
    points = curve["points"]
    assert [p["iteration"] for p in points] == [1, 3, 5]
    logged = {r["iteration"]: r for r in map(json.loads, (run / "training_metrics.json").read_text().splitlines())}
    for p in points:  # the training health probe's scores, from the checkpoint files: what training logged
        assert p["invariance"] == logged[p["iteration"]]["invariance"]
        assert p["effective_rank"] == pytest.approx(logged[p["iteration"]]["effective_rank"], abs=1e-5)
    best = max(points, key=lambda p: (p["knn_balanced_accuracy"], -p["iteration"]))
    assert outcome.manifest.summary["iteration"] == best["iteration"] == curve["best"]["iteration"]
    assert (run / "eval" / "knn_curve.png").is_file()
    converted = torch.load(setup["root"] / "model-knn" / "backbone.pth", weights_only=True)
    chosen = unwrap_backbone_state_dict(torch.load(best["path"], weights_only=True))
    assert converted.keys() == chosen.keys() and all(torch.equal(converted[k], chosen[k]) for k in chosen)
    with pytest.raises(ConfigError, match="select"):
        load_config(ConvertConfig, None, {**values, "annotations": None})


def test_patients_split_and_site_predictability(setup: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    root = setup["root"]
    (root / "sites.csv").write_text("slide_id,site\ntissue_40x,A\ntissue_20x,A\ntissue_generic,B\n")
    caplog.set_level(logging.INFO, logger="dinov3_core")
    evaluate(setup, "better", "eval-sites", baseline=None, sites=str(root / "sites.csv"), **{"gate.promote": False})
    assert "evaluate: site predictability: started" in caplog.text
    assert "evaluate: site predictability: candidate done (" in caplog.text
    assert re.search(r"evaluate: site predictability: done in \d", caplog.text)
    ev = EvaluationReport.from_json((root / "eval-sites" / "evaluation.json").read_text())
    assert 0.0 <= ev.site_predictability["candidate"] <= 1.0
    # The fold that tests tissue_generic (the only slide of site B) has no B slide to learn the site from.
    assert any("site predictability on 2 of 3 folds" in w for w in ev.warnings), ev.warnings

    (root / "patients.csv").write_text("slide_id,patient\ntissue_40x,p1\ntissue_20x,p1\ntissue_generic,p2\n")
    evaluate(
        setup, "better", "eval-patients", baseline=None, patients=str(root / "patients.csv"), **{"gate.promote": False}
    )
    ev = EvaluationReport.from_json((root / "eval-patients" / "evaluation.json").read_text())
    assert ev.split["by"] == "patient" and ev.split["test_groups"] == ["p1", "p2"]
    for fold in ev.split["per_fold"]:  # the two slides of p1 are on one side of every fold
        assert len(fold["train_groups"]) == len(fold["test_groups"]) == 1
    assert ev.evidence["unit"] == "patient" and ev.evidence["test_groups"] == 2
    (root / "bad.csv").write_text("slide_id,patient\ntissue_40x,p1\n")
    from dinov3_core.evaluate.config import EvaluateError

    with pytest.raises(EvaluateError, match="no patient for slide"):
        evaluate(setup, "better", "eval-bad", baseline=None, patients=str(root / "bad.csv"))
