"""The dense probe: patch tokens labelled by the annotation under their centre, and a linear probe on them.

A ViT turns a tile of T×T pixels into a side×side grid of patch tokens, flattened row-major (token k covers grid
row k // side, column k % side). A tile read at its store origin (x, y) covers `tile_size_level0` level-0 pixels a
side (the tile stage's µm/px and downsample are in that number), so token k's centre in level-0 slide coordinates
is (x + (col + ½)·step, y + (row + ½)·step) with step = tile_size_level0 / side.

A token takes the class of the one class union (`shapely.union_all` of that class's polygons, holes excluded) whose
interior holds its centre (`shapely.contains_xy`). It is left out when its centre is outside every annotation, in
two classes (ambiguous), or within half a token (step / 2) of any class's boundary (`shapely.dwithin`): a token on
an edge sees both sides, so its label would be a guess. Of the kept tokens of a tile at most
`probe.dense_tokens_per_tile` are used, evenly spaced over the grid (deterministic), which bounds the memory
(tiles × tokens × dimensions) and the probe's cost.

The probe is the tile probe's logistic regression (`classifiers.linear_probe_cv`, C swept on the same validation
slides, every fold and C in one batched solve) fitted on the tokens of each fold's training tiles and predicting
the tokens of its test tiles, so the folds, the slides kept apart and the statistics over test slides
(`statistics`) are the tile probe's; metrics: balanced accuracy and mIoU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import shapely

from dinov3_core.evaluate import classifiers as C
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate.geojson import read_geojson
from dinov3_core.evaluate.label_report import read_slide
from dinov3_core.evaluate.labels import _match_files
from dinov3_core.tiling import store as ts

DENSE_METRICS = ("balanced_accuracy", "miou")


def token_centres(origins: np.ndarray, tile_level0: float, side: int) -> np.ndarray:
    """(N, side², 2) level-0 (x, y) centres of the patch tokens of tiles at `origins` (N, 2), in token order."""
    step = tile_level0 / side
    offsets = (np.arange(side) + 0.5) * step
    rows, cols = np.meshgrid(offsets, offsets, indexing="ij")  # token k: row k // side, column k % side
    grid = np.stack([cols.ravel(), rows.ravel()], axis=1)
    return np.asarray(origins, np.float64)[:, None, :] + grid[None]


def class_unions(shapes: Sequence[tuple[str, shapely.Geometry]]) -> dict[str, Any]:
    """class → the union of its polygons (prepared: many points are tested against it), sorted by class."""
    names = sorted({name for name, _ in shapes})
    unions = {n: shapely.union_all([g for name, g in shapes if name == n]) for n in names}
    for u in unions.values():
        shapely.prepare(u)
    return unions


def token_classes(centres: np.ndarray, unions: dict[str, Any], margin: float) -> np.ndarray:
    """Class name of each centre (M, 2), "" where left out: in no class or in several, or within `margin` of a
    class boundary (the boundary test only for the centres still in, the costly part)."""
    out = np.full(len(centres), "", dtype=object)
    if not unions or not len(centres):
        return out
    x, y = centres[:, 0], centres[:, 1]
    hits = np.stack([shapely.contains_xy(u, x, y) for u in unions.values()])
    single = np.flatnonzero(hits.sum(axis=0) == 1)
    if not len(single):
        return out
    points = shapely.points(centres[single])
    near = np.zeros(len(single), dtype=bool)
    for u in unions.values():
        boundary = shapely.boundary(u)
        shapely.prepare(boundary)
        near |= shapely.dwithin(boundary, points, margin)
    keep = single[~near]
    out[keep] = np.array(list(unions), dtype=object)[hits[:, keep].argmax(axis=0)]
    return out


def pick_tokens(classes: np.ndarray, per_tile: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, P) token classes ("" left out) → (positions (N, K) int64, -1 padding; their classes (N, K), "" padding):
    at most K = `per_tile` kept tokens per tile, evenly spaced over the kept ones in grid order."""
    n = len(classes)
    pos = np.full((n, per_tile), -1, np.int64)
    lab = np.full((n, per_tile), "", dtype=object)
    for i in range(n):
        kept = np.flatnonzero(classes[i] != "")
        if len(kept) > per_tile:
            kept = kept[np.unique(np.linspace(0, len(kept) - 1, per_tile).round().astype(np.int64))]
        pos[i, : len(kept)], lab[i, : len(kept)] = kept, classes[i, kept]
    return pos, lab


@dataclass
class DenseTokens:
    """The tokens of the labelled tiles the dense probe uses, for one patch grid."""

    side: int
    positions: np.ndarray  # (N_tiles, K) token index in the tile's grid, -1: none
    labels: np.ndarray  # (N_tiles, K) class, "": none

    def counts(self) -> dict[str, Any]:
        kept = self.labels[self.positions >= 0]
        names, n = np.unique(kept.astype(str), return_counts=True)
        return {
            "tokens": len(kept),
            "tiles_with_tokens": int((self.positions >= 0).any(axis=1).sum()),
            "grid": f"{self.side}x{self.side}",
            "tokens_per_tile": int(self.positions.shape[1]),
            "classes": {str(c): int(k) for c, k in zip(names, n, strict=True)},
        }


def dense_tokens(
    root: Path, ds: Any, annotations: str, idx: np.ndarray, side: int, per_tile: int, exclude: Sequence[str] = ()
) -> DenseTokens:
    """The labelled tokens of the tiles `idx` (global indices of `ds`) for a side×side patch grid, from the GeoJSON
    folder `annotations` (a CSV of tile origins has no geometry: no tokens)."""
    positions = np.full((len(idx), per_tile), -1, np.int64)
    labels = np.full((len(idx), per_tile), "", dtype=object)
    folder = Path(annotations).expanduser()
    if not folder.is_dir() or not len(idx):
        return DenseTokens(side, positions, labels)
    files, _ = _match_files(folder, ts.complete_slide_ids(root))
    slide_of, row_of = ds.locate_many(idx)
    for s in np.unique(slide_of):
        slide_id = ds.slide_ids[s]
        if slide_id not in files:
            continue
        slide = read_slide(root, slide_id)
        at = np.flatnonzero(slide_of == s)
        centres = token_centres(slide.coords[row_of[at]], slide.tile, side)
        unions = class_unions(read_geojson(files[slide_id]).shapes)
        step = slide.tile / side
        classes = token_classes(centres.reshape(-1, 2), unions, step / 2).reshape(len(at), side * side)
        # excluded classes still make a token in two classes ambiguous (as they make a tile), then are dropped
        classes[np.isin(classes.astype(str), list(exclude))] = ""
        positions[at], labels[at] = pick_tokens(classes, per_tile)
    return DenseTokens(side, positions, labels)


# --------------------------------------------------------------------------------------------------- the probe


def miou(y: np.ndarray, pred: np.ndarray, n: int, _: np.ndarray | None = None) -> float:
    """Mean intersection over union of the classes present in `y` or `pred`, from the pooled confusion matrix:
    IoU_c = TP / (TP + FP + FN)."""
    cm = np.bincount(y * n + pred, minlength=n * n).reshape(n, n)
    union = cm.sum(0) + cm.sum(1) - np.diag(cm)
    present = union > 0
    return float((np.diag(cm)[present] / union[present]).mean())


METRICS: dict[str, P.Metric] = {"balanced_accuracy": P.balanced_accuracy, "miou": miou}


@dataclass
class DenseSet:
    """The tokens of one model as probe samples: features, classes, and the labelled tile each comes from."""

    x: np.ndarray  # (M, D)
    y: np.ndarray  # (M,) class names
    tile: np.ndarray  # (M,) position of the token's tile among the labelled tiles (the tile probe's rows)


def dense_set(tokens: DenseTokens, features: np.ndarray) -> DenseSet:
    """Flatten `features` (N_tiles, K, D) of `tokens.positions` into the kept tokens."""
    tile, slot = np.nonzero(tokens.positions >= 0)
    return DenseSet(features[tile, slot].astype(np.float32), tokens.labels[tile, slot].astype(str), tile)


def _folds(cv: P.CrossValidation, tile: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The tile folds as token folds: (train, validation positions within train, test) token indices."""
    out = []
    for f in cv.folds:
        train, test = np.flatnonzero(np.isin(tile, f.train)), np.flatnonzero(np.isin(tile, f.test))
        val = np.flatnonzero(np.isin(tile[train], f.val))
        out.append((train, val, test))
    return out


def predict(
    d: DenseSet, cv: P.CrossValidation, cs: Sequence[float], device: str | None = None
) -> tuple[P.Predictions, list[float]]:
    """Pooled out-of-fold predictions of the linear probe on the tokens, and the C each fold chose."""
    classes = np.unique(d.y)
    codes = np.searchsorted(classes, d.y)
    scores = np.zeros((len(d.y), len(classes)), np.float64)
    fit = []
    for train, val, test in _folds(cv, d.tile):
        if not len(test):
            continue
        if len(np.unique(d.y[train])) < 2:  # nothing to separate: the tokens are predicted as the one class
            scores[np.ix_(test, np.searchsorted(classes, np.unique(d.y[train])))] = 1.0
            continue
        fit.append(C.Fold(train, val, test))
    chosen: list[float] = []
    if fit:
        proba, chosen = C.linear_probe_cv(d.x, codes, len(classes), fit, cs, device)
        for f in fit:
            scores[f.test] = proba[f.test]
    return P.Predictions(classes, scores), chosen


__all__ = [
    "DENSE_METRICS",
    "DenseSet",
    "DenseTokens",
    "class_unions",
    "dense_set",
    "dense_tokens",
    "miou",
    "pick_tokens",
    "predict",
    "token_centres",
    "token_classes",
]
