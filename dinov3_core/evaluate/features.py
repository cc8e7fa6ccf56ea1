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
from dinov3_core.inference.loader import TileReader, read_ahead
from dinov3_core.train.label_free import effective_rank

FEATURES = ("cls", "mean_patch")


def selection_key(store: Path, indices: np.ndarray, mpp: float | None = None) -> str:
    """Which tiles: the store's manifest content, the µm/px level read (None: the first) and the global indices."""
    h = hashlib.sha256()
    manifest = store / "manifest.json"
    if manifest.is_file():
        h.update(manifest.read_bytes())
    if mpp is not None:  # the first level keeps the key it had before stores had levels
        h.update(f"mpp={float(mpp)!r}".encode())
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


def tokens_key(key: str, tokens: np.ndarray | None) -> str:
    """The selection key of tiles `key` plus the patch tokens kept of each (`tokens`, (N, K), -1: none): a cache
    file holds the dense tokens exactly when its name says which, so a cache written before the dense probe (or
    for other tokens) is never read for them; it is recomputed instead."""
    if tokens is None:
        return key
    return f"{key}-d{hashlib.sha256(np.ascontiguousarray(tokens, np.int64).tobytes()).hexdigest()[:10]}"


def compute(
    model: FeatureModel,
    ds: Any,
    indices: np.ndarray,
    batch_size: int,
    loader_threads: int = 0,
    prefetch_batches: int = 2,
    progress: Callable[[int], None] | None = None,
    tokens: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """{"cls": (N, D), "mean_patch": (N, D)} float32 of the tiles `indices` of `ds` (a `TileDataset`), in order:
    `loader_threads` threads read and `prepare` up to `prefetch_batches` batches ahead of `model.infer`. With
    `tokens` (N, K) also "dense" (N, K, D): those patch tokens of each tile (zeros where -1), from the same pass."""
    batches = [indices[start : start + batch_size] for start in range(0, len(indices), batch_size)]
    parts: dict[str, list[np.ndarray]] = {"cls": [], "mean_patch": [], "dense": []}
    done = 0
    keep = tokens is not None
    for batch, prepared in read_ahead(batches, TileReader(ds, model.prepare), loader_threads, prefetch_batches):
        cls, mean, patch = model.infer(prepared, keep)  # type: ignore[misc]
        parts["cls"].append(cls)
        parts["mean_patch"].append(mean)
        if keep:
            assert patch is not None and tokens is not None
            pick = tokens[done : done + len(batch)]
            if pick.size and pick.max() >= patch.shape[1]:
                raise ValueError(f"token {pick.max()} asked of a model with {patch.shape[1]} patch tokens")
            dense = np.take_along_axis(patch, np.maximum(pick, 0)[..., None], axis=1)
            parts["dense"].append(np.where(pick[..., None] >= 0, dense, 0).astype(np.float32))
        done += len(batch)
        if progress is not None:
            progress(len(batch))
    if not batches:
        return {name: np.zeros((0, 0), np.float32) for name in FEATURES}
    return {k: np.concatenate(v) for k, v in parts.items() if v}


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as done:
        return {k: done[k] for k in (*FEATURES, "dense") if k in done.files}


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
    tokens: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """`compute`, from the cache when present (`cache_path`), else computed and cached; `precision`: the one the
    model was opened with; `key`: `tokens_key` of the tiles and `tokens` when dense tokens are asked for."""
    path = cache_path(cache, model, key, precision)
    if path.is_file():
        return load(path)
    out = compute(model, ds, indices, batch_size, loader_threads, prefetch_batches, progress, tokens)
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
        scores |= {
            "dense_effective_rank": dense["effective_rank"],
            "dense_agreement": dense["agreement"],
            "dense_score": dense["score"],
        }
    return scores


def stain_invariance(
    model: FeatureModel, tiles: np.ndarray, scale_sigma: float, shift_sigma: float, seed: int
) -> float:
    """Top-1 retrieval accuracy of stain-perturbed tiles among the originals (cosine on CLS): each uint8 tile
    (N, T, T, 3) is re-stained by `hed_jitter` (the training augmentation's stain step) with its own fixed scale
    U(1 ± `scale_sigma`) and shift U(± `shift_sigma`) from a generator seeded with `seed`, and counts as found
    when its original is the most similar of all originals. Label-free: 1.0 means the stain shift never moves
    a tile's feature closer to another tile than to itself. Ties (identical tiles) count as found, within float
    rounding, so a zero perturbation scores 1.0 exactly."""
    from dinov3_core.data.photometric import hed_jitter

    rng = np.random.default_rng(seed)
    n = len(tiles)
    scale = torch.from_numpy(rng.uniform(1 - scale_sigma, 1 + scale_sigma, (n, 3)).astype(np.float32))
    shift = torch.from_numpy(rng.uniform(-shift_sigma, shift_sigma, (n, 3)).astype(np.float32))
    rgb = torch.from_numpy(tiles.astype(np.float32) / 255.0).permute(0, 3, 1, 2)
    perturbed = (hed_jitter(rgb, scale, shift).permute(0, 2, 3, 1).numpy() * 255.0).astype(np.float32)
    # `normalise` scales by 1/255 again; a float input keeps the perturbation unquantised
    a = l2_normalise(model.run(normalise(perturbed))[0])
    b = l2_normalise(model.run(normalise(tiles))[0])
    sim = a @ b.T
    return float((np.diag(sim) >= sim.max(axis=1) - 1e-5).mean())


def l2_normalise(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


__all__ = [
    "FEATURES",
    "cache_path",
    "compute",
    "embed",
    "health",
    "load",
    "normalise",
    "open_model",
    "precision_of",
    "represent",
    "save",
    "selection_key",
    "stain_invariance",
    "tokens_key",
]
