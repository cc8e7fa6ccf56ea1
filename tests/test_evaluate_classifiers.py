"""The torch classifiers of the probes equal the scikit-learn / numpy code they replaced.

References, kept here verbatim from the evaluate stage before the torch classifiers: scikit-learn's
`StandardScaler` + `LogisticRegression(C, max_iter=2000)` with C chosen by balanced accuracy on the validation
tiles (ties to the smaller C) and a refit on all training tiles, and the numpy cosine kNN. Compared on synthetic
Gaussian clusters (separable and overlapping, 2, 3 and 5 classes) and on the real sample cohort: the sample slides
tiled by the tile stage, labelled by their GeoJSON annotations, embedded by a seeded test ViT (tile features and
the dense probe's patch tokens), folds from the stage's grouped cross-validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dinov3_core.evaluate import classifiers as C
from dinov3_core.evaluate import dense as D
from dinov3_core.evaluate import knn as K
from dinov3_core.evaluate import linear_probe as L
from dinov3_core.evaluate import newton
from dinov3_core.evaluate import probes as P
from tests.helpers import eval_backbone, tile_store

CS = [0.01, 0.1, 1.0, 10.0]


def reference_linear(
    train: np.ndarray, train_y: np.ndarray, val_pos: np.ndarray, test: np.ndarray, cs: Sequence[float], n: int
) -> tuple[np.ndarray, float]:
    """scikit-learn's probe (the stage's before the torch one): (N_test, n) probabilities over codes, chosen C."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import balanced_accuracy_score
    from sklearn.preprocessing import StandardScaler

    def fit(x: np.ndarray, y: np.ndarray, c: float) -> Any:
        scaler = StandardScaler().fit(x)
        # converged: with its default tol scikit-learn can stop short of the optimum by enough to flip the C a
        # fold chooses, and the probe solves the objective, not scikit-learn's stopping rule
        model = LogisticRegression(C=c, max_iter=20000, tol=1e-10, random_state=0)
        return scaler, model.fit(scaler.transform(x), y)

    chosen = float(cs[len(cs) // 2])
    fit_pos = np.setdiff1d(np.arange(len(train)), val_pos)
    if len(val_pos) and len(cs) > 1 and len(np.unique(train_y[fit_pos])) > 1:
        best = -1.0
        for c in cs:
            scaler, model = fit(train[fit_pos], train_y[fit_pos], c)
            acc = balanced_accuracy_score(train_y[val_pos], model.predict(scaler.transform(train[val_pos])))
            if acc > best + 1e-9:
                best, chosen = acc, float(c)
    scaler, model = fit(train, train_y, chosen)
    out = np.zeros((len(test), n))
    out[:, model.classes_] = model.predict_proba(scaler.transform(test))
    return out, chosen


def reference_knn(train: np.ndarray, train_y: np.ndarray, test: np.ndarray, n: int, k: int, t: float) -> np.ndarray:
    """The numpy cosine kNN (exp(sim / T) weighted votes, normalised) the stage used before."""

    def unit(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    a, b = unit(test), unit(train)
    k = min(k, len(b))
    sim = a @ b.T
    top = np.argpartition(-sim, k - 1, axis=1)[:, :k]
    w = np.exp(np.take_along_axis(sim, top, axis=1) / t)
    scores = np.einsum("nk,nkc->nc", w, np.eye(n, dtype=np.float32)[train_y][top])
    return scores / np.maximum(scores.sum(1, keepdims=True), 1e-12)


def clusters(n_slides: int, per_slide: int, k: int, d: int, spread: float, seed: int) -> tuple[np.ndarray, ...]:
    """Gaussian class clusters with a per-slide shift (staining batches), off-centre and scaled per dimension (so
    standardisation matters): features, codes, slide ids."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, d))
    y = rng.integers(0, k, n_slides * per_slide)
    g = np.repeat(np.arange(n_slides), per_slide).astype(str).astype(object)
    shift = rng.normal(size=(n_slides, d)) * 0.3
    x = centres[y] + np.repeat(shift, per_slide, 0) + rng.normal(size=(len(y), d)) * spread
    return x * rng.uniform(0.5, 5, d) + rng.normal(size=d) * 10, y, g


def folds_of(y: np.ndarray, g: np.ndarray, n: int = 5) -> tuple[P.CrossValidation, list[C.Fold]]:
    cv = P.cross_validate_by_group(y, g, folds=n, seed=0)
    return cv, [C.Fold(f.train, np.searchsorted(f.train, f.val), f.test) for f in cv.folds]


def assert_linear_equal(x: np.ndarray, y: np.ndarray, k: int, folds: list[C.Fold], other_c: int = 0) -> None:
    """Same C per fold (but `other_c` folds), balanced accuracy within 0.005, probabilities close."""
    proba, chosen = C.linear_probe_cv(x, y, k, folds, CS)
    ref = np.zeros_like(proba)
    ref_chosen = []
    for f in folds:
        ref[f.test], c = reference_linear(x[f.train], y[f.train], f.val, x[f.test], CS, k)
        ref_chosen.append(c)
    assert sum(a != b for a, b in zip(chosen, ref_chosen, strict=True)) <= other_c, (chosen, ref_chosen)
    tested = np.concatenate([f.test for f in folds])
    pred, ref_pred = proba[tested].argmax(1), ref[tested].argmax(1)

    # A tile within 0.01 of a tie between its top two classes in both solvers may fall either way (a weakly
    # regularised fit on a small fold): it counts as agreeing. Any other disagreement is counted.
    def margin(p: np.ndarray) -> np.ndarray:
        top = np.sort(p, 1)
        return top[:, -1] - top[:, -2]

    tie = (pred != ref_pred) & (margin(proba[tested]) < 0.01) & (margin(ref[tested]) < 0.01)
    mine = C.balanced_accuracy(y[tested], np.where(tie, ref_pred, pred), k)
    theirs = C.balanced_accuracy(y[tested], ref_pred, k)
    assert abs(mine - theirs) <= 0.005, (mine, theirs, int(tie.sum()))
    assert tie.sum() <= max(1, len(tested) // 100), "more near-ties than a converged solver should leave"
    # scikit-learn stops at a gradient of 1e-4, this solver ten times tighter: the probabilities agree to about that
    # (a few tiles of a weakly regularised fit, where scikit-learn stops far from the optimum, move more)
    same = np.concatenate([f.test for f, a, b in zip(folds, chosen, ref_chosen, strict=True) if a == b])
    diff = np.abs(proba[same] - ref[same]).max(1)
    assert np.median(diff) < 1e-3 and diff.max() < 0.25, (np.median(diff), diff.max())


@pytest.mark.parametrize(("k", "spread"), [(2, 0.3), (2, 1.5), (3, 1.0), (5, 0.2), (5, 2.0)])
def test_linear_probe_equals_scikit_learn_on_synthetic_clusters(k: int, spread: float) -> None:
    x, y, g = clusters(8, 60, k, 24, spread, seed=k)
    _, folds = folds_of(y.astype(str), g)
    assert_linear_equal(x, y, k, folds)


# L-BFGS stops at a gradient of 1e-5, short of the optimum the converged reference reaches: in one fold of the
# 5-class, overlapping case its C = 0.01 and C = 1 validation accuracies then swap order (they differ by 0.006 at
# the optimum), so that fold may choose another C; the balanced accuracy must agree all the same.
LBFGS_OTHER_C = 1


def large_path(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """Make every input take the large-input path (float32 products, all folds in one solve); the returned list
    collects the feature dtype of every solve, so a test can tell the path was taken."""
    seen: list[torch.dtype] = []
    fit = L._fit_group

    def spy(x: torch.Tensor, *args: Any) -> Any:
        seen.append(x.dtype)
        return fit(x, *args)

    monkeypatch.setattr(newton, "MAX_PARAMETERS", 0)  # wide features: L-BFGS, not Newton's method
    monkeypatch.setattr(L, "_SMALL", 0)
    monkeypatch.setattr(L, "_fit_group", spy)
    return seen


@pytest.mark.parametrize(("k", "spread"), [(3, 1.0), (5, 2.0)])
def test_linear_probe_small_lbfgs_path_equals_scikit_learn(
    monkeypatch: pytest.MonkeyPatch, k: int, spread: float
) -> None:
    """Features too wide for Newton's method but few tiles: the batched float64 L-BFGS."""
    monkeypatch.setattr(newton, "MAX_PARAMETERS", 0)
    x, y, g = clusters(8, 60, k, 24, spread, seed=k)
    _, folds = folds_of(y.astype(str), g)
    assert_linear_equal(x, y, k, folds, other_c=LBFGS_OTHER_C)


def test_newton_is_taken_for_narrow_features_and_steps_few_times() -> None:
    x, y, _ = clusters(4, 60, 3, 24, 1.0, seed=3)
    assert newton.fits_newton(24, 3) and not newton.fits_newton(1024, 3)
    solved = newton.fit(torch.as_tensor(x), torch.as_tensor(y), 3, CS)
    assert [s.c for s in solved] == CS and all(s.steps <= 30 for s in solved)


@pytest.mark.parametrize(("k", "spread"), [(2, 1.5), (3, 1.0), (5, 2.0)])
def test_linear_probe_large_input_path_equals_scikit_learn(
    monkeypatch: pytest.MonkeyPatch, k: int, spread: float
) -> None:
    x, y, g = clusters(8, 60, k, 24, spread, seed=k)
    _, folds = folds_of(y.astype(str), g)
    seen = large_path(monkeypatch)
    assert_linear_equal(x, y, k, folds, other_c=LBFGS_OTHER_C)
    assert seen == [torch.float32]


def test_knn_over_fold_pairs_equals_numpy() -> None:
    x, y, g = clusters(7, 50, 3, 32, 1.0, seed=1)
    cv, _ = folds_of(y.astype(str), g)
    mine = C.knn_cv(x, y, [f.test for f in cv.folds], 3, 20, 0.07)
    for f in cv.folds:
        np.testing.assert_allclose(
            mine[f.test], reference_knn(x[f.train], y[f.train], x[f.test], 3, 20, 0.07), atol=1e-5
        )
    one = cv.folds[0]
    np.testing.assert_allclose(
        C.knn_scores(x[one.train], y[one.train], x[one.test], 3, 20, 0.07), mine[one.test], atol=1e-5
    )


def float32_neighbours(x: np.ndarray, train: np.ndarray, test: np.ndarray, k: int) -> np.ndarray:
    """(len(test), k) sorted row indices of the float32 cosine top-k of `test` among `train` (numpy, exhaustive)."""
    u = x.astype(np.float32) / np.linalg.norm(x.astype(np.float32), axis=1, keepdims=True)
    sim = u[test] @ u[train].T
    return np.sort(train[np.argsort(-sim, axis=1, kind="stable")[:, :k]], axis=1)


def assert_same_neighbours(x: np.ndarray, tests: list[np.ndarray], k: int) -> None:
    """knn_cv's bf16-screened, float32-re-ranked neighbours are the exhaustive float32 top-k, row for row."""
    got = C.knn_cv_neighbours(x, tests, k)
    everyone = np.arange(len(x))
    for t, (_, at) in zip(tests, got, strict=True):
        ref = float32_neighbours(x, np.setdiff1d(everyone, t), t, k)
        np.testing.assert_array_equal(np.sort(at.numpy(), axis=1), ref)


def test_knn_screening_keeps_the_float32_neighbours() -> None:
    x, y, g = clusters(7, 50, 3, 32, 1.0, seed=1)
    cv, _ = folds_of(y.astype(str), g)
    assert all(len(x) - len(f.test) > 2 * 20 for f in cv.folds)  # the screening truncates: the test means something
    assert_same_neighbours(x, [f.test for f in cv.folds], 20)


def near_ties(n: int = 200, d: int = 64) -> np.ndarray:
    """Row 0, then `n` rows whose cosine similarities to it are 0.9 + i·10⁻⁶: all one bf16 value (its resolution
    near 0.9 is 2⁻⁸), distinct in float32."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(n, d))
    w[:, 0] = 0
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    c = 0.9 + np.arange(n) * 1e-6
    rows = c[:, None] * np.eye(1, d) + np.sqrt(1 - c**2)[:, None] * w
    return np.concatenate([np.eye(1, d), rows])


def test_knn_screening_searches_near_ties_again_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    x = near_ties()
    tests = [np.array([0]), np.arange(1, len(x))]
    assert_same_neighbours(x, tests, 20)
    # without the float32 search of unsure rows the bf16 screening loses some of row 0's neighbours
    monkeypatch.setattr(K, "_SCREEN_ERROR", -np.inf)
    with pytest.raises(AssertionError):
        assert_same_neighbours(x, tests, 20)


def test_few_shot_knn_equals_numpy_per_draw() -> None:
    x, y, g = clusters(6, 40, 3, 16, 1.0, seed=2)
    cv, _ = folds_of(y.astype(str), g)
    draws = P.few_shot_draws_cv(y, cv, [1, 4, 16], 3, seed=0)
    assert set(draws) == {1, 4, 16}
    got = C.knn_few_shot(x, y, [(f.train, f.test) for f in cv.folds], draws, 3, 20, 0.07)
    for n, per_draw in draws.items():
        for j, picks in enumerate(per_draw):
            for f, p in zip(cv.folds, picks, strict=True):
                ref = reference_knn(x[f.train[p]], y[f.train[p]], x[f.test], 3, 20, 0.07)
                np.testing.assert_allclose(got[n][j][f.test], ref, atol=1e-5)


# ------------------------------------------------------------------------------------------- the real cohort


@pytest.fixture(scope="module")
def cohort(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sample slides at 64 px, 1 µm/px, labelled by their GeoJSON, embedded by the seeded test ViT: tile
    features (cls + mean patch) and the dense probe's tokens, with the stage's folds."""
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.evaluate import features as F
    from dinov3_core.evaluate.evaluation import labelled_tiles

    root = tmp_path_factory.mktemp("classifiers")
    store = tile_store(sample_slides.slides, root / "tiles.zarr", tile_size=64, mpp=1.0)
    annotations = str(next(iter(sample_slides.annotations.values())).parent)
    ds = TileDataset(store, image_format="numpy")
    idx, labels, slides, _ = labelled_tiles(store, ds, annotations, [])
    model = F.open_model(eval_backbone(root / "model", "vit_test"), backend="torch")
    tokens = D.dense_tokens(store, ds, annotations, idx, 4, 16)
    raw = F.embed(
        model,
        ds,
        idx,
        root / "cache",
        F.tokens_key(F.selection_key(store, idx), tokens.positions),
        64,
        tokens=tokens.positions,
    )
    classes = np.unique(labels)
    cv = P.cross_validate_by_group(labels, slides, folds=5, seed=0)
    return {
        "x": F.represent(raw, "cls+mean_patch"),
        "y": np.searchsorted(classes, labels),
        "k": len(classes),
        "cv": cv,
        "dense": D.dense_set(tokens, raw["dense"]),
    }


def test_linear_probe_and_knn_equal_the_references_on_the_sample_cohort(cohort: dict[str, Any]) -> None:
    x, y, k, cv = cohort["x"], cohort["y"], cohort["k"], cohort["cv"]
    assert len(y) > 100 and k >= 2 and len(cv.folds) >= 3
    folds = [C.Fold(f.train, np.searchsorted(f.train, f.val), f.test) for f in cv.folds]
    assert_linear_equal(x, y, k, folds)
    mine = C.knn_cv(x, y, [f.test for f in cv.folds], k, 20, 0.07)
    for f in cv.folds:
        np.testing.assert_allclose(
            mine[f.test], reference_knn(x[f.train], y[f.train], x[f.test], k, 20, 0.07), atol=1e-5
        )
    assert all(len(y) - len(f.test) > 2 * 20 for f in cv.folds)  # the bf16 screening truncates
    assert_same_neighbours(x, [f.test for f in cv.folds], 20)


def test_dense_probe_equals_scikit_learn_on_the_sample_cohort(cohort: dict[str, Any]) -> None:
    d = cohort["dense"]
    classes = np.unique(d.y)
    codes = np.searchsorted(classes, d.y)
    assert len(d.y) > 500 and len(classes) >= 2
    p, chosen = D.predict(d, cohort["cv"], CS, "cpu")
    folds = [C.Fold(tr, val, te) for tr, val, te in D._folds(cohort["cv"], d.tile) if len(te)]
    folds = [f for f in folds if len(np.unique(codes[f.train])) > 1]
    assert len(chosen) == len(folds)
    # One fold's validation tokens hold one on the decision boundary of C = 0.1 (both solvers' probabilities agree to
    # 5e-4 there, yet the argmax flips): its balanced accuracy then moves by one token, and so may the chosen C.
    assert_linear_equal(d.x, codes, len(classes), folds, other_c=1)
    tested = np.concatenate([f.test for f in folds])
    direct, _ = C.linear_probe_cv(d.x, codes, len(classes), folds, CS)
    np.testing.assert_array_equal(p.scores[tested], direct[tested])


def test_the_large_input_path_equals_scikit_learn_on_the_sample_cohort(
    cohort: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lab-scale path (float32 products) on the real tile features and dense tokens."""
    x, y, k, cv = cohort["x"], cohort["y"], cohort["k"], cohort["cv"]
    seen = large_path(monkeypatch)
    assert_linear_equal(
        x,
        y,
        k,
        other_c=LBFGS_OTHER_C,
        folds=[C.Fold(f.train, np.searchsorted(f.train, f.val), f.test) for f in cv.folds],
    )
    d = cohort["dense"]
    codes = np.searchsorted(np.unique(d.y), d.y)
    folds = [C.Fold(tr, val, te) for tr, val, te in D._folds(cv, d.tile) if len(te)]
    folds = [f for f in folds if len(np.unique(codes[f.train])) > 1]
    assert_linear_equal(d.x, codes, codes.max() + 1, folds, other_c=1)  # the boundary token (see the dense test)
    assert seen == [torch.float32, torch.float32]


def test_the_modules_import_no_orchestration() -> None:
    for name in ("classifiers", "knn", "linear_probe", "torch_runtime"):
        source = (Path(C.__file__).parent / f"{name}.py").read_text()
        assert "prefect" not in source and "flows" not in source, name
