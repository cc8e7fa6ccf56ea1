"""Statistics over test groups (slides, or patients): intervals for display and the gate's permutation test.

Every pooled metric the evaluation reports is a function of a sum of per-group tables: balanced accuracy,
macro-F1 and mIoU of the summed confusion matrix, AUROC of the summed histograms of positive and negative scores
over the score levels. So each model's predictions are reduced once to a (groups × cells) table, and any pool of
groups, a bootstrap resample (each group counted as often as drawn) or a permutation (some groups' tables taken
from the other model), is a matrix product: all resamples at once, no metric call per resample.

* `metrics_with_ci`: point estimates and 95 % percentile bootstrap intervals over the groups (display only);
* `compare`: the paired difference of two models on the same tiles, its bootstrap interval, and an exact paired
  permutation test over the groups (`permutation_test`), one-sided (H1: the first model is better);
* `slides_needed`: from the per-group differences, the number of groups at which the test would have power 0.8.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dinov3_core.evaluate.probes import Predictions


CONFUSION_METRICS = ("balanced_accuracy", "macro_f1", "miou")
METRICS = (*CONFUSION_METRICS, "auroc")
# Exact enumeration of the 2^n swap patterns up to this many groups, a fixed-seed Monte Carlo sample beyond.
EXACT_MAX_GROUPS = 16
MONTE_CARLO_PATTERNS = 20_000
PERMUTATION_TEST = "paired permutation test over test {unit}s"
# Keeps a (patterns × table cells) block of a permutation or bootstrap evaluation within ~128 MiB of float64.
_BLOCK_CELLS = 1 << 24


@dataclass(frozen=True)
class Groups:
    """The groups (slides or patients) of the tested samples: sorted names, and each sample's position in them."""

    names: np.ndarray  # (G,)
    index: np.ndarray  # (N,) int64

    @classmethod
    def of(cls, labels: np.ndarray) -> Groups:
        names, index = np.unique(np.asarray(labels), return_inverse=True)
        return cls(names, index.astype(np.int64))

    def __len__(self) -> int:
        return len(self.names)


def bootstrap_counts(n_groups: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, groups): how often each group is drawn into each resample of `n_groups` groups with replacement.
    The draws are those of one `rng.integers(0, G, G)` call per resample (the same stream, drawn in one call)."""
    draws = np.random.default_rng(seed).integers(0, n_groups, (resamples, n_groups))
    flat = (np.arange(resamples)[:, None] * n_groups + draws).ravel()
    return np.bincount(flat, minlength=resamples * n_groups).reshape(resamples, n_groups)


@dataclass(frozen=True)
class Design:
    """The groups and their bootstrap resamples, shared by every model of one evaluation (paired by construction)."""

    groups: Groups
    counts: np.ndarray  # (B, G) bootstrap multiplicities
    seed: int = 0
    unit: str = "slide"

    @classmethod
    def over(cls, labels: np.ndarray, resamples: int, seed: int, unit: str = "slide") -> Design:
        groups = Groups.of(labels)
        return cls(groups, bootstrap_counts(len(groups), resamples, seed), seed, unit)

    def subset(self, rows: np.ndarray) -> Design:
        """The same design for the samples `rows` (the dense probe's tokens of the labelled tiles): the groups they
        fall in, resampled with the same seed (as a fresh bootstrap over those groups would be)."""
        return Design.over(self.groups.names[self.groups.index[rows]], len(self.counts), self.seed, self.unit)


# ----------------------------------------------------------------------------------------- tables and metrics


def confusion_table(truth: np.ndarray, predicted: np.ndarray, groups: Groups, n_classes: int) -> np.ndarray:
    """(G, C·C) int64: each group's confusion matrix (rows the true class code), flattened."""
    flat = (groups.index * n_classes + truth) * n_classes + predicted
    return np.bincount(flat, minlength=len(groups) * n_classes**2).reshape(len(groups), n_classes**2)


def score_table(positive: np.ndarray, scores: Sequence[np.ndarray], groups: Groups) -> list[np.ndarray]:
    """Per model, (G, 2·L) int64: each group's counts of positive then negative samples at each of the L score
    levels shared by all `scores` (ascending), so that pooled tables of any of the models stay comparable."""
    levels = np.unique(np.concatenate(scores))
    out = []
    for s in scores:
        at = np.searchsorted(levels, s)
        cells = np.where(positive, at, len(levels) + at)
        out.append(np.bincount(groups.index * 2 * len(levels) + cells, minlength=len(groups) * 2 * len(levels)))
    return [t.reshape(len(groups), 2 * len(levels)) for t in out]


def _mean_present(values: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Mean of `values` over the `present` entries of the last axis (nan where none is present)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(present, values, 0.0).sum(-1) / present.sum(-1)


def _confusion_metric(name: str, n_classes: int) -> Callable[[np.ndarray], np.ndarray]:
    def metric(sums: np.ndarray) -> np.ndarray:
        cm = sums.reshape(-1, n_classes, n_classes).astype(np.float64)
        diag, rows, cols = np.diagonal(cm, axis1=1, axis2=2), cm.sum(2), cm.sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            if name == "balanced_accuracy":  # mean recall over the classes present in the truth
                return _mean_present(diag / rows, rows > 0)
            if name == "macro_f1":  # classes in the truth or the predictions; 0 for one never right
                return _mean_present(2 * diag / (rows + cols), rows + cols > 0)
            union = rows + cols - diag  # miou: IoU = TP / (TP + FP + FN)
            return _mean_present(diag / union, union > 0)

    return metric


def _auroc(sums: np.ndarray) -> np.ndarray:
    """Mann-Whitney AUROC of summed level histograms (B, 2·L): P(score of a positive > a negative's), ties ½."""
    pos, neg = np.split(sums.astype(np.float64), 2, axis=1)
    below = np.cumsum(neg, axis=1) - neg  # negatives strictly below each level
    n_pos, n_neg = pos.sum(1), neg.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        auc = (pos * (below + 0.5 * neg)).sum(1) / (n_pos * n_neg)
    return np.where((n_pos > 0) & (n_neg > 0), auc, np.nan)


def pooled_metric(name: str, n_classes: int) -> Callable[[np.ndarray], np.ndarray]:
    """The metric `name` of summed tables (B, cells) → (B,)."""
    if name == "auroc":
        return _auroc
    if name not in CONFUSION_METRICS:
        raise ValueError(f"unknown metric {name!r}; one of {', '.join(METRICS)}")
    return _confusion_metric(name, n_classes)


def tables(name: str, truth: np.ndarray, preds: Sequence[Predictions], groups: Groups) -> list[np.ndarray]:
    """Each model's per-group table for `name` (`truth`: class codes; AUROC: two classes, on shared levels)."""
    if name == "auroc":
        positives = [p.positive() for p in preds]
        return score_table(truth == 1, [s for s in positives if s is not None], groups)
    return [confusion_table(truth, p.scores.argmax(1), groups, len(p.classes)) for p in preds]


def _blocks(total: int, cells: int) -> range:
    return range(0, total, max(1, _BLOCK_CELLS // max(cells, 1)))


def _weighted(weights: np.ndarray, table: np.ndarray, metric: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """metric(weights @ table) for every row of `weights`, in blocks of bounded memory."""
    step = _blocks(len(weights), table.shape[1]).step
    return np.concatenate([metric(weights[i : i + step] @ table) for i in range(0, len(weights), step)])


def percentile_interval(values: np.ndarray) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan"), float("nan")
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


# ------------------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class Estimate:
    """A pooled metric and its 95 % percentile bootstrap interval over the groups."""

    value: float
    ci_low: float
    ci_high: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Comparison:
    """metric(a) − metric(b) on the same tiles: the bootstrap interval (display) and the permutation test (the gate).
    `per_group`: each group's own difference (the metric of its tiles alone), for the slides-needed estimate."""

    value: float
    ci_low: float
    ci_high: float
    p_value: float
    test: str
    exact: bool  # all 2^n swap patterns enumerated (else a Monte Carlo sample, +1 corrected)
    groups: int
    per_group: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Comparison:
        """A comparison from `evaluation.json` (one written before the permutation test has no p-value: nan)."""
        return cls(
            value=float(d["value"]),
            ci_low=float(d["ci_low"]),
            ci_high=float(d["ci_high"]),
            p_value=float(d.get("p_value", math.nan)),
            test=str(d.get("test", "")),
            exact=bool(d.get("exact", False)),
            groups=int(d.get("groups", 0)),
            per_group=[float(v) for v in d.get("per_group", [])],
        )


def metrics_with_ci(
    truth: np.ndarray, p: Predictions, design: Design, names: Sequence[str] = METRICS
) -> dict[str, Estimate]:
    """{metric: Estimate} of one model's pooled predictions (`truth`: class codes); AUROC only for two classes."""
    out: dict[str, Estimate] = {}
    confusion = confusion_table(truth, p.scores.argmax(1), design.groups, len(p.classes))
    for name in names:
        if name == "auroc" and len(p.classes) != 2:
            continue
        table = confusion if name != "auroc" else tables(name, truth, [p], design.groups)[0]
        metric = pooled_metric(name, len(p.classes))
        value = float(metric(table.sum(0, keepdims=True))[0])
        out[name] = Estimate(value, *percentile_interval(_weighted(design.counts, table, metric)))
    return out


def swap_patterns(n_groups: int, seed: int) -> tuple[np.ndarray, bool]:
    """(patterns (P, G) of 0/1: which groups swap models, exact): all 2^G (the first the identity) up to
    `EXACT_MAX_GROUPS`, else `MONTE_CARLO_PATTERNS` drawn with a fixed seed."""
    if n_groups <= EXACT_MAX_GROUPS:
        return (np.arange(2**n_groups)[:, None] >> np.arange(n_groups)) & 1, True
    return np.random.default_rng([seed, n_groups]).integers(0, 2, (MONTE_CARLO_PATTERNS, n_groups)), False


def permutation_test(
    a: np.ndarray, b: np.ndarray, metric: Callable[[np.ndarray], np.ndarray], seed: int = 0
) -> tuple[float, bool]:
    """One-sided p-value of metric(Σa) − metric(Σb) under H0: per group, the two models' outputs are exchangeable.

    Swapping group g moves its table from one pool to the other: the pools under a pattern s are Σa + s·(b − a) and
    Σb − s·(b − a). Exact: the share of the 2^G patterns whose difference reaches the observed one (the identity
    counts, so p ≥ 2^-G); Monte Carlo: (1 + hits) / (1 + patterns). Ties count as reaching it (conservative)."""
    patterns, exact = swap_patterns(len(a), seed)
    delta = (b - a).astype(np.float64)
    sum_a, sum_b = a.sum(0).astype(np.float64), b.sum(0).astype(np.float64)
    observed = float(metric(sum_a[None])[0] - metric(sum_b[None])[0])
    if not math.isfinite(observed):
        return math.nan, exact
    hits = 0
    blocks = _blocks(len(patterns), delta.shape[1])
    for i in blocks:
        shift = patterns[i : i + blocks.step] @ delta
        diff = metric(sum_a + shift) - metric(sum_b - shift)
        hits += int(np.count_nonzero(diff >= observed - 1e-12))
    if exact:
        return hits / len(patterns), True
    return (1 + hits) / (1 + len(patterns)), False


def compare(truth: np.ndarray, a: Predictions, b: Predictions, name: str, design: Design) -> Comparison:
    """metric(a) − metric(b) on the same samples: interval over the same bootstrap resamples, permutation p-value."""
    ta, tb = tables(name, truth, [a, b], design.groups)
    metric = pooled_metric(name, len(a.classes))
    value = float(metric(ta.sum(0, keepdims=True))[0] - metric(tb.sum(0, keepdims=True))[0])
    interval = percentile_interval(_weighted(design.counts, ta, metric) - _weighted(design.counts, tb, metric))
    p, exact = permutation_test(ta, tb, metric, design.seed)
    per_group = (metric(ta) - metric(tb)).tolist()
    test = PERMUTATION_TEST.format(unit=design.unit) + (" (exact)" if exact else " (Monte Carlo)")
    return Comparison(value, *interval, p, test, exact, len(design.groups), per_group)


# ---------------------------------------------------------------------------------------------- the design


def min_groups(alpha: float) -> int:
    """The fewest groups for which an exact paired permutation test can reach p ≤ alpha: its least p is 2^-n."""
    return max(1, math.ceil(math.log2(1 / alpha) - 1e-12))


@dataclass(frozen=True)
class SlidesNeeded:
    """How many test groups the measured effect would need for power `power` at `alpha` (None: not estimable)."""

    groups: int | None
    mean: float  # of the per-group differences
    sd: float
    why: str = ""  # when `groups` is None


def slides_needed(per_group: Sequence[float], alpha: float, power: float = 0.8, cap: int = 10_000) -> SlidesNeeded:
    """A one-sample t approximation of the paired test on the per-group differences (mean d, SD s): the least n with
    n ≥ ((t_{1-α,n-1} + t_{power,n-1}) · s / d)², floored at `min_groups(alpha)`. The permutation test on the pooled
    metric behaves like a test on the mean per-group difference when groups are of similar size; this is a planning
    figure, not a promise."""
    from scipy import stats  # deferred: scipy.stats costs a few hundred ms at import

    values = np.asarray([v for v in per_group if math.isfinite(v)], np.float64)
    floor = min_groups(alpha)
    if len(values) < 2:
        mean = float(values.mean()) if len(values) else math.nan
        return SlidesNeeded(None, mean, math.nan, "fewer than two groups with a difference")
    mean, sd = float(values.mean()), float(values.std(ddof=1))
    if mean <= 0:
        return SlidesNeeded(None, mean, sd, "the measured effect is not positive: more slides would not help")
    if sd == 0:
        return SlidesNeeded(floor, mean, sd)
    # the normal approximation is a lower bound (t quantiles are wider): start there and walk up
    z = (stats.norm.ppf(1 - alpha) + stats.norm.ppf(power)) * sd / mean
    n = max(floor, 2, math.ceil(z**2))
    while n <= cap:
        if n >= ((stats.t.ppf(1 - alpha, n - 1) + stats.t.ppf(power, n - 1)) * sd / mean) ** 2:
            return SlidesNeeded(n, mean, sd)
        n += 1
    return SlidesNeeded(None, mean, sd, f"more than {cap}: the effect is small against its spread across slides")


__all__ = [
    "CONFUSION_METRICS",
    "METRICS",
    "Comparison",
    "Design",
    "Estimate",
    "Groups",
    "SlidesNeeded",
    "bootstrap_counts",
    "compare",
    "confusion_table",
    "metrics_with_ci",
    "min_groups",
    "permutation_test",
    "pooled_metric",
    "slides_needed",
    "swap_patterns",
    "tables",
]
