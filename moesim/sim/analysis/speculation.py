"""Closed forms of speculative decoding with geometric acceptance (vectorised).

k = draft length (k = 0 is plain decoding), α = acceptance rate, C(k) = relative cost of one
speculative iteration = (T_draft(k) + T_target(k + 1)) / T_target(1).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moesim.errors import InputError
from moesim.sim.cost.tree import DEFAULT_SIBLING_RATE, TreeSpec, depth_alphas

TIE_RTOL = 1e-12
_NEAR_ONE = 1e-6


def check_acceptance(alpha: np.ndarray | float, name: str = "alpha") -> np.ndarray:
    """Reject acceptance rates outside [0, 1] (or not finite)."""
    values = np.asarray(alpha, np.float64)
    bad = ~np.isfinite(values) | (values < 0) | (values > 1)
    if np.any(bad):
        raise InputError(f"{name} must lie in [0, 1], got {values[bad].flat[0]}")
    return values


def check_draft_lengths(draft_len: np.ndarray | int, name: str = "draft length") -> np.ndarray:
    """Reject negative or fractional draft lengths."""
    values = np.asarray(draft_len)
    if values.dtype.kind == "f" and np.any(values != np.round(values)):
        raise InputError(f"{name} must be an integer, got {values[values != np.round(values)].flat[0]}")
    values = values.astype(np.int64)
    if np.any(values < 0):
        raise InputError(f"{name} must be >= 0, got {values[values < 0].flat[0]}")
    return values


def tokens_per_pass(draft_len: np.ndarray | int, alpha: np.ndarray | float) -> np.ndarray:
    """Expected tokens committed per verify pass τ(k, α) = Σ_{i=0..k} α^i = (1 − α^(k+1)) / (1 − α)."""
    k = np.asarray(draft_len, np.float64)
    a = np.asarray(alpha, np.float64)
    k, a = np.broadcast_arrays(k, a)
    near_one = np.abs(1.0 - a) < _NEAR_ONE
    safe = np.where(near_one, 0.5, a)
    closed = (1.0 - safe ** (k + 1.0)) / (1.0 - safe)
    # near α = 1: Σ α^i = (k+1) − (k+1)k/2·(1−α) + O((1−α)²)
    series = (k + 1.0) - 0.5 * (k + 1.0) * k * (1.0 - a)
    return np.where(near_one, series, closed)


def relative_cost(draft_us: np.ndarray, target_us: np.ndarray) -> np.ndarray:
    """C(k) = (T_draft(k) + T_target(k + 1)) / T_target(1) from arrays indexed by k = 0..k_max.

    `draft_us[k]` is the drafting time of k tokens (0 at k = 0); `target_us[k]` the verify pass of
    k + 1 tokens, so `target_us[0]` is plain decoding's pass. Extra leading axes broadcast.
    """
    draft = np.asarray(draft_us, np.float64)
    target = np.asarray(target_us, np.float64)
    return (draft + target) / target[..., :1]


def speedup(draft_len: np.ndarray | int, alpha: np.ndarray | float, cost: np.ndarray) -> np.ndarray:
    """S(k, α) = τ(k, α) / C(k); `cost` is C indexed by k = 0..k_max."""
    k = np.asarray(draft_len, np.int64)
    return tokens_per_pass(k, alpha) / np.asarray(cost, np.float64)[k]


def speedup_table(alpha: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """S for every α (leading axis) and k = 0..k_max (last axis): shape (len(α), len(C)).

    τ(k, α) is summed directly, Σ_{i<=k} α^i by cumulative product and sum along k (exact near α = 1).
    """
    a = np.asarray(alpha, np.float64).reshape(-1, 1)
    c = np.asarray(cost, np.float64)
    powers = np.empty((a.shape[0], c.size))
    powers[:, :1] = 1.0
    powers[:, 1:] = a
    np.cumprod(powers, axis=1, out=powers)
    np.cumsum(powers, axis=1, out=powers)
    powers /= c
    return powers


def tokens_per_pass_table(rates: np.ndarray, max_draft: int, tree: TreeSpec, sibling_rate: float = DEFAULT_SIBLING_RATE) -> np.ndarray:
    """τ for every acceptance point (rows of per-depth top-1 rates; a row's last rate repeats) and
    k = 0..max_draft: shape (points, max_draft + 1). The chain sums Π α_d by cumulative product and
    sum (as `speedup_table`, so a constant row gives its numbers bit for bit); a tree sums its nodes."""
    points = depth_alphas(rates, max(max_draft, 1))
    if not tree.is_chain:
        return np.stack([tree.tokens_per_pass(k, points, sibling_rate) for k in range(max_draft + 1)], axis=1)
    powers = np.empty((points.shape[0], max_draft + 1))
    powers[:, :1] = 1.0
    powers[:, 1:] = points[:, :max_draft]
    np.cumprod(powers, axis=1, out=powers)
    np.cumsum(powers, axis=1, out=powers)
    return powers


def best_in_table(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the k of the largest speedup (ties within rtol 1e-12 to the larger k) and that speedup."""
    top = table.max(axis=1, keepdims=True)
    within = table >= top * (1.0 - TIE_RTOL)
    k_star = table.shape[1] - 1 - np.argmax(within[:, ::-1], axis=1)
    return k_star, table[np.arange(table.shape[0]), k_star]


def best_draft(alpha: np.ndarray | float, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k*(α) = argmax_k S(k, α) over k = 0..k_max, ties (within rtol 1e-12) to the larger k; and S(k*)."""
    a = np.asarray(alpha, np.float64)
    k_star, best = best_in_table(speedup_table(a.ravel(), cost))
    return k_star.reshape(a.shape), best.reshape(a.shape)


def break_even_alpha(draft_len: np.ndarray | int, cost: np.ndarray, iterations: int = 80) -> np.ndarray:
    """α*(k): the acceptance where τ(k, α) = C(k), so SD at draft length k pays for α > α*.

    τ rises from 1 (α = 0) to k + 1 (α = 1): α* = 0 when C(k) <= 1, NaN (never pays) when
    C(k) >= k + 1 (so always at k = 0, plain decoding); otherwise found by bisection.
    """
    k = np.atleast_1d(np.asarray(draft_len, np.int64))
    c = np.asarray(cost, np.float64)[k]
    low, high = np.zeros(k.shape), np.ones(k.shape)
    for _ in range(iterations):
        mid = 0.5 * (low + high)
        above = tokens_per_pass(k, mid) >= c
        high = np.where(above, mid, high)
        low = np.where(above, low, mid)
    result = 0.5 * (low + high)
    result = np.where(c <= 1.0, 0.0, result)
    return np.where(c >= k + 1.0, np.nan, result).reshape(np.shape(draft_len))


def staircase(
    cost: np.ndarray, grid: int = 2001, iterations: int = 60, best: Callable[[np.ndarray | float], np.ndarray] | None = None
) -> list[tuple[float, int]]:
    """The best-draft staircase [(α from which k* = k, k), ...] starting at α = 0; every jump
    between grid points is located by bisection (several jumps in one grid cell included).
    `best(α)` gives k* (default: the chain's, `best_draft(α, cost)`)."""
    if best is None:
        best = lambda a: best_draft(a, cost)[0]  # noqa: E731
    alphas = np.linspace(0.0, 1.0, grid)
    k_star = best(alphas)
    steps = [(0.0, int(k_star[0]))]
    for i in np.flatnonzero(np.diff(k_star) != 0):
        low, current = float(alphas[i]), int(k_star[i])
        while current != k_star[i + 1]:
            lo, hi = low, float(alphas[i + 1])
            for _ in range(iterations):
                mid = 0.5 * (lo + hi)
                if int(best(mid)) == current:
                    lo = mid
                else:
                    hi = mid
            current = int(best(hi))
            steps.append((hi, current))
            low = hi
    return steps
