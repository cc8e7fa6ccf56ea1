"""The evaluation protocol on controlled features: the slide split, the probes, the intervals and the gate."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dinov3_core.config import load_config
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate.config import EvaluateConfig
from dinov3_core.evaluate.gate import decide


def clustered(n_slides: int, per_class: int, classes: int, spread: float, seed: int) -> tuple[np.ndarray, ...]:
    """Features with one cluster per class (+ a per-slide offset, as staining batches give), labels, slide ids."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, 16)) * 3
    x, y, g = [], [], []
    for s in range(n_slides):
        offset = rng.normal(size=16) * 0.5
        for c in range(classes):
            x.append(centres[c] + offset + rng.normal(size=(per_class, 16)) * spread)
            y += [f"class{c}"] * per_class
            g += [f"slide{s}"] * per_class
    return np.concatenate(x), np.array(y, object), np.array(g, object)


def test_split_never_puts_a_slide_on_both_sides() -> None:
    _, y, g = clustered(9, 10, 3, 1.0, 0)
    split = P.split_by_group(y, g, test_fraction=0.34, seed=3)
    assert not set(g[split.train]) & set(g[split.test])
    assert set(split.test_groups) == set(g[split.test]) and len(split.test_groups) == 3
    assert set(y[split.train]) == set(y[split.test]) == set(y)
    assert set(split.val) <= set(split.train) and split.val_by == "slide"
    again = P.split_by_group(y, g, test_fraction=0.34, seed=3)
    assert np.array_equal(split.test, again.test)  # fixed seed: the same split every run


def test_a_class_on_one_slide_only_is_refused_with_its_name() -> None:
    _, y, g = clustered(4, 10, 2, 1.0, 0)
    y[g == "slide0"] = "rare"  # only slide0 has it
    y[(g != "slide0") & (y == "rare")] = "class0"
    with pytest.raises(P.ProtocolError, match=r"class 'rare' is annotated on 1 slide"):
        P.split_by_group(y, g, test_fraction=0.34, seed=0)


def test_probes_separate_clusters_and_fail_on_noise() -> None:
    x, y, g = clustered(6, 20, 3, 0.5, 1)
    split = P.split_by_group(y, g, test_fraction=0.34, seed=0)
    classes = np.unique(y)
    knn = P.Predictions(classes, P.knn_scores(x[split.train], y[split.train], x[split.test], classes, 20, 0.07))
    assert P.score(y[split.test], knn, P.balanced_accuracy) > 0.95
    order, proba, c = P.linear_probe(x[split.train], y[split.train], np.searchsorted(split.train, split.val),
                                     x[split.test], [0.01, 1.0], 0)  # fmt: skip
    assert P.score(y[split.test], P.Predictions(order, proba), P.balanced_accuracy) > 0.95 and c in (0.01, 1.0)
    noise = np.random.default_rng(0).normal(size=x.shape)
    chance = P.Predictions(classes, P.knn_scores(noise[split.train], y[split.train], noise[split.test], classes, 20,
                                                 0.07))  # fmt: skip
    assert P.score(y[split.test], chance, P.balanced_accuracy) < 0.6


def test_bootstrap_resamples_slides_and_pairs_models() -> None:
    x, y, g = clustered(9, 15, 2, 1.5, 2)
    split = P.split_by_group(y, g, test_fraction=0.34, seed=0)
    boot = P.Bootstrap.over_groups(g[split.test], 200, seed=0)
    test_groups = g[split.test]
    for s in boot.samples[:20]:  # every resample is made of whole slides
        counts = {str(k): int(v) for k, v in zip(*np.unique(test_groups[s], return_counts=True), strict=True)}
        assert all(v % np.sum(test_groups == k) == 0 for k, v in counts.items())
    classes = np.unique(y)
    good = P.Predictions(classes, P.knn_scores(x[split.train], y[split.train], x[split.test], classes, 20, 0.07))
    noise = np.random.default_rng(1).normal(size=x.shape)
    bad = P.Predictions(classes, P.knn_scores(noise[split.train], y[split.train], noise[split.test], classes, 20, 0.07))
    m = P.metrics_with_ci(y[split.test], good, boot)
    assert m["balanced_accuracy"]["ci_low"] <= m["balanced_accuracy"]["value"] <= m["balanced_accuracy"]["ci_high"]
    assert "auroc" in m  # two classes
    diff = P.paired_difference(y[split.test], good, bad, "balanced_accuracy", boot)
    assert diff["ci_low"] > 0.1  # the better features are better on every resample of the test slides
    same = P.paired_difference(y[split.test], good, good, "balanced_accuracy", boot)
    assert same == {"value": 0.0, "ci_low": 0.0, "ci_high": 0.0}


def test_few_shot_draws_are_shared_and_per_class() -> None:
    y = np.array(["a"] * 10 + ["b"] * 3, object)
    draws = P.few_shot_draws(y, [1, 2, 4], 3, seed=0)
    assert set(draws) == {1, 2}  # 4 shots of "b" do not exist
    for n, picks in draws.items():
        for p in picks:
            assert (y[p] == "a").sum() == (y[p] == "b").sum() == n
    assert all(np.array_equal(a, b) for a, b in zip(draws[2], P.few_shot_draws(y, [2], 3, seed=0)[2], strict=True))


# ------------------------------------------------------------------------------------------------------ gate


def gate_cfg(**values: Any) -> EvaluateConfig:
    return load_config(EvaluateConfig, None, {"store": "s", "candidate": "c.onnx", "output": "o", **values})


def evaluation(cand: float, champ: tuple[float, float] | None, base: float = 0.0, rank: float = 0.3) -> dict:
    metric = {"value": 0.8, "ci_low": 0.7, "ci_high": 0.9}
    models: dict[str, Any] = {"candidate": {"health": {"cls_effective_rank": rank, "dense_score": 0.5},
                                            "probes": {"linear": {"balanced_accuracy": metric}}}}  # fmt: skip
    comparisons: dict[str, Any] = {"candidate_vs_baseline": {"linear.balanced_accuracy": {
        "value": base, "ci_low": base - 0.05, "ci_high": base + 0.05}}}  # fmt: skip
    if champ is not None:
        models["champion"] = {"health": {"cls_effective_rank": 0.3, "dense_score": 0.4}}
        comparisons["candidate_vs_champion"] = {"linear.balanced_accuracy": {"value": cand, "ci_low": champ[0],
                                                                             "ci_high": champ[1]}}  # fmt: skip
    return {"models": models, "comparisons": comparisons, "labelled_tiles": 100}


def test_gate_rules() -> None:
    cfg = gate_cfg()
    assert decide(cfg, evaluation(0.1, (0.02, 0.2))).promote
    assert not decide(cfg, evaluation(0.1, (-0.01, 0.2))).promote  # the interval includes no gain
    assert not decide(gate_cfg(**{"gate.margin": 0.05}), evaluation(0.1, (0.02, 0.2))).promote
    assert "below the baseline" in decide(cfg, evaluation(0.1, (0.02, 0.2), base=-0.1)).reason
    assert "collapsed" in decide(cfg, evaluation(0.1, (0.02, 0.2), rank=0.001)).reason
    first = evaluation(0.0, None, base=0.2)  # no champion yet: the baseline is the bar
    assert decide(cfg, first).promote and "first model" in decide(cfg, first).reason
    assert not decide(cfg, evaluation(0.0, None, base=0.03)).promote  # 0.03 - 0.05 < 0
    unlabelled = {**evaluation(0.1, (0.02, 0.2)), "labelled_tiles": 0}
    assert "promotion is off" in decide(cfg, unlabelled).reason
    assert decide(gate_cfg(**{"gate.label_free": True}), unlabelled).promote  # 0.5 ≥ champion's 0.4
    broken = evaluation(0.1, (0.02, 0.2))
    broken["models"]["champion"]["error"] = "ExtractError: cannot load"
    assert "could not be evaluated" in decide(cfg, broken).reason


@pytest.mark.parametrize("n_classes", [2, 3, 5])
def test_fast_metrics_equal_scikit_learn(n_classes: int) -> None:
    from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score

    rng = np.random.default_rng(n_classes)
    classes = np.array([f"c{i}" for i in range(n_classes)], object)
    for trial in range(20):
        y = classes[rng.integers(0, n_classes - (trial % 2), 200)]  # some trials leave a class out of the truth
        scores = rng.random((200, n_classes))
        if trial % 3 == 0:
            scores[:, -1] = 0  # ... or out of the predictions
        p = P.Predictions(classes, scores)
        idx = rng.integers(0, 200, 150)  # a resample with repeats
        expect = {
            "balanced_accuracy": balanced_accuracy_score(y[idx], p.predicted[idx]),
            "macro_f1": f1_score(y[idx], p.predicted[idx], average="macro", zero_division=0),
        }
        if n_classes == 2 and len(set(y[idx])) == 2:
            expect["auroc"] = roc_auc_score(y[idx] == classes[1], scores[idx, 1])
        for name, value in expect.items():
            assert P.score(y, p, P.METRICS[name], idx) == pytest.approx(value, abs=1e-12), (name, trial)
