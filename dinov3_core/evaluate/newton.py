"""Newton's method for the linear probe when the features are narrow: a few exact steps instead of hundreds.

The linear probe minimises scikit-learn's objective, `C · Σ log-loss + ½‖W‖²` with an unpenalised intercept, on
standardised features (`classifiers` states the protocol). Quasi-Newton solvers (scikit-learn's lbfgs, the batched
L-BFGS in `classifiers`) need hundreds of steps on it when C is large and the classes nearly separate, as on real
patch tokens, and each step streams every row. With D features and K classes the Hessian has ((D + 1)·K)² entries:
for the widths the probes meet on CPU models (D ≤ a few hundred) it is small, costs K(K + 1)/2 weighted Gram
products of the rows per step, and Newton's method converges quadratically, in about ten steps from the previous C's
solution (the C path is solved in ascending order, each C warm-started from the one before).

The objective is invariant to adding one constant to every intercept (the softmax does not see it), so the
intercepts' block of the Hessian is singular along that direction: a ridge of `_INTERCEPT_RIDGE` · n on it picks the
smallest such shift and changes no prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Newton's method is used while the Hessian of one problem has at most this many parameters ((D + 1)·K).
MAX_PARAMETERS = 1536
_INTERCEPT_RIDGE = 1e-10


@dataclass
class Solution:
    """One fitted problem: weights in standardised coordinates, and the standardisation of its rows."""

    theta: torch.Tensor  # (D + 1, K): weights, then the intercept row
    mu: torch.Tensor  # (D,)
    sd: torch.Tensor  # (D,)
    classes: torch.Tensor  # (K,) bool: the classes present in its rows (the others never predicted)
    c: float
    steps: int

    def proba(self, x: torch.Tensor) -> torch.Tensor:
        """(N, n_classes) float64 class probabilities of the rows `x` (absent classes: 0)."""
        z = ((x - self.mu) / self.sd) @ self.theta[:-1] + self.theta[-1]
        out = torch.zeros((len(x), len(self.classes)), dtype=torch.float64, device=x.device)
        out[:, self.classes] = torch.softmax(z, 1)
        return out


def standardisation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std (ddof 0; a constant feature's std is 1), as scikit-learn's StandardScaler."""
    mu = x.mean(0)
    sd = (x - mu).square().mean(0).sqrt()
    tiny = sd < 10 * torch.finfo(torch.float64).eps * mu.abs().clamp_min(1)
    return mu, torch.where(tiny, torch.ones_like(sd), sd)


def _objective(a: torch.Tensor, y1: torch.Tensor, theta: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, probabilities) of Σ log-loss + ‖W‖² / (2C) at `theta` (the objective divided by C)."""
    z = a @ theta
    logp = torch.log_softmax(z, 1)
    value = -(logp * y1).sum() + theta[:-1].square().sum() / (2 * c)
    return value, logp.exp()


def _newton_step(
    a: torch.Tensor, af: torch.Tensor, y1: torch.Tensor, theta: torch.Tensor, p: torch.Tensor, c: float
) -> torch.Tensor:
    """The Newton direction at `theta` (probabilities `p`): solve H·δ = −∇. `af`: the rows `a` in single precision,
    in which the Hessian is built (it only steers; the gradient stays exact)."""
    d1, k = theta.shape
    grad = a.T @ (p - y1)
    grad[:-1] += theta[:-1] / c
    pf = p.float()
    pairs = [(i, j) for i in range(k) for j in range(i, k)]
    w = torch.stack([pf[:, i] * ((1.0 if i == j else 0.0) - pf[:, j]) for i, j in pairs], 1)  # (N, pairs)
    blocks = (af.T @ (af[:, None, :] * w[:, :, None]).reshape(len(af), -1)).double()  # one product for all pairs
    blocks = blocks.reshape(d1, len(pairs), d1).permute(1, 0, 2)
    h = torch.zeros((k, d1, k, d1), dtype=torch.float64, device=a.device)
    for (i, j), block in zip(pairs, blocks, strict=True):
        h[i, :, j, :] = block
        if j != i:
            h[j, :, i, :] = block.T
    ridge = torch.eye(d1, dtype=torch.float64, device=a.device) / c
    ridge[-1, -1] = _INTERCEPT_RIDGE * len(a)
    for i in range(k):
        h[i, :, i, :] += ridge
    step = torch.linalg.solve(h.reshape(k * d1, k * d1), -grad.T.reshape(-1))  # class-major, as h
    return step.reshape(k, d1).T


def fit(
    x: torch.Tensor,
    codes: torch.Tensor,
    n_classes: int,
    cs: Sequence[float],
    tol: float = 1e-9,
    max_steps: int = 100,
    start: torch.Tensor | None = None,
) -> list[Solution]:
    """Fit the rows `x` (N, D) float64 with class codes `codes` for every C of `cs` (solved in ascending order, each
    warm-started from the previous, the first from `start` or zero): one `Solution` per C, in the order of `cs`. A
    problem stops when its gradient's largest entry, scaled as scikit-learn's (the objective divided by C·N), is
    below `tol`."""
    mu, sd = standardisation(x)
    a = torch.cat([(x - mu) / sd, torch.ones((len(x), 1), dtype=x.dtype, device=x.device)], 1)
    af = a.float()
    present = torch.bincount(codes, minlength=n_classes) > 0
    local = torch.cumsum(present.long(), 0)[codes] - 1
    k = int(present.sum())
    y1 = torch.nn.functional.one_hot(local, k).double()
    # scikit-learn fits two classes with one logit; a 2-class softmax at C/2 has the same minimiser (classifiers)
    scale = 0.5 if k == 2 else 1.0
    theta = torch.zeros((a.shape[1], k), dtype=torch.float64, device=x.device) if start is None else start.clone()
    out: dict[float, Solution] = {}
    for c in sorted(set(float(v) for v in cs)):
        ce = c * scale
        value, p = _objective(a, y1, theta, ce)
        steps = 0
        for _ in range(max_steps):
            grad = a.T @ (p - y1)
            grad[:-1] += theta[:-1] / ce
            if float(grad.abs().max()) / len(a) <= tol:
                break
            delta = _newton_step(a, af, y1, theta, p, ce)
            slope = float((grad * delta).sum())
            t = 1.0
            for _ in range(40):  # Armijo backtracking: the full Newton step nearly always passes
                trial = theta + t * delta
                new_value, new_p = _objective(a, y1, trial, ce)
                if new_value <= value + 1e-4 * t * slope:
                    break
                t *= 0.5
            else:
                break  # no decrease left at float64 resolution
            theta, value, p = trial, new_value, new_p
            steps += 1
        out[c] = Solution(theta.clone(), mu, sd, present, c, steps)
    return [out[float(c)] for c in cs]


# Below this many multiply-adds in a step's Hessian product a step is a few small ops: one thread, since waking
# others (often busy on a shared machine) costs more than the op.
_ONE_THREAD_MACS = 1 << 27


def threads(n_rows: int, n_features: int, n_classes: int, device: torch.device) -> int:
    """torch threads for a solve of this size (0: the library default)."""
    pairs = n_classes * (n_classes + 1) // 2
    small = n_rows * (n_features + 1) ** 2 * pairs < _ONE_THREAD_MACS
    return 1 if small and device.type == "cpu" else 0


def fits_newton(n_features: int, n_classes: int) -> bool:
    """Whether Newton's method is the cheaper solver for this width."""
    return (n_features + 1) * n_classes <= MAX_PARAMETERS


__all__ = ["MAX_PARAMETERS", "Solution", "fit", "fits_newton", "standardisation", "threads"]
