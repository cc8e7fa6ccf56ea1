"""Tile features of one model for the evaluation, through the extract stage's code path, cached by model hash.

`open_model`, `normalise` and the loop are extract's: the same ONNX Runtime or PyTorch model, the same ImageNet
normalisation, the tile store's µm/px, and the same reader threads (`TileReader` + `read_ahead`) preparing the next
batches while the model runs `infer` (on CUDA: uint8 tiles pinned, normalised on the GPU), so evaluate scales
the way extract does. On the CPU the features are bit-identical to the serial `model.run(normalise(tiles))`.
Features of a (model hash, precision, tile selection) triple are written once to `<output>/cache/` (atomically),
so a rerun or a second evaluation against the same champion recomputes nothing, and a bf16 embedding never passes
for fp32. With several processes the same `compute` runs on every rank of a torchrun job
(`dinov3_core.evaluate.embed_job`), each on its share of the tiles, and rank 0 writes the same cache file.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dinov3_core.files import atomic_path
from dinov3_core.gram.teacher import dense_scores_of
from dinov3_core.inference.feature_model import FeatureModel, normalise, open_model
from dinov3_core.inference.label_free import effective_rank
from dinov3_core.inference.loader import TileReader, read_ahead

FEATURES = ("cls", "mean_patch")


def selection_key(store: Path, indices: np.ndarray) -> str:
    """Which tiles: the store's manifest content and the global indices."""
    h = hashlib.sha256()
    manifest = store / "manifest.json"
    if manifest.is_file():
        h.update(manifest.read_bytes())
    h.update(np.ascontiguousarray(indices, np.int64).tobytes())
    return h.hexdigest()[:16]


def precision_of(model: str | Path, precision: str) -> str:
    """The precision `model` runs at: `precision` for a PyTorch backbone (autocast), fp32 for an ONNX model, which
    runs as exported (its precision is in its file, hence in its hash)."""
    return "fp32" if Path(model).suffix == ".onnx" else precision


def cache_path(cache: Path, model: FeatureModel, key: str, precision: str = "fp32") -> Path:
    """The cache file of `model`'s features of selection `key`; a reduced precision is part of the name."""
    tag = model.hash if precision == "fp32" else f"{model.hash}-{precision}"
    return cache / f"features-{tag}-{key}.npz"


def compute(
    model: FeatureModel,
    ds: Any,
    indices: np.ndarray,
    batch_size: int,
    loader_threads: int = 0,
    prefetch_batches: int = 2,
    progress: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """{"cls": (N, D), "mean_patch": (N, D)} float32 of the tiles `indices` of `ds` (a `TileDataset`), in order:
    `loader_threads` threads read and `prepare` up to `prefetch_batches` batches ahead of `model.infer`."""
    batches = [indices[start : start + batch_size] for start in range(0, len(indices), batch_size)]
    cls_parts, mean_parts = [], []
    for batch, prepared in read_ahead(batches, TileReader(ds, model.prepare), loader_threads, prefetch_batches):
        cls, mean, _ = model.infer(prepared, False)  # type: ignore[misc]
        cls_parts.append(cls)
        mean_parts.append(mean)
        if progress is not None:
            progress(len(batch))
    if not batches:
        return {name: np.zeros((0, 0), np.float32) for name in FEATURES}
    return {"cls": np.concatenate(cls_parts), "mean_patch": np.concatenate(mean_parts)}


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as done:
        return {k: done[k] for k in FEATURES}


def save(path: Path, features: dict[str, np.ndarray]) -> None:
    """Atomically: a file under the final name is always complete."""
    with atomic_path(path) as tmp:
        np.savez(tmp, **features)


def embed(
    model: FeatureModel,
    ds: Any,
    indices: np.ndarray,
    cache: Path,
    key: str,
    batch_size: int,
    progress: Callable[[int], None] | None = None,
    *,
    precision: str = "fp32",
    loader_threads: int = 0,
    prefetch_batches: int = 2,
) -> dict[str, np.ndarray]:
    """`compute`, from the cache when present (`cache_path`), else computed and cached; `precision`: the one the
    model was opened with."""
    path = cache_path(cache, model, key, precision)
    if path.is_file():
        return load(path)
    out = compute(model, ds, indices, batch_size, loader_threads, prefetch_batches, progress)
    save(path, out)
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


__all__ = ["FEATURES", "cache_path", "compute", "embed", "health", "load", "normalise", "open_model", "precision_of",
           "represent", "save", "selection_key"]  # fmt: skip
