"""Downstream quality along a training run: every teacher-only eval checkpoint scored by kNN on a fixed labelled
subset, so a run whose probes peak before its loss stops falling can be cut at the peak.

    curve = knn_curve("runs/lab/pretrain", "tiles.zarr", "annotations/")
    curve.best       # the eval checkpoint with the highest kNN balanced accuracy (earliest on a tie)

The subset, split and kNN are the evaluate stage's (same labels, slide split, k and temperature); features are
cached per checkpoint hash under `<run>/eval/knn_cache/`, so a rerun after one more checkpoint scores one file.
When the run recorded a health probe (`<run>/health_probe.json`), each point also carries the label-free scores
training logged at that iteration — CLS effective rank and augmentation invariance on the same tiles and views,
by the same code (`train.label_free`), from the checkpoint file instead of the teacher in memory.
The curve is written to `<run>/eval/knn_curve.json` and `knn_curve.png` (and to MLflow by the caller's run).
`wsidino convert … select=best_knn` converts the best checkpoint instead of the latest.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.evaluate import classifiers as C
from dinov3_core.evaluate import features as F
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate.config import EvaluateError
from dinov3_core.evaluate.evaluation import labelled_tiles
from dinov3_core.evaluate.evaluation_json import write_json
from dinov3_core.gram.teacher import find_eval_checkpoints
from dinov3_core.models.released import unwrap_backbone_state_dict
from dinov3_core.tiling import store as ts
from dinov3_core.train import label_free as LF
from dinov3_core.train.health_probe import PROBE_FILE, read_probe

logger = logging.getLogger(__name__)

CURVE_FILE = "knn_curve.json"


@dataclass
class CurvePoint:
    iteration: int
    path: str
    knn_balanced_accuracy: float
    effective_rank: float | None = None  # the training health probe's scores (None: the run has no probe)
    invariance: float | None = None


@dataclass
class KnnCurve:
    points: list[CurvePoint]
    split: dict[str, Any]
    labelled_tiles: int
    warnings: list[str] = field(default_factory=list)

    @property
    def best(self) -> CurvePoint:
        return max(self.points, key=lambda p: (p.knn_balanced_accuracy, -p.iteration))

    def as_dict(self) -> dict[str, Any]:
        return {
            "points": [asdict(p) for p in self.points],
            "best": asdict(self.best),
            "split": self.split,
            "labelled_tiles": self.labelled_tiles,
            "warnings": self.warnings,
        }


def knn_curve(
    run_dir: str | Path,
    store: str | Path,
    annotations: str | Path,
    *,
    max_tiles_per_slide: int = 500,
    k: int = 20,
    temperature: float = 0.07,
    test_fraction: float = 0.34,
    seed: int = 0,
    batch_size: int = 64,
) -> KnnCurve:
    """Score every `<run>/eval/training_<it>/teacher_checkpoint.pth`; write the curve into `<run>/eval/`.

    Raises:
        EvaluateError: No eval checkpoint, or no labelled tile in the store.
    """
    run = Path(run_dir)
    checkpoints = find_eval_checkpoints(run)
    if not checkpoints:
        raise EvaluateError(f"{run}/eval has no training_<it>/teacher_checkpoint.pth to score; is it a training run?")
    root = ts.check_store(store)
    ds = TileDataset(root, image_format="numpy")
    warnings: list[str] = []
    idx, y, groups, _ = labelled_tiles(root, ds, str(annotations), warnings, max_tiles_per_slide=max_tiles_per_slide)
    if not len(idx):
        raise EvaluateError(f"no tile of {root} is labelled by {annotations}; the kNN curve needs annotations")
    split = P.split_by_group(y, groups, test_fraction=test_fraction, seed=seed)
    classes = np.unique(y)
    cache, key = run / "eval" / "knn_cache", F.selection_key(root, idx)
    points = []
    for c in checkpoints:
        model = F.open_model(c.path, backend="torch")
        x = F.represent(F.embed(model, ds, idx, cache, key, batch_size), "cls")
        scores = C.knn_scores(
            x[split.train], np.searchsorted(classes, y[split.train]), x[split.test], len(classes), k, temperature
        )
        acc = P.score(y[split.test], P.Predictions(classes, scores), P.balanced_accuracy)
        health = probe_scores(run, model) or {}
        points.append(CurvePoint(c.iteration, str(c.path), acc, health.get("effective_rank"), health.get("invariance")))
        logger.info("kNN curve: iteration %d → balanced accuracy %.4f %s", c.iteration, acc, health)
    curve = KnnCurve(points, split.as_dict(), len(idx), warnings)
    _write(run / "eval", curve)
    return curve


def best_knn_checkpoint(
    run_dir: str | Path, store: str | Path, annotations: str | Path
) -> tuple[Path, dict[str, torch.Tensor], int, KnnCurve]:
    """The teacher-only eval checkpoint of the run with the best kNN score: (its directory, backbone state dict,
    iteration, the whole curve)."""
    curve = knn_curve(run_dir, store, annotations)
    best = curve.best
    logger.info(
        "best_knn: iteration %d (kNN balanced accuracy %.4f) of %s",
        best.iteration,
        best.knn_balanced_accuracy,
        [p.iteration for p in curve.points],
    )
    obj = torch.load(best.path, map_location="cpu", weights_only=True)
    sd = {k: v.contiguous() for k, v in unwrap_backbone_state_dict(obj, source=best.path).items()}
    return Path(best.path).parent, sd, best.iteration, curve


def probe_scores(run_dir: str | Path, model: F.FeatureModel | str | Path) -> dict[str, float] | None:
    """The training health probe's `effective_rank` and `invariance` of a model (an eval checkpoint of the run, or
    any backbone file), on the run's recorded probe tiles and views; None when the run recorded no probe."""

    probe = read_probe(Path(run_dir) / PROBE_FILE)
    if probe is None:
        return None
    fm = model if isinstance(model, F.FeatureModel) else F.open_model(model, backend="torch")

    def embed(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(fm.run(np.ascontiguousarray(x.numpy()))[0])

    return LF.score_tiles(embed, probe.read, len(probe.tiles), probe.views)


def _write(eval_dir: Path, curve: KnnCurve) -> None:
    # deferred: matplotlib is slow to import, only for the figures
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_json(eval_dir / CURVE_FILE, curve.as_dict())
    fig, ax = plt.subplots(figsize=(5, 3))
    its = [p.iteration for p in curve.points]
    ax.plot(its, [p.knn_balanced_accuracy for p in curve.points], marker="o")
    ax.axvline(curve.best.iteration, color="grey", linestyle=":", label=f"best: {curve.best.iteration}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("kNN balanced accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(eval_dir / "knn_curve.png", dpi=110)
    plt.close(fig)


def read_curve(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / "eval" / CURVE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


__all__ = ["CURVE_FILE", "CurvePoint", "KnnCurve", "best_knn_checkpoint", "knn_curve", "probe_scores", "read_curve"]
