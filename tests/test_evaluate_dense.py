"""The dense probe and the stain-invariance score of the evaluate stage, on the sample cohort.

The cohort is the sample-slide generator's "test" preset (3 annotated slides, class polygons Tumor, Squamous
epithelium, Stroma, in QuPath's GeoJSON), tiled by the real tile stage at 64 px and 1 µm/px, so the test ViT (patch
16) sees a 4×4 grid of patch tokens per tile. Two real ONNX models (a random ViT and the same ViT made colour-blind)
are exported and registered; one is made `@champion`, the other is the candidate, the baseline is the
architecture at initialisation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shapely

from dinov3_core.config import load_config
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.runner import run_stage
from tests.helpers import eval_backbone, export_registered, tile_store

ARCH = "vit_test"
NAME = "wsidino-backbone-dense"


def backbone(root: Path, colour_blind: bool) -> Path:
    return eval_backbone(root, ARCH, colour_blind=colour_blind)


@pytest.fixture(scope="module")
def cohort(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("dense")
    store = tile_store(sample_slides.slides, root / "tiles.zarr", tile_size=64, mpp=1.0)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    colour, _ = export_registered(backbone(root / "colour", False), NAME, uri, size=64)
    blind, blind_version = export_registered(backbone(root / "blind", True), NAME, uri, size=64)
    MlflowClient(uri).set_registered_model_alias(NAME, "champion", blind_version)
    annotations = next(iter(sample_slides.annotations.values())).parent
    return {"root": root, "store": store, "uri": uri, "colour": colour, "blind": blind, "annotations": annotations}


def evaluate(cohort: dict[str, Any], output: str, **values: Any) -> EvaluationReport:
    from dinov3_core.evaluate.config import EvaluateConfig

    cfg = load_config(
        EvaluateConfig,
        None,
        {
            "store": str(cohort["store"]),
            "candidate": str(cohort["colour"]),
            "output": str(cohort["root"] / output),
            "annotations": str(cohort["annotations"]),
            "register_name": NAME,
            "tracking.uri": cohort["uri"],
            "baseline": "init",
            "gate.promote": False,
            "probe.bootstrap": 100,
            "probe.few_shot": [1],
            "probe.few_shot_draws": 1,
            "progress": False,
            **values,
        },
    )
    run_stage("evaluate", cfg)
    return EvaluationReport.from_json((cohort["root"] / output / "evaluation.json").read_text())


# ------------------------------------------------------------------------------------------- token labels


def test_token_centres_and_the_boundary_rule_on_a_tiled_slide(cohort: dict[str, Any], tmp_path: Path) -> None:
    """A polygon whose right edge crosses one tile at 40 % of its width: of the 4×4 tokens, column 0 (centre 12.5 %
    of the tile, 27.5 % of a tile from the edge) is kept, column 1 (37.5 %: 2.5 % from the edge, under half a token,
    12.5 %) is left out as a boundary token, columns 2 and 3 are outside every annotation."""
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.evaluate.dense import dense_tokens, token_centres

    ds = TileDataset(cohort["store"], image_format="numpy")
    s = 0
    size = float(ds.slide_attrs(s)["tile_size_level0"])
    coords = ds.slide_coords(s)
    row = len(coords) // 2
    x, y = (float(v) for v in coords[row])
    centres = token_centres(coords[[row]], size, 4)[0]
    # independently: token 0 is the top-left, 3 the top-right, 4 the start of the second row, 15 the bottom-right
    step = size / 4
    assert np.allclose(centres[0], [x + step / 2, y + step / 2])
    assert np.allclose(centres[3], [x + 3.5 * step, y + step / 2])
    assert np.allclose(centres[4], [x + step / 2, y + 1.5 * step])
    assert np.allclose(centres[15], [x + size - step / 2, y + size - step / 2])

    edge = x + 0.4 * size
    polygon = shapely.box(x - 4 * size, y - 4 * size, edge, y + 5 * size)  # covers the tile's rows entirely
    folder = tmp_path / "annotations"
    folder.mkdir()
    feature = {
        "type": "Feature",
        "geometry": json.loads(shapely.to_geojson(polygon)),
        "properties": {"objectType": "annotation", "classification": {"name": "Tumor"}},
    }
    slide_id = ds.slide_ids[s]
    (folder / f"{slide_id}.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [feature]}))
    found = dense_tokens(cohort["store"], ds, str(folder), np.array([ds.global_index(s, row)]), 4, per_tile=16)
    kept = sorted(found.positions[0][found.positions[0] >= 0].tolist())
    assert kept == [0, 4, 8, 12]  # column 0 of every row
    assert set(found.labels[0][found.positions[0] >= 0]) == {"Tumor"}
    # A margin check of its own: every kept centre is more than half a token from the edge, every left-out one in
    # the polygon is within it.
    inside = [k for k in range(16) if centres[k, 0] < edge]
    assert sorted(set(inside) - set(kept)) == [1, 5, 9, 13]
    assert all(edge - centres[k, 0] > step / 2 for k in kept)
    assert found.counts()["tokens"] == 4 and found.counts()["grid"] == "4x4"
    # A second class overlapping the top row makes those tokens ambiguous, even when the class is excluded
    top = shapely.box(x - size, y - size, x + size, y + step)  # row 0 inside it, row 1 half a token below
    feature2 = {
        **feature,
        "geometry": json.loads(shapely.to_geojson(top)),
        "properties": {"objectType": "annotation", "classification": {"name": "Ignore"}},
    }
    (folder / f"{slide_id}.geojson").write_text(
        json.dumps({"type": "FeatureCollection", "features": [feature, feature2]})
    )
    found = dense_tokens(
        cohort["store"], ds, str(folder), np.array([ds.global_index(s, row)]), 4, per_tile=16, exclude=["Ignore"]
    )
    assert sorted(found.positions[0][found.positions[0] >= 0].tolist()) == [8, 12]  # row 1: ½ token off the edge


def test_at_most_dense_tokens_per_tile_are_kept_evenly(cohort: dict[str, Any], tmp_path: Path) -> None:
    from dinov3_core.evaluate.dense import pick_tokens

    classes = np.full((2, 16), "", dtype=object)
    classes[0, :] = "Stroma"
    classes[1, [3, 7]] = "Tumor"
    pos, lab = pick_tokens(classes, 4)
    assert pos[0].tolist() == [0, 5, 10, 15] and set(lab[0]) == {"Stroma"}
    assert pos[1].tolist() == [3, 7, -1, -1] and lab[1].tolist() == ["Tumor", "Tumor", "", ""]


def test_miou_from_the_pooled_confusion_matrix() -> None:
    from sklearn.metrics import jaccard_score

    from dinov3_core.evaluate.dense import miou

    rng = np.random.default_rng(0)
    y, pred = rng.integers(0, 3, 200), rng.integers(0, 3, 200)
    assert miou(y, pred, 3) == pytest.approx(jaccard_score(y, pred, average="macro"))


# ------------------------------------------------------------------------------------------- the stage


def test_the_stage_reports_dense_metrics_and_stain_invariance_and_gates_on_dense_miou(cohort: dict[str, Any]) -> None:
    # three slides reach p = 1/8 at best: alpha 0.125 lets the gate decide on them (the default 0.025 needs 6)
    ev = evaluate(cohort, "eval-dense", **{"gate.primary_metric": "dense.miou", "gate.alpha": 0.125})
    assert set(ev.models) == {"candidate", "champion", "baseline"}
    counts = None
    for role, model in ev.models.items():
        dense = model["probes"]["dense"]
        for metric in ("balanced_accuracy", "miou"):
            m = dense[metric]
            assert 0 <= m["ci_low"] <= m["value"] <= m["ci_high"] <= 1, (role, metric, m)
        assert counts is None or dense["counts"] == counts  # one grid: the same tokens for every model
        counts = dense["counts"]
        assert len(dense["linear_c_per_fold"]) == ev.split["folds"]
        assert 0 <= model["health"]["stain_invariance"] <= 1
    assert counts["grid"] == "4x4" and 0 < counts["tokens"] <= 16 * ev.labelled_tiles
    assert set(counts["classes"]) <= set(ev.classes) and len(counts["classes"]) >= 2
    for other in ("champion", "baseline"):
        diff = ev.comparisons[f"candidate_vs_{other}"]["dense.miou"]
        cand, theirs = ev.models["candidate"]["probes"]["dense"]["miou"], ev.models[other]["probes"]["dense"]
        assert diff["value"] == pytest.approx(cand["value"] - theirs["miou"]["value"])
        assert diff["ci_low"] <= diff["value"] <= diff["ci_high"]
    decision = ev.decision
    # the gate decided on the dense metric: its interval, and its reason names it (vs the baseline or the champion)
    assert decision["evidence"]["metric"] == "dense.miou" and decision["reason"].startswith("dense.miou ")
    diff = ev.comparisons["candidate_vs_champion"]["dense.miou"]
    assert decision["evidence"]["interval"] == {k: diff[k] for k in ("value", "ci_low", "ci_high")}
    vs_baseline = ev.comparisons["candidate_vs_baseline"]["dense.miou"]["value"]
    assert decision["promote"] == (diff["p_value"] <= 0.125 and diff["value"] > 0 and vs_baseline >= 0)
    if vs_baseline < 0:
        assert decision["reason"] == f"dense.miou {vs_baseline:+.4f} below the baseline"
    else:
        assert "dense.miou vs champion" in decision["reason"]
    md = (cohort["root"] / "eval-dense" / "evaluation.md").read_text()
    assert "dense mIoU" in md and "stain invariance" in md and f"Dense probe: {counts['tokens']} labelled" in md
    print(
        "dense:",
        {
            r: {k: round(m["probes"]["dense"][k]["value"], 3) for k in ("balanced_accuracy", "miou")}
            | {"stain": m["health"]["stain_invariance"]}
            for r, m in ev.models.items()
        },
    )


def test_a_cache_without_dense_tokens_is_not_read_for_them(cohort: dict[str, Any]) -> None:
    """The same output directory embedded first without the dense probe: its cache files hold no patch tokens,
    and the next run (dense on) computes its own instead of failing on them or reading them."""
    ev = evaluate(cohort, "eval-cache", **{"probe.dense_tokens_per_tile": 0})
    assert all("dense" not in m["probes"] for m in ev.models.values())
    cache = cohort["root"] / "eval-cache" / "cache"
    before = set(cache.glob("features-*.npz"))
    ev = evaluate(cohort, "eval-cache", **{"probe.dense_tokens_per_tile": 4})
    assert all(m["probes"]["dense"]["counts"]["tokens_per_tile"] == 4 for m in ev.models.values())
    new = set(cache.glob("features-*.npz")) - before
    assert len(new) == 3 and all("-d" in p.stem for p in new)


# ------------------------------------------------------------------------------------------- stain invariance


def test_stain_invariance_is_one_without_perturbation_and_a_share_otherwise(cohort: dict[str, Any]) -> None:
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.evaluate.features import open_model, stain_invariance

    ds = TileDataset(cohort["store"], image_format="numpy")
    tiles = ds.read_batch(np.linspace(0, len(ds) - 1, 48).round().astype(np.int64))
    model = open_model(cohort["colour"])
    assert stain_invariance(model, tiles, 0.0, 0.0, seed=0) == 1.0
    mild = stain_invariance(model, tiles, 0.1, 0.02, seed=0)
    strong = stain_invariance(model, tiles, 0.9, 0.5, seed=0)
    assert 0.0 <= strong < 1.0 and 0.0 <= mild <= 1.0  # a stain far beyond training moves some tiles off
    assert strong <= mild
    assert stain_invariance(model, tiles, 0.1, 0.02, seed=0) == mild  # deterministic
