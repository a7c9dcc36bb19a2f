"""Exact routing features of every window of n consecutive positions, for one large n (Numba).

`windows` counts every n = 1..64 at once with occurrence bitmasks; past 64 (prefill chunks,
batched verification, kernel tables that run to 4096 tokens) one n at a time is counted with a
sliding window instead. Per sequence and MoE layer the scan keeps each expert's count over the
window's rows and how many experts have each count; a row entering adds its K experts, the row
leaving removes its K: U = experts with a count > 0, M = the largest count (it falls by at most
one per removal, so the count-of-counts finds the new maximum in one step). O(T·L·K) per n.
"""

from __future__ import annotations

import numpy as np

from moesim.kernels.features import RoutingFeatures
from moesim.kernels.jit import njit


@njit
def _sliding_joint(experts, seq_starts, n_experts, n, joint):  # noqa: ANN001, ANN202
    """joint[u, m] += 1 for every (window of n rows, layer) with U = u and M = m."""
    _, n_layers, k = experts.shape
    counts = np.zeros(n_experts, np.int64)
    of_count = np.zeros(n + 2, np.int64)
    for s in range(seq_starts.shape[0] - 1):
        lo, hi = seq_starts[s], seq_starts[s + 1]
        if hi - lo < n:
            continue
        for layer in range(n_layers):
            counts[:] = 0
            of_count[:] = 0
            distinct = 0
            most = 0
            for t in range(lo, hi):
                for j in range(k):
                    e = np.intp(experts[t, layer, j])
                    c = counts[e]
                    if c == 0:
                        distinct += 1
                    else:
                        of_count[c] -= 1
                    counts[e] = c + 1
                    of_count[c + 1] += 1
                    most = max(most, c + 1)
                if t - n >= lo:
                    for j in range(k):
                        e = np.intp(experts[t - n, layer, j])
                        c = counts[e]
                        of_count[c] -= 1
                        counts[e] = c - 1
                        if c == 1:
                            distinct -= 1
                        else:
                            of_count[c - 1] += 1
                        if c == most and of_count[c] == 0:
                            most -= 1
                if t - lo >= n - 1:
                    joint[distinct, most] += 1


def sliding_distribution(experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, n: int) -> tuple[RoutingFeatures, np.ndarray]:
    """Every (U, M) a (window of n rows, MoE layer) takes, with its probability (summing to 1),
    exactly as `WindowSummary.feature_distribution(n)` gives it for n <= 64."""
    if n < 1:
        raise ValueError(f"window size must be >= 1, got {n}")
    starts = np.asarray(seq_starts, np.int64)
    joint = np.zeros((n_experts + 1, n + 1), np.int64)
    _sliding_joint(experts, starts, n_experts, n, joint)
    u, m = np.nonzero(joint)
    counts = joint[u, m].astype(np.float64)
    k = experts.shape[2]
    features = RoutingFeatures(
        n_tokens=np.full(u.shape, float(n)),
        slots=np.full(u.shape, float(n * k)),
        distinct_experts=u.astype(np.float64),
        max_tokens_per_expert=m.astype(np.float64),
    )
    return features, counts / counts.sum() if counts.size else counts
