"""Frozen-feature probes with slides kept apart: grouped cross-validation, kNN, linear probe, few-shot kNN, metrics.

The protocol of pathology foundation-model evaluations (kaiko's eva, UNI, Virchow), on one set of labelled tiles:

* **grouped cross-validation over slides** (or patients when a slide → patient table is given): the groups are
  dealt into k folds (`probe.folds`, at most one fold per group, at least 2), stratified by class (scikit-learn's
  `StratifiedGroupKFold`, fixed seed, recorded); each fold's probes are fitted on the other folds' groups and
  predict its own, so every slide is tested exactly once and never by a probe that saw it. The predictions of all
  folds are pooled: every labelled tile is a test tile, and a small cohort still has several test slides;
* **kNN**: k = 20 nearest training tiles by cosine similarity, votes weighted by exp(similarity / T) (DINO's
  weighted kNN);
* **linear probe**: L2-regularised logistic regression on standardised features, C chosen on a validation split of
  the fold's training slides, then refitted on all of them (the classifiers, batched torch: `classifiers`);
* **few-shot kNN**: n tiles per class (1, 2, 4, 8, 16) drawn from each fold's training slides, several draws;
* **metrics**: balanced accuracy and macro-F1 (AUROC for two classes) of the pooled predictions, each with a
  bootstrap 95 % interval over the test slides (all of them); paired differences between two models resample the
  *same* slides for both.

Every model is scored on the same tiles, folds and draws, so differences come from the features alone.
`split_by_group` (one train/test split) remains for the quick checks that need no interval (convert's kNN curve).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dinov3_core.errors import WsidinoError

Metric = Callable[[np.ndarray, np.ndarray, int, np.ndarray | None], float]  # (true codes, predicted, classes, p1)


class ProtocolError(WsidinoError):
    """The labels cannot support a slide-level evaluation (too few slides or tiles for a class)."""


@dataclass
class Split:
    """Tile indices of each side, and which slides (groups) are where: recorded in evaluation.json."""

    train: np.ndarray
    val: np.ndarray  # part of the training tiles, for choosing the linear probe's C
    test: np.ndarray
    train_groups: list[str]
    test_groups: list[str]
    val_by: str  # "slide" (or patient), or "tile" when only one training group exists

    def as_dict(self) -> dict[str, Any]:
        return {
            "train_groups": self.train_groups,
            "test_groups": self.test_groups,
            "val_by": self.val_by,
            "tiles": {"train": len(self.train), "val": len(self.val), "test": len(self.test)},
        }


def split_by_group(labels: np.ndarray, groups: np.ndarray, *, test_fraction: float, seed: int) -> Split:
    """Stratified group split: the test groups are one fold of round(1 / test_fraction) folds.

    Raises:
        ProtocolError: A class is on fewer than two groups, or ends up on one side only; the message names it.
    """
    # deferred: importing scikit-learn is slow, paid only by the probes
    from sklearn.model_selection import StratifiedGroupKFold

    classes = np.unique(labels)
    _require_two_groups_per_class(labels, groups)
    n_groups = len(np.unique(groups))
    folds = min(max(2, round(1 / test_fraction)), n_groups)
    cv = StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed)
    best: tuple[int, np.ndarray, np.ndarray] | None = None
    for train, test in cv.split(np.zeros(len(labels)), labels, groups):
        both = len(set(labels[train]) & set(labels[test]))
        if best is None or both > best[0]:
            best = (both, train, test)
        if both == len(classes):
            break
    assert best is not None
    _, train, test = best
    missing = sorted(set(classes) - set(labels[test])) + sorted(set(classes) - set(labels[train]))
    if missing:
        raise ProtocolError(
            f"no slide-level split puts class(es) {', '.join(map(repr, missing))} on both the training and the "
            f"test side with {n_groups} slide/patient groups; annotate these classes on more slides"
        )
    return _split(labels, groups, train, test, seed)


def _split(labels: np.ndarray, groups: np.ndarray, train: np.ndarray, test: np.ndarray, seed: int) -> Split:
    """The split of `train` / `test` rows, with the validation rows drawn from the training side."""
    val_pos, val_by = _validation(labels[train], groups[train], seed)
    return Split(
        train=np.sort(train),
        val=np.sort(train[val_pos]),
        test=np.sort(test),
        train_groups=sorted(map(str, np.unique(groups[train]))),
        test_groups=sorted(map(str, np.unique(groups[test]))),
        val_by=val_by,
    )


# Deals of the groups tried before falling back to leave-one-group-out, which always has every class on the
# training side of every fold (each class is on ≥ 2 groups) but costs a fold per group.
_DEALS = 20


@dataclass
class CrossValidation:
    """The folds of a grouped cross-validation: every group is the test side of exactly one fold."""

    folds: list[Split]
    scheme: str  # "stratified group k-fold" or "leave one group out" (the fallback)

    @property
    def test_groups(self) -> list[str]:
        return sorted(g for f in self.folds for g in f.test_groups)

    def as_dict(self) -> dict[str, Any]:
        return {
            "folds": len(self.folds),
            "scheme": self.scheme,
            "test_groups": self.test_groups,  # every group: each is tested once
            "per_fold": [f.as_dict() for f in self.folds],
        }


def _require_two_groups_per_class(labels: np.ndarray, groups: np.ndarray) -> None:
    for c in np.unique(labels):
        on = np.unique(groups[labels == c])
        if len(on) < 2:
            raise ProtocolError(
                f"class {c!r} is annotated on {len(on)} slide/patient group(s) ({', '.join(map(str, on))}); an "
                "evaluation that keeps slides apart needs it on at least two. Annotate it on more slides, or merge "
                "or drop it (evaluate.exclude_classes)"
            )


def cross_validate_by_group(labels: np.ndarray, groups: np.ndarray, *, folds: int, seed: int) -> CrossValidation:
    """k-fold cross-validation over groups (k = `folds`, capped at the number of groups, at least 2), stratified
    by class; every fold's training side holds every class (else another deal, else leave-one-group-out).

    Raises:
        ProtocolError: A class is on fewer than two groups; the message names it and the fix.
    """
    # deferred: importing scikit-learn is slow, paid only by the probes
    from sklearn.model_selection import LeaveOneGroupOut, StratifiedGroupKFold

    _require_two_groups_per_class(labels, groups)
    classes = set(np.unique(labels))
    n_groups = len(np.unique(groups))
    k = min(max(2, folds), n_groups)
    x = np.zeros(len(labels))
    parts: list[tuple[np.ndarray, np.ndarray]] | None = None
    scheme = "leave one group out"
    if k < n_groups:
        for deal in range(_DEALS):  # deterministic: the seeds seed, seed + 1, … in order
            cv = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed + deal)
            found = list(cv.split(x, labels, groups))
            if all(len(test) and set(labels[train]) == classes for train, test in found):
                parts, scheme = found, "stratified group k-fold"
                break
    if parts is None:  # k == number of groups, or no deal kept every class on every training side
        parts = list(LeaveOneGroupOut().split(x, labels, groups))
    return CrossValidation([_split(labels, groups, train, test, seed) for train, test in parts], scheme)


def _validation(labels: np.ndarray, groups: np.ndarray, seed: int) -> tuple[np.ndarray, str]:
    """Positions (within the training tiles) of the validation part: a group fold when there are ≥ 2 groups
    with every class, else a stratified quarter of the tiles (recorded as such)."""
    # deferred: importing scikit-learn is slow, paid only by the probes
    from sklearn.model_selection import StratifiedGroupKFold, StratifiedShuffleSplit

    if len(np.unique(groups)) >= 3:
        cv = StratifiedGroupKFold(n_splits=min(4, len(np.unique(groups))), shuffle=True, random_state=seed)
        for fit, val in cv.split(np.zeros(len(labels)), labels, groups):
            if set(labels[fit]) == set(labels):
                return val, "slide"
    counts = np.unique(labels, return_counts=True)[1]
    if counts.min() < 2:
        return np.zeros(0, np.int64), "none"
    sss = StratifiedShuffleSplit(n_splits=1, test_size=0.25, random_state=seed)
    _, val = next(sss.split(np.zeros(len(labels)), labels))
    return val, "tile"


# ------------------------------------------------------------------------------------------------ classifiers


def l2_normalise(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


# ----------------------------------------------------------------------------------------------------- metrics


# Metrics work on class codes (indices into the sorted class names) through one confusion matrix (the few-shot
# draws and site predictability call them; the intervals and the gate use `statistics`, on per-slide confusions).
# They equal scikit-learn's balanced_accuracy_score, f1_score(average="macro", zero_division=0) and roc_auc_score
# (tested).


def _confusion(y: np.ndarray, pred: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(y * n + pred, minlength=n * n).reshape(n, n)


def balanced_accuracy(y: np.ndarray, pred: np.ndarray, n: int, _: np.ndarray | None = None) -> float:
    """Mean recall over the classes present in `y`."""
    cm = _confusion(y, pred, n)
    support = cm.sum(1)
    present = support > 0
    return float((np.diag(cm)[present] / support[present]).mean())


def macro_f1(y: np.ndarray, pred: np.ndarray, n: int, _: np.ndarray | None = None) -> float:
    """Mean F1 over the classes present in `y` or `pred` (0 for a class never predicted correctly)."""
    cm = _confusion(y, pred, n)
    denominator = cm.sum(0) + cm.sum(1)
    present = denominator > 0
    return float((2 * np.diag(cm)[present] / denominator[present]).mean())


def auroc(y: np.ndarray, _: np.ndarray, n: int, positive_score: np.ndarray | None) -> float:
    # deferred: importing scikit-learn is slow, paid only by the probes
    from sklearn.metrics import roc_auc_score

    if positive_score is None or n != 2 or len(np.unique(y)) < 2:
        return float("nan")
    return float(roc_auc_score(y == 1, positive_score))


@dataclass
class Predictions:
    """One probe's output on the test tiles of one model."""

    classes: np.ndarray  # sorted class names
    scores: np.ndarray  # (N_test, C)
    _truth: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)  # (labels, their codes), cached

    @property
    def predicted(self) -> np.ndarray:
        return self.classes[self.scores.argmax(1)]

    def positive(self) -> np.ndarray | None:
        return self.scores[:, 1] if len(self.classes) == 2 else None

    def codes(self, y: np.ndarray) -> np.ndarray:
        """Class codes of the true labels `y` (every test class is a training class: the split guarantees it)."""
        if self._truth is None or self._truth[0] is not y:
            self._truth = (y, np.searchsorted(self.classes, y))
        return self._truth[1]


def score(y: np.ndarray, p: Predictions, metric: Metric, idx: np.ndarray | None = None) -> float:
    """`metric` of `p` against the true labels `y`, on the test tiles `idx` (a bootstrap resample) or all."""
    sel = slice(None) if idx is None else idx
    pos = p.positive()
    pred = p.scores.argmax(1)
    return metric(p.codes(y)[sel], pred[sel], len(p.classes), None if pos is None else pos[sel])


METRICS: dict[str, Metric] = {"balanced_accuracy": balanced_accuracy, "macro_f1": macro_f1, "auroc": auroc}


def few_shot_draws(train_y: np.ndarray, shots: Sequence[int], draws: int, seed: int) -> dict[int, list[np.ndarray]]:
    """Training-tile positions per (shots, draw): n tiles of every class, drawn once for every model."""
    classes = np.unique(train_y)
    out: dict[int, list[np.ndarray]] = {}
    for n in shots:
        if any((train_y == c).sum() < n for c in classes):
            continue  # not enough training tiles of some class for n shots
        rng = np.random.default_rng([seed, n])  # per shot count: the draws do not depend on the other counts
        out[n] = [
            np.concatenate([rng.choice(np.flatnonzero(train_y == c), n, replace=False) for c in classes])
            for _ in range(draws)
        ]
    return out


def few_shot_draws_cv(
    labels: np.ndarray, cv: CrossValidation, shots: Sequence[int], draws: int, seed: int
) -> dict[int, list[list[np.ndarray]]]:
    """{shots: [draw: [fold: positions within that fold's training tiles]]}: the shot counts every fold's training
    side has enough tiles of every class for, drawn once for every model."""
    per_fold = [few_shot_draws(labels[f.train], shots, draws, seed + i) for i, f in enumerate(cv.folds)]
    common = [n for n in shots if all(n in d for d in per_fold)]
    return {n: [[d[n][j] for d in per_fold] for j in range(draws)] for n in common}


__all__ = [
    "METRICS",
    "CrossValidation",
    "Predictions",
    "ProtocolError",
    "Split",
    "cross_validate_by_group",
    "few_shot_draws",
    "few_shot_draws_cv",
    "split_by_group",
]
