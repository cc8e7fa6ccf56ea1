"""The evaluate stage as one plain function, `run_evaluate(cfg) -> EvaluateResult`.

    cfg = load_config(EvaluateConfig, None, {"store": "out/tiles.zarr", "candidate": "out/model/model.onnx",
                                              "output": "out/evaluation", "annotations": "slides/annotations"})
    result = run_evaluate(cfg)     # evaluation.json, pictures, the gate's decision (and the alias moved)

One run scores the candidate, the registry's champion and a baseline on the same labelled tiles, cross-validation
folds and draws (`probes`), adds label-free health for each (`features.health`), and lets the gate decide (`gate`).

The labelled tiles are embedded through extract's reader threads and model (`features.embed`); given an
`embed_job` (the stage runner's, when the launch asks for more than one process) a model's features are computed
by a torchrun job instead (`dinov3_core.evaluate.embed_job`), which leaves them in the same cache file: everything
after the embedding (probes, gate, promotion) runs once, here.
"""

from __future__ import annotations

import csv
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.evaluate import dense as D
from dinov3_core.evaluate import features as F
from dinov3_core.evaluate import gate as G
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate import report
from dinov3_core.evaluate.config import EvaluateConfig, EvaluateError
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.evaluate.labels import label_tiles
from dinov3_core.evaluate.models import (
    ModelUnderTest,
    baseline_model,
    candidate_model,
    champion_model,
    check_same_file,
)
from dinov3_core.evaluate.scoring import dense_probe, probe_models, site_predictability
from dinov3_core.files import write_text_atomic
from dinov3_core.launch import TorchrunFailed
from dinov3_core.progress import Phase, Progress
from dinov3_core.tiling import store as ts

logger = logging.getLogger(__name__)
# A step of minutes says it is alive at least this often (its loops' lines; each step also logs its start and end).
PROGRESS_EVERY_S = 10.0


def _phase(label: str) -> Phase:
    return Phase(f"evaluate: {label}", log=logger.info, every_s=PROGRESS_EVERY_S)


@dataclass
class EvaluateResult:
    output: Path
    report: EvaluationReport  # what evaluation.json holds
    decision: G.Decision
    table: str  # markdown
    seconds: float
    warnings: list[str] = field(default_factory=list)

    @property
    def champion_model(self) -> str | None:
        return self.report.champion_model


def _table(path: str | None, key: str) -> dict[str, str]:
    """slide_id → value from a two-column CSV with a header (patients, sites)."""
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise EvaluateError(f"{key}={p}: no such CSV; give a file with a header and the columns slide_id,<value>")
    with p.open(newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or len(rows[0]) < 2:
        raise EvaluateError(f"{p}: expected a header and rows of slide_id,<value> ({key})")
    return {r[0].strip(): r[1].strip() for r in rows[1:] if len(r) >= 2 and r[0].strip()}


Labelled = tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]


def labelled_tiles(
    root: Path,
    ds: Any,
    annotations: str | None,
    warnings: list[str],
    *,
    min_overlap: float = 0.0,
    exclude_classes: Sequence[str] = (),
    max_tiles_per_slide: int | None = None,
) -> Labelled:
    """(global tile indices, class labels, slide ids) of the labelled tiles, and the label report for the JSON;
    at most `max_tiles_per_slide` per slide, evenly spaced (deterministic)."""
    empty = (np.zeros(0, np.int64), np.zeros(0, object), np.zeros(0, object))
    if not annotations:
        return (*empty, {"annotations": None})

    found = label_tiles(root, annotations, min_overlap=min_overlap)
    warnings += found.warnings
    if found.missing:
        names = ", ".join(found.missing[:10])
        warnings.append(f"{len(found.missing)} slide(s) of the store have no annotations: {names}")
    if found.unknown:
        warnings.append(f"annotations name slides not in the store: {', '.join(found.unknown[:10])}")
    slide_index = {s: i for i, s in enumerate(ds.slide_ids)}
    idx, labels, slides = [], [], []
    per_slide: dict[str, dict[str, int]] = {}
    for slide_id, lab in sorted(found.slides.items()):
        keep = ~np.isin(lab.labels.astype(str), list(exclude_classes))
        rows, names = lab.rows[keep], lab.labels[keep].astype(str)
        if max_tiles_per_slide and len(rows) > max_tiles_per_slide:
            pick = np.unique(np.linspace(0, len(rows) - 1, max_tiles_per_slide).round().astype(np.int64))
            rows, names = rows[pick], names[pick]
        s = slide_index[slide_id]
        idx.append(np.array([ds.global_index(s, int(r)) for r in rows], np.int64))
        labels.append(names)
        slides.append(np.full(len(rows), slide_id, object))
        per_slide[slide_id] = {"kept": len(rows)}
    info = {**found.summary(), "kept_per_slide": per_slide}
    if not idx:
        return (*empty, info)
    return np.concatenate(idx), np.concatenate(labels), np.concatenate(slides), info


def _evenly(n: int, k: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(k, n)).round().astype(np.int64))


def _health_tiles(ds: Any, n: int) -> np.ndarray:
    """uint8 tiles evenly spaced over the store."""
    return ds.read_batch(_evenly(len(ds), n))


def _grid_side(fm: F.FeatureModel, image: np.ndarray) -> int | None:
    """The side of the model's square patch grid (None: not square), from one tile."""
    n = fm.run(image[None])[1].shape[1]
    side = math.isqrt(n)
    return side if side * side == n else None


# (opened model, its cache file, the labelled tiles' global indices): fills the cache file (a torchrun job)
EmbedJob = Callable[[F.FeatureModel, Path, np.ndarray], None]


def run_evaluate(cfg: EvaluateConfig, embed_job: EmbedJob | None = None) -> EvaluateResult:
    """Embed, probe and compare; write the outputs; decide and apply the promotion. Bad input raises a
    `WsidinoError` naming the file or key; a failed `embed_job` raises `TorchrunFailed`, whichever the model."""
    start = time.perf_counter()
    out, warnings = Path(cfg.output), []
    cache = out / "cache"
    root = ts.check_store(cfg.store)
    ds = TileDataset(root, image_format="numpy", mpp=cfg.mpp)  # a missing level: TileStoreError naming the levels
    candidate = candidate_model(cfg)
    if not candidate.path.is_file():
        raise EvaluateError(f"candidate={candidate.path}: no such model file; give a model.onnx or backbone.pth")
    models: list[ModelUnderTest] = [candidate]
    champion = champion_model(cfg, cache, warnings)
    same = champion is not None and champion.version is not None and champion.version == candidate.version
    if same and champion is not None and candidate.path.suffix == ".onnx":
        check_same_file(candidate, champion, cfg)
    if champion is not None and not same:
        models.append(champion)
    baseline = baseline_model(cfg, candidate, cache, warnings)
    if baseline is not None:
        models.append(baseline)

    with _phase("labelling tiles from the annotations"):
        idx, y, slides, label_info = labelled_tiles(
            root,
            ds,
            cfg.annotations,
            warnings,
            min_overlap=cfg.min_overlap,
            exclude_classes=cfg.exclude_classes,
            max_tiles_per_slide=cfg.max_tiles_per_slide,
        )
    groups = slides
    patients = _table(cfg.patients, "patients")
    if patients:
        unknown = sorted(set(slides) - set(patients))
        if unknown:
            raise EvaluateError(f"patients={cfg.patients} has no patient for slide(s) {', '.join(unknown[:10])}")
        groups = np.array([patients[s] for s in slides], object)
    tiles = _health_tiles(ds, cfg.health_tiles)
    images = F.normalise(tiles)
    stain_tiles = tiles[_evenly(len(tiles), cfg.stain.tiles)]
    want_dense = bool(len(idx) and cfg.probe.dense_tokens_per_tile and cfg.annotations)
    tokens_of: dict[int, D.DenseTokens | None] = {}  # patch-grid side → the labelled tokens (one labelling a grid)
    key = F.selection_key(root, idx, cfg.mpp)
    counts = dict(zip(*np.unique(y, return_counts=True), strict=True))
    evaluation = EvaluationReport(
        store=str(root),
        mpp=cfg.mpp if cfg.mpp is not None else (ds.slide_attrs(0).get("mpp_requested") if ds.slide_ids else None),
        labelled_tiles=len(idx),
        labels=label_info,
        classes={str(c): int(n) for c, n in counts.items()},
        candidate_is_champion=same,
        warnings=warnings,
    )
    feats: dict[str, np.ndarray] = {}
    dense: dict[str, tuple[D.DenseTokens, np.ndarray]] = {}
    for m in models:
        entry: dict[str, Any] = {**m.as_dict()}
        with _phase(f"{m.role} model: health, stain invariance, embedding") as phase:
            evaluation.models[m.role] = entry
            try:
                precision = F.precision_of(m.path, cfg.precision)
                fm = F.open_model(m.path, threads=cfg.num_threads, device=cfg.device, precision=precision)
                entry["hash"], entry["backend"] = fm.hash, fm.backend
                entry["health"] = F.health(fm, images)
                phase.tick("health done", always=True)
                s = cfg.stain
                entry["health"]["stain_invariance"] = F.stain_invariance(
                    fm, stain_tiles, s.scale_sigma, s.shift_sigma, s.seed
                )
                phase.tick("stain invariance done", always=True)
                if len(idx):
                    tokens = None
                    if want_dense:
                        side = _grid_side(fm, images[0])
                        if side is not None and side not in tokens_of:
                            found = D.dense_tokens(
                                root,
                                ds,
                                str(cfg.annotations),
                                idx,
                                side,
                                cfg.probe.dense_tokens_per_tile,
                                cfg.exclude_classes,
                            )
                            tokens_of[side] = found if (found.positions >= 0).any() else None
                        tokens = tokens_of.get(side) if side is not None else None
                    positions = tokens.positions if tokens is not None else None
                    mkey = F.tokens_key(key, positions)
                    path = F.cache_path(cache, fm, mkey, precision)
                    if embed_job is not None and not path.is_file():
                        if positions is None:
                            embed_job(fm, path, idx)
                        else:
                            embed_job(fm, path, idx, tokens=positions)
                    bar = Progress(
                        f"evaluate: embedding {m.role}",
                        unit="tile",
                        total=len(idx),
                        enabled=cfg.progress,
                        every_s=PROGRESS_EVERY_S,
                        log=logger.info,
                    )
                    with bar:
                        raw = F.embed(
                            fm,
                            ds,
                            idx,
                            cache,
                            mkey,
                            cfg.batch_size,
                            bar.update,
                            precision=precision,
                            loader_threads=cfg.loader_threads,
                            prefetch_batches=cfg.prefetch_batches,
                            tokens=positions,
                        )
                    feats[m.role] = F.represent(raw, cfg.probe.features)
                    if tokens is not None:
                        dense[m.role] = (tokens, raw["dense"])
            except Exception as err:
                if m.role == "candidate" or isinstance(err, TorchrunFailed):  # a job's failure is not the model's
                    raise
                entry["error"] = f"{type(err).__name__}: {str(err)[:500]}"
                warnings.append(f"{m.role} {m.path} could not be evaluated: {entry['error']}")
        logger.info("evaluate: %s embedded (%s)", m.role, m.description)

    dims = {role: x.shape[1] for role, x in feats.items()}
    if "champion" in dims and dims["champion"] != dims["candidate"]:
        warnings.append(
            f"the champion ({champion.description if champion else ''}) is another architecture (features of "
            f"{dims['champion']} vs {dims['candidate']} dimensions): both are probed on the same tiles and folds, "
            "so the comparison stands, but check that replacing it is intended"
        )
    predictions: dict[str, dict[str, P.Predictions]] = {}
    if len(idx):
        unit = "patient" if patients else "slide"
        with _phase(f"tile probes of {len(feats)} model(s) on {len(np.unique(groups))} {unit}s") as phase:
            probed = probe_models(cfg, feats, y, groups, unit, phase.tick, lambda w: phase.tick(w, always=True))
        cv, predictions = probed.cv, probed.predictions
        evaluation.split = {**cv.as_dict(), "by": unit, "seed": cfg.probe.seed}
        evaluation.evidence = {"unit": unit, "test_groups": len(cv.test_groups), "folds": len(cv.folds)}
        need = cfg.gate.required_test_slides()
        if len(cv.test_groups) < need:
            warnings.append(
                f"only {len(cv.test_groups)} annotated {unit}s ({', '.join(cv.test_groups)}): the gate's permutation "
                f"test cannot reach gate.alpha={cfg.gate.alpha} on fewer than {need} (its least p-value is "
                f"2^-{len(cv.test_groups)}), so nothing is promoted (unless gate.allow_point_estimate=true); "
                "annotate more slides"
            )
        for role in feats:
            evaluation.models[role]["probes"] = probed.probes[role]
        evaluation.comparisons = probed.comparisons
        if dense:
            with _phase(f"dense probe of {len(dense)} model(s)") as phase:
                dense_probe(cfg, dense, probed.design, cv, evaluation, lambda w: phase.tick(w, always=True))
        sites = _table(cfg.sites, "sites")
        if sites:
            with _phase("site predictability") as phase:
                evaluation.site_predictability = site_predictability(
                    cfg, feats, slides, sites, cv, warnings, lambda w: phase.tick(w, always=True)
                )
        names = {role: str(evaluation.models[role].get("description") or "") for role in feats}
        with _phase("pictures and QuPath predictions"):
            report.save_pictures(out, y, feats, predictions, names, slides)
            evaluation.qupath = report.qupath_predictions(
                out, ds, idx, y, predictions["candidate"]["linear"], label_info.get("colours")
            )
    with _phase("gate, evaluation.json and MLflow"):
        decision = G.decide(cfg, evaluation)
        cand_metrics = report.flat_metrics(evaluation.models["candidate"])
        decision = G.apply(cfg, decision, candidate.version, cand_metrics)
        evaluation.decision = decision.as_dict()
        evaluation.evidence = evaluation.decision["evidence"]  # the protocol's counts and what the gate made of them
        evaluation.champion_model = (
            str(candidate.path)
            if (decision.applied or same)
            else (str(champion.path) if champion is not None and champion.path.is_file() else None)
        )
        table = report.markdown(evaluation)
        write_text_atomic(out / "evaluation.json", evaluation.to_json())
        (out / "evaluation.md").write_text(table)
        report.log_mlflow(cfg, evaluation, out)
    return EvaluateResult(out, evaluation, decision, table, time.perf_counter() - start, warnings)


__all__ = ["EmbedJob", "EvaluateResult", "labelled_tiles", "run_evaluate"]
