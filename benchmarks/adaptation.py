"""Domain adaptation on the sample cohort: pretrain-only vs pretrain + gram, and stain augmentation off vs on, by the
evaluate stage's tile and dense probes, on slides whose stain training saw and on one whose stain it did not.

Slides: the "demo" sample slides (six, one stain per slide, annotated; `--quick`: the "test" slides) are tiled
(96 px at 0.5 µm/px) into the training store. The evaluation store is that store plus the "heldout" sample slide
(`wsidino_dev.sample_slides`, seed 1: other tissue), stained paler in hematoxylin and stronger in eosin than any
drawn stain: a lab no training slide comes from. Training never sees it.

Rows, side by side in one run, all at the same total iterations N (the cpu recipe's 1,000; `--quick`: 40) and the
cpu recipe otherwise (configs/pretrain/cpu.yaml, configs/gram/cpu.yaml):

* init: the vit_test backbone at initialisation (what the cpu recipe starts from);
* pretrain N, no stain augmentation (`crops.hed_p=0`, `crops.stain_norm_p=0`);
* pretrain N, HED jitter (the cpu recipe as shipped: `hed_p=0.5`);
* pretrain N, HED jitter + cohort re-targeting (`stain_norm_p=0.5`, as in the GPU recipes);
* pretrain N − G, then gram G (G = 20 % of N, configs/gram/cpu.yaml's rule), HED jitter in both.

Each trained run goes through the real convert stage (`run_stage("convert")`) and every model through the real
evaluate stage (`run_stage("evaluate")`, no baseline or champion, default protocol: slide-level cross-validation,
every slide tested once, 95 % bootstrap intervals over the test slides): linear tile probe balanced accuracy, dense
probe mIoU, label-free stain invariance and effective rank. The held-out slide's own scores are the same
out-of-fold predictions restricted to its tiles (read from the stage's probe functions while it runs, scored
with its metric functions: `probes.balanced_accuracy`, `dense.miou`). One slide gives no interval.

Usage: python benchmarks/adaptation.py [--quick] [--output DIR] [--workdir DIR]   (writes DIR/adaptation.json)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from dinov3_core.config import load_config
from dinov3_core.convert.config import ConvertConfig
from dinov3_core.evaluate import dense as D
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate import scoring
from dinov3_core.evaluate.config import EvaluateConfig
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.gram.anchoring import run_gram
from dinov3_core.gram.config import GramConfig
from dinov3_core.models import backbone_kwargs, build_backbone, save_backbone
from dinov3_core.runner import run_stage
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.engine import run_tile
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.pretrain import run_pretrain
from wsidino_dev.sample_slides import make_sample_slides

HELDOUT = "tissue_heldout_stain"
GRAM_SHARE = 0.2  # configs/gram/cpu.yaml: the gram phase is 20 % of the pretraining iterations
NO_AUG = {"crops.hed_p": 0.0, "crops.stain_norm_p": 0.0}
HED = {"crops.hed_p": 0.5, "crops.stain_norm_p": 0.0}
HED_RETARGET = {"crops.hed_p": 0.5, "crops.stain_norm_p": 0.5}
MULTI_MPP = {"data.mpp_weights": {0.5: 0.5, 1.0: 0.5}}
ROWS = ("init", "hed", "gram", "noaug", "retarget", "multimpp")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tile(slides: list[Path], store: Path, mpp: float | list[float] = 0.5) -> None:
    """Each slide into `store` at 96 px tiles without overlap, at `mpp` (µm/px; a list: one level each)."""
    for slide in slides:
        values = {"input": str(slide), "output": str(store), "tile_size": 96, "stride": 96, "mpp": mpp}
        run_tile(load_config(TileConfig, None, {**values, "progress": False, "tracking.enabled": False}))


def multi_mpp_store(root: Path, slides: list[Path]) -> Path:
    """The training slides cut at 0.5 and 1.0 µm/px into one store (96 px tiles at both: the second level sees
    four times the area per tile). Evaluation stays at 0.5 µm/px, the store's first level."""
    store = root / "train-multi.zarr"
    if not store.exists():
        tile(slides, store, mpp=[0.5, 1.0])
    return store


def stores(root: Path, preset: str) -> tuple[Path, Path, Path, list[Path]]:
    """(training store, evaluation store = training slides + the held-out-stain slide, annotations, the training
    slides)."""
    train = make_sample_slides(root / "slides", preset, negatives=False)  # type: ignore[arg-type]
    held = make_sample_slides(root / "heldout", "heldout", seed=1, negatives=False)
    annotations = root / "annotations"
    annotations.mkdir(exist_ok=True)
    for path in [*train.annotations.values(), *held.annotations.values()]:
        shutil.copy(path, annotations / path.name)
    train_store, eval_store = root / "train.zarr", root / "eval.zarr"
    if not train_store.exists():
        tile(train.slides, train_store)
    if not eval_store.exists():
        shutil.copytree(train_store, eval_store)
        tile(held.slides, eval_store)
    return train_store, eval_store, annotations, list(train.slides)


def schedule(iterations: int) -> dict[str, Any]:
    """The cpu recipe's 4 epochs over `iterations`, checkpoints and eval checkpoints every epoch (so gram starts
    from the run's last iteration and has teachers to pick from)."""
    epoch = iterations // 4
    return {
        "train.epoch_length": epoch,
        "checkpointing.period": epoch,
        "evaluation.eval_period_iterations": epoch,
        "tracking.enabled": False,
    }


def pretrain(store: Path, out: Path, iterations: int, aug: dict[str, Any]) -> float:
    values = {"data.stores": [str(store)], "output_dir": str(out), **schedule(iterations), **aug}
    start = time.perf_counter()
    run_pretrain(load_config(PretrainConfig, "cpu", values, stage="pretrain"))
    return time.perf_counter() - start


def gram(store: Path, pretrain_dir: Path, out: Path, config: str, iterations: int | None) -> float:
    values: dict[str, Any] = {
        "data.stores": [str(store)],
        "pretrain_dir": str(pretrain_dir),
        "output_dir": str(out),
        "tracking.enabled": False,
    }
    if iterations is not None:
        values |= schedule(iterations) | {
            "gram.first_update": max(1, iterations // 20),
            "gram.update_frequency": max(1, iterations // 20),
        }
    start = time.perf_counter()
    run_gram(load_config(GramConfig, config, values, stage="gram"))
    return time.perf_counter() - start


def convert(run: Path, out: Path) -> Path:
    values = {"input": str(run), "output_dir": str(out), "tracking.enabled": False}
    return Path(run_stage("convert", load_config(ConvertConfig, None, values)).result.backbone)


def init_backbone(out: Path) -> Path:
    """The cpu recipe's backbone at initialisation (seed 0), saved as convert saves one."""
    torch.manual_seed(0)
    arch = "vit_test"
    weights = save_backbone(build_backbone(arch).eval(), out / "backbone.pth")
    (out / "config.yaml").write_text(yaml.safe_dump({"arch": arch, "backbone_kwargs": backbone_kwargs(arch)}))
    return weights


class Spy:
    """Keeps the evaluate stage's out-of-fold predictions (tile linear probe and dense probe) as it makes them."""

    def __init__(self) -> None:
        self.tile: tuple[np.ndarray, P.CrossValidation, P.Predictions] | None = None
        self.dense: tuple[D.DenseSet, P.Predictions] | None = None
        self._score, self._predict = scoring.score_model, D.predict

    def __enter__(self) -> Spy:
        def score(cfg: Any, x: np.ndarray, y: np.ndarray, cv: P.CrossValidation, *rest: Any) -> Any:
            out = self._score(cfg, x, y, cv, *rest)
            self.tile = (y, cv, out[1]["linear"])
            return out

        def predict(d: D.DenseSet, *args: Any) -> Any:
            out = self._predict(d, *args)
            self.dense = (d, out[0])
            return out

        scoring.score_model, D.predict = score, predict
        return self

    def __exit__(self, *_: object) -> None:
        scoring.score_model, D.predict = self._score, self._predict

    def heldout_scores(self) -> dict[str, float]:
        assert self.tile is not None
        y, cv, linear = self.tile
        test = next(f.test for f in cv.folds if f.test_groups == [HELDOUT])
        out = {"linear_balanced_accuracy": P.score(y, linear, P.balanced_accuracy, test)}
        if self.dense is not None:
            d, p = self.dense
            out["dense_miou"] = P.score(d.y, p, D.miou, np.flatnonzero(np.isin(d.tile, test)))
        return out


def evaluate(store: Path, annotations: Path, weights: Path, out: Path) -> dict[str, Any]:
    values = {
        "store": str(store),
        "candidate": str(weights),
        "output": str(out),
        "annotations": str(annotations),
        "baseline": None,
        "champion": False,
        "gate.promote": False,
        "progress": False,
        "tracking.enabled": False,
    }
    with Spy() as spy:
        run_stage("evaluate", load_config(EvaluateConfig, None, values))
    model = EvaluationReport.from_json((out / "evaluation.json").read_text()).models["candidate"]
    probes = model["probes"]
    return {
        "linear": probes["linear"]["balanced_accuracy"],
        "dense": probes.get("dense", {}).get("miou"),
        "stain_invariance": model["health"].get("stain_invariance"),
        "effective_rank": model["health"].get("cls_effective_rank"),
        "dense_effective_rank": model["health"].get("dense_effective_rank"),
        "heldout": spy.heldout_scores(),
        "test_slides": len(spy.tile[1].folds) if spy.tile else None,
    }


def interval(m: dict[str, float] | None) -> str:
    if not m:
        return "–"
    return f"{m['value']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test slides, 40 iterations")
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--workdir", default=None, help="keep the slides, stores and runs here (default: a temp dir)")
    parser.add_argument("--table", help="only print the table of an adaptation.json")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which rows (default all: {','.join(ROWS)})")
    args = parser.parse_args()
    if args.table:
        print_table(Path(args.table))
        return
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    n = 40 if args.quick else 1000
    g = int(n * GRAM_SHARE)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor(),
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "iterations": n,
        "gram_iterations": g,
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        train_store, eval_store, annotations, train_slides = stores(root, "test" if args.quick else "demo")
        log(f"stores: {time.perf_counter() - start:.0f} s")
        seconds: dict[str, float] = {}
        results: dict[str, Any] = {}

        def done(name: str, weights: Path, iterations: str) -> None:
            """Evaluate one model now and write what is measured so far (a stopped run keeps its rows)."""
            slug = "".join(c if c.isalnum() else "_" for c in name)
            results[name] = {
                "iterations": iterations,
                **evaluate(eval_store, annotations, weights, root / "eval" / slug),
            }
            log(f"{name}: evaluated")
            (out / "adaptation.json").write_text(
                json.dumps({"environment": env, "seconds": seconds, "results": results}, indent=2, default=float) + "\n"
            )

        if "init" in rows:
            done("init (starting backbone)", init_backbone(root / "init"), "0")
        if "hed" in rows:
            hed = root / "hed"
            seconds["pretrain N"] = pretrain(train_store, hed / "pretrain", n, HED)
            done("pretrain, HED jitter (cpu recipe)", convert(hed / "pretrain", hed / "model"), f"{n}")
        if "gram" in rows:
            short = root / "gram"
            seconds["pretrain N − G"] = pretrain(train_store, short / "pretrain", n - g, HED)
            seconds["gram G"] = gram(train_store, short / "pretrain", short / "gram", "cpu", g if args.quick else None)
            log(f"pretrain {n - g} + gram {g}: {seconds['pretrain N − G'] + seconds['gram G']:.0f} s")
            done("pretrain + gram, HED jitter", convert(short / "gram", short / "model"), f"{n - g} + {g}")
        for name, slug, aug in (
            ("pretrain, no stain augmentation", "noaug", NO_AUG),
            ("pretrain, HED jitter + re-targeting", "retarget", HED_RETARGET),
        ):
            if slug not in rows:
                continue
            run = root / slug
            seconds[f"pretrain N, {slug}"] = pretrain(train_store, run / "pretrain", n, aug)
            done(name, convert(run / "pretrain", run / "model"), f"{n}")
        if "multimpp" in rows:  # the same slides cut at 0.5 and 1.0 µm/px, half the samples from each
            multi = root / "multimpp"
            store = multi_mpp_store(root, train_slides)
            seconds["pretrain N, multimpp"] = pretrain(store, multi / "pretrain", n, {**HED, **MULTI_MPP})
            done("pretrain, HED jitter, 0.5 + 1.0 µm/px", convert(multi / "pretrain", multi / "model"), f"{n}")
    print_table(out / "adaptation.json")


def print_table(path: Path) -> None:
    doc = json.loads(path.read_text())
    env, results, seconds = doc["environment"], doc["results"], doc["seconds"]
    n, g = env["iterations"], env["gram_iterations"]
    print(
        f"\n## adaptation (cpu recipe, N = {n} iterations, gram G = {g}; evaluation store = the training slides + "
        f"the held-out-stain slide; CPU {env['threads']} threads)\n"
    )
    print(
        "| model | iterations | linear tile probe, bal. acc. [95 % CI], all test slides | dense mIoU [95 % CI], all "
        "test slides | held-out stain slide: bal. acc. | held-out: dense mIoU | stain invariance "
        "| CLS / dense eff. rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        h = r["heldout"]
        print(
            f"| {name} | {r['iterations']} | {interval(r['linear'])} | {interval(r['dense'])} | "
            f"{h['linear_balanced_accuracy']:.3f} | {h.get('dense_miou', float('nan')):.3f} | "
            f"{r['stain_invariance']:.3f} | {r['effective_rank']:.3f} / "
            f"{r['dense_effective_rank']:.3f} |"
        )
    print("\nseconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))


if __name__ == "__main__":
    main()
