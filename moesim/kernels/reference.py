"""Plain vectorised numpy references for the Numba counters (tests and benchmarks use them).

Same inputs and outputs as the fast paths in `windows` and `unions`, computed another way:
- windows: sort every slot by (layer, expert, row), read the distance to each earlier
  occurrence of the same expert off the sorted order (the c-th previous occurrence is c places
  back), combine per row with array operations, then sum (U) or take the max (M) along the n
  diagonals. Work grows with the longest run of repeats within N rows, not with the windows.
- unions: gather the rows of every window, count (group, layer, expert) with one bincount.
- reuse: re-read distances and tile reads from their definitions, slot by slot in plain Python
  (small inputs only), and their window means by enumerating every window.
"""

from __future__ import annotations

import numpy as np


def window_features_reference(
    experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, max_pass: int, rows: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """U and M of the windows of n = 1..max_pass rows ending at rows[0]..rows[1]-1: two (R, L, N)
    int64 arrays, 0 where the window would start before its sequence."""
    starts = np.asarray(seq_starts, np.int64)
    r0, r1 = rows if rows is not None else (0, experts.shape[0])
    b0 = max(0, r0 - max_pass + 1)
    block = experts[b0:r1].astype(np.int64)
    n_rows, n_layers, k = block.shape
    seq = np.searchsorted(starts, np.arange(b0, r1), side="right") - 1
    # slots in (row, layer, j) order; a stable sort by (layer, expert) keeps rows ascending
    key = (np.arange(n_layers)[None, :, None] * n_experts + block).reshape(-1)
    order = np.argsort(key, kind="stable")
    key_sorted = key[order]
    row_sorted = order // (n_layers * k)
    seq_sorted = seq[row_sorted]
    slot_row = np.repeat(np.arange(n_rows), n_layers * k)
    slot_layer = np.tile(np.repeat(np.arange(n_layers), k), n_rows)
    # new_at[t, l, d]: slots of row t with no occurrence of their expert in rows t-d..t-1
    # top_at[t, l, d]: 1 + the most earlier occurrences any slot of row t has within d rows
    first_gap = np.full(key.shape, max_pass, np.int64)
    deepest = np.zeros((n_rows, n_layers, max_pass), np.int64)
    for c in range(1, max_pass):
        same = (key_sorted[c:] == key_sorted[:-c]) & (seq_sorted[c:] == seq_sorted[:-c])
        dist = row_sorted[c:] - row_sorted[:-c]
        hit = same & (dist < max_pass)
        if not hit.any():
            break
        slots = order[c:][hit]
        if c == 1:
            first_gap[slots] = dist[hit]
        # one value c per pass, passes in increasing c: plain assignment keeps the largest
        deepest[slot_row[slots], slot_layer[slots], dist[hit]] = c
    new_at = (first_gap.reshape(n_rows, n_layers, k, 1) > np.arange(max_pass)).sum(axis=2)
    top_at = 1 + np.maximum.accumulate(deepest, axis=2)
    # by start row a (block-relative): U(a, n) = Σ_{d<n} new_at[a+d, :, d], M likewise with max
    u = np.zeros((r1 - r0, n_layers, max_pass), np.int64)
    m = np.zeros((r1 - r0, n_layers, max_pass), np.int64)
    u_run = new_at[:, :, 0].copy()
    m_run = top_at[:, :, 0].copy()
    end = np.arange(r0, r1) - b0  # block-relative last rows
    for d in range(max_pass):
        if 0 < d < n_rows:
            u_run[: n_rows - d] += new_at[d:, :, d]
            m_run[: n_rows - d] = np.maximum(m_run[: n_rows - d], top_at[d:, :, d])
        begin = end - d
        ok = (begin >= 0) & (begin + b0 >= starts[seq[end]])
        u[ok, :, d] = u_run[begin[ok]]
        m[ok, :, d] = m_run[begin[ok]]
    return u, m


def summary_reference(u: np.ndarray, m: np.ndarray, n_experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fields of `WindowSummary` (joint, per-layer sums of U, U², M) from per-window arrays (R, L, N)."""
    max_pass = u.shape[2]
    u_max = min(max_pass * top_k, n_experts)
    valid = u > 0
    n_index = np.broadcast_to(np.arange(max_pass), u.shape)[valid]
    joint = np.bincount((n_index * (u_max + 1) + u[valid]) * (max_pass + 1) + m[valid], minlength=max_pass * (u_max + 1) * (max_pass + 1))
    return joint.reshape(max_pass, u_max + 1, max_pass + 1), u.sum(axis=0), (u * u).sum(axis=0), m.sum(axis=0)


def union_features_reference(
    experts: np.ndarray, group_offsets: np.ndarray, starts: np.ndarray, lengths: np.ndarray, n_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group of windows (windows group_offsets[g]..group_offsets[g+1]-1, window w = rows
    starts[w]..starts[w]+lengths[w]-1) and layer: distinct experts of the union of the slots,
    max tokens per expert, and tokens per expert counts; shapes (G, L), (G, L), (G, L, E)."""
    group_offsets = np.asarray(group_offsets, np.int64)
    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    n_groups = group_offsets.size - 1
    n_layers = experts.shape[1]
    window_group = np.repeat(np.arange(n_groups), np.diff(group_offsets))
    row_window = np.repeat(np.arange(starts.size), lengths)
    rows = starts[row_window] + (np.arange(row_window.size) - np.repeat(np.cumsum(lengths) - lengths, lengths))
    ids = experts[rows].astype(np.int64)  # (S, L, K)
    key = (window_group[row_window][:, None, None] * n_layers + np.arange(n_layers)[None, :, None]) * n_experts + ids
    counts = np.bincount(key.reshape(-1), minlength=n_groups * n_layers * n_experts).reshape(n_groups, n_layers, n_experts)
    return (counts > 0).sum(axis=2), counts.max(axis=2, initial=0), counts


def reuse_features_reference(
    experts: np.ndarray, group_offsets: np.ndarray, starts: np.ndarray, lengths: np.ndarray, n_experts: int, tiles: tuple[int, ...]
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Per group and layer, from the definitions in plain Python: the re-read histogram (a re-read
    at slot s of the expert last read at slot p has distance |set(slots p+1..s)|) and, per tile
    T, Σ_e ceil(c_e / T)."""
    n_groups, n_layers = len(group_offsets) - 1, experts.shape[1]
    hist = np.zeros((n_groups, n_layers, n_experts + 1), np.int64)
    reads = {t: np.zeros((n_groups, n_layers), np.int64) for t in tiles}
    for g in range(n_groups):
        rows = [t for w in range(group_offsets[g], group_offsets[g + 1]) for t in range(starts[w], starts[w] + lengths[w])]
        for layer in range(n_layers):
            stream = [int(e) for t in rows for e in experts[t, layer]]
            for s, e in enumerate(stream):
                earlier = [p for p in range(s) if stream[p] == e]
                if earlier:
                    hist[g, layer, len(set(stream[earlier[-1] + 1 : s + 1]))] += 1
            for t in tiles:
                reads[t][g, layer] = sum(-(-stream.count(e) // t) for e in set(stream))
    return hist, reads


def window_reuse_means_reference(
    experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, max_pass: int, tiles: tuple[int, ...]
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Means over every window of n = 1..max_pass rows of each sequence and over the layers of
    `reuse_features_reference` of that window alone."""
    hist = np.zeros((max_pass, n_experts + 1))
    reads = {t: np.zeros(max_pass) for t in tiles}
    for n in range(1, max_pass + 1):
        first = [a for lo, hi in np.stack([seq_starts[:-1], seq_starts[1:]], axis=1) for a in range(lo, hi - n + 1)]
        if not first:
            hist[n - 1] = np.nan
            for t in tiles:
                reads[t][n - 1] = np.nan
            continue
        h, r = reuse_features_reference(experts, np.arange(len(first) + 1), np.array(first), np.full(len(first), n), n_experts, tiles)
        hist[n - 1] = h.mean(axis=(0, 1))
        for t in tiles:
            reads[t][n - 1] = r[t].mean()
    return hist, reads
