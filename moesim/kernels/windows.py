"""Routing features of every window of n consecutive positions, for n = 1..N at once (Numba).

Arrays follow the trace layout: `experts` is (T, L, K) unsigned ids of T token rows (all
sequences, in order), L MoE layers and top-K; `seq_starts` holds each sequence's first row and
then T. A window is named by its last row t and its size n: rows t-n+1..t of one sequence (it
never crosses a sequence boundary). Per window and MoE layer: n·K slots, U distinct experts
(what a deduplicating engine reads) and M = max tokens per expert (the most of the window's
tokens that select one expert).

How it is counted, in one pass over the rows. Per layer and expert the scan keeps a mask of
the last N rows (bit i = row t-i) where the expert occurred: every row shifts all masks by one
and sets bit 0 of the row's experts (masks of 16, 32 or 64 bits, the narrowest that holds N).
For row t and d < N:
    new_d(t) = slots of row t whose expert does not occur in rows t-d..t-1,
    top_d(t) = max over slots of row t of the occurrences of its expert in rows t-d..t
(popcounts of the slot's mask). With V_t[d] = U and W_t[d] = M of the window of d+1 rows
ending at t:
    V_t[d] = V_{t-1}[d-1] + new_d(t),    W_t[d] = max(W_{t-1}[d-1], top_d(t)),
one shifted vector add and max per row and layer, written straight into the output (the
previous output row is V_{t-1}, W_{t-1}). N <= 64. About 35 ns per row and layer at N = 16 on
one Zen 4 core; `docs/performance.md` has the measurements.

Products of that scan:
- `window_features`: per-window arrays (rows, L, N) for a range of last rows;
  `iter_window_features` walks a trace block by block in bounded memory.
- `summarize_windows`: every window reduced on the fly into a `WindowSummary`: exact
  distribution of (U, M) per n pooled over layers, and per-layer sums of U, U² and M. Summaries
  of disjoint window sets add, so a streamed trace gives the same numbers as one read whole.

Ids must be below `n_experts`: `check_routing` verifies it in one vectorised pass (the trace
reader guarantees it already) so that the scan itself carries no per-slot check.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numba
import numpy as np

from moesim.kernels.features import RoutingFeatures
from moesim.kernels.jit import njit

MAX_PASS_LIMIT = 64  # the widest occurrence mask
_SUMMARY_BLOCK = 1024  # rows of per-window arrays a summary reduces at a time (stays in L2)

_M1 = np.uint64(0x5555555555555555)
_M2 = np.uint64(0x3333333333333333)
_M4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_H01 = np.uint64(0x0101010101010101)


@njit(inline="always")
def _popcount(x):  # noqa: ANN001, ANN202
    """Set bits of an unsigned mask (LLVM turns this into a vector popcount)."""
    x = x - ((x >> np.uint64(1)) & _M1)
    x = (x & _M2) + ((x >> np.uint64(2)) & _M2)
    x = (x + (x >> np.uint64(4))) & _M4
    return np.int64((x * _H01) >> np.uint64(56))


def _low_masks(max_pass: int) -> np.ndarray:
    """low[d] = bits 0..d set (rows t-d..t), in the narrowest mask type that holds max_pass bits."""
    dtype = np.uint16 if max_pass <= 16 else np.uint32 if max_pass <= 32 else np.uint64
    return np.array([(1 << (d + 1)) - 1 for d in range(max_pass)], dtype)


@njit(inline="always")
def _row_step(experts, t, layer, lo, occ, slot_mask, low, new_at, top_at):  # noqa: ANN001, ANN202
    """Advance layer `layer` to row t: update the occurrence masks, fill new_at and top_at
    (the masks start empty at row `lo`: the sequence start, or where the scan began)."""
    k = experts.shape[2]
    max_pass = low.shape[0]
    n_experts = occ.shape[1]
    if t == lo:
        for e in range(n_experts):
            occ[layer, e] = 0
    else:
        for e in range(n_experts):
            occ[layer, e] = occ[layer, e] << 1
    for j in range(k):
        e = np.intp(experts[t, layer, j])
        mask = occ[layer, e] | 1
        occ[layer, e] = mask
        slot_mask[j] = mask
    for d in range(max_pass):
        new_at[d] = 0
        top_at[d] = 1
    for j in range(0, k, 4):  # four slots per sweep keep the lane accumulators in registers
        m0, m1, m2, m3 = slot_mask[j], slot_mask[j + 1], slot_mask[j + 2], slot_mask[j + 3]
        for d in range(max_pass):
            c0 = np.int16(_popcount(m0 & low[d]))
            c1 = np.int16(_popcount(m1 & low[d]))
            c2 = np.int16(_popcount(m2 & low[d]))
            c3 = np.int16(_popcount(m3 & low[d]))
            new_at[d] += np.int16(c0 == 1) + np.int16(c1 == 1) + np.int16(c2 == 1) + np.int16(c3 == 1)
            top_at[d] = max(top_at[d], max(max(c0, c1), max(c2, c3)))


@njit
def _window_rows(experts, seq_starts, n_experts, low, r0, r1, out_u, out_m):  # noqa: ANN001, ANN202
    """out[t - r0 + N - 1, l, n-1] = U, M of the window of n rows ending at row t, for t in
    [r0, r1) (N = len(low)); 0 where that window would start before its sequence. The first
    N - 1 rows of out are scratch: rows r0-N+1..r0-1 are scanned there (windows ending at r0
    start no earlier), and each row's V, W are the previous row's shifted by one lane."""
    _, n_layers, k = experts.shape
    max_pass = low.shape[0]
    occ = np.zeros((n_layers, n_experts), low.dtype)
    slot_mask = np.zeros(-(-k // 4) * 4, low.dtype)  # padding masks stay 0: no count, no max
    new_at = np.zeros(max_pass, np.int16)
    top_at = np.zeros(max_pass, np.int16)
    scan_lo = max(0, r0 - max_pass + 1)
    s = np.searchsorted(seq_starts, scan_lo, side="right") - 1
    t = scan_lo
    while t < r1:
        lo = max(seq_starts[s], scan_lo)
        stop = min(seq_starts[s + 1], r1)
        while t < stop:
            b = t - r0 + max_pass - 1
            span = t - lo  # windows of up to span + 1 rows end at t
            for layer in range(n_layers):
                _row_step(experts, t, layer, lo, occ, slot_mask, low, new_at, top_at)
                out_u[b, layer, 0] = k
                out_m[b, layer, 0] = 1
                if span == 0:
                    for d in range(1, max_pass):
                        out_u[b, layer, d] = 0
                        out_m[b, layer, d] = 0
                    continue
                for d in range(1, max_pass):  # V_t[d] = V_{t-1}[d-1] + new_d(t); W likewise with max
                    out_u[b, layer, d] = out_u[b - 1, layer, d - 1] + new_at[d]
                    out_m[b, layer, d] = max(out_m[b - 1, layer, d - 1], top_at[d])
                for d in range(span + 1, max_pass):
                    out_u[b, layer, d] = 0
                    out_m[b, layer, d] = 0
            t += 1
        s += 1


@njit
def _accumulate(out_u, out_m, joint, sum_u, sum_u2, sum_m):  # noqa: ANN001, ANN202
    """Add a block of per-window arrays to the summary (an incomplete window, U = 0, lands in
    joint[:, 0, 0], which the caller clears)."""
    n_rows, n_layers, max_pass = out_u.shape
    for r in range(n_rows):
        for layer in range(n_layers):
            for d in range(max_pass):
                u = np.int64(out_u[r, layer, d])
                sum_u[layer, d] += u
                sum_u2[layer, d] += u * u
                sum_m[layer, d] += out_m[r, layer, d]
            for d in range(max_pass):
                joint[d, out_u[r, layer, d], out_m[r, layer, d]] += 1


@njit
def _summarize_rows(experts, seq_starts, n_experts, low, r0, r1, buf_u, buf_m, joint, sum_u, sum_u2, sum_m):  # noqa: ANN001, ANN202
    """Add every window ending at a row in [r0, r1) to the summary, a block of rows at a time."""
    lead = low.shape[0] - 1
    block = buf_u.shape[0] - lead
    for b0 in range(r0, r1, block):
        b1 = min(b0 + block, r1)
        _window_rows(experts, seq_starts, n_experts, low, b0, b1, buf_u, buf_m)
        _accumulate(buf_u[lead : lead + b1 - b0], buf_m[lead : lead + b1 - b0], joint, sum_u, sum_u2, sum_m)


@njit(parallel=True)
def _summarize_parallel(experts, seq_starts, n_experts, low, bounds, buf_u, buf_m, joint, sum_u, sum_u2, sum_m):  # noqa: ANN001, ANN202
    """`_summarize_rows` for row ranges [bounds[b], bounds[b+1]) in parallel, range b into [b]."""
    for b in numba.prange(bounds.shape[0] - 1):
        _summarize_rows(
            experts, seq_starts, n_experts, low, bounds[b], bounds[b + 1], buf_u[b], buf_m[b], joint[b], sum_u[b], sum_u2[b], sum_m[b]
        )


# ---- public API -------------------------------------------------------------------------------


def check_routing(experts: np.ndarray, seq_starts: np.ndarray, n_experts: int) -> np.ndarray:
    """Check the array layout the counters expect; returns seq_starts as int64."""
    if experts.ndim != 3 or experts.dtype.kind != "u":
        raise ValueError(f"experts must be a (T, L, K) array of unsigned ids, got {experts.dtype} {experts.shape}")
    if not experts.shape[2] <= n_experts <= 1 << 15:
        raise ValueError(f"n_experts ({n_experts}) must lie in top-k ({experts.shape[2]})..32768")
    if experts.size and int(experts.max()) >= n_experts:
        raise ValueError(f"expert ids must be below n_experts ({n_experts})")
    starts = np.asarray(seq_starts, np.int64)
    if starts.ndim != 1 or starts.size < 2 or starts[0] != 0 or starts[-1] != experts.shape[0] or np.any(np.diff(starts) <= 0):
        raise ValueError("seq_starts must rise strictly from 0 to the number of rows")
    return starts


def _check_max_pass(max_pass: int) -> None:
    if not 1 <= max_pass <= MAX_PASS_LIMIT:
        raise ValueError(f"max_pass must be in 1..{MAX_PASS_LIMIT}, got {max_pass}")


def window_count(seq_starts: np.ndarray, max_pass: int) -> np.ndarray:
    """Windows of each size n = 1..max_pass: Σ_sequences max(length − n + 1, 0)."""
    lengths = np.diff(np.asarray(seq_starts, np.int64))
    n = np.arange(1, max_pass + 1)
    return np.maximum(lengths[:, None] - n[None, :] + 1, 0).sum(axis=0)


def _feature_dtype(limit: int) -> type[np.unsignedinteger]:
    return np.uint8 if limit <= np.iinfo(np.uint8).max else np.uint16


@dataclass(frozen=True)
class WindowFeatures:
    """Features of the windows whose last row is in `rows[0]..rows[1]-1`, for n = 1..max_pass.

    `distinct_experts[t - rows[0], l, n-1]` and `max_tokens_per_expert[...]` are U and M in
    layer l of the window of n rows ending at row t; both are 0 where that window would start
    before its sequence (a real window has U >= K and M >= 1).
    """

    rows: tuple[int, int]
    top_k: int
    distinct_experts: np.ndarray  # (R, L, N) uint8 (uint16 when min(N·K, E) > 255)
    max_tokens_per_expert: np.ndarray  # (R, L, N) uint8

    @property
    def max_pass(self) -> int:
        """Largest window size N."""
        return int(self.distinct_experts.shape[2])

    def valid(self, n: int) -> np.ndarray:
        """Which rows end a complete window of n rows: shape (R,), bool."""
        return self.distinct_experts[:, 0, n - 1] > 0

    def routing_features(self, n: int) -> RoutingFeatures:
        """RoutingFeatures of the complete windows of n rows: shape (windows, L)."""
        keep = self.valid(n)
        return RoutingFeatures(
            n_tokens=np.float64(n),
            slots=np.float64(n * self.top_k),
            distinct_experts=self.distinct_experts[keep, :, n - 1],
            max_tokens_per_expert=self.max_tokens_per_expert[keep, :, n - 1],
        )


def _window_buffers(n_rows: int, n_layers: int, k: int, n_experts: int, max_pass: int) -> tuple[np.ndarray, np.ndarray]:
    """Output of `_window_rows` for n_rows rows, after its max_pass - 1 scratch rows."""
    shape = (n_rows + max_pass - 1, n_layers, max_pass)
    return np.zeros(shape, _feature_dtype(min(max_pass * k, n_experts))), np.zeros(shape, _feature_dtype(max_pass))


def window_features(
    experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, max_pass: int, rows: tuple[int, int] | None = None
) -> WindowFeatures:
    """U and M of every window of n = 1..max_pass rows ending in `rows` (default: all rows)."""
    starts = check_routing(experts, seq_starts, n_experts)
    _check_max_pass(max_pass)
    r0, r1 = rows if rows is not None else (0, experts.shape[0])
    if not 0 <= r0 <= r1 <= experts.shape[0]:
        raise ValueError(f"rows {rows} outside 0..{experts.shape[0]}")
    out_u, out_m = _window_buffers(r1 - r0, experts.shape[1], experts.shape[2], n_experts, max_pass)
    if r1 > r0:
        _window_rows(experts, starts, n_experts, _low_masks(max_pass), r0, r1, out_u, out_m)
    return WindowFeatures((r0, r1), experts.shape[2], out_u[max_pass - 1 :], out_m[max_pass - 1 :])


def iter_window_features(
    experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, max_pass: int, block_rows: int = 1 << 14
) -> Iterator[WindowFeatures]:
    """`window_features` for consecutive blocks of last rows, in bounded memory.

    The blocks share two buffers: each block's arrays are overwritten by the next one (copy
    what you keep). Fresh arrays per block would cost a page fault per 4 KiB of output.
    """
    starts = check_routing(experts, seq_starts, n_experts)
    _check_max_pass(max_pass)
    n_rows, n_layers, k = experts.shape
    buf_u, buf_m = _window_buffers(min(block_rows, n_rows), n_layers, k, n_experts, max_pass)
    low = _low_masks(max_pass)
    lead = max_pass - 1
    for r0 in range(0, n_rows, block_rows):
        r1 = min(r0 + block_rows, n_rows)
        _window_rows(experts, starts, n_experts, low, r0, r1, buf_u, buf_m)
        yield WindowFeatures((r0, r1), k, buf_u[lead : lead + r1 - r0], buf_m[lead : lead + r1 - r0])


@dataclass(frozen=True)
class WindowSummary:
    """Exact distribution of per-window features, per window size n = 1..max_pass.

    `joint[n-1, u, m]`: (window, MoE layer) pairs of n rows with U = u and M = m, pooled over
    layers; `sum_distinct_experts[l, n-1]`, `sum_sq_distinct_experts`, `sum_max_tokens_per_expert`:
    per-layer sums over windows of U, U² and M. Percentiles are the inverted-CDF kind: the
    smallest value with at least q of the mass at or below it (numpy `method="inverted_cdf"`).
    """

    top_k: int
    n_experts: int
    joint: np.ndarray  # (N, Umax+1, N+1) int64
    sum_distinct_experts: np.ndarray  # (L, N) int64
    sum_sq_distinct_experts: np.ndarray  # (L, N) int64
    sum_max_tokens_per_expert: np.ndarray  # (L, N) int64

    @property
    def max_pass(self) -> int:
        """Largest window size N."""
        return int(self.joint.shape[0])

    @property
    def n_layers(self) -> int:
        """MoE layers L."""
        return int(self.sum_distinct_experts.shape[0])

    def windows(self) -> np.ndarray:
        """Windows counted per n (each counted once, not once per layer): shape (N,)."""
        return self.joint.sum(axis=(1, 2)) // max(self.n_layers, 1)

    def merge(self, other: WindowSummary) -> WindowSummary:
        """Summary of the union of two disjoint sets of windows."""
        return WindowSummary(
            self.top_k,
            self.n_experts,
            self.joint + other.joint,
            self.sum_distinct_experts + other.sum_distinct_experts,
            self.sum_sq_distinct_experts + other.sum_sq_distinct_experts,
            self.sum_max_tokens_per_expert + other.sum_max_tokens_per_expert,
        )

    def _per_window(self, sums: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return sums / self.windows()

    def mean_distinct_experts_per_layer(self) -> np.ndarray:
        """Mean U per layer and n: (L, N); NaN where no window has n rows."""
        return self._per_window(self.sum_distinct_experts)

    def std_distinct_experts_per_layer(self) -> np.ndarray:
        """Standard deviation of U over windows, per layer and n: (L, N)."""
        mean = self.mean_distinct_experts_per_layer()
        return np.sqrt(np.maximum(self._per_window(self.sum_sq_distinct_experts) - mean**2, 0.0))

    def mean_distinct_experts(self) -> np.ndarray:
        """Mean U over windows and layers, per n: (N,)."""
        return self.mean_distinct_experts_per_layer().mean(axis=0)

    def byte_share_per_layer(self) -> np.ndarray:
        """u(n) = mean U / (n·K) per layer: (L, N)."""
        return self.mean_distinct_experts_per_layer() / (np.arange(1, self.max_pass + 1) * self.top_k)

    def byte_share(self) -> np.ndarray:
        """u(n) = mean U / (n·K), over windows and layers: (N,)."""
        return self.mean_distinct_experts() / (np.arange(1, self.max_pass + 1) * self.top_k)

    def mean_max_tokens_per_expert_per_layer(self) -> np.ndarray:
        """Mean M per layer and n: (L, N)."""
        return self._per_window(self.sum_max_tokens_per_expert)

    def mean_max_tokens_per_expert(self) -> np.ndarray:
        """Mean M over windows and layers, per n: (N,)."""
        return self.mean_max_tokens_per_expert_per_layer().mean(axis=0)

    def distinct_experts_histogram(self) -> np.ndarray:
        """(window, layer) pairs per n and U: (N, Umax+1)."""
        return self.joint.sum(axis=2)

    def max_tokens_histogram(self) -> np.ndarray:
        """(window, layer) pairs per n and M: (N, N+1)."""
        return self.joint.sum(axis=1)

    def distinct_experts_percentiles(self, q: float | list[float]) -> np.ndarray:
        """Percentiles q (in %) of U over (window, layer) pairs per n: (len(q), N)."""
        return histogram_percentiles(self.distinct_experts_histogram(), q)

    def max_tokens_percentiles(self, q: float | list[float]) -> np.ndarray:
        """Percentiles q (in %) of M over (window, layer) pairs per n: (len(q), N)."""
        return histogram_percentiles(self.max_tokens_histogram(), q)

    def feature_distribution(self, n: int) -> tuple[RoutingFeatures, np.ndarray]:
        """Every (U, M) a (window, layer) of n rows takes, with its probability (summing to 1):
        E[f(features)] = Σ probability · f(features) for any per-layer time model f."""
        u, m = np.nonzero(self.joint[n - 1])
        counts = self.joint[n - 1, u, m].astype(np.float64)
        features = RoutingFeatures(
            n_tokens=np.full(u.shape, float(n)),
            slots=np.full(u.shape, float(n * self.top_k)),
            distinct_experts=u.astype(np.float64),
            max_tokens_per_expert=m.astype(np.float64),
        )
        return features, counts / counts.sum() if counts.size else counts

    def mean_features(self) -> RoutingFeatures:
        """Mean features per n over windows and layers: shape (N,)."""
        n = np.arange(1, self.max_pass + 1, dtype=np.float64)
        return RoutingFeatures(n, n * self.top_k, self.mean_distinct_experts(), self.mean_max_tokens_per_expert())


def histogram_percentiles(hist: np.ndarray, q: float | list[float]) -> np.ndarray:
    """Inverted-CDF percentiles of the values 0..V-1 counted along the last axis of `hist`:
    the smallest v whose cumulative count reaches q% of the total (q = 0: the smallest value
    present). Shape (len(q), *hist.shape[:-1]); NaN where the total is 0."""
    qs = np.atleast_1d(np.asarray(q, np.float64))
    cum = np.cumsum(hist, axis=-1)
    total = cum[..., -1:]
    out = np.empty((qs.size, *hist.shape[:-1]))
    for i, p in enumerate(qs):
        reach = cum >= np.maximum(p / 100.0 * total, np.minimum(total, 1))
        out[i] = np.where(total[..., 0] > 0, np.argmax(reach, axis=-1), np.nan)
    return out


def empty_summary(n_layers: int, n_experts: int, top_k: int, max_pass: int) -> WindowSummary:
    """A summary of no windows (the start of a streamed sum)."""
    u_max = min(max_pass * top_k, n_experts)
    zeros = np.zeros((n_layers, max_pass), np.int64)
    return WindowSummary(top_k, n_experts, np.zeros((max_pass, u_max + 1, max_pass + 1), np.int64), zeros, zeros.copy(), zeros.copy())


def summarize_windows(
    experts: np.ndarray,
    seq_starts: np.ndarray,
    n_experts: int,
    max_pass: int,
    count_from: int = 0,
    parallel: bool = False,
) -> WindowSummary:
    """Distribution of U and M over every window of n = 1..max_pass rows and every layer.

    Only windows whose last row is >= `count_from` are counted: for a chunk of
    `moesim.tracegen.formats.trace.iter_chunks`, pass its `new_from` and merge the chunks' summaries.
    `parallel` splits the rows over Numba's threads (same result).
    """
    starts = check_routing(experts, seq_starts, n_experts)
    _check_max_pass(max_pass)
    n_rows, n_layers, k = experts.shape
    empty = empty_summary(n_layers, n_experts, k, max_pass)
    first = min(count_from, n_rows)
    ranges = max(1, min(numba.get_num_threads(), (n_rows - first) // _SUMMARY_BLOCK)) if parallel else 1
    bounds = np.linspace(first, n_rows, ranges + 1).astype(np.int64)
    block = max(1, min(_SUMMARY_BLOCK, n_rows - first))
    buffers = [np.stack([b] * ranges) for b in _window_buffers(block, n_layers, k, n_experts, max_pass)]
    parts = [
        np.zeros((ranges, *a.shape), np.int64)
        for a in (empty.joint, empty.sum_distinct_experts, empty.sum_sq_distinct_experts, empty.sum_max_tokens_per_expert)
    ]
    low = _low_masks(max_pass)
    if parallel:
        _summarize_parallel(experts, starts, n_experts, low, bounds, *buffers, *parts)
    else:
        _summarize_rows(experts, starts, n_experts, low, bounds[0], bounds[1], *(b[0] for b in buffers), *(p[0] for p in parts))
    joint, *sums = (p.sum(axis=0) for p in parts)
    joint[:, 0, 0] = 0  # incomplete windows
    return WindowSummary(k, n_experts, joint, *sums)
