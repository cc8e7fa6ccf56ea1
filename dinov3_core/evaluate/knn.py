"""Cosine kNN probes in batched torch: the cross-validated kNN over fold pairs and the few-shot kNN.

Cosine similarity by blocked matrix products, `torch.topk`, votes weighted by exp(sim / T) and normalised to sum to
1. Over cross-validation folds whose test sets partition the tiles (`knn_cv`), every pair of folds' similarities is
computed once and serves both folds (the training side of a fold is the others). Few-shot kNN: per fold one
similarity pass against the union of all drawn tiles, then a batched top-k per shot count over all draws at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dinov3_core.evaluate.torch_runtime import resolve_device

# Similarity blocks hold at most this many float32 values (256 MiB), whatever the cohort size.
_BLOCK_VALUES = 1 << 26
# knn_cv's re-ranking gathers at most this many float32 values at a time (16 MiB).
_GATHER_VALUES = 1 << 22
# knn_cv screens in bfloat16 and keeps this many times k candidates per row for the exact re-ranking.
_SCREEN = 2
# How far a bfloat16 screened cosine similarity of unit vectors may be from the float32 one before knn_cv searches
# that row again in float32: the output's rounding (half a unit in the last place below 1, 2⁻⁹) plus as much again
# for the inputs' rounding (whose error is a sum of D independent terms, typically far smaller). Not a worst-case
# bound (2⁻⁷ + 2⁻⁹ would be, and would send most rows to the float32 search); tested on the sample cohort and the
# synthetic lab-scale set.
_SCREEN_ERROR = 2.0**-8


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


def _exact_topk(u: torch.Tensor, rows: torch.Tensor, train: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float32 top-k of `rows` among the rows `train` of `u` (blocked): (values, positions in `u`)."""
    vals = torch.full((len(rows), k), -torch.inf, device=u.device)
    idx = torch.zeros((len(rows), k), dtype=torch.int64, device=u.device)
    step = max(1, _BLOCK_VALUES // max(1, len(train)))
    for start in range(0, len(train), step):
        cols = train[start : start + step]
        top, at = torch.topk(u[rows] @ u[cols].T, min(k, len(cols)), dim=1)
        _merge(vals, idx, top, cols[at])
    return vals, idx


def _rerank(
    u: torch.Tensor, rows: torch.Tensor, cand: torch.Tensor, floor: torch.Tensor, k: int, train: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of `rows` from their screened candidates `cand` (positions in `u`): float32 similarities of the
    candidates, then the top k. `floor` is each row's lowest screened similarity kept (-inf when every training row
    is a candidate): a row whose exact k-th similarity is not clear of it by `_SCREEN_ERROR` may have lost a
    neighbour to the bf16 rounding, and is searched exactly over `train` (its whole training side)."""
    vals = torch.empty((len(rows), k), device=u.device)
    idx = torch.empty((len(rows), k), dtype=torch.int64, device=u.device)
    # The gathered candidates are rows × k' × D values: small blocks, which the allocator reuses (a fresh large one
    # costs its page faults on every block).
    step = max(1, _GATHER_VALUES // max(1, cand.shape[1] * u.shape[1]))
    for start in range(0, len(rows), step):
        r, c = rows[start : start + step], cand[start : start + step]
        sim = torch.bmm(u[c], u[r][:, :, None])[..., 0]
        top, at = torch.topk(sim, k, dim=1)
        vals[start : start + step], idx[start : start + step] = top, torch.gather(c, 1, at)
    unsure = torch.nonzero(vals[:, -1] <= floor + _SCREEN_ERROR)[:, 0]
    if len(unsure) and train is not None:
        vals[unsure], idx[unsure] = _exact_topk(u, rows[unsure], train, k)
    return vals, idx


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
    training side is every other fold), from `knn_cv_neighbours`."""
    dev = resolve_device(device) if not isinstance(device, torch.device) else device
    y = torch.as_tensor(np.asarray(codes, np.int64), device=dev)
    out = torch.zeros((len(x), n_classes), dtype=torch.float32, device=dev)
    for t, (sim, at) in zip(tests, knn_cv_neighbours(x, tests, k, dev), strict=True):
        if sim.shape[1]:
            out[torch.as_tensor(np.asarray(t, np.int64), device=dev)] = _votes(sim, at, y, n_classes, temperature)
    return out.cpu().numpy()


def knn_cv_neighbours(
    x: np.ndarray, tests: Sequence[np.ndarray], k: int, device: str | torch.device | None = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per fold of `tests` (test sets partitioning the rows of `x`), its test rows' k nearest training rows by cosine
    similarity: (similarities, row indices), both (N_test, k), best first. Each pair of folds' similarities is
    computed once and serves both.

    The pairs are screened in bfloat16 (half the memory traffic, and on CPUs with bf16 instructions several times the
    float32 matrix-product rate): each row keeps its `_SCREEN` × k best screened candidates, which are then re-ranked
    by exact float32 similarities, so the neighbours and similarities are the float32 ones. A row whose k-th exact
    similarity is within `_SCREEN_ERROR` of its last screened candidate is searched again in float32."""
    dev = resolve_device(device) if not isinstance(device, torch.device) else device
    u = _unit(x, dev)
    ub = u.bfloat16()
    parts = [torch.as_tensor(np.asarray(t, np.int64), device=dev) for t in tests]
    if sum(len(p) for p in parts) != len(u) or len(torch.unique(torch.cat(parts))) != len(u):
        raise ValueError("knn_cv: the folds' test sets must partition the tiles (use knn_scores per fold otherwise)")
    kk = [min(k, len(u) - len(p)) for p in parts]  # a fold's k is capped by its own training side
    ks = [min(_SCREEN * n, len(u) - len(p)) for p, n in zip(parts, kk, strict=True)]  # screened candidates
    vals = [
        torch.full((len(p), n), -torch.inf, dtype=torch.bfloat16, device=dev) for p, n in zip(parts, ks, strict=True)
    ]
    idx = [torch.zeros((len(p), n), dtype=torch.int64, device=dev) for p, n in zip(parts, ks, strict=True)]
    # one similarity buffer for every block (a fresh one per block costs its page faults each time)
    buf = torch.empty(_BLOCK_VALUES, dtype=torch.bfloat16, device=dev)
    for a, pa in enumerate(parts):
        for b in range(a + 1, len(parts)):
            pb = parts[b]
            if not len(pa) or not len(pb):
                continue
            xb = ub[pb]
            step = max(1, _BLOCK_VALUES // len(pb))
            for start in range(0, len(pa), step):
                rows = pa[start : start + step]
                sim = buf[: len(rows) * len(pb)].view(len(rows), len(pb))
                torch.mm(ub[rows], xb.T, out=sim)  # (rows of a) × (fold b): a's candidates among b, and b's among a
                top, at = torch.topk(sim, min(ks[a], len(pb)), dim=1)
                _merge(vals[a][start : start + step], idx[a][start : start + step], top, pb[at])
                top, at = torch.topk(sim.T, min(ks[b], len(rows)), dim=1)
                _merge(vals[b], idx[b], top, rows[at])
    everyone, out = torch.arange(len(u), device=dev), []
    for p, v, i, n, m in zip(parts, vals, idx, kk, ks, strict=True):
        if not len(p) or not n:
            out.append((torch.zeros((len(p), 0), device=dev), torch.zeros((len(p), 0), dtype=torch.int64, device=dev)))
            continue
        truncated = m < len(u) - len(p)  # else every training row is a candidate: the re-ranking is exact
        floor = v[:, -1].float() if truncated else torch.full((len(p),), -torch.inf, device=dev)
        train = everyone[~torch.isin(everyone, p)] if truncated else None
        out.append(_rerank(u, p, i, floor, n, train))
    return out


def knn_few_shot(
    x: np.ndarray,
    codes: np.ndarray,
    folds: Sequence[tuple[np.ndarray, np.ndarray]],
    picks: dict[int, list[list[np.ndarray]]],
    n_classes: int,
    k: int,
    temperature: float,
    device: str | torch.device | None = "cpu",
    tick: Callable[[str], None] | None = None,
) -> dict[int, list[np.ndarray]]:
    """{shots: [draw: (N, K) pooled scores]} of the n-shot kNN: `folds` (train, test) row indices, `picks`
    {shots: [draw: [fold: positions within that fold's training rows]]}. Per fold one similarity pass against all
    its drawn tiles, then one top-k per shot count over every draw; `tick(what)` as each fold is done."""
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
        if tick is not None:
            tick(f"few-shot kNN fold {f + 1}/{len(folds)}")
    return out


__all__ = ["knn_cv", "knn_cv_neighbours", "knn_few_shot", "knn_scores"]
