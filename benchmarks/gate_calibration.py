"""Gate calibration: how often the promotion gate promotes a candidate that is no better (and, given trained
models, how often it promotes one that is), measured by running the real gate on real probe outputs.

* **Null pairs**: M randomly initialised `vit_test` backbones (seeds 0..M-1: no learned difference between any two)
  embed the labelled tiles of a cohort once each and are probed once each by the stage's own code
  (`scoring.probe_models`: grouped cross-validation, kNN, linear probe, per-slide statistics); then for distinct
  unordered pairs, in a random orientation (candidate = a, baseline = b: the registry's first model), the stage's
  comparisons (`scoring.paired_comparisons`) and `gate.decide` give the verdict. The share promoted is the
  false-promotion rate, with its exact (Clopper-Pearson) 95 % interval; beside it the rule the gate had before (the
  lower bound of the 95 % percentile bootstrap interval over test slides > margin, from at least 3 slides), on the
  same pairs.
* **Real pairs** (`--trained PATH ...`: a trained model's `model.onnx` or `backbone.pth`): each against the same
  architecture at initialisation (the stage's `baseline=init`) and against every null model: the share promoted is the
  power. Without `--trained` power is not measured, and the output says so.

Cohorts (`--cohort`): `test` (the "test" preset of `wsidino_dev.sample_slides`: 3 annotated slides), `demo` (the
demo preset) and `synthetic` (the "test" preset generated with `--seeds` seeds into one folder, 3 annotated slides
each, renamed apart: 12 with the default 4 seeds). Tiles of 32 px at 2 µm/px, as the evaluate tests use.

Usage: python benchmarks/gate_calibration.py [--cohort test synthetic] [--models 32] [--pairs 240] [--quick]
       [--trained model.onnx ...] [--output DIR]   (writes DIR/gate_calibration.json)
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from dinov3_core.config import load_config
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.evaluate import evaluation as E
from dinov3_core.evaluate import features as F
from dinov3_core.evaluate import gate as G
from dinov3_core.evaluate import scoring
from dinov3_core.evaluate.config import EvaluateConfig
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.evaluate.models import ModelUnderTest, baseline_model
from dinov3_core.inference.backbone import INFERENCE_OVERRIDES
from dinov3_core.models import backbone_kwargs, build_backbone, save_backbone
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.engine import run_tile
from wsidino_dev.sample_slides import make_sample_slides

ARCH = "vit_test"
ALPHAS = (0.05, 0.025, 0.01)  # the levels the table shows beside the gate's own


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_cohort(root: Path, cohort: str, seeds: int) -> tuple[Path, Path]:
    """(tile store, annotations folder) of the cohort's annotated slides."""
    slides, annotations = root / "slides", root / "slides" / "annotations"
    annotations.mkdir(parents=True, exist_ok=True)
    store = root / "tiles.zarr"
    generated = range(seeds) if cohort == "synthetic" else [0]
    for seed in generated:
        made = make_sample_slides(
            root / f"gen-{seed}", "demo" if cohort == "demo" else "test", seed=seed, negatives=False
        )
        for stem, geojson in made.annotations.items():
            slide = next(s for s in made.slides if s.stem == stem)
            name = f"s{seed}_{stem}" if cohort == "synthetic" else stem  # distinct slide ids across seeds
            target = slides / f"{name}{slide.suffix}"
            shutil.copy(slide, target)
            shutil.copy(geojson, annotations / f"{name}.geojson")
            values = {
                "input": str(target),
                "output": str(store),
                "tile_size": 32,
                "mpp": 2.0,
                "progress": False,
                "tracking.enabled": False,
            }
            run_tile(load_config(TileConfig, None, values))
    return store, annotations


def init_model(root: Path, seed: int) -> Path:
    """A randomly initialised `vit_test` (torch seed `seed`) in the released layout, with its config.yaml."""
    torch.manual_seed(seed)
    folder = root / f"init-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(
        yaml.safe_dump({"arch": ARCH, "backbone_kwargs": backbone_kwargs(ARCH, **INFERENCE_OVERRIDES)})
    )
    return save_backbone(build_backbone(ARCH, **INFERENCE_OVERRIDES).eval(), folder / "backbone.pth")


@dataclass
class Cohort:
    cfg: EvaluateConfig
    ds: Any
    idx: np.ndarray
    y: np.ndarray
    groups: np.ndarray
    images: np.ndarray  # health tiles, normalised


def load_cohort(store: Path, annotations: Path, root: Path, max_tiles: int) -> Cohort:
    values = {
        "store": str(store),
        "candidate": "unused.onnx",
        "output": str(root / "evaluation"),
        "annotations": str(annotations),
        "max_tiles_per_slide": max_tiles,
        "probe.bootstrap": 1000,
        "progress": False,
        "tracking.enabled": False,
        "health_tiles": 64,
    }
    cfg = load_config(EvaluateConfig, None, values)
    ds = TileDataset(store, image_format="numpy")
    idx, y, slides, _ = E.labelled_tiles(store, ds, str(annotations), [], max_tiles_per_slide=max_tiles)
    images = F.normalise(E._health_tiles(ds, cfg.health_tiles))
    return Cohort(cfg, ds, idx, y, slides, images)


def embed(c: Cohort, model: Path, cache: Path) -> tuple[np.ndarray, dict[str, float]]:
    """The model's features of the labelled tiles (the stage's embedding and representation) and its health."""
    fm = F.open_model(model, threads=0)
    key = F.selection_key(Path(c.cfg.store), c.idx)
    raw = F.embed(fm, c.ds, c.idx, cache, key, c.cfg.batch_size, loader_threads=0)
    return F.represent(raw, c.cfg.probe.features), F.health(fm, c.images)


@dataclass
class Rate:
    promoted: int
    pairs: int
    rate: float
    ci_low: float
    ci_high: float  # exact (Clopper-Pearson) 95 %


def rate(promoted: int, pairs: int) -> Rate:
    from scipy.stats import beta

    low = 0.0 if promoted == 0 else float(beta.ppf(0.025, promoted, pairs - promoted + 1))
    high = 1.0 if promoted == pairs else float(beta.ppf(0.975, promoted + 1, pairs - promoted))
    return Rate(promoted, pairs, promoted / pairs if pairs else float("nan"), low, high)


def judge(c: Cohort, probed: scoring.Probed, health: dict[str, Any], a: str, b: str) -> tuple[G.Decision, bool]:
    """(the gate's decision on candidate a vs baseline b, the former bootstrap rule's verdict on the same pair)."""
    preds = {"candidate": probed.predictions[a], "baseline": probed.predictions[b]}
    comparisons = scoring.paired_comparisons(c.y, preds, probed.design)
    evaluation = EvaluationReport(
        store=str(c.cfg.store),
        models={
            "candidate": {"health": health[a], "probes": probed.probes[a]},
            "baseline": {"health": health[b], "probes": probed.probes[b]},
        },
        comparisons=comparisons,
        labelled_tiles=len(c.y),
        evidence={"unit": "slide", "test_groups": len(probed.cv.test_groups), "folds": len(probed.cv.folds)},
    )
    decision = G.decide(c.cfg, evaluation)
    d = comparisons["candidate_vs_baseline"][c.cfg.gate.primary_metric]
    old = len(probed.cv.test_groups) >= 3 and d["ci_high"] > d["ci_low"] and d["ci_low"] > c.cfg.gate.margin
    return decision, bool(old)


def run_cohort(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    store, annotations = make_cohort(root / name, name, args.seeds)
    c = load_cohort(store, annotations, root / name, args.max_tiles)
    n_slides = len(np.unique(c.groups))
    log(f"{name}: {n_slides} annotated slides, {len(c.y)} labelled tiles ({time.perf_counter() - t0:.0f} s)")
    feats, health = {}, {}
    for seed in range(args.models):
        role = f"init{seed}"
        feats[role], health[role] = embed(c, init_model(root / "models", seed), root / name / "cache")
    trained: dict[str, str] = {}
    for i, path in enumerate(args.trained):
        role = f"trained{i}"
        feats[role], health[role] = embed(c, Path(path), root / name / "cache")
        cand = ModelUnderTest("candidate", Path(path), "trained")
        init = baseline_model(
            load_config(EvaluateConfig, None, {**_values(c.cfg), "baseline": "init", "candidate": path}),
            cand,
            root / name,
            [],
        )
        if init is not None:
            feats[f"{role}-init"], health[f"{role}-init"] = embed(c, init.path, root / name / "cache")
        trained[role] = path
    t1 = time.perf_counter()
    probed = scoring.probe_models(c.cfg, feats, c.y, c.groups)
    probe_s = time.perf_counter() - t1
    log(f"{name}: {len(feats)} models probed in {probe_s:.0f} s")

    rng = np.random.default_rng(0)
    nulls = [f"init{s}" for s in range(args.models)]
    pairs = list(itertools.combinations(nulls, 2))
    chosen = [pairs[i] for i in rng.permutation(len(pairs))[: args.pairs]]
    promoted = old_promoted = 0
    p_values, differences = [], []
    t2 = time.perf_counter()
    for a, b in chosen:
        if rng.random() < 0.5:
            a, b = b, a
        decision, old = judge(c, probed, health, a, b)
        promoted += decision.promote
        old_promoted += old
        p_values.append(decision.evidence.p_value)
        differences.append(decision.evidence.interval.value if decision.evidence.interval else float("nan"))
    gate_s = (time.perf_counter() - t2) / max(len(chosen), 1)
    power: dict[str, Any] = {"measured": False, "why": "no --trained model given"}
    if trained:
        vs_init = [judge(c, probed, health, r, f"{r}-init")[0] for r in trained if f"{r}-init" in feats]
        vs_nulls = [judge(c, probed, health, r, b)[0] for r in trained for b in nulls]
        power = {
            "measured": True,
            "models": trained,
            "vs_own_init": asdict(rate(sum(d.promote for d in vs_init), len(vs_init))),
            "vs_null_models": asdict(rate(sum(d.promote for d in vs_nulls), len(vs_nulls))),
            "evidence_lines": [G.evidence_line(d) for d in vs_init],
        }
    return {
        "cohort": name,
        "slides": n_slides,
        "labelled_tiles": len(c.y),
        "models": args.models,
        "pairs": len(chosen),
        "alpha": c.cfg.gate.alpha,
        "min_test_slides": c.cfg.gate.required_test_slides(),
        "gate": asdict(rate(promoted, len(chosen))),
        "bootstrap_rule": asdict(rate(old_promoted, len(chosen))),
        "p_values": p_values,
        # the same pairs at other levels (p ≤ α and a difference above the margin, as the gate decides)
        "at_alpha": {
            str(a): asdict(
                rate(
                    sum(
                        p is not None and p <= a and d > c.cfg.gate.margin
                        for p, d in zip(p_values, differences, strict=True)
                    ),
                    len(chosen),
                )
            )
            for a in ALPHAS
        },
        "power": power,
        "probe_seconds_per_model": probe_s / len(feats),
        "gate_seconds_per_pair": gate_s,
    }


def _values(cfg: EvaluateConfig) -> dict[str, Any]:
    return {
        "store": cfg.store,
        "candidate": cfg.candidate,
        "output": cfg.output,
        "annotations": cfg.annotations,
        "progress": False,
        "tracking.enabled": False,
    }


def table(results: list[dict[str, Any]]) -> str:
    alpha = results[0]["alpha"] if results else ""
    others = " | ".join(f"at α {a}" for a in ALPHAS)
    lines = [
        f"| cohort | slides | null pairs | gate (permutation, α {alpha}): false promotions [95 % CI] | {others} | "
        "former rule (bootstrap lower bound > 0): false promotions [95 % CI] | power (trained vs init) |",
        "|---|---|---|---|" + "---|" * len(ALPHAS) + "---|---|",
    ]
    for r in results:
        g, o, p = r["gate"], r["bootstrap_rule"], r["power"]
        pw = (
            "not measured (no --trained model)"
            if not p["measured"]
            else (
                f"{p['vs_own_init']['promoted']}/{p['vs_own_init']['pairs']} vs own init; "
                f"{p['vs_null_models']['rate']:.0%} vs {r['models']} inits"
            )
        )
        lines.append(
            f"| {r['cohort']} | {r['slides']} | {r['pairs']} | {g['promoted']}/{g['pairs']} = "
            f"{g['rate']:.1%} [{g['ci_low']:.1%}, {g['ci_high']:.1%}] | "
            + " | ".join(
                f"{r['at_alpha'][str(a)]['rate']:.1%} [≤ {r['at_alpha'][str(a)]['ci_high']:.1%}]" for a in ALPHAS
            )
            + f" | {o['promoted']}/{o['pairs']} = "
            f"{o['rate']:.1%} [{o['ci_low']:.1%}, {o['ci_high']:.1%}] | {pw} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cohort", nargs="+", default=["test", "synthetic"], choices=["test", "demo", "synthetic"])
    parser.add_argument("--seeds", type=int, default=4, help="synthetic: the test preset generated with this many")
    parser.add_argument("--models", type=int, default=32, help="null models (random inits)")
    parser.add_argument("--pairs", type=int, default=240, help="distinct null pairs judged per cohort")
    parser.add_argument("--max-tiles", type=int, default=200, help="labelled tiles kept per slide")
    parser.add_argument("--trained", nargs="*", default=[], help="trained model.onnx / backbone.pth: power")
    parser.add_argument("--quick", action="store_true", help="8 models, 28 pairs, the test cohort")
    parser.add_argument("--output", default="bench-output")
    args = parser.parse_args()
    if args.quick:
        args.models, args.pairs, args.cohort = 8, 28, ["test"]
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_cohort(name, args, Path(tmp)) for name in args.cohort]
    (out / "gate_calibration.json").write_text(json.dumps(results, indent=1))
    print(f"\n## gate calibration ({args.models} random-init {ARCH} models, the real gate on distinct pairs)\n")
    print(table(results))
    for r in results:
        if not r["power"]["measured"]:
            print(f"\n{r['cohort']}: power not measured ({r['power']['why']}).")


if __name__ == "__main__":
    main()
