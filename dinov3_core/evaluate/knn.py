"""Cosine kNN probes in batched torch: the cross-validated kNN over fold pairs and the few-shot kNN.

Cosine similarity by blocked matrix products, `torch.topk`, votes weighted by exp(sim / T) and normalised to sum to
1. Over cross-validation folds whose test sets partition the tiles (`knn_cv`), every pair of folds' similarities is
computed once and serves both folds (the training side of a fold is the others). Few-shot kNN: per fold one
similarity pass against the union of all drawn tiles, then a batched top-k per shot count over all draws at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dinov3_core.evaluate.torch_runtime import resolve_device

# Similarity blocks hold at most this many float32 values (256 MiB), whatever the cohort size.
_BLOCK_VALUES = 1 << 26


def _unit(x: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x, np.float32) if isinstance(x, np.ndarray) else x, device=device).float()
    return t / t.norm(dim=1, keepdim=True).clamp_min(1e-12)


def _votes(sim: torch.Tensor, idx: torch.Tensor, codes: torch.Tensor, n_classes: int, t: float) -> torch.Tensor:
    """(…, k) top similarities and their training positions → (…, K) normalised weighted votes."""
    scores = torch.zeros((*sim.shape[:-1], n_classes), dtype=torch.float32, device=sim.device)
    scores.scatter_add_(-1, codes[idx], torch.exp(sim / t))
    return scores / scores.sum(-1, keepdim=True).clamp_min(1e-12)


def knn_scores(
    train: np.ndarray,
    train_codes: np.ndarray,
    test: np.ndarray,
    n_classes: int,
    k: int,
    temperature: float,
    device: str | torch.device | None = "cpu",
) -> np.ndarray:
    """(N_test, K) class scores of a cosine kNN with exp(sim / T) weighted votes, normalised to sum to 1."""
    dev = resolve_device(device) if not isinstance(device, torch.device) else device
    a, b = _unit(test, dev), _unit(train, dev)
    codes = torch.as_tensor(np.asarray(train_codes, np.int64), device=dev)
    k = min(k, len(b))
    out = torch.zeros((len(a), n_classes), dtype=torch.float32, device=dev)
    step = max(1, _BLOCK_VALUES // max(1, len(b)))
    for start in range(0, len(a), step):  # bounded memory: step × N_train similarities at a time
        sim, idx = torch.topk(a[start : start + step] @ b.T, k, dim=1)
        out[start : start + step] = _votes(sim, idx, codes, n_classes, temperature)
    return out.cpu().numpy()


def _merge(vals: torch.Tensor, idx: torch.Tensor, sim: torch.Tensor, at: torch.Tensor) -> None:
    """Fold a block's candidates (similarities `sim`, training positions `at`) into the running top-k, in place
    (`vals`, `idx` may be views of the whole fold's)."""
    top, pos = torch.topk(torch.cat([vals, sim], 1), vals.shape[1], dim=1)
    idx.copy_(torch.gather(torch.cat([idx, at], 1), 1, pos))
    vals.copy_(top)


def knn_cv(
    x: np.ndarray,
    codes: np.ndarray,
    tests: Sequence[np.ndarray],
    n_classes: int,
    k: int,
    temperature: float,
    device: str | torch.device | None = "cpu",
) -> np.ndarray:
    """(N, K) pooled out-of-fold kNN scores of folds whose test sets `tests` partition the rows of `x` (each fold's
    training side is every other fold). Each pair of folds' similarities is computed once and serves both."""
    dev = resolve_device(device) if not isinstance(device, torch.device) else device
    u, y = _unit(x, dev), torch.as_tensor(np.asarray(codes, np.int64), device=dev)
    parts = [torch.as_tensor(np.asarray(t, np.int64), device=dev) for t in tests]
    if sum(len(p) for p in parts) != len(u) or len(torch.unique(torch.cat(parts))) != len(u):
        raise ValueError("knn_cv: the folds' test sets must partition the tiles (use knn_scores per fold otherwise)")
    kk = [min(k, len(u) - len(p)) for p in parts]  # a fold's k is capped by its own training side
    vals = [torch.full((len(p), n), -torch.inf, device=dev) for p, n in zip(parts, kk, strict=True)]
    idx = [torch.zeros((len(p), n), dtype=torch.int64, device=dev) for p, n in zip(parts, kk, strict=True)]
    for a, pa in enumerate(parts):
        for b in range(a + 1, len(parts)):
            pb = parts[b]
            if not len(pa) or not len(pb):
                continue
            xb = u[pb]
            step = max(1, _BLOCK_VALUES // len(pb))
            for start in range(0, len(pa), step):
                rows = pa[start : start + step]
                sim = u[rows] @ xb.T  # (rows of a) × (fold b): a's candidates among b, and b's among a
                top, at = torch.topk(sim, min(kk[a], len(pb)), dim=1)
                _merge(vals[a][start : start + step], idx[a][start : start + step], top, pb[at])
                top, at = torch.topk(sim.T, min(kk[b], len(rows)), dim=1)
                _merge(vals[b], idx[b], top, rows[at])
    out = torch.zeros((len(u), n_classes), dtype=torch.float32, device=dev)
    for p, v, i in zip(parts, vals, idx, strict=True):
        out[p] = _votes(v, i, y, n_classes, temperature)
    return out.cpu().numpy()


def knn_few_shot(
    x: np.ndarray,
    codes: np.ndarray,
    folds: Sequence[tuple[np.ndarray, np.ndarray]],
    picks: dict[int, list[list[np.ndarray]]],
    n_classes: int,
    k: int,
    temperature: float,
    device: str | torch.device | None = "cpu",
) -> dict[int, list[np.ndarray]]:
    """{shots: [draw: (N, K) pooled scores]} of the n-shot kNN: `folds` (train, test) row indices, `picks`
    {shots: [draw: [fold: positions within that fold's training rows]]}. Per fold one similarity pass against all
    its drawn tiles, then one top-k per shot count over every draw."""
    dev = resolve_device(device) if not isinstance(device, torch.device) else device
    u, y = _unit(x, dev), torch.as_tensor(np.asarray(codes, np.int64), device=dev)
    out = {n: [np.zeros((len(u), n_classes), np.float32) for _ in per_draw] for n, per_draw in picks.items()}
    for f, (train, test) in enumerate(folds):
        if not len(test) or not picks:
            continue
        chosen = {n: np.stack([np.asarray(train)[d[f]] for d in per_draw]) for n, per_draw in picks.items()}
        union, inverse = np.unique(np.concatenate([c.ravel() for c in chosen.values()]), return_inverse=True)
        test_t = torch.as_tensor(np.asarray(test, np.int64), device=dev)
        cols = u[torch.as_tensor(union, device=dev)]
        step = max(1, _BLOCK_VALUES // max(1, len(union) * 4))
        offset = 0
        where = {}
        for n, c in chosen.items():  # each draw's columns within the union
            where[n] = torch.as_tensor(inverse[offset : offset + c.size].reshape(c.shape), device=dev)
            offset += c.size
        for start in range(0, len(test_t), step):
            rows = test_t[start : start + step]
            sim = u[rows] @ cols.T
            for n, c in chosen.items():
                sub = sim[:, where[n]].permute(1, 0, 2)  # (draws, rows, shots × classes)
                top, at = torch.topk(sub, min(k, c.shape[1]), dim=2)
                train_pos = torch.as_tensor(c, device=dev).gather(1, at.reshape(len(c), -1)).reshape(at.shape)
                scores = _votes(top, train_pos, y, n_classes, temperature).cpu().numpy()
                for j in range(len(c)):
                    out[n][j][rows.cpu().numpy()] = scores[j]
    return out


__all__ = ["knn_cv", "knn_few_shot", "knn_scores"]
