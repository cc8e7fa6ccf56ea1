"""The evaluation protocol on controlled features: the grouped cross-validation, the probes, the intervals and the
gate (its evidence rule included)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from dinov3_core.config import load_config
from dinov3_core.evaluate import classifiers as C
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate import statistics as S
from dinov3_core.evaluate.config import EvaluateConfig
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.evaluate.gate import decide, evidence_line


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


def knn(train: np.ndarray, train_y: np.ndarray, test: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """The stage's kNN (k = 20, T = 0.07) on class names."""
    return C.knn_scores(train, np.searchsorted(classes, train_y), test, len(classes), 20, 0.07)


def test_split_never_puts_a_slide_on_both_sides() -> None:
    _, y, g = clustered(9, 10, 3, 1.0, 0)
    split = P.split_by_group(y, g, test_fraction=0.34, seed=3)
    assert not set(g[split.train]) & set(g[split.test])
    assert set(split.test_groups) == set(g[split.test]) and len(split.test_groups) == 3
    assert set(y[split.train]) == set(y[split.test]) == set(y)
    assert set(split.val) <= set(split.train) and split.val_by == "slide"
    again = P.split_by_group(y, g, test_fraction=0.34, seed=3)
    assert np.array_equal(split.test, again.test)  # fixed seed: the same split every run


@pytest.mark.parametrize(("n_slides", "folds", "expect"), [(9, 5, 5), (3, 5, 3), (2, 5, 2), (12, 2, 2)])
def test_cross_validation_tests_every_slide_once_and_never_trains_on_it(n_slides: int, folds: int, expect: int) -> None:
    _, y, g = clustered(n_slides, 10, 3, 1.0, 0)
    cv = P.cross_validate_by_group(y, g, folds=folds, seed=3)
    assert len(cv.folds) == expect  # capped at the number of slides
    tested = np.concatenate([f.test for f in cv.folds])
    assert np.array_equal(np.sort(tested), np.arange(len(y)))  # every tile tested exactly once
    assert cv.test_groups == sorted(set(g))  # so every slide is a test slide
    for f in cv.folds:
        assert not set(g[f.train]) & set(g[f.test])  # a fold never trains on the slides it tests
        assert set(g[f.train]) | set(g[f.test]) == set(g)
        assert set(y[f.train]) == set(y)  # every class on the training side
        assert set(f.val) <= set(f.train)
    again = P.cross_validate_by_group(y, g, folds=folds, seed=3)
    assert all(
        np.array_equal(a.test, b.test) and np.array_equal(a.val, b.val)
        for a, b in zip(cv.folds, again.folds, strict=True)
    )
    assert cv.as_dict()["folds"] == expect and len(cv.as_dict()["per_fold"]) == expect


def test_cross_validation_keeps_a_rare_class_on_every_training_side() -> None:
    _, y, g = clustered(6, 10, 2, 1.0, 0)
    y[np.isin(g, ["slide0", "slide1"]) & (y == "class1")] = "rare"  # on two slides only
    cv = P.cross_validate_by_group(y, g, folds=2, seed=0)
    for f in cv.folds:  # two folds could put both slides on one test side: another deal (or leave-one-out) avoids it
        assert "rare" in set(y[f.train])
    tested = np.concatenate([f.test for f in cv.folds])
    assert np.array_equal(np.sort(tested), np.arange(len(y)))


def test_probes_separate_clusters_and_fail_on_noise() -> None:
    x, y, g = clustered(6, 20, 3, 0.5, 1)
    split = P.split_by_group(y, g, test_fraction=0.34, seed=0)
    classes = np.unique(y)
    near = P.Predictions(classes, knn(x[split.train], y[split.train], x[split.test], classes))
    assert P.score(y[split.test], near, P.balanced_accuracy) > 0.95
    proba, c = C.linear_probe(
        x[split.train],
        np.searchsorted(classes, y[split.train]),
        np.searchsorted(split.train, split.val),
        x[split.test],
        len(classes),
        [0.01, 1.0],
    )
    assert P.score(y[split.test], P.Predictions(classes, proba), P.balanced_accuracy) > 0.95 and c in (0.01, 1.0)
    noise = np.random.default_rng(0).normal(size=x.shape)
    chance = P.Predictions(classes, knn(noise[split.train], y[split.train], noise[split.test], classes))
    assert P.score(y[split.test], chance, P.balanced_accuracy) < 0.6


def test_bootstrap_resamples_slides_and_pairs_models() -> None:
    x, y, g = clustered(9, 15, 2, 1.5, 2)
    split = P.split_by_group(y, g, test_fraction=0.34, seed=0)
    design = S.Design.over(g[split.test], 200, seed=0)
    assert design.counts.shape == (200, 3) and (design.counts.sum(1) == 3).all()  # whole slides, 3 per resample
    classes = np.unique(y)
    good = P.Predictions(classes, knn(x[split.train], y[split.train], x[split.test], classes))
    noise = np.random.default_rng(1).normal(size=x.shape)
    bad = P.Predictions(classes, knn(noise[split.train], y[split.train], noise[split.test], classes))
    truth = good.codes(y[split.test])
    m = S.metrics_with_ci(truth, good, design)
    assert m["balanced_accuracy"].ci_low <= m["balanced_accuracy"].value <= m["balanced_accuracy"].ci_high
    assert "auroc" in m  # two classes
    diff = S.compare(truth, good, bad, "balanced_accuracy", design)
    assert diff.ci_low > 0.1  # the better features are better on every resample of the test slides
    assert diff.p_value == pytest.approx(1 / 8)  # ... and on each of the 3 slides: the least p of 3 slides
    same = S.compare(truth, good, good, "balanced_accuracy", design)
    assert (same.value, same.ci_low, same.ci_high, same.p_value) == (0.0, 0.0, 0.0, 1.0)


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
    """The gate at alpha 0.05 unless `values` say otherwise (the wording below is written for it; the default,
    0.025, has its own test)."""
    values = {"gate.alpha": 0.05, **values}
    return load_config(EvaluateConfig, None, {"store": "s", "candidate": "c.onnx", "output": "o", **values})


def test_the_default_alpha_is_one_sided_0025_and_needs_six_slides() -> None:
    cfg = load_config(EvaluateConfig, None, {"store": "s", "candidate": "c.onnx", "output": "o"})
    assert cfg.gate.alpha == 0.025 and cfg.gate.required_test_slides() == 6
    five = decide(cfg, evaluation(0.5, 1 / 32, test_groups=5))
    assert not five.promote and "2^-5 = 0.0312 > gate.alpha 0.025" in five.reason and "fewer than 6" in five.reason
    assert decide(cfg, evaluation(0.1, 1 / 64, test_groups=6)).promote
    assert not decide(cfg, evaluation(0.1, 0.03, test_groups=9)).promote  # promoted at 0.05, not at 0.025


def diff(value: float, p: float, groups: int, spread: float = 0.02) -> dict[str, Any]:
    """A comparison as `statistics.compare` writes it: per-slide differences around `value`."""
    per_group = list(value + spread * np.linspace(-1, 1, groups)) if groups > 1 else [value]
    return {
        "value": value,
        "ci_low": value - 0.05,
        "ci_high": value + 0.05,
        "p_value": p,
        "test": "paired permutation test over test slides (exact)",
        "exact": True,
        "groups": groups,
        "per_group": per_group,
    }


def evaluation(
    cand: float, p: float | None, base: float = 0.0, rank: float = 0.3, test_groups: int = 6, base_p: float = 0.01
) -> EvaluationReport:
    """Candidate − champion `cand` with p-value `p` (None: no champion), candidate − baseline `base`."""
    metric = {"value": 0.8, "ci_low": 0.7, "ci_high": 0.9}
    models: dict[str, Any] = {
        "candidate": {
            "health": {"cls_effective_rank": rank, "dense_score": 0.5},
            "probes": {"linear": {"balanced_accuracy": metric}},
        }
    }
    comparisons: dict[str, Any] = {
        "candidate_vs_baseline": {"linear.balanced_accuracy": diff(base, base_p, test_groups)}
    }
    if p is not None:
        models["champion"] = {"health": {"cls_effective_rank": 0.3, "dense_score": 0.4}}
        comparisons["candidate_vs_champion"] = {"linear.balanced_accuracy": diff(cand, p, test_groups)}
    evidence = {"unit": "slide", "test_groups": test_groups, "folds": min(5, test_groups)}
    return EvaluationReport("store", models=models, comparisons=comparisons, labelled_tiles=100, evidence=evidence)


def test_gate_rules() -> None:
    cfg = gate_cfg()
    assert decide(cfg, evaluation(0.1, 0.016)).promote
    assert not decide(cfg, evaluation(0.1, 0.06)).promote  # not significant at alpha 0.05
    assert decide(gate_cfg(**{"gate.alpha": 0.1}), evaluation(0.1, 0.06)).promote
    assert not decide(gate_cfg(**{"gate.margin": 0.15}), evaluation(0.1, 0.016)).promote  # significant, too small
    assert "below the baseline" in decide(cfg, evaluation(0.1, 0.016, base=-0.1)).reason
    assert "collapsed" in decide(cfg, evaluation(0.1, 0.016, rank=0.001)).reason
    first = evaluation(0.0, None, base=0.2)  # no champion yet: the baseline is the bar
    assert decide(cfg, first).promote and "first model" in decide(cfg, first).reason
    assert not decide(cfg, evaluation(0.0, None, base=0.03, base_p=0.3)).promote
    unlabelled = dataclasses.replace(evaluation(0.1, 0.016), labelled_tiles=0)
    assert "promotion is off" in decide(cfg, unlabelled).reason
    assert decide(gate_cfg(**{"gate.label_free": True}), unlabelled).promote  # 0.5 ≥ champion's 0.4
    broken = evaluation(0.1, 0.016)
    broken.models["champion"]["error"] = "ExtractError: cannot load"
    assert "could not be evaluated" in decide(cfg, broken).reason
    d = decide(cfg, evaluation(0.1, 0.016))
    assert "p = 0.016 (paired permutation test over test slides (exact))" in d.reason
    assert d.evidence.p_value == 0.016 and d.evidence.min_test_slides == 5 and d.evidence.sufficient is True


def test_the_gate_refuses_three_slides_however_good() -> None:
    """The least p-value of a permutation test over 3 slides is 1/8: nothing is promoted, and the reason says why
    (the minimum from alpha, not a constant) and how many slides the measured effect would need."""
    cfg = gate_cfg()
    three = evaluation(0.5, 0.125, test_groups=3)  # a huge gain, the best 3 slides can give
    d = decide(cfg, three)
    assert not d.promote and d.evidence.sufficient is False and d.evidence.min_test_slides == 5
    assert d.reason.startswith(
        "not enough evidence: 3 test slide(s): a permutation test over 3 slide(s) cannot give "
        "a p-value below 2^-3 = 0.125 > gate.alpha 0.05, so nothing can be promoted on fewer "
        "than 5; annotate at least 2 more slide(s)"
    ), d.reason
    assert "would need about 5 annotated slides (have 3)" in d.reason  # a clear effect: the attainable minimum
    assert "gate.allow_point_estimate=true" in d.reason
    # alpha moves the minimum: at 0.01, 7 slides.
    strict = decide(gate_cfg(**{"gate.alpha": 0.01}), evaluation(0.5, 1 / 64, test_groups=6))
    assert not strict.promote and "fewer than 7" in strict.reason and "2^-6 = 0.0156" in strict.reason
    # The first model of a registry faces the same rule against the baseline.
    first = evaluation(0.0, None, base=0.2, base_p=0.125, test_groups=3)
    assert not decide(cfg, first).promote and "3 test slide(s)" in decide(cfg, first).reason
    # Patients: the groups are patients, and the advice says so.
    patients = evaluation(0.2, 0.25, test_groups=2)
    patients.evidence["unit"] = "patient"
    assert "slides of at least 3 more patient(s)" in decide(cfg, patients).reason
    # A refusal needs no evidence either way: below the baseline stays below the baseline with enough slides.
    assert "below the baseline" in decide(cfg, evaluation(0.1, 0.016, base=-0.1)).reason
    # gate.min_test_slides asks for more than the test needs, never less.
    assert (
        "fewer than gate.min_test_slides=8"
        in decide(gate_cfg(**{"gate.min_test_slides": 8}), evaluation(0.1, 0.016)).reason
    )


def test_the_gate_promotes_six_consistent_slides_and_says_how_many_more_a_weak_effect_needs() -> None:
    cfg = gate_cfg()
    six = decide(cfg, evaluation(0.08, 1 / 64, test_groups=6))
    assert six.promote and six.evidence.sufficient is True
    line = evidence_line(six)
    assert line.startswith(
        "gate: linear.balanced_accuracy candidate − champion +0.080 [95 % CI +0.030, +0.130], "
        "p = 0.01562 (paired permutation, 6 slides, α 0.05): promote (not applied)"
    ), line
    weak = decide(cfg, evaluation(0.02, 0.2, test_groups=6))
    stronger = decide(cfg, evaluation(0.04, 0.2, test_groups=6))
    assert not weak.promote and not stronger.promote
    n_weak, n_strong = weak.evidence.slides_needed, stronger.evidence.slides_needed
    assert n_weak is not None and n_strong is not None and n_weak > n_strong >= 5
    assert f"the measured effect +0.020 would need about {n_weak} annotated slides (have 6)" in weak.reason
    assert f"about {n_weak} slides needed for this effect" in evidence_line(weak)


def test_allow_point_estimate_decides_on_three_slides_and_says_so() -> None:
    cfg = gate_cfg(**{"gate.allow_point_estimate": True})
    d = decide(cfg, evaluation(0.054, 0.125, test_groups=3))
    assert d.promote  # the explicit opt-out: the point estimate > margin
    assert "decided on a point estimate (gate.allow_point_estimate=true) although 3 test slide(s)" in d.reason
    assert d.evidence.point_estimate is True and d.evidence.allow_point_estimate is True
    assert "on a point estimate (gate.allow_point_estimate)" in evidence_line(d)
    assert not decide(cfg, evaluation(-0.01, 0.9, test_groups=3)).promote  # still needs the point > margin
    # With enough slides the opt-out changes nothing and is not claimed: the test decides.
    enough = decide(cfg, evaluation(0.1, 0.016))
    assert enough.promote and "point estimate" not in enough.reason and enough.evidence.sufficient is True
    assert not decide(cfg, evaluation(0.1, 0.2)).promote


def test_gate_config_checks_alpha_and_min_test_slides() -> None:
    from dinov3_core.config import ConfigError

    with pytest.raises(ConfigError, match="min_test_slides"):
        gate_cfg(**{"gate.min_test_slides": 4})  # the test cannot reach 0.05 on 4
    assert gate_cfg(**{"gate.min_test_slides": 4, "gate.alpha": 0.1}).gate.required_test_slides() == 4
    with pytest.raises(ConfigError, match="alpha"):
        gate_cfg(**{"gate.alpha": 0})
    with pytest.raises(ConfigError, match="folds"):
        gate_cfg(**{"probe.folds": 1})


def test_pooled_folds_give_a_small_cohort_a_real_interval() -> None:
    """Three slides: the old single split tested one (a point interval); the folds test all three."""
    x, y, g = clustered(3, 20, 2, 4.0, 4)  # overlapping classes: accuracy below 1 on some slide
    cv = P.cross_validate_by_group(y, g, folds=5, seed=0)
    classes = np.unique(y)
    scores = np.zeros((len(y), 2), np.float32)
    for f in cv.folds:
        scores[f.test] = knn(x[f.train], y[f.train], x[f.test], classes)
    noise = np.random.default_rng(1).normal(size=x.shape)
    chance = np.zeros_like(scores)
    for f in cv.folds:
        chance[f.test] = knn(noise[f.train], y[f.train], noise[f.test], classes)
    design = S.Design.over(g, 200, seed=0)
    good, worse = P.Predictions(classes, scores), P.Predictions(classes, chance)
    m = S.metrics_with_ci(good.codes(y), good, design)["balanced_accuracy"]
    assert m.ci_high - m.ci_low > 0
    diff = S.compare(good.codes(y), good, worse, "balanced_accuracy", design)
    assert diff.ci_high > diff.ci_low and diff.value > 0 and diff.groups == 3


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


def test_the_linear_probe_keeps_the_middle_c_when_validation_holds_a_whole_class() -> None:
    """A small fold can put every tile of a class in its validation slides: C cannot be chosen on them then (the
    rest has one class), so the probe keeps the middle C and fits the whole fold (scikit-learn raised on one class)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 1, (20, 4)), rng.normal(3, 1, (10, 4))])
    y = np.array(["a"] * 20 + ["b"] * 10)
    val = np.arange(20, 30)  # every "b" is a validation tile
    proba, c = C.linear_probe(x, (y == "b").astype(np.int64), val, x[:3], 2, [0.1, 1.0, 10.0])
    assert c == 1.0 and proba.shape == (3, 2) and (proba.argmax(1) == 0).all()
