"""The L2 logistic-regression linear probe in batched torch: every fold × C solved at once by a batched L-BFGS.

scikit-learn's objective exactly, `C · Σ log-loss + ½‖W‖²` with an unpenalised intercept, on features standardised
by the fitted tiles' mean and std (ddof 0, std 0 → 1, as `StandardScaler`), multinomial softmax over the classes
present in the fitted tiles. scikit-learn fits two classes with one logit; a 2-class softmax with C/2 has the same
minimiser (the penalty splits the logit difference evenly over two columns), so one code path serves both. Every
(fold, C) problem is solved at once by a batched L-BFGS (one matrix product for all of them per step), each to a
gradient tolerance ten times tighter than scikit-learn's default (at its default, 1e-4, both solvers stop at different
points short of the optimum and their balanced accuracies drift apart on the sample cohort). C is chosen as before:
balanced accuracy on the validation tiles, ties to the smaller C, then a refit on all the fold's training tiles
(warm-started); the middle C when no validation is possible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dinov3_core.evaluate import newton
from dinov3_core.evaluate.torch_runtime import resolve_device, torch_threads

# Below this many feature values the linear probe works in float64 (the per-step overhead dominates); above, in
# float32 matrix products (half the memory, twice the speed). Either way every fold × C is one batched solve over
# all the rows, fold membership as 0/1 row weights, so each step streams the feature matrix once for every fold.
_SMALL = 1 << 22
# Rows per block where a float64 copy of the feature matrix would otherwise be made (statistics).
_ROWS = 8192


def balanced_accuracy(y: np.ndarray, pred: np.ndarray, n: int) -> float:
    """Mean recall over the classes present in `y` (codes), as scikit-learn's `balanced_accuracy_score`."""
    cm = np.bincount(y * n + pred, minlength=n * n).reshape(n, n)
    support = cm.sum(1)
    present = support > 0
    return float((np.diag(cm)[present] / support[present]).mean())


@dataclass
class _Problems:
    """G independent logistic regressions on the rows of one feature matrix: which rows each fits (weights 0/1),
    its C, its classes, and the standardisation of its rows (the optimiser works in standardised coordinates)."""

    x: torch.Tensor  # (N, D), centred on the mean of all rows (keeps the per-problem centring well conditioned)
    y: torch.Tensor  # (N,) codes
    member: torch.Tensor  # (G, N) float64 0/1
    c: torch.Tensor  # (G,) effective C (C / 2 for two classes: see the module docstring)
    present: torch.Tensor  # (G, K) bool
    mu: torch.Tensor  # (G, D) float64
    sd: torch.Tensor  # (G, D) float64

    @classmethod
    def build(cls, x: torch.Tensor, y: torch.Tensor, member: torch.Tensor, c: torch.Tensor, k: int) -> _Problems:
        n = member.sum(1, keepdim=True)
        s1 = torch.zeros((len(member), x.shape[1]), dtype=torch.float64, device=x.device)
        s2 = torch.zeros_like(s1)
        for start in range(0, len(x), _ROWS):  # float64 sums a block of rows at a time
            xd, m = x[start : start + _ROWS].double(), member[:, start : start + _ROWS]
            s1 += m @ xd
            s2 += m @ xd.square()
        mu = s1 / n
        var = s2 / n - mu.square()  # ddof 0, as StandardScaler
        sd = var.clamp_min(0).sqrt()
        sd = torch.where(sd < 10 * torch.finfo(torch.float64).eps * mu.abs().clamp_min(1), torch.ones_like(sd), sd)
        onehot = torch.nn.functional.one_hot(y, k).double()
        present = (member @ onehot) > 0
        c = torch.where(present.sum(1) == 2, c / 2, c)
        return cls(x, y, member, c, present, mu, sd)

    def objective(self, theta: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean-scaled objective (1/n)(Σ log-loss) + ‖W‖² / (2 C n) and its gradient, for the problems `g` at
        `theta` (len(g), (D + 1)·K): scikit-learn's, divided by C·n, so its gradient tolerance means the same."""
        d, k = self.x.shape[1], self.present.shape[1]
        w, b = theta[:, : d * k].reshape(-1, d, k), theta[:, d * k :]
        mu, sd, member = self.mu[g], self.sd[g], self.member[g]
        n = member.sum(1)
        weff = w / sd[:, :, None]
        beff = b - torch.einsum("gd,gdk->gk", mu, weff)
        z = (self.x @ weff.permute(1, 0, 2).reshape(d, -1).to(self.x.dtype)).double().reshape(-1, len(g), k)
        z = (z + beff).masked_fill(~self.present[g], -1e30)  # classes absent from a problem's rows: no column
        logp = torch.log_softmax(z, -1)
        yy = self.y[:, None, None].expand(-1, len(g), 1)
        nll = -(logp.gather(2, yy)[..., 0] * member.T).sum(0)
        loss = nll / n + (w.square().sum((1, 2))) / (2 * self.c[g] * n)
        r = logp.exp()
        r.scatter_add_(2, yy, -torch.ones_like(r[..., :1]))
        r *= (member.T / n)[:, :, None]
        a = (self.x.T @ r.reshape(len(self.x), -1).to(self.x.dtype)).double().reshape(d, len(g), k).permute(1, 0, 2)
        rs = r.sum(0)
        gw = (a - mu[:, :, None] * rs[:, None, :]) / sd[:, :, None] + w / (self.c[g] * n)[:, None, None]
        return loss, torch.cat([gw.reshape(len(g), -1), rs], 1)

    def logits(self, theta: torch.Tensor, g: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(len(rows), len(g), K) logits of the problems `g` at `theta` on `rows` (absent classes: -inf)."""
        d, k = self.x.shape[1], self.present.shape[1]
        w, b = theta[:, : d * k].reshape(-1, d, k), theta[:, d * k :]
        weff = w / self.sd[g][:, :, None]
        beff = b - torch.einsum("gd,gdk->gk", self.mu[g], weff)
        z = self.x[rows] @ weff.permute(1, 0, 2).reshape(d, -1).to(self.x.dtype)
        return (z.double().reshape(len(rows), -1, k) + beff).masked_fill(~self.present[g], -torch.inf)


def lbfgs(
    fg: _Problems, theta: torch.Tensor, tol: float = 1e-5, max_iter: int = 2000, memory: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise every problem of `fg` from `theta` (G, P) by L-BFGS with Armijo backtracking (the objectives are
    strictly convex, so every step's curvature is positive). A problem stops when its gradient's largest entry is
    below `tol`, or when a step no longer lowers its objective beyond float64 rounding. (theta, iterations)."""
    g_all = torch.arange(len(theta), device=theta.device)
    f, g = fg.objective(theta, g_all)
    active = g.abs().amax(1) > tol
    s_hist = torch.zeros((len(theta), memory, theta.shape[1]), dtype=theta.dtype, device=theta.device)
    y_hist, rho = torch.zeros_like(s_hist), torch.zeros((len(theta), memory), dtype=theta.dtype, device=theta.device)
    iters = torch.zeros(len(theta), dtype=torch.int64)
    for it in range(max_iter):
        act = torch.nonzero(active)[:, 0]
        if not len(act):
            break
        q, order = g[act].clone(), [(it - 1 - j) % memory for j in range(min(it, memory))]  # newest first
        alpha = []
        for j in order:
            a = rho[act, j] * (s_hist[act, j] * q).sum(1)
            q -= a[:, None] * y_hist[act, j]
            alpha.append(a)
        if order:  # initial Hessian s·y / y·y of the newest pair (rho = 1 / s·y, 0 when it was skipped)
            r, yy = rho[act, order[0]], (y_hist[act, order[0]].square()).sum(1)
            gamma = torch.where(r > 0, 1 / (r * yy).clamp_min(1e-300), torch.ones_like(r))
        else:
            gamma = 1 / g[act].abs().amax(1).clamp_min(1.0)  # a cautious first step
        q *= gamma[:, None]
        for j, a in zip(reversed(order), reversed(alpha), strict=True):
            beta = rho[act, j] * (y_hist[act, j] * q).sum(1)
            q += s_hist[act, j] * (a - beta)[:, None]
        d = -q
        slope = (g[act] * d).sum(1)
        uphill = slope >= 0
        d[uphill], slope[uphill] = -g[act][uphill], -(g[act][uphill].square()).sum(1)
        t = torch.ones(len(act), dtype=theta.dtype, device=theta.device)
        todo = torch.arange(len(act), device=theta.device)
        new_f, new_g = f[act].clone(), g[act].clone()
        done = torch.zeros(len(act), dtype=torch.bool, device=theta.device)
        for _ in range(40):  # backtracking: halve the step of the problems whose objective did not fall enough
            fn, gn = fg.objective(theta[act[todo]] + t[todo, None] * d[todo], act[todo])
            ok = fn <= f[act[todo]] + 1e-4 * t[todo] * slope[todo]
            new_f[todo[ok]], new_g[todo[ok]], done[todo[ok]] = fn[ok], gn[ok], True
            todo = todo[~ok]
            if not len(todo):
                break
            t[todo] *= 0.5
        step = t[:, None] * d
        step[~done] = 0
        slot = it % memory
        s, yv = step, new_g - g[act]
        sy = (s * yv).sum(1)
        s_hist[act, slot], y_hist[act, slot] = s, yv
        rho[act, slot] = torch.where(sy > 1e-300, 1 / sy.clamp_min(1e-300), torch.zeros_like(sy))
        stalled = ~done | ((f[act] - new_f) <= 64 * torch.finfo(torch.float64).eps * new_f.abs().clamp_min(1))
        theta[act] += step
        f[act], g[act] = torch.where(done, new_f, f[act]), torch.where(done[:, None], new_g, g[act])
        iters[act.cpu()] += 1
        active[act] = (g[act].abs().amax(1) > tol) & ~stalled
    return theta, iters


@dataclass
class Fold:
    """One fold of the linear probe: row indices of its training and test tiles, and the validation tiles as
    positions within the training ones (where C is chosen)."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


def linear_probe_cv(
    x: np.ndarray,
    codes: np.ndarray,
    n_classes: int,
    folds: Sequence[Fold],
    cs: Sequence[float],
    device: str | torch.device | None = "cpu",
    tol: float = 1e-5,
    tick: Callable[[str], None] | None = None,
) -> tuple[np.ndarray, list[float]]:
    """(N, K) float64 test-tile probabilities of every fold pooled (rows of no fold's test: 0), and the C each fold
    chose. Every fold's training side needs two classes (the caller decides what a one-class fold predicts).
    `tick(what)`: called as each fold of the fold-by-fold path is done (progress of a long probe)."""
    dev = resolve_device(device) if not isinstance(device, torch.device) else device
    if newton.fits_newton(x.shape[1], n_classes):  # narrow features: a few exact Newton steps per C (newton.py)
        return _fit_newton(x, codes, n_classes, folds, [float(c) for c in cs], dev, tick)
    small = x.size * max(1, len(folds)) <= _SMALL
    xt = torch.as_tensor(np.asarray(x, np.float64 if small else np.float32), device=dev)
    xt = xt - _column_mean(xt).to(xt.dtype)  # a copy: `x` may share its memory
    y = torch.as_tensor(np.asarray(codes, np.int64), device=dev)
    scores = np.zeros((len(x), n_classes), np.float64)
    # Small problems run thousands of tiny ops: one thread, since waking the others (busy on a shared machine) costs
    # more than the op itself.
    with torch_threads(1 if small and dev.type == "cpu" else 0):
        picked = _fit_group(xt, y, n_classes, list(folds), [float(c) for c in cs], tol)
    for f, (proba, _) in zip(folds, picked, strict=True):
        scores[f.test] = proba
    return scores, [c for _, c in picked]


def _fit_newton(
    x: np.ndarray,
    codes: np.ndarray,
    k: int,
    folds: Sequence[Fold],
    cs: list[float],
    dev: torch.device,
    tick: Callable[[str], None] | None = None,
) -> tuple[np.ndarray, list[float]]:
    """`linear_probe_cv` by Newton's method, fold by fold: the C path on the fit tiles (the training tiles less the
    validation ones), C by balanced accuracy on the validation tiles (ties to the smaller C), then the refit on all
    the fold's training tiles, warm-started from the chosen solution."""
    xt = torch.as_tensor(np.asarray(x, np.float64), device=dev)
    y = torch.as_tensor(np.asarray(codes, np.int64), device=dev)
    scores = np.zeros((len(x), k), np.float64)
    chosen: list[float] = []
    middle = cs[len(cs) // 2]
    for i, f in enumerate(folds):
        train = torch.as_tensor(np.asarray(f.train, np.int64), device=dev)
        fit = np.setdiff1d(f.train, f.train[f.val]) if len(f.val) else np.asarray(f.train)
        fit_t = torch.as_tensor(fit.astype(np.int64), device=dev)
        best_c, start = middle, None
        # C is chosen on the validation tiles only when the rest still has two classes to separate (a small fold can
        # put all of a class in its validation slides); otherwise the middle C, fitted on the whole fold.
        if len(f.val) and len(cs) > 1 and len(torch.unique(y[fit_t])) > 1:
            val = torch.as_tensor(np.asarray(f.train[f.val], np.int64), device=dev)
            truth = y[val].cpu().numpy()
            best = -1.0
            with torch_threads(newton.threads(len(fit), x.shape[1], k, dev)):
                path = newton.fit(xt[fit_t], y[fit_t], k, cs)
            for c, solved in zip(cs, path, strict=True):
                acc = balanced_accuracy(truth, solved.proba(xt[val]).argmax(1).cpu().numpy(), k)
                if acc > best + 1e-9:  # ties: the smaller C (the sweep's order)
                    best, best_c, start = acc, c, solved
        present = torch.bincount(y[train], minlength=k) > 0
        warm = start.theta if start is not None and bool((start.classes == present).all()) else None
        with torch_threads(newton.threads(len(train), x.shape[1], k, dev)):
            final = newton.fit(xt[train], y[train], k, [best_c], start=warm)[0]
        scores[f.test] = final.proba(xt[torch.as_tensor(np.asarray(f.test, np.int64), device=dev)]).cpu().numpy()
        chosen.append(best_c)
        if tick is not None:
            tick(f"linear probe fold {i + 1}/{len(folds)}")
    return scores, chosen


def _column_mean(x: torch.Tensor) -> torch.Tensor:
    """float64 column means of `x`, a block of rows at a time (no float64 copy of the whole matrix)."""
    total = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
    for start in range(0, len(x), _ROWS):
        total += x[start : start + _ROWS].double().sum(0)
    return total / max(1, len(x))


def _fit_group(
    x: torch.Tensor, y: torch.Tensor, k: int, folds: list[Fold], cs: list[float], tol: float
) -> list[tuple[np.ndarray, float]]:
    """Choose C on each fold's validation tiles (all folds × C in one solve), refit each fold at its C on all its
    training tiles (warm-started, one solve), predict its test tiles."""
    dev, n = x.device, len(x)
    p = (x.shape[1] + 1) * k
    middle = cs[len(cs) // 2]
    sel: list[tuple[int, np.ndarray]] = []  # (fold, fit rows) of the folds whose C is chosen on validation
    for i, f in enumerate(folds):
        fit = np.setdiff1d(f.train, f.train[f.val]) if len(f.val) else f.train
        # C is chosen on the validation tiles only when the rest still has two classes to separate (a small fold can
        # put all of a class in its validation slides); otherwise the middle C, fitted on the whole fold.
        if len(f.val) and len(cs) > 1 and len(torch.unique(y[torch.as_tensor(fit, device=dev)])) > 1:
            sel.append((i, fit))
    best_c, start = [middle] * len(folds), [torch.zeros(p, dtype=torch.float64, device=dev) for _ in folds]
    if sel:
        member = torch.zeros((len(sel) * len(cs), n), dtype=torch.float64, device=dev)
        for j, (_, fit) in enumerate(sel):
            member[j * len(cs) : (j + 1) * len(cs), torch.as_tensor(fit, device=dev)] = 1
        c = torch.tensor(cs * len(sel), dtype=torch.float64, device=dev)
        problems = _Problems.build(x, y, member, c, k)
        theta, _ = lbfgs(problems, torch.zeros((len(c), p), dtype=torch.float64, device=dev), tol)
        for j, (i, _) in enumerate(sel):
            f, g = folds[i], torch.arange(j * len(cs), (j + 1) * len(cs), device=dev)
            val = torch.as_tensor(f.train[f.val], device=dev)
            pred = problems.logits(theta[g], g, val).argmax(2).cpu().numpy()  # (val, C)
            truth = y[val].cpu().numpy()
            best = -1.0
            for ci, cv in enumerate(cs):
                acc = balanced_accuracy(truth, pred[:, ci], k)
                if acc > best + 1e-9:  # ties: the smaller C (the sweep's order)
                    best, best_c[i], start[i] = acc, cv, theta[g[ci]]
    member = torch.zeros((len(folds), n), dtype=torch.float64, device=dev)
    for i, f in enumerate(folds):
        member[i, torch.as_tensor(f.train, device=dev)] = 1
    problems = _Problems.build(x, y, member, torch.tensor(best_c, dtype=torch.float64, device=dev), k)
    theta, _ = lbfgs(problems, torch.stack(start), tol)
    out = []
    for i, f in enumerate(folds):
        g = torch.tensor([i], device=dev)
        z = problems.logits(theta[g], g, torch.as_tensor(f.test, device=dev))[:, 0]
        out.append((torch.softmax(z, 1).cpu().numpy(), best_c[i]))
    return out


def linear_probe(
    train: np.ndarray,
    train_codes: np.ndarray,
    val_pos: np.ndarray,
    test: np.ndarray,
    n_classes: int,
    cs: Sequence[float],
    device: str | torch.device | None = "cpu",
    tol: float = 1e-5,
) -> tuple[np.ndarray, float]:
    """One fold: (N_test, K) test probabilities and the chosen C (C by balanced accuracy on the validation tiles
    `val_pos`, positions within `train`)."""
    x = np.concatenate([train, test])
    codes = np.concatenate([train_codes, np.zeros(len(test), np.int64)])
    fold = Fold(np.arange(len(train)), np.asarray(val_pos, np.int64), np.arange(len(train), len(x)))
    scores, chosen = linear_probe_cv(x, codes, n_classes, [fold], cs, device, tol)
    return scores[len(train) :], chosen[0]


__all__ = ["Fold", "balanced_accuracy", "lbfgs", "linear_probe", "linear_probe_cv"]
