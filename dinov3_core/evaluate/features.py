"""Tile features of one model for the evaluation, through the extract stage's code path, cached by model hash.

`open_model` and `normalise` are extract's: the same ONNX Runtime or PyTorch model, the same ImageNet
normalisation, the tile store's µm/px. Features of a (model hash, tile selection) pair are written once to
`<output>/cache/` (atomically), so a rerun or a second evaluation against the same champion recomputes nothing.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dinov3_core.export.extract import FeatureModel, normalise, open_model
from dinov3_core.files import atomic_path


def selection_key(store: Path, indices: np.ndarray) -> str:
    """Which tiles: the store's manifest content and the global indices."""
    h = hashlib.sha256()
    manifest = store / "manifest.json"
    if manifest.is_file():
        h.update(manifest.read_bytes())
    h.update(np.ascontiguousarray(indices, np.int64).tobytes())
    return h.hexdigest()[:16]


def embed(
    model: FeatureModel,
    read: Callable[[np.ndarray], np.ndarray],
    indices: np.ndarray,
    cache: Path,
    key: str,
    batch_size: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """{"cls": (N, D), "mean_patch": (N, D)} of the tiles `indices` (float32), from the cache when present."""
    path = cache / f"features-{model.hash}-{key}.npz"
    if path.is_file():
        with np.load(path) as done:
            return {k: done[k] for k in ("cls", "mean_patch")}
    cls_parts, mean_parts = [], []
    for start in range(0, len(indices), batch_size):
        batch = indices[start : start + batch_size]
        cls, patch = model.run(normalise(read(batch)))
        cls_parts.append(cls)
        mean_parts.append(patch.mean(axis=1))
        if progress is not None:
            progress(len(batch))
    out = {"cls": np.concatenate(cls_parts), "mean_patch": np.concatenate(mean_parts)}
    with atomic_path(path) as tmp:
        np.savez(tmp, **out)
    return out


def represent(features: dict[str, np.ndarray], which: str) -> np.ndarray:
    """What a tile is represented by in the probes: CLS, the mean patch token, or both concatenated."""
    if which == "cls+mean_patch":
        return np.concatenate([features["cls"], features["mean_patch"]], axis=1)
    return features[which]


def health(model: FeatureModel, images: np.ndarray) -> dict[str, float]:
    """Label-free health on normalised images (N, 3, S, S): effective rank of the CLS features (near 0: collapsed)
    and the gram stage's dense consistency (patch features agree under a flip + rotation), so a collapsed model
    is caught even where nobody annotated anything."""
    from dinov3_core.evaluate.label_free import effective_rank
    from dinov3_core.gram.teacher import dense_scores_of

    cls, patch = model.run(images)
    scores = {"cls_effective_rank": effective_rank(torch.from_numpy(cls))}
    side = math.isqrt(patch.shape[1])
    if side * side == patch.shape[1] and images.shape[-1] % side == 0:

        def tokens(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(model.run(np.ascontiguousarray(x.numpy()))[1])

        dense = dense_scores_of(tokens, torch.from_numpy(images), images.shape[-1] // side)
        scores |= {"dense_effective_rank": dense["effective_rank"], "dense_agreement": dense["agreement"],
                   "dense_score": dense["score"]}  # fmt: skip
    return scores


__all__ = ["embed", "health", "open_model", "represent", "selection_key"]
