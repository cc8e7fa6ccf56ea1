"""The gate needs evidence: a backbone of Gaussian noise never replaces a trained champion, on the cohorts the
sample-slide generator makes for `make demo`.

The cohort is the generator's own (the "test" preset: the demo's slides at a quarter of the size per side, with the
class polygons they were rendered from: Tumor, Squamous epithelium, Stroma), tiled by the real tile stage. The
champion is the test ViT trained on the cohort's labelled tiles (a linear head on its CLS token, a few seconds:
a DINO run that learns takes minutes on 2 cores), exported to ONNX, registered, and made `@champion` by the gate
itself. The candidate has the same architecture with every tensor replaced by `torch.randn_like`: the model the
audit saw promoted (+0.054 on one test slide, a zero-width "interval").
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from dinov3_core.config import load_config
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.runner import run_stage
from tests.helpers import export_registered, tile_store, torch_threads

ARCH = "vit_test"
NAME = "wsidino-backbone-evidence"


def save(model: torch.nn.Module, root: Path) -> Path:
    from dinov3_core.inference.backbone import INFERENCE_OVERRIDES
    from dinov3_core.models import backbone_kwargs, save_backbone

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(
        yaml.safe_dump({"arch": ARCH, "backbone_kwargs": backbone_kwargs(ARCH, **INFERENCE_OVERRIDES)})
    )
    return save_backbone(model, root / "backbone.pth")


def trained_backbone(store: Path, annotations: Path, root: Path) -> Path:
    """The test ViT trained to tell the annotated classes apart (CLS token → linear head, cross-entropy)."""
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.evaluate.evaluation import labelled_tiles
    from dinov3_core.inference.backbone import INFERENCE_OVERRIDES
    from dinov3_core.inference.feature_model import normalise
    from dinov3_core.models import build_backbone

    ds = TileDataset(store, image_format="numpy")
    idx, labels, _, _ = labelled_tiles(store, ds, str(annotations), [])
    classes, y = np.unique(labels, return_inverse=True)
    x = torch.from_numpy(normalise(ds.read_batch(idx)))
    torch.manual_seed(0)
    model = build_backbone(ARCH, **INFERENCE_OVERRIDES)
    head = torch.nn.Linear(model.embed_dim, len(classes))
    opt = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=1e-3)
    target = torch.from_numpy(y)
    with torch_threads(1):
        model.train()
        for _ in range(150):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(head(model.forward_features(x)["x_norm_clstoken"]), target)
            loss.backward()
            opt.step()
    return save(model.eval(), root)


def noise_backbone(like: Path, root: Path) -> Path:
    """`like`'s architecture, every tensor Gaussian noise."""
    from dinov3_core.inference.backbone import INFERENCE_OVERRIDES
    from dinov3_core.models import build_backbone

    model = build_backbone(ARCH, **INFERENCE_OVERRIDES).eval()
    model.load_state_dict(torch.load(like, weights_only=True))
    torch.manual_seed(1)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t))
    return save(model, root)


def evaluate(cohort: dict[str, Any], candidate: str, output: str, annotations: Path | None = None, **values: Any):
    from dinov3_core.evaluate.config import EvaluateConfig

    cfg = load_config(
        EvaluateConfig,
        None,
        {
            "store": str(cohort["store"]),
            "candidate": str(cohort[candidate]),
            "output": str(cohort["root"] / output),
            "annotations": str(annotations or cohort["annotations"]),
            "register_name": NAME,
            "tracking.uri": cohort["uri"],
            "probe.bootstrap": 200,
            "probe.few_shot": [1, 4],
            "probe.few_shot_draws": 2,
            "progress": False,
            **values,
        },
    )
    outcome = run_stage("evaluate", cfg)
    return outcome, EvaluationReport.from_json((cohort["root"] / output / "evaluation.json").read_text())


def champion_version(cohort: dict[str, Any]) -> str:
    from mlflow import MlflowClient

    return str(MlflowClient(cohort["uri"]).get_model_version_by_alias(NAME, "champion").version)


def version_tags(cohort: dict[str, Any], model: Path) -> dict[str, str]:
    from mlflow import MlflowClient

    from dinov3_core import manifest as mf

    version = str(mf.producer_manifest(model).summary["model_version"])
    return {"version": version, **MlflowClient(cohort["uri"]).get_model_version(NAME, version).tags}


@pytest.fixture(scope="module")
def cohort(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo cohort (3 annotated slides), a trained champion made @champion by the gate, a noise candidate."""
    root = tmp_path_factory.mktemp("evidence")
    annotations = next(iter(sample_slides.annotations.values())).parent
    assert len(sample_slides.annotations) == 3  # every slide the generator makes for the demo is annotated
    store = tile_store(sample_slides.slides, root / "tiles.zarr", tile_size=32, mpp=2.0)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    trained = trained_backbone(store, annotations, root / "trained")
    cohort = {
        "root": root,
        "store": store,
        "uri": uri,
        "annotations": annotations,
        "trained": export_registered(trained, NAME, uri)[0],
        "noise": export_registered(noise_backbone(trained, root / "noise"), NAME, uri)[0],
    }
    # The trained model becomes the registry's first champion through the gate, against the untrained init. Three
    # slides reach p = 1/8 at best: alpha 0.125 is the least that lets them promote (the default 0.025 needs 6).
    _, ev = evaluate(cohort, "trained", "eval-trained", baseline="init", **{"gate.alpha": 0.125})
    cohort["first"] = ev
    assert ev.decision["applied"], ev.decision["reason"]
    two = root / "annotations-2"  # the fewest slides a slide-level evaluation accepts: every class on two
    two.mkdir()
    for stem in ("tissue_40x", "tissue_20x"):
        shutil.copy(sample_slides.annotations[stem], two / f"{stem}.geojson")
    cohort["two"] = two
    return cohort


def test_a_trained_first_model_is_promoted_on_the_evidence_of_every_slide(cohort: dict[str, Any]) -> None:
    ev = cohort["first"]
    assert ev.split["folds"] == 3 and ev.split["test_groups"] == ["tissue_20x", "tissue_40x", "tissue_generic"]
    for fold in ev.split["per_fold"]:
        assert not set(fold["train_groups"]) & set(fold["test_groups"])
    evidence = ev.evidence
    assert evidence["test_groups"] == 3 and evidence["folds"] == 3 and evidence["sufficient"] is True
    assert evidence["point_estimate"] is False and evidence["allow_point_estimate"] is False
    assert evidence["p_value"] == 0.125 and evidence["min_test_slides"] == 3 and "exact" in evidence["test"]
    low, high = evidence["interval"]["ci_low"], evidence["interval"]["ci_high"]
    assert low < high  # a real interval, from three test slides (for display: the test decided)
    assert ev.decision["evidence"] == evidence
    tags = version_tags(cohort, cohort["trained"])
    assert champion_version(cohort) == tags["version"]
    assert (tags["wsidino.eval.test_slides"], tags["wsidino.eval.folds"]) == ("3", "3")
    assert tags["wsidino.eval.evidence"] == "sufficient" and tags["wsidino.eval.allow_point_estimate"] == "false"
    assert f"[{low:+.4f}, {high:+.4f}]" in tags["wsidino.eval.interval"]
    assert tags["wsidino.eval.p_value"] == "0.125" and tags["wsidino.eval.alpha"] == "0.125"
    md = (cohort["root"] / "eval-trained" / "evaluation.md").read_text()
    assert "p = 0.125 (paired permutation, 3 slides, α 0.125): promoted to @champion" in md
    assert "3 test slides (the test needs 3 at α 0.125), 3 folds; sufficient" in md


def test_a_noise_candidate_is_not_promoted_over_the_trained_champion(cohort: dict[str, Any]) -> None:
    champion = champion_version(cohort)
    outcome, ev = evaluate(cohort, "noise", "eval-noise", **{"gate.alpha": 0.125})
    diff = ev.comparisons["candidate_vs_champion"]["linear.balanced_accuracy"]
    assert not ev.decision["promote"] and not ev.decision["applied"], ev.decision
    reason = ev.decision["reason"]  # names what it measured: the champion, or the baseline it also fell below
    assert diff["p_value"] > 0.125 and ("vs champion" in reason or "below the baseline" in reason), reason
    assert ev.evidence["test_groups"] == 3 and ev.evidence["sufficient"] is True
    assert champion_version(cohort) == champion
    assert outcome.manifest.summary["promoted"] is False and outcome.manifest.summary["decision"]
    assert outcome.manifest.summary["evidence"].startswith("gate: linear.balanced_accuracy candidate − champion")
    tags = version_tags(cohort, cohort["noise"])
    assert tags["wsidino.promotion"] == "kept" and tags["wsidino.promotion_reason"] == ev.decision["reason"]


def test_two_annotated_slides_are_not_enough_evidence(cohort: dict[str, Any]) -> None:
    """The protocol's smallest cohort (each class on two slides); the audit's one-test-slide split cannot happen
    any more (every slide is tested), so this is where thin evidence now shows."""
    champion = champion_version(cohort)
    _, ev = evaluate(cohort, "noise", "eval-noise-2", annotations=cohort["two"])
    reason = ev.decision["reason"]
    assert not ev.decision["promote"] and champion_version(cohort) == champion
    assert reason.startswith(
        "not enough evidence: 2 test slide(s): a permutation test over 2 slide(s) cannot give "
        "a p-value below 2^-2 = 0.25 > gate.alpha 0.025, so nothing can be promoted on fewer "
        "than 6; annotate at least 4 more slide(s)"
    ), reason
    assert ev.evidence["test_groups"] == 2 and ev.evidence["sufficient"] is False
    assert any("only 2 annotated slides" in w for w in ev.warnings)
    assert version_tags(cohort, cohort["noise"])["wsidino.eval.evidence"] == "insufficient"


def test_allow_point_estimate_decides_on_two_slides_and_records_it(cohort: dict[str, Any]) -> None:
    champion = champion_version(cohort)
    _, ev = evaluate(
        cohort, "noise", "eval-noise-opt-in", annotations=cohort["two"], **{"gate.allow_point_estimate": True}
    )
    reason = ev.decision["reason"]
    assert "decided on a point estimate (gate.allow_point_estimate=true) although 2 test slide(s)" in reason
    assert ev.evidence["point_estimate"] is True and ev.evidence["allow_point_estimate"] is True
    assert not ev.decision["promote"] and champion_version(cohort) == champion  # noise is still worse
    md = (cohort["root"] / "eval-noise-opt-in" / "evaluation.md").read_text()
    assert "decided on a point estimate (gate.allow_point_estimate=true)" in md
