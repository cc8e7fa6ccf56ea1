"""The statistics over test slides (`dinov3_core.evaluate.statistics`): the vectorised bootstrap equals the loop it
replaced, the permutation test is exact on hand-made cases, and the slides-needed estimate follows the effect."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from dinov3_core.evaluate import classifiers as C
from dinov3_core.evaluate import dense as D
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate import statistics as S
from tests.test_evaluate_protocol import clustered

# ------------------------------------------------------------------------------------ the former loop, as reference


@dataclass
class LoopBootstrap:
    """The implementation `statistics` replaced (probes.Bootstrap): one metric call per resample."""

    samples: list[np.ndarray] = field(default_factory=list)

    @classmethod
    def over_groups(cls, test_groups: np.ndarray, n: int, seed: int) -> LoopBootstrap:
        rng = np.random.default_rng(seed)
        names = np.unique(test_groups)
        members = [np.flatnonzero(test_groups == g) for g in names]
        samples = [np.concatenate([members[i] for i in rng.integers(0, len(names), len(names))]) for _ in range(n)]
        return cls(samples)

    def interval(self, stat: Callable[[np.ndarray], float]) -> tuple[float, float]:
        values = np.array([stat(s) for s in self.samples], np.float64)
        values = values[np.isfinite(values)]
        if not len(values):
            return float("nan"), float("nan")
        return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


LOOP_METRICS = {**P.METRICS, "miou": D.miou}


def loop_metric(y: np.ndarray, p: P.Predictions, name: str, boot: LoopBootstrap) -> dict[str, float]:
    m = LOOP_METRICS[name]
    low, high = boot.interval(lambda s: P.score(y, p, m, s))
    return {"value": P.score(y, p, m), "ci_low": low, "ci_high": high}


def loop_difference(y: np.ndarray, a: P.Predictions, b: P.Predictions, name: str, boot: LoopBootstrap) -> dict:
    m = LOOP_METRICS[name]
    low, high = boot.interval(lambda s: P.score(y, a, m, s) - P.score(y, b, m, s))
    return {"value": P.score(y, a, m) - P.score(y, b, m), "ci_low": low, "ci_high": high}


def probe_predictions(n_slides: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[P.Predictions]]:
    """Pooled out-of-fold kNN and linear-probe predictions (the real probes) of clustered and of noise features."""
    x, y, g = clustered(n_slides, 12, classes, 2.5, seed)
    noise = np.random.default_rng(seed).normal(size=x.shape)
    cv = P.cross_validate_by_group(y, g, folds=5, seed=0)
    names = np.unique(y)
    codes = np.searchsorted(names, y)
    folds = [C.Fold(f.train, np.searchsorted(f.train, f.val), f.test) for f in cv.folds]
    preds = []
    for feats in (x, noise):
        knn = C.knn_cv(feats, codes, [f.test for f in cv.folds], classes, 20, 0.07)
        linear, _ = C.linear_probe_cv(feats, codes, classes, folds, [0.1, 1.0])
        preds += [P.Predictions(names, knn), P.Predictions(names, linear)]
    return y, g, preds


@pytest.mark.parametrize(("n_slides", "classes"), [(3, 2), (7, 3), (5, 4)])
def test_vectorised_bootstrap_equals_the_loop_on_probe_predictions(n_slides: int, classes: int) -> None:
    y, g, preds = probe_predictions(n_slides, classes, seed=n_slides)
    boot = LoopBootstrap.over_groups(g, 300, seed=4)
    design = S.Design.over(g, 300, seed=4)
    names = [*S.CONFUSION_METRICS, *(["auroc"] if classes == 2 else [])]
    for p in preds:
        got = S.metrics_with_ci(p.codes(y), p, design, names)
        assert set(got) == set(names)
        for name in names:
            assert got[name].as_dict() == pytest.approx(loop_metric(y, p, name, boot), abs=1e-12), name
    for a, b in ((preds[1], preds[3]), (preds[0], preds[1]), (preds[2], preds[0])):
        for name in names:
            got = S.compare(a.codes(y), a, b, name, design)
            want = loop_difference(y, a, b, name, boot)
            assert {"value": got.value, "ci_low": got.ci_low, "ci_high": got.ci_high} == pytest.approx(want, abs=1e-12)


def test_the_dense_design_resamples_its_own_groups_like_a_fresh_bootstrap() -> None:
    y, g, preds = probe_predictions(5, 2, seed=1)
    rows = np.flatnonzero(g != "slide2")  # tokens on four of the five slides
    p = P.Predictions(preds[1].classes, preds[1].scores[rows])
    got = S.metrics_with_ci(p.codes(y[rows]), p, S.Design.over(g, 200, 3).subset(rows), ["miou"])["miou"]
    want = loop_metric(y[rows], p, "miou", LoopBootstrap.over_groups(g[rows], 200, 3))
    assert got.as_dict() == pytest.approx(want, abs=1e-12)


# ------------------------------------------------------------------------------------------ the permutation test


def hand_made(n_slides: int, wrong: list[int], per_class: int = 10) -> tuple[np.ndarray, P.Predictions, ...]:
    """Two classes on every slide; model a is right on every tile, model b wrong on `wrong[s]` class-1 tiles of
    slide s. Returns (truth codes, a, b, groups)."""
    y, g, b = [], [], []
    for s in range(n_slides):
        y += [0] * per_class + [1] * per_class
        g += [f"s{s:02d}"] * 2 * per_class
        b += [0] * per_class + [0] * wrong[s] + [1] * (per_class - wrong[s])
    truth, names = np.array(y), np.array(["a", "b"], object)
    onehot = np.eye(2)
    return truth, P.Predictions(names, onehot[truth]), P.Predictions(names, onehot[np.array(b)]), np.array(g)


@pytest.mark.parametrize("n", [3, 4, 6, 9])
def test_every_slide_favouring_the_candidate_gives_p_two_to_the_minus_n(n: int) -> None:
    truth, a, b, g = hand_made(n, [1 + s % 3 for s in range(n)])
    c = S.compare(truth, a, b, "balanced_accuracy", S.Design.over(g, 100, 0))
    assert c.exact and c.groups == n and c.p_value == pytest.approx(2.0**-n)
    assert c.value > 0 and all(d > 0 for d in c.per_group) and "exact" in c.test
    reverse = S.compare(truth, b, a, "balanced_accuracy", S.Design.over(g, 100, 0))
    assert reverse.p_value == 1.0  # one-sided: the worse model is never significant


def test_identical_models_give_p_one_and_a_mixed_sign_effect_is_not_significant() -> None:
    truth, a, _, g = hand_made(6, [0] * 6)
    assert S.compare(truth, a, a, "macro_f1", S.Design.over(g, 100, 0)).p_value == 1.0
    truth, a, b, g = hand_made(6, [2, 2, 2, 0, 0, 0])  # b as good as a on half the slides
    p = S.compare(truth, a, b, "balanced_accuracy", S.Design.over(g, 100, 0)).p_value
    assert p == pytest.approx(8 / 64)  # the 3 slides where they differ decide: 2^3 of the 2^6 patterns tie or beat


def test_many_slides_use_a_monte_carlo_sample_with_the_plus_one_correction() -> None:
    n = S.EXACT_MAX_GROUPS + 2
    truth, a, b, g = hand_made(n, [1] * n)
    c = S.compare(truth, a, b, "miou", S.Design.over(g, 50, 0))
    assert not c.exact and "Monte Carlo" in c.test
    # only patterns that swap nothing reach the observed difference: (1 + those drawn) / (1 + patterns)
    patterns, _ = S.swap_patterns(n, 0)
    assert c.p_value == pytest.approx((1 + int((patterns.sum(1) == 0).sum())) / (1 + len(patterns)))


def test_auroc_from_score_histograms_equals_scikit_learn_and_is_tested_too() -> None:
    from sklearn.metrics import roc_auc_score

    y, g, preds = probe_predictions(6, 2, seed=3)
    p, q = preds[0], preds[2]
    got = S.metrics_with_ci(p.codes(y), p, S.Design.over(g, 50, 0), ["auroc"])["auroc"]
    assert got.value == pytest.approx(roc_auc_score(p.codes(y) == 1, p.scores[:, 1]), abs=1e-12)
    c = S.compare(p.codes(y), p, q, "auroc", S.Design.over(g, 50, 0))
    assert c.value > 0.2 and c.p_value == pytest.approx(1 / 64)  # features beat noise on every one of 6 slides


# ------------------------------------------------------------------------------------------------ the design


@pytest.mark.parametrize(("alpha", "n"), [(0.05, 5), (0.01, 7), (0.125, 3), (0.1, 4), (0.0625, 4)])
def test_the_least_number_of_slides_follows_alpha(alpha: float, n: int) -> None:
    assert S.min_groups(alpha) == n and 2.0**-n <= alpha < 2.0 ** -(n - 1)


def test_slides_needed_falls_as_the_effect_grows_and_is_floored() -> None:
    rng = np.random.default_rng(0)
    spread = rng.normal(size=8)
    spread = (spread - spread.mean()) / spread.std(ddof=1) * 0.05  # SD 0.05 across slides
    small, large = S.slides_needed(0.02 + spread, 0.05), S.slides_needed(0.06 + spread, 0.05)
    assert small.groups is not None and large.groups is not None
    assert small.groups > large.groups >= S.min_groups(0.05)
    assert small.mean == pytest.approx(0.02) and small.sd == pytest.approx(0.05)
    assert 35 <= small.groups <= 45  # ((1.645 + 0.842) · 0.05 / 0.02)² ≈ 39, a little more for t
    assert S.slides_needed([0.1, 0.1, 0.1], 0.05).groups == 5  # no spread: the attainable minimum
    assert S.slides_needed([-0.02, 0.01, -0.03], 0.05).groups is None
    assert "not positive" in S.slides_needed([-0.02, 0.01, -0.03], 0.05).why
