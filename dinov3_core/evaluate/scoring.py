"""Scoring the models' features of the same labelled tiles: the tile probes (kNN, linear, few-shot kNN) on shared
cross-validation folds, the dense probe of labelled patch tokens, site predictability, and the candidate's paired
comparisons with the champion and the baseline. `evaluation.run_evaluate` and `benchmarks/gate_calibration.py` share
`probe_models`: what the benchmark calibrates is what the stage runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dinov3_core.evaluate import classifiers as C
from dinov3_core.evaluate import dense as D
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate import statistics as S
from dinov3_core.evaluate.config import EvaluateConfig
from dinov3_core.evaluate.evaluation_json import EvaluationReport

Tick = Callable[[str], None]  # `Phase.tick`: a progress line, at most every few seconds


def _no_tick(what: str) -> None:
    pass


def dense_probe(
    cfg: EvaluateConfig,
    dense: dict[str, tuple[D.DenseTokens, np.ndarray]],
    design: S.Design,
    cv: P.CrossValidation,
    evaluation: EvaluationReport,
    tick: Tick = _no_tick,
) -> None:
    """The dense probe of every model with labelled tokens, into `probes.dense`, and the paired candidate − other
    differences into the comparisons (only between models of one patch grid: the same tokens, so paired)."""
    preds: dict[str, tuple[D.DenseSet, P.Predictions, S.Design, int]] = {}
    designs: dict[int, S.Design] = {}
    for role, (tokens, x) in dense.items():
        d = D.dense_set(tokens, x)
        if len(np.unique(d.y)) < 2:
            evaluation.warnings.append(f"{role}: fewer than two classes among the labelled tokens: no dense probe")
            continue
        if tokens.side not in designs:  # the tokens' statistics are over the same slides as the tiles'
            designs[tokens.side] = design.subset(d.tile)
        tokens_design = designs[tokens.side]
        with C.torch_threads(cfg.num_threads):
            p, cs = D.predict(d, cv, cfg.probe.linear_c, cfg.device)
        estimates = S.metrics_with_ci(p.codes(d.y), p, tokens_design, D.DENSE_METRICS)
        entry: dict[str, Any] = {k: e.as_dict() for k, e in estimates.items()}
        entry.update(linear_c_per_fold=cs, counts=tokens.counts())
        evaluation.models[role].setdefault("probes", {})["dense"] = entry
        preds[role] = (d, p, tokens_design, tokens.side)
        tick(f"{role}: {len(d.y)} tokens probed")
    if "candidate" not in preds:
        return
    d, mine, tokens_design, side = preds["candidate"]
    for other in ("champion", "baseline"):
        if other not in preds:
            continue
        if preds[other][3] != side:
            evaluation.warnings.append(
                f"dense probe: the {other}'s patch grid differs from the candidate's, so "
                "their dense metrics are not paired (no dense comparison)"
            )
            continue
        evaluation.comparisons.setdefault(f"candidate_vs_{other}", {}).update(
            {
                f"dense.{m}": S.compare(mine.codes(d.y), mine, preds[other][1], m, tokens_design).as_dict()
                for m in D.DENSE_METRICS
            }
        )


def score_model(
    cfg: EvaluateConfig,
    x: np.ndarray,
    y: np.ndarray,
    cv: P.CrossValidation,
    design: S.Design,
    draws: dict[int, list[list[np.ndarray]]],
    tick: Tick = _no_tick,
) -> tuple[dict[str, Any], dict[str, P.Predictions]]:
    """kNN, linear probe and few-shot kNN of one model's features, each fold predicted by probes fitted on the
    other folds: metrics (with CIs) of the pooled predictions, and the predictions (every labelled tile, once).
    `tick(what)` after each probe and fold (progress lines)."""
    pc = cfg.probe
    classes = np.unique(y)
    codes = np.searchsorted(classes, y)
    folds = [C.Fold(f.train, np.searchsorted(f.train, f.val), f.test) for f in cv.folds]
    with C.torch_threads(cfg.num_threads):
        knn = C.knn_cv(x, codes, [f.test for f in cv.folds], len(classes), pc.knn_k, pc.knn_temperature, cfg.device)
        tick("kNN")
        linear, cs = C.linear_probe_cv(x, codes, len(classes), folds, pc.linear_c, cfg.device, tick=tick)
        tick("linear probe")
        shots = C.knn_few_shot(
            x,
            codes,
            [(f.train, f.test) for f in cv.folds],
            draws,
            len(classes),
            pc.knn_k,
            pc.knn_temperature,
            cfg.device,
            tick=tick,
        )
    tick("few-shot kNN")
    few: dict[str, Any] = {}
    for n, per_draw in shots.items():  # one draw: the pooled predictions of every fold's n-shot kNN
        accs = [P.score(y, P.Predictions(classes, scores), P.balanced_accuracy) for scores in per_draw]
        few[str(n)] = {"balanced_accuracy": float(np.mean(accs)), "std": float(np.std(accs)), "draws": len(accs)}
    knn_p, linear_p = P.Predictions(classes, knn), P.Predictions(classes, linear)
    values, counts = np.unique(cs, return_counts=True)
    ci = {
        name: {k: e.as_dict() for k, e in S.metrics_with_ci(p.codes(y), p, design).items()}
        for name, p in (("knn", knn_p), ("linear", linear_p))
    }
    probes = {
        "knn": ci["knn"],
        "linear": ci["linear"],
        "few_shot": few,
        "linear_c": float(values[counts.argmax()]),  # the C most folds chose
        "linear_c_per_fold": cs,
    }
    return probes, {"knn": knn_p, "linear": linear_p}


@dataclass
class Probed:
    """Every model's probes on the same folds, groups and resamples, and the candidate's comparisons."""

    cv: P.CrossValidation
    design: S.Design
    probes: dict[str, dict[str, Any]]  # role → evaluation.json's `probes` (without the dense probe)
    predictions: dict[str, dict[str, P.Predictions]]  # role → probe → pooled out-of-fold predictions
    comparisons: dict[str, Any]  # candidate_vs_<other> → metric → `statistics.Comparison` as a dict


def probe_models(
    cfg: EvaluateConfig,
    feats: dict[str, np.ndarray],
    y: np.ndarray,
    groups: np.ndarray,
    unit: str = "slide",
    tick: Tick = _no_tick,
    done: Tick = _no_tick,
) -> Probed:
    """The tile probes of every model (role → features of the same labelled tiles), and, when there is a
    `candidate`, its paired comparisons with the `champion` and `baseline` among them. The stage and
    `benchmarks/gate_calibration.py` share it: what the benchmark calibrates is what the stage runs. `tick(what)`
    through each model's probes (throttled progress lines), `done(what)` once per model and for the comparisons."""
    pc = cfg.probe
    cv = P.cross_validate_by_group(y, groups, folds=pc.folds, seed=pc.seed)
    # Every tile is a test tile (of its own fold): the statistics are over all the groups.
    design = S.Design.over(groups, pc.bootstrap, pc.seed, unit)
    draws = P.few_shot_draws_cv(y, cv, pc.few_shot, pc.few_shot_draws, pc.seed)
    probes, predictions = {}, {}
    for role, x in feats.items():
        probes[role], predictions[role] = score_model(cfg, x, y, cv, design, draws, lambda w, r=role: tick(f"{r}: {w}"))
        done(f"{role}: kNN, linear probe, few-shot kNN and bootstrap intervals done")
    comparisons = paired_comparisons(y, predictions, design)
    done(f"paired comparisons ({pc.bootstrap} bootstrap resamples, permutation tests) done")
    return Probed(cv, design, probes, predictions, comparisons)


def paired_comparisons(y: np.ndarray, preds: dict[str, dict[str, P.Predictions]], design: S.Design) -> dict[str, Any]:
    """{candidate_vs_<champion|baseline>: {<probe>.<metric>: `statistics.Comparison` as a dict}}: the paired
    difference, its bootstrap interval (display) and the permutation test's p-value (the gate)."""
    out: dict[str, Any] = {}
    if "candidate" not in preds:
        return out
    for other in ("champion", "baseline"):
        if other not in preds:
            continue
        out[f"candidate_vs_{other}"] = {
            f"{probe}.{metric}": S.compare(
                preds["candidate"][probe].codes(y), preds["candidate"][probe], preds[other][probe], metric, design
            ).as_dict()
            for probe in ("knn", "linear")
            for metric in P.METRICS
            if metric != "auroc" or len(preds["candidate"][probe].classes) == 2
        }
    return out


def site_predictability(
    cfg: EvaluateConfig,
    feats: dict[str, np.ndarray],
    slides: np.ndarray,
    sites: dict[str, str],
    cv: P.CrossValidation,
    warnings: list[str],
    tick: Tick = _no_tick,
) -> dict[str, float]:
    """Balanced accuracy of a kNN predicting the site (scanner, hospital) on the same folds, pooled over the folds
    whose test sites are all among their training slides: lower is better."""
    s = np.array([sites.get(str(x), "") for x in slides], object)
    usable = [f for f in cv.folds if set(s[f.test]) <= set(s[f.train])]
    if not usable or len(set(s)) < 2:
        warnings.append("site predictability skipped: no fold has all its test sites among its training slides")
        return {}
    if len(usable) < len(cv.folds):
        warnings.append(
            f"site predictability on {len(usable)} of {len(cv.folds)} folds: the others test a site "
            "none of their training slides comes from"
        )
    classes = np.unique(s)
    tested = np.concatenate([f.test for f in usable])
    out = {}
    for role, x in feats.items():
        # every fold's training side is the other folds' test tiles, so one pass over all folds serves the usable
        with C.torch_threads(cfg.num_threads):
            scores = C.knn_cv(
                x,
                np.searchsorted(classes, s),
                [f.test for f in cv.folds],
                len(classes),
                cfg.probe.knn_k,
                cfg.probe.knn_temperature,
                cfg.device,
            )
        out[role] = P.score(s[tested], P.Predictions(classes, scores[tested]), P.balanced_accuracy)
        tick(f"{role} done")
    return out


__all__ = ["Probed", "dense_probe", "paired_comparisons", "probe_models", "score_model", "site_predictability"]
