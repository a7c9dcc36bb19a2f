"""Routing locality counted from expert ids alone (Numba): mean distinct experts per window for
every pass size at once, reuse between tokens d apart, and experts used per layer.

Arrays follow the trace layout: `experts` is (T, L, K) unsigned ids of T token rows (all
sequences, in order), L MoE layers and top-K; `seq_starts` holds each sequence's first row and
then T. Nothing here knows about models, bytes or hardware.
"""

from __future__ import annotations

import numba
import numpy as np

from moesim.kernels.jit import njit


@njit
def _gap_histograms(experts, seq_starts, n_experts, max_pass, r0, r1, hist, tail_hist):  # noqa: ANN001, ANN202
    """Add the slots of rows [r0, r1) to hist[l, g] and, for the last max_pass - 1 rows of a
    sequence, to tail_hist[l, r, g] (r = rows to the sequence end); g = distance to the previous
    occurrence of the slot's expert in its sequence (row - sequence start + 1 for a first
    occurrence), capped at max_pass. The max_pass - 1 rows before r0 are scanned, not counted:
    an occurrence further back gives g = max_pass either way."""
    _, n_layers, k = experts.shape
    last = np.full((n_layers, n_experts), -(1 << 30), np.int32)
    scan = max(0, r0 - max_pass + 1)
    s = np.searchsorted(seq_starts, scan, side="right") - 1
    t = scan
    while t < r1:
        a = seq_starts[s]
        b = seq_starts[s + 1]
        stop = min(b, r1)
        while t < stop:
            first = min(t - a + 1, max_pass)  # caps g for first occurrences and at max_pass
            counted = t >= r0
            r = b - t
            for layer in range(n_layers):
                for j in range(k):
                    e = np.intp(experts[t, layer, j])
                    g = min(t - last[layer, e], first)
                    last[layer, e] = t
                    if counted:
                        hist[layer, g] += 1
                        if r < max_pass:
                            tail_hist[layer, r, g] += 1
            t += 1
        s += 1


@njit(parallel=True)
def _gap_histograms_parallel(experts, seq_starts, n_experts, max_pass, bounds, hist, tail_hist):  # noqa: ANN001, ANN202
    for b in numba.prange(bounds.shape[0] - 1):
        _gap_histograms(experts, seq_starts, n_experts, max_pass, bounds[b], bounds[b + 1], hist[b], tail_hist[b])


def mean_distinct_experts(experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, max_pass: int, parallel: bool = False) -> np.ndarray:
    """Mean over windows of distinct experts U(n) per layer, for n = 1..max_pass: shape (L, max_pass).

    A slot adds a new expert to a window exactly when its expert's previous occurrence lies
    before the window; a slot at gap g lies new in min(g, n) windows of size n, less
    min(g, n - r) windows cut off by the sequence end (r = rows to the end, r < n). Windows
    never cross a sequence boundary. A pass size with no window gives NaN. `parallel` splits
    the rows over Numba's threads (same result).
    """
    if max_pass < 1:
        raise ValueError("max_pass must be >= 1")
    starts = np.asarray(seq_starts, np.int64)
    n_rows, n_layers, _ = experts.shape
    if n_rows and int(experts.max()) >= n_experts:
        raise ValueError(f"expert ids must be below n_experts ({n_experts})")
    ranges = max(1, min(numba.get_num_threads(), n_rows // 4096)) if parallel else 1
    bounds = np.linspace(0, n_rows, ranges + 1).astype(np.int64)
    hist = np.zeros((ranges, n_layers, max_pass + 1), np.int64)
    tail_hist = np.zeros((ranges, n_layers, max_pass, max_pass + 1), np.int64)
    if parallel:
        _gap_histograms_parallel(experts, starts, n_experts, max_pass, bounds, hist, tail_hist)
    else:
        _gap_histograms(experts, starts, n_experts, max_pass, 0, n_rows, hist[0], tail_hist[0])
    hist, tail_hist = hist.sum(axis=0), tail_hist.sum(axis=0)
    g = np.arange(max_pass + 1)
    n = np.arange(1, max_pass + 1)
    totals = hist @ np.minimum(g[:, None], n[None, :])  # (L, N)
    r = np.arange(max_pass)
    cut = np.minimum(g[None, :, None], np.maximum(n[None, None, :] - r[:, None, None], 0))  # (r, g, n)
    cut = np.where(r[:, None, None] < n[None, None, :], cut, 0)
    totals = totals - np.einsum("lrg,rgn->ln", tail_hist, cut)
    lengths = np.diff(starts)
    windows = np.maximum(lengths[:, None] - n[None, :] + 1, 0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(windows > 0, totals / np.maximum(windows, 1), np.nan)


@njit
def _overlap_counts(experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, max_distance: int) -> tuple[np.ndarray, np.ndarray]:
    _, n_layers, k = experts.shape
    ring = max_distance + 1
    member = np.zeros((n_layers, ring, n_experts), np.bool_)
    shared = np.zeros((n_layers, max_distance + 1), np.int64)
    pairs = np.zeros(max_distance + 1, np.int64)
    for s in range(seq_starts.shape[0] - 1):
        a = seq_starts[s]
        b = seq_starts[s + 1]
        member[:] = False
        for t in range(a, b):
            slot = (t - a) % ring
            for layer in range(n_layers):
                if t - a >= ring:
                    for j in range(k):
                        member[layer, slot, np.intp(experts[t - ring, layer, j])] = False
                for d in range(1, max_distance + 1):
                    if t - a >= d:
                        prev = (t - a - d) % ring
                        for j in range(k):
                            if member[layer, prev, np.intp(experts[t, layer, j])]:
                                shared[layer, d] += 1
                for j in range(k):
                    member[layer, slot, np.intp(experts[t, layer, j])] = True
            for d in range(1, max_distance + 1):
                if t - a >= d:
                    pairs[d] += 1
    return shared, pairs


def reuse(experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, max_distance: int = 1) -> np.ndarray:
    """Mean |S_t ∩ S_t+d| / K over token pairs d apart within a sequence: shape (L, max_distance)."""
    if max_distance < 1:
        raise ValueError("max_distance must be >= 1")
    shared, pairs = _overlap_counts(experts, np.asarray(seq_starts, np.int64), n_experts, max_distance)
    k = experts.shape[2]
    with np.errstate(invalid="ignore", divide="ignore"):
        return shared[:, 1:] / (k * pairs[None, 1:].astype(np.float64))


def experts_used(experts: np.ndarray, n_experts: int) -> np.ndarray:
    """Number of distinct experts each layer selects anywhere in the trace: shape (L,)."""
    n_layers = experts.shape[1]
    used = np.zeros((n_layers, n_experts), bool)
    layer_index = np.broadcast_to(np.arange(n_layers)[None, :, None], experts.shape)
    used[layer_index.reshape(-1), experts.reshape(-1).astype(np.intp)] = True
    return used.sum(axis=1)
