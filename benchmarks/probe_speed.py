"""Probe speed: the scikit-learn / numpy probes the evaluate stage used before (kept here as the reference) vs the
batched torch classifiers (`dinov3_core.evaluate.classifiers`), side by side in one run on one machine.

* **demo-shaped**: the demo cohort's shapes (724 labelled tiles × 128 features = cls + mean patch of a 64-d model,
  3 classes, 12 slides, 11,600 dense tokens × 64), synthetic class-conditional Gaussian features with per-slide
  shifts, two models (candidate + baseline): kNN, linear probe (4 C), few-shot kNN (1-16 shots × 5 draws), the dense
  probe; the stage's folds (`cross_validate_by_group`, 5 folds) and draws;
* **lab scale**: 10⁵ tiles × 1,024 features, 50 slides, 5 classes, 5 folds, 4 C, 2·10⁵ dense tokens × 1,024, one
  model. The old path would take hours: its kNN is timed on one block of test tiles and its linear probe on one fit
  (one fold, C = 1), then extrapolated (labelled so).

Lab scale also times the torch classifiers of git revision `--baseline` (loaded from git) in the same process, so
the speed-up over them is measured side by side.

Usage: python benchmarks/probe_speed.py [--skip-lab | --lab-only] [--parts knn,linear,fewshot,dense] [--no-old]
[--baseline REV] (also `python benchmarks/evaluate.py --probes-only`)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dinov3_core.evaluate import classifiers as C
from dinov3_core.evaluate import probes as P

CS = [0.01, 0.1, 1.0, 10.0]
# The torch classifiers as first merged (fp32 kNN, linear probe fold by fold): the lab-scale baseline.
BASELINE = "673386f"


def old_knn(train: np.ndarray, train_y: np.ndarray, test: np.ndarray, n: int, k: int = 20, t: float = 0.07) -> Any:
    """The numpy kNN the stage used before (codes instead of names)."""

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    a, b = unit(test.astype(np.float32)), unit(train.astype(np.float32))
    k = min(k, len(b))
    onehot = np.eye(n, dtype=np.float32)[train_y]
    scores = np.zeros((len(a), n), np.float32)
    for start in range(0, len(a), 4096):
        sim = a[start : start + 4096] @ b.T
        top = np.argpartition(-sim, k - 1, axis=1)[:, :k]
        w = np.exp(np.take_along_axis(sim, top, axis=1) / t)
        scores[start : start + 4096] = np.einsum("nk,nkc->nc", w, onehot[top])
    return scores / np.maximum(scores.sum(1, keepdims=True), 1e-12)


def old_fit(x: np.ndarray, y: np.ndarray, c: float) -> Any:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(x)
    return scaler, LogisticRegression(C=c, max_iter=2000, random_state=0).fit(scaler.transform(x), y)


def old_linear(train: np.ndarray, train_y: np.ndarray, val: np.ndarray, test: np.ndarray, cs: Sequence[float]) -> Any:
    """The scikit-learn linear probe the stage used before: C on the validation tiles, refit, predict."""
    from sklearn.metrics import balanced_accuracy_score

    chosen, fit = float(cs[len(cs) // 2]), np.setdiff1d(np.arange(len(train)), val)
    if len(val) and len(np.unique(train_y[fit])) > 1:
        best = -1.0
        for c in cs:
            scaler, model = old_fit(train[fit], train_y[fit], c)
            acc = balanced_accuracy_score(train_y[val], model.predict(scaler.transform(train[val])))
            if acc > best + 1e-9:
                best, chosen = acc, float(c)
    scaler, model = old_fit(train, train_y, chosen)
    return model.predict_proba(scaler.transform(test)), chosen


def cohort(n: int, d: int, k: int, slides: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Class-conditional Gaussian features with per-slide shifts (fixed seed): features, codes, slide ids."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    g = rng.integers(0, slides, n)
    centres, shifts = rng.normal(size=(k, d)) * 0.15, rng.normal(size=(slides, d)) * 0.3
    x = (centres[y] + shifts[g] + rng.normal(size=(n, d)).astype(np.float32)).astype(np.float32)
    return x, y, np.array([f"slide{i:02d}" for i in g], object)


def folds(y: np.ndarray, g: np.ndarray) -> tuple[P.CrossValidation, list[C.Fold]]:
    cv = P.cross_validate_by_group(y, g, folds=5, seed=0)
    return cv, [C.Fold(f.train, np.searchsorted(f.train, f.val), f.test) for f in cv.folds]


def token_folds(cv: P.CrossValidation, tile: np.ndarray) -> list[C.Fold]:
    out = []
    for f in cv.folds:
        train, test = np.flatnonzero(np.isin(tile, f.train)), np.flatnonzero(np.isin(tile, f.test))
        out.append(C.Fold(train, np.flatnonzero(np.isin(tile[train], f.val)), test))
    return out


def run_old(x: np.ndarray, y: np.ndarray, k: int, cv: P.CrossValidation, fs: list[C.Fold], draws: dict) -> None:
    for f in fs:
        old_knn(x[f.train], y[f.train], x[f.test], k)
        old_linear(x[f.train], y[f.train], f.val, x[f.test], CS)
    for per_draw in draws.values():
        for picks in per_draw:
            for f, p in zip(cv.folds, picks, strict=True):
                old_knn(x[f.train[p]], y[f.train[p]], x[f.test], k)


def run_new(x: np.ndarray, y: np.ndarray, k: int, cv: P.CrossValidation, fs: list[C.Fold], draws: dict) -> None:
    C.knn_cv(x, y, [f.test for f in cv.folds], k, 20, 0.07)
    C.linear_probe_cv(x, y, k, fs, CS)
    C.knn_few_shot(x, y, [(f.train, f.test) for f in cv.folds], draws, k, 20, 0.07)


def timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def demo_shaped(rows: list[dict[str, Any]]) -> None:
    x, y, g = cohort(724, 128, 3, 12, 0)
    cv, fs = folds(y.astype(str), g)
    draws = P.few_shot_draws_cv(y, cv, [1, 2, 4, 8, 16], 5, 0)
    rng = np.random.default_rng(1)
    tile = np.sort(rng.integers(0, len(y), 11_600))
    dx = (rng.normal(size=(len(tile), 64)) + np.eye(3, 64)[y[tile]] * 0.5).astype(np.float32)
    dfolds = token_folds(cv, tile)
    run_new(x[:200], y[:200], 3, *folds(y[:200].astype(str), g[:200]), {})  # warm-up: torch's first-call costs
    for name, old, new in (
        (
            "tile probes (kNN, linear 4 C, few-shot 5 × 5)",
            lambda: run_old(x, y, 3, cv, fs, draws),
            lambda: run_new(x, y, 3, cv, fs, draws),
        ),
        (
            "dense probe (11,600 tokens × 64, 4 C)",
            lambda: [old_linear(dx[f.train], y[tile][f.train], f.val, dx[f.test], CS) for f in dfolds],
            lambda: C.linear_probe_cv(dx, y[tile], 3, dfolds, CS),
        ),
    ):
        t_old, t_new = 2 * timed(old), 2 * timed(new)  # two models: candidate + baseline
        rows.append({"set": "demo-shaped, 2 models", "part": name, "old_s": t_old, "new_s": t_new, "note": ""})


def demo_cohort(rows: list[dict[str, Any]], workdir: Path, annotations: Path, base: Any) -> None:
    """The demo's own evaluation, from a `make demo` work directory: its labelled tiles, the cached features of its
    candidate and baseline, the dense tokens and the stage's folds; old vs torch vs the torch baseline."""
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.evaluate import dense as D
    from dinov3_core.evaluate import features as F
    from dinov3_core.evaluate.evaluation import labelled_tiles
    from dinov3_core.tiling import store as ts

    root = ts.check_store(str(workdir / "tiles.zarr"))
    ds = TileDataset(root, image_format="numpy")
    idx, labels, slides, _ = labelled_tiles(root, ds, str(annotations), [], max_tiles_per_slide=2000)
    classes = np.unique(labels)
    y = np.searchsorted(classes, labels)
    cv, fs = folds(labels, slides)
    draws = P.few_shot_draws_cv(labels, cv, [1, 2, 4, 8, 16], 5, 0)
    caches = sorted((workdir / "evaluation" / "cache").glob("features-*.npz"))
    models = [np.load(c) for c in caches]
    # the demo's vit_test sees a 224 px tile as a 14 × 14 patch grid (the stage reads the side off the model)
    tokens = D.dense_tokens(root, ds, str(annotations), idx, 14, models[0]["dense"].shape[1])
    dense = [D.dense_set(tokens, raw["dense"]) for raw in models]
    feats = [F.represent({k: raw[k] for k in raw.files}, "cls+mean_patch") for raw in models]
    k = len(classes)
    tag = f"demo cohort ({len(y)} tiles, {len(np.unique(slides))} slides), {len(models)} models"
    parts = [
        (
            f"tile probes (kNN, linear 4 C, few-shot 5 × 5; {feats[0].shape[1]}-d)",
            lambda: [run_old(x, y, k, cv, fs, draws) for x in feats],
            lambda mod: [run_with(mod, x, y, k, cv, fs, draws) for x in feats],
        ),
        (
            f"dense probe ({len(dense[0].y)} tokens × {dense[0].x.shape[1]}, 4 C)",
            lambda: [
                old_linear(d.x[f.train], np.searchsorted(classes, d.y)[f.train], f.val, d.x[f.test], CS)
                for d in dense
                for f in token_folds(cv, d.tile)
            ],
            lambda mod: [
                mod.linear_probe_cv(d.x, np.searchsorted(classes, d.y), k, token_folds(cv, d.tile), CS) for d in dense
            ],
        ),
    ]
    for name, old, new in parts:
        row = {"set": tag, "part": name, "old_s": timed(old), "new_s": timed(new, C), "note": "real features"}
        if base is not None:
            row["base_s"] = timed(new, base)
        rows.append(row)


def run_with(mod: Any, x: np.ndarray, y: np.ndarray, k: int, cv: P.CrossValidation, fs: list, draws: dict) -> None:
    """`run_new` with the classifiers of module `mod` (today's, or the baseline revision's)."""
    mod.knn_cv(x, y, [f.test for f in cv.folds], k, 20, 0.07)
    mod.linear_probe_cv(x, y, k, fs, CS)
    mod.knn_few_shot(x, y, [(f.train, f.test) for f in cv.folds], draws, k, 20, 0.07)


def baseline_module(rev: str) -> Any:
    """The torch classifiers as of git revision `rev` (one module then), loaded from git: the side-by-side baseline."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:dinov3_core/evaluate/classifiers.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType(f"classifiers_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:classifiers.py", "exec"), module.__dict__)
    return module


def lab_neighbours(x: np.ndarray, tests: list[np.ndarray], rows: int = 1024) -> str:
    """How many of `rows` test tiles of fold 1 have the exhaustive float32 top-20 as knn_cv's neighbours."""
    got = C.knn_cv_neighbours(x, tests, 20)[0][1].numpy()
    pick = np.random.default_rng(0).choice(len(tests[0]), rows, replace=False)
    train = np.setdiff1d(np.arange(len(x)), tests[0])
    u = torch.nn.functional.normalize(torch.as_tensor(x), dim=1)
    ref = train[torch.topk(u[tests[0][pick]] @ u[train].T, 20, dim=1).indices.numpy()]
    same = (np.sort(ref, 1) == np.sort(got[pick], 1)).all(1).sum()
    return f"top-20 = float32's for {same}/{rows} sampled tiles"


def lab_scale(rows: list[dict[str, Any]], parts: set[str], old: bool, base: Any) -> None:
    x, y, g = cohort(100_000, 1024, 5, 50, 2)
    cv, fs = folds(y.astype(str), g)
    tests = [f.test for f in cv.folds]
    f = fs[0]
    nan = float("nan")

    def row(part: str, t_old: float, fn: str, args: tuple, note: str) -> None:
        t_base = timed(getattr(base, fn), *args) if base is not None else nan
        t_new = timed(getattr(C, fn), *args)
        rows.append({"set": "lab scale", "part": part, "old_s": t_old, "base_s": t_base, "new_s": t_new, "note": note})

    if "knn" in parts:
        t = timed(old_knn, x[f.train], y[f.train], x[f.test[:4096]], 5) * len(y) / 4096 if old else nan
        note = "old: one block of 4,096 test tiles, extrapolated; " + lab_neighbours(x, tests)
        row("kNN (10⁵ × 8·10⁴ × 1,024)", t, "knn_cv", (x, y, tests, 5, 20, 0.07), note)
    if "linear" in parts:
        fit = np.setdiff1d(np.arange(len(f.train)), f.val)
        t = timed(old_fit, x[f.train][fit], y[f.train][fit], 1.0) * len(fs) * (len(CS) + 1) if old else nan
        row("linear probe (5 folds × 4 C + refits)", t, "linear_probe_cv", (x, y, 5, fs, CS), "old: one fit × 25")
    if "fewshot" in parts:
        draws = P.few_shot_draws_cv(y, cv, [1, 2, 4, 8, 16], 5, 0)
        args = (x, y, [(f.train, f.test) for f in cv.folds], draws, 5, 20, 0.07)
        row("few-shot kNN (5 shots × 5 draws × 5 folds)", nan, "knn_few_shot", args, "old not timed")
    if "dense" in parts:
        del x
        rng = np.random.default_rng(3)
        tile = np.sort(rng.integers(0, len(y), 200_000))
        dx = rng.normal(size=(len(tile), 1024)).astype(np.float32) + np.eye(5, 1024, dtype=np.float32)[y[tile]] * 0.3
        args = (dx, y[tile], 5, token_folds(cv, tile), CS)
        row("dense probe (2·10⁵ tokens × 1,024, 4 C)", nan, "linear_probe_cv", args, "old not timed")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-lab", action="store_true", help="the demo-shaped set only")
    parser.add_argument("--lab-only", action="store_true", help="the lab-scale set only")
    parser.add_argument("--parts", default="knn,linear,fewshot,dense", help="lab-scale parts, comma-separated")
    parser.add_argument("--no-old", action="store_true", help="lab scale: skip the scikit-learn / numpy timings")
    parser.add_argument(
        "--baseline", default=BASELINE, help="git revision of the torch classifiers to time side by side ('' for none)"
    )
    parser.add_argument("--demo-dir", default=None, help="a `make demo` work directory: its own features, timed")
    parser.add_argument("--annotations", default=None, help="with --demo-dir: its annotations (default DIR/slides/…)")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    if args.demo_dir:
        demo = Path(args.demo_dir)
        notes = Path(args.annotations) if args.annotations else demo / "slides" / "annotations"
        demo_cohort(rows, demo, notes, baseline_module(args.baseline) if args.baseline else None)
    if not args.lab_only:
        demo_shaped(rows)
    if not args.skip_lab:
        base = baseline_module(args.baseline) if args.baseline else None
        lab_scale(rows, set(args.parts.split(",")), not args.no_old, base)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"\n## probe speed (CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, load {load})\n")
    print(
        f"| set | part | old (sklearn/numpy) s | torch {args.baseline or '–'} s | torch now s | speed-up vs old | "
        "vs torch before | note |\n|---|---|---:|---:|---:|---:|---:|---|"
    )
    for r in rows:
        base_s = r.get("base_s", float("nan"))
        print(
            f"| {r['set']} | {r['part']} | {r['old_s']:.2f} | {base_s:.2f} | {r['new_s']:.2f} | "
            f"{r['old_s'] / r['new_s']:.1f}× | {base_s / r['new_s']:.1f}× | {r['note']} |"
        )


if __name__ == "__main__":
    main()
