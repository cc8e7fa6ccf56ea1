"""Evaluation cost per 10,000 labelled tiles on CPU (embedding vs probe time), side by side with extract's tiles/s.

A real tile store (the tile stage on sample slides, 224 px tiles at 0.5 µm/px, stride 112: the "demo" slides, a
few thousand tiles; `--quick`: the "test" slides, 178 tiles), a randomly initialised `vit_test` backbone exported
to ONNX through the stage runner (no MLflow), and a label for every tile: tiles classed into DAB terciles (mean
DAB optical density, scikit-image's colour deconvolution, as `tests/test_evaluate_stage.py` does) and written as
QuPath-style GeoJSON, one polygon per tile around its centre. Then, in one run, on the same store and model:

* **extract**: `run_extract` over every tile (read, normalise, model, zarr writes, PCA maps), tiles/s;
* **embedding**: the evaluate stage's `features.embed` over every labelled tile into a fresh cache (model opening
  included, as in extract's figure), with `model.onnx` (ONNX Runtime: the candidate, a champion) and with the
  same model's `backbone.pth` (PyTorch eager: how a baseline runs, released weights or `init`);
* **run_evaluate, cold**: the whole stage into a fresh directory (candidate + baseline, `baseline=auto`: the
  architecture at initialisation; no registry, so no champion), default protocol (k = 20, 4 C values, few-shot
  1–16 × 5 draws, 1000 bootstrap resamples);
* **run_evaluate, warm**: the same again with the feature cache filled: labels, label-free health, probes,
  pictures and reports only;
* and its parts on the cached features: labels (GeoJSON → tiles), health (256 tiles per model), probes (folds,
  kNN, linear probe with the C sweep, few-shot kNN, bootstrap intervals and paired differences, both models) and
  pictures.

Usage: python benchmarks/evaluate.py [--quick] [--output DIR]   (writes DIR/evaluate.json)
       python benchmarks/evaluate.py --probes-only [--skip-lab]  (probe speed, old vs new: `probe_speed.py`)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from extract import make_store  # the sibling script (its directory is sys.path[0]): the same tile store

from dinov3_core.config import load_config
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.evaluate import features as F
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate import report
from dinov3_core.evaluate.config import EvaluateConfig
from dinov3_core.evaluate.evaluation import run_evaluate
from dinov3_core.evaluate.labels import label_tiles
from dinov3_core.evaluate.scoring import probe_models
from dinov3_core.export.config import ExportConfig
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.extract import run_extract
from dinov3_core.inference.backbone import INFERENCE_OVERRIDES
from dinov3_core.models import backbone_kwargs, build_backbone, save_backbone
from dinov3_core.runner import run_stage

CLASSES = ("DAB low", "DAB mid", "DAB high")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def dab_annotations(store: Path, out: Path) -> dict[str, int]:
    """One GeoJSON per slide labelling every tile: its DAB tercile, as a square around the tile's centre (side =
    the stride, so overlapping tiles still each take exactly their own class by the centre rule)."""
    from shapely import box, union_all
    from skimage.color import rgb2hed

    from wsidino_dev.sample_slides.annotations import class_collection

    ds = TileDataset(store, image_format="numpy")
    dab = np.concatenate(
        [
            [rgb2hed(t)[..., 2].mean() for t in ds.read_batch(np.arange(start, min(start + 256, len(ds))))]
            for start in range(0, len(ds), 256)
        ]
    )
    names = np.array(CLASSES, object)[np.searchsorted(np.quantile(dab, [1 / 3, 2 / 3]), dab, side="right")]
    out.mkdir(parents=True, exist_ok=True)
    start = 0
    for s, slide_id in enumerate(ds.slide_ids):
        coords = ds.slide_coords(s)
        attrs = ds.slide_attrs(s)
        tile = float(attrs["tile_size_level0"])
        half = min(float(attrs.get("stride_level0") or tile), tile) / 2
        centres = coords + tile / 2
        mine = names[start : start + len(coords)]
        shapes = {}
        for cls in CLASSES:
            rows = np.flatnonzero(mine == cls)
            if len(rows):
                shapes[cls] = union_all([box(x - half, y - half, x + half, y + half) for x, y in centres[rows]])
        (out / f"{slide_id}.geojson").write_text(json.dumps(class_collection(shapes)))
        start += len(coords)
    return {c: int((names == c).sum()) for c in CLASSES}


def make_model(root: Path, arch: str) -> tuple[Path, Path, float]:
    """A random `arch` backbone (seed 1: not the seed-0 init baseline) exported like the pipeline does, through
    the stage runner: its manifest names the weights, so `baseline=auto` finds the architecture. No MLflow."""
    torch.manual_seed(1)
    kwargs = backbone_kwargs(arch, **INFERENCE_OVERRIDES)
    weights = save_backbone(build_backbone(arch, **INFERENCE_OVERRIDES).eval(), root / arch / "backbone.pth")
    (root / arch / "config.yaml").write_text(yaml.safe_dump({"arch": arch, "backbone_kwargs": kwargs}))
    values = {
        "weights": str(weights),
        "output": str(root / arch / "model.onnx"),
        "parity_batches": [2],
        "tracking.enabled": False,
    }
    outcome, seconds = timed(run_stage, "export", load_config(ExportConfig, None, values))
    return weights, outcome.result.path, seconds


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def main() -> None:
    if "--probes-only" in sys.argv:  # the probe-speed section alone: old (scikit-learn / numpy) vs torch probes
        import probe_speed  # the sibling script

        probe_speed.main([a for a in sys.argv[1:] if a != "--probes-only"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes-only", action="store_true", help="the probe-speed section alone (probe_speed.py)")
    parser.add_argument("--quick", action="store_true", help="the small test slides, one repeat")
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--tile-size", type=int, default=224)
    parser.add_argument("--stride", type=int, default=112, help="tile stride (px): overlap gives more tiles")
    parser.add_argument("--batch-size", type=int, default=64, help="for extract and evaluate alike")
    parser.add_argument("--repeats", type=int, default=1, help="best of N for extract and the embedding")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    preset = "test" if args.quick else "demo"
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        store = make_store(root, args.tile_size, args.stride, preset)
        log(f"tile store ({preset} slides) ready in {time.perf_counter() - t0:.1f} s")
        weights, onnx_path, export_s = make_model(root / "models", "vit_test")
        log(f"vit_test exported in {export_s:.1f} s")
        counts, _ = timed(dab_annotations, store, root / "annotations")
        log(f"annotations: {counts}")

        # (a) extract, (b) the evaluate embedding, side by side on the same store and model.
        extract = {}
        embedding: dict[str, dict[str, Any]] = {}
        ds = TileDataset(store, image_format="numpy")
        idx = np.arange(len(ds), dtype=np.int64)  # every tile is labelled
        key = F.selection_key(store, idx)
        for r in range(repeats):
            values = {
                "store": str(store),
                "model": str(onnx_path),
                "output": str(root / f"features-{r}.zarr"),
                "progress": False,
                "batch_size": args.batch_size,
                "tracking.enabled": False,
            }
            result = run_extract(load_config(ExtractConfig, None, values))
            if not extract or result.tiles_per_s > extract["tiles_per_s"]:
                extract = {"tiles": result.tiles, "seconds": result.seconds, "tiles_per_s": result.tiles_per_s}
            log(f"extract: {result.tiles} tiles {result.tiles_per_s:.1f} tiles/s")
            for role, model in (("model.onnx (ONNX Runtime)", onnx_path), ("backbone.pth (PyTorch eager)", weights)):
                start = time.perf_counter()
                fm = F.open_model(model)
                F.embed(fm, ds, idx, root / f"cache-{r}-{fm.backend}", key, args.batch_size)
                seconds = time.perf_counter() - start
                if role not in embedding or len(idx) / seconds > embedding[role]["tiles_per_s"]:
                    embedding[role] = {"tiles": len(idx), "seconds": seconds, "tiles_per_s": len(idx) / seconds}
                log(f"embed {role}: {len(idx) / seconds:.1f} tiles/s")

        # (d) the whole stage cold, then (c) warm (features cached).
        values = {
            "store": str(store),
            "candidate": str(onnx_path),
            "output": str(root / "evaluation"),
            "annotations": str(root / "annotations"),
            "max_tiles_per_slide": None,
            "batch_size": args.batch_size,
            "progress": False,
            "tracking.enabled": False,
        }
        cfg = load_config(EvaluateConfig, None, values)
        cold, cold_s = timed(run_evaluate, cfg)
        log(f"run_evaluate cold: {cold_s:.1f} s ({cold.report.labelled_tiles} labelled tiles)")
        warm, warm_s = timed(run_evaluate, cfg)
        log(f"run_evaluate warm: {warm_s:.1f} s")
        primary = [r.report.models["candidate"]["probes"]["linear"]["balanced_accuracy"] for r in (cold, warm)]
        assert primary[0] == primary[1], primary  # the warm run read the cold run's features
        labelled = cold.report.labelled_tiles

        # Its parts, on the cached features.
        found, labels_s = timed(label_tiles, store, cfg.annotations)
        y = np.concatenate([found.slides[s].labels.astype(str) for s in sorted(found.slides)])
        groups = np.concatenate([np.full(len(found.slides[s].rows), s, object) for s in sorted(found.slides)])
        assert len(y) == labelled, (len(y), labelled)
        images = F.normalise(
            ds.read_batch(np.unique(np.linspace(0, len(ds) - 1, cfg.health_tiles).round().astype(np.int64)))
        )
        feats, health_s = {}, 0.0
        for role, entry in cold.report.models.items():
            fm = F.open_model(entry["path"])
            health_s += timed(F.health, fm, images)[1]
            cached = F.embed(fm, ds, idx, Path(cfg.output) / "cache", key, cfg.batch_size)
            feats[role] = F.represent(cached, cfg.probe.features)
        start = time.perf_counter()
        pc = cfg.probe
        probed = probe_models(cfg, feats, y, groups)  # folds, probes, statistics and comparisons, as the stage
        preds, cv = probed.predictions, probed.cv
        probes_s = time.perf_counter() - start
        _, pictures_s = timed(report.save_pictures, root / "pictures", y, feats, preds)
        # Side by side on the same resamples: balanced accuracy by scikit-learn (string labels, as before) and by
        # the confusion-matrix metric the stage uses.
        from sklearn.metrics import balanced_accuracy_score

        linear, y_test = preds["candidate"]["linear"], y
        members = [np.flatnonzero(groups == g) for g in probed.design.groups.names]
        samples = [
            np.concatenate([np.repeat(m, k) for m, k in zip(members, row, strict=True)]) for row in probed.design.counts
        ]
        sk = timed(lambda: [balanced_accuracy_score(y_test[s], linear.predicted[s]) for s in samples])
        cm = timed(lambda: [P.score(y_test, linear, P.balanced_accuracy, s) for s in samples])
        assert np.allclose(sk[0], cm[0]), "the two metrics disagree"
        boot_rows = {"scikit-learn": sk[1], "confusion matrix": cm[1]}

    models = len(feats)
    roles = "+".join(feats)  # candidate+baseline
    per10k = 10_000 / labelled
    cand = embedding["model.onnx (ONNX Runtime)"]
    rows = [
        {"measurement": "extract: `run_extract` (ONNX Runtime), every tile", **extract},
        *({"measurement": f"evaluate embedding: `features.embed`, {role}", **e} for role, e in embedding.items()),
        {"measurement": "labels: GeoJSON → tile labels (shapely)", "tiles": labelled, "seconds": labels_s},
        {
            "measurement": f"label-free health ({cfg.health_tiles} tiles × {models} models: {roles})",
            "tiles": labelled,
            "seconds": health_s,
        },
        {
            "measurement": f"probes: folds, kNN, linear (C sweep), few-shot, {pc.bootstrap} bootstraps ({roles})",
            "tiles": labelled,
            "seconds": probes_s,
        },
        {"measurement": f"pictures: confusion + embedding maps ({roles})", "tiles": labelled, "seconds": pictures_s},
        *(
            {
                "measurement": f"bootstrap of one metric, {pc.bootstrap} resamples: {how}",
                "tiles": labelled,
                "seconds": t,
            }
            for how, t in boot_rows.items()
        ),
        {"measurement": "`run_evaluate`, warm feature cache", "tiles": labelled, "seconds": warm_s},
        {"measurement": f"`run_evaluate`, cold ({roles} embedded)", "tiles": labelled, "seconds": cold_s},
    ]
    for row in rows:
        row["s_per_10k"] = row["seconds"] * 10_000 / row["tiles"]
    summary = {
        "labelled_tiles": labelled,
        "classes": counts,
        "test_slides": len(cv.test_groups),
        "folds": len(cv.folds),
        "test_tiles": labelled,
        "extract_tiles_per_s": extract["tiles_per_s"],
        "embedding_tiles_per_s": cand["tiles_per_s"],
        "embedding_over_extract": cand["tiles_per_s"] / extract["tiles_per_s"],
        "embedding_s_per_10k_per_model": 10_000 / cand["tiles_per_s"],
        "probes_s_per_10k": probes_s * per10k,
        "probes_s_per_10k_per_model": probes_s * per10k / models,
    }
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor(),
        "threads": torch.get_num_threads(),
        "preset": preset,
        "tile_size": args.tile_size,
        "stride": args.stride,
        "batch_size": args.batch_size,
        "arch": "vit_test",
        "export_seconds": round(export_s, 1),
    }
    (out / "evaluate.json").write_text(json.dumps({"environment": env, "summary": summary, "results": rows}, indent=2))
    print(
        f"\n## evaluate ({labelled} labelled tiles of {args.tile_size} px, {len(counts)} classes, vit_test, "
        f"batch {args.batch_size}, CPU {env['threads']} threads; {len(cv.folds)}-fold cross-validation: "
        f"{len(cv.test_groups)} test slide(s), {labelled} tiles)\n"
    )
    print("| measurement | tiles | s | tiles/s | s per 10,000 labelled tiles |\n|---|---:|---:|---:|---:|")
    for r in rows:
        rate = f"{r['tiles_per_s']:.1f}" if "tiles_per_s" in r else "–"
        print(f"| {r['measurement']} | {r['tiles']} | {r['seconds']:.2f} | {rate} | {r['s_per_10k']:.1f} |")
    print(
        f"\nembedding {summary['embedding_s_per_10k_per_model']:.1f} s vs probes "
        f"{summary['probes_s_per_10k_per_model']:.1f} s per 10,000 labelled tiles and model; evaluate embedding "
        f"÷ extract tiles/s = {summary['embedding_over_extract']:.2f}"
    )


if __name__ == "__main__":
    main()
