"""Routing features of unions of windows: batches of sequences and real speculative passes (Numba).

A *group* is a set of windows (row ranges) verified in one pass: B sequences decoding together
(MoESD: each contributes n tokens, ragged n allowed), or one sequence's verify pass. Per group
and MoE layer the features are those of the union of all its slots: tokens Σn, slots Σn·K,
distinct experts U, max tokens per expert M, and optionally a histogram of tokens per expert.

Layout as in `moesim.kernels.windows`: `experts` (T, L, K) ids, windows named by first row and
length. Groups are given flat: windows `group_offsets[g]..group_offsets[g+1]-1` form group g.

Where windows come from:
- `batch_lanes` + `batch_windows`: B lanes decoding together, each lane a different sequence
  of the trace (staggered: lane b starts a fraction b/B into its sequence), or (when the trace
  has fewer than B sequences) B equal segments of one sequence; `BatchLanes.source` says which.
- `speculative_passes`: the windows of real verify passes from per-step accepted counts (a pass
  of k+1 tokens commits accepted+1, the next pass starts there); `sample_accepted_geometric`
  draws the accepted counts for an acceptance rate α with a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from moesim.kernels.features import RoutingFeatures
from moesim.kernels.jit import njit


@njit
def _union_groups(experts, n_experts, group_offsets, starts, lengths, counts, out_u, out_m, hist):  # noqa: ANN001, ANN202
    """Fill out_u[g, l], out_m[g, l] for each group; if hist has more than one column, add each
    expert's token count c >= 1 to hist[l, c]. `counts` (L, W), W > E, is zero on entry and on
    exit; an id >= E lands in a column >= E (ids are clamped to W - 1, no branch per slot) and
    is caught once per group."""
    _, n_layers, k = experts.shape
    width = counts.shape[1]
    with_hist = hist.shape[1] > 1
    for g in range(group_offsets.shape[0] - 1):
        for w in range(group_offsets[g], group_offsets[g + 1]):
            for t in range(starts[w], starts[w] + lengths[w]):
                for layer in range(n_layers):
                    for j in range(k):
                        counts[layer, min(np.intp(experts[t, layer, j]), width - 1)] += 1
        stray = 0
        for layer in range(n_layers):
            u = 0
            m = 0
            if with_hist:
                for e in range(n_experts):
                    c = counts[layer, e]
                    if c:
                        hist[layer, c] += 1
            for e in range(n_experts):
                c = counts[layer, e]
                u += c > 0
                m = max(m, c)
                counts[layer, e] = 0
            for e in range(n_experts, width):
                stray |= counts[layer, e]
                counts[layer, e] = 0
            out_u[g, layer] = u
            out_m[g, layer] = m
        if stray:
            raise ValueError("expert id >= n_experts")


@njit(parallel=True)
def _union_groups_parallel(experts, n_experts, group_offsets, starts, lengths, bounds, counts, out_u, out_m, hist):  # noqa: ANN001, ANN202
    """`_union_groups` for group ranges [bounds[b], bounds[b+1]) in parallel, scratch counts[b]."""
    for b in numba.prange(bounds.shape[0] - 1):
        g0, g1 = bounds[b], bounds[b + 1]
        _union_groups(experts, n_experts, group_offsets[g0 : g1 + 1], starts, lengths, counts[b], out_u[g0:g1], out_m[g0:g1], hist[b])


@dataclass(frozen=True)
class UnionFeatures:
    """Features of G groups of windows per MoE layer.

    `distinct_experts[g, l]`, `max_tokens_per_expert[g, l]`; `n_tokens[g]` = Σ window lengths;
    `tokens_per_expert_histogram[l, c]` (when requested): over all groups, experts of layer l
    that received exactly c of their group's tokens (c >= 1; column 0 is 0).
    """

    top_k: int
    n_tokens: np.ndarray  # (G,) int64
    distinct_experts: np.ndarray  # (G, L) int64
    max_tokens_per_expert: np.ndarray  # (G, L) int64
    tokens_per_expert_histogram: np.ndarray | None = None  # (L, C+1) int64

    def routing_features(self) -> RoutingFeatures:
        """RoutingFeatures of shape (G, L)."""
        n = self.n_tokens[:, None].astype(np.float64)
        return RoutingFeatures(n, n * self.top_k, self.distinct_experts, self.max_tokens_per_expert)

    def byte_share(self) -> np.ndarray:
        """U / (Σn·K) per group and layer: what a deduplicating engine reads per per-slot byte."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.distinct_experts / (self.n_tokens[:, None] * self.top_k)


@njit
def _windows_inside(starts, lengths, rows):  # noqa: ANN001, ANN202
    """Whether every window [starts[i], starts[i] + lengths[i]) lies within rows 0..rows."""
    for i in range(starts.shape[0]):  # noqa: SIM110 (a loop Numba compiles; all() of a generator it does not)
        if starts[i] < 0 or lengths[i] < 0 or starts[i] + lengths[i] > rows:
            return False
    return True


def _check_windows(experts: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if experts.ndim != 3 or experts.dtype.kind != "u":
        raise ValueError(f"experts must be a (T, L, K) array of unsigned ids, got {experts.dtype} {experts.shape}")
    starts = np.ascontiguousarray(starts, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    if starts.shape != lengths.shape or starts.ndim != 1:
        raise ValueError("starts and lengths must be 1-d arrays of one length")
    if not _windows_inside(starts, lengths, experts.shape[0]):
        raise ValueError(f"a window lies outside rows 0..{experts.shape[0]}")
    return starts, lengths


def union_features(
    experts: np.ndarray, starts: np.ndarray, lengths: np.ndarray, n_experts: int, scratch: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct experts and max tokens per expert of the union of the windows (rows
    starts[i]..starts[i]+lengths[i]-1), per layer: two (L,) int64 arrays.

    The per-iteration call of a simulator: pass a `scratch` from `union_scratch` to skip the
    allocation (it must be all zero; the call leaves it so).
    """
    starts, lengths = _check_windows(experts, starts, lengths)
    counts = union_scratch(experts.shape[1], n_experts) if scratch is None else scratch
    if counts.shape != (experts.shape[1], _width(n_experts)) or counts.dtype != np.int32:
        raise ValueError("scratch must come from union_scratch(n_layers, n_experts)")
    out_u = np.empty((1, experts.shape[1]), np.int64)
    out_m = np.empty((1, experts.shape[1]), np.int64)
    try:
        _union_groups(experts, n_experts, np.array([0, starts.size], np.int64), starts, lengths, counts, out_u, out_m, _NO_HIST)
    except ValueError:
        counts[:] = 0  # a reused scratch stays valid
        raise
    return out_u[0], out_m[0]


_NO_HIST = np.zeros((1, 1), np.int64)


def _width(n_experts: int) -> int:
    """Counter columns: one past the experts, where ids >= E are clamped and caught."""
    return n_experts + 1


def union_scratch(n_layers: int, n_experts: int) -> np.ndarray:
    """Zeroed per-expert counters that `union_features` reuses between calls."""
    return np.zeros((n_layers, _width(n_experts)), np.int32)


def union_features_many(
    experts: np.ndarray,
    group_offsets: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    n_experts: int,
    histogram: bool = False,
    parallel: bool = False,
) -> UnionFeatures:
    """Features of every group of windows (see the module docstring for the layout)."""
    starts, lengths = _check_windows(experts, starts, lengths)
    offsets = np.ascontiguousarray(group_offsets, np.int64)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != starts.size or np.any(np.diff(offsets) < 0):
        raise ValueError("group_offsets must rise from 0 to the number of windows")
    n_groups, n_layers = offsets.size - 1, experts.shape[1]
    cumulative = np.concatenate([[0], np.cumsum(lengths)])
    tokens = cumulative[offsets[1:]] - cumulative[offsets[:-1]]
    ranges = max(1, min(numba.get_num_threads(), n_groups // 64)) if parallel else 1
    bounds = np.linspace(0, n_groups, ranges + 1).astype(np.int64)
    width = int(tokens.max()) + 1 if histogram and n_groups else 1
    hist = np.zeros((ranges, n_layers, width), np.int64)
    counts = np.zeros((ranges, n_layers, _width(n_experts)), np.int32)
    out_u = np.zeros((n_groups, n_layers), np.int64)
    out_m = np.zeros((n_groups, n_layers), np.int64)
    if parallel:
        _union_groups_parallel(experts, n_experts, offsets, starts, lengths, bounds, counts, out_u, out_m, hist)
    else:
        _union_groups(experts, n_experts, offsets, starts, lengths, counts[0], out_u, out_m, hist[0])
    return UnionFeatures(experts.shape[2], tokens, out_u, out_m, hist.sum(axis=0) if histogram else None)


# ---- passes of a server: windows, prefill blocks, expert-parallel ranks -------------------------


@njit
def _union_pass(experts, n_experts, starts, lengths, checkpoints, block_lo, block_hi, ranks, counts, out_u, out_m, out_s):  # noqa: ANN001, ANN202
    """Count the windows' slots and add the blocks' counts (checkpoints[hi] − checkpoints[lo]) per
    (layer, expert), then per rank r (experts r·E/R .. (r+1)·E/R − 1) and layer: distinct experts,
    max tokens per expert and slots; `counts` is zero on entry and on exit (as `_union_groups`)."""
    _, n_layers, k = experts.shape
    width = counts.shape[1]
    for w in range(starts.shape[0]):
        for t in range(starts[w], starts[w] + lengths[w]):
            for layer in range(n_layers):
                for j in range(k):
                    counts[layer, min(np.intp(experts[t, layer, j]), width - 1)] += 1
    for b in range(block_lo.shape[0]):
        lo, hi = block_lo[b], block_hi[b]
        for layer in range(n_layers):
            for e in range(n_experts):
                counts[layer, e] += checkpoints[hi, layer, e] - checkpoints[lo, layer, e]
    per_rank = n_experts // ranks
    stray = 0
    for layer in range(n_layers):
        for r in range(ranks):
            u = 0
            m = 0
            slots = 0
            for e in range(r * per_rank, (r + 1) * per_rank):
                c = counts[layer, e]
                u += c > 0
                m = max(m, c)
                slots += c
                counts[layer, e] = 0
            out_u[r, layer] = u
            out_m[r, layer] = m
            out_s[r, layer] = slots
        for e in range(n_experts, width):
            stray |= counts[layer, e]
            counts[layer, e] = 0
    if stray:
        raise ValueError("expert id >= n_experts")


@njit
def _checkpoints(experts, n_experts, rows, stride, out):  # noqa: ANN001, ANN202
    """out[j, l, e] = slots of expert e in layer l among rows 0 .. j·stride − 1."""
    _, n_layers, k = experts.shape
    running = np.zeros((n_layers, n_experts), np.int32)
    for t in range(rows):
        if t % stride == 0:
            out[t // stride] = running
        for layer in range(n_layers):
            for j in range(k):
                e = np.intp(experts[t, layer, j])
                if e < n_experts:
                    running[layer, e] += 1
    out[rows // stride] = running


@dataclass(frozen=True)
class PrefillRegion:
    """The first `rows` rows of a trace (a multiple of `stride`), with cumulative slot counts per
    (layer, expert) every `stride` rows: a prefill chunk of c rows of the region costs its two
    partial ends as windows plus one difference of checkpoints, whatever c."""

    rows: int
    stride: int
    checkpoints: np.ndarray  # (rows / stride + 1, L, E) int32

    @classmethod
    def of(cls, experts: np.ndarray, n_experts: int, max_rows: int = 4096, stride: int = 16) -> PrefillRegion:
        """The region of the first min(T, max_rows) rows, rounded down to the stride (all T rows when T < stride)."""
        total = experts.shape[0]
        rows = total if total < stride else (min(total, max_rows) // stride) * stride
        step = stride if total >= stride else max(total, 1)
        out = np.zeros((rows // step + 1, experts.shape[1], n_experts), np.int32)
        _checkpoints(experts, n_experts, rows, step, out)
        return cls(rows, step, out)

    def pieces(self, first_row: int, tokens: int, windows: tuple[list[int], list[int]], blocks: tuple[list[int], list[int]]) -> None:
        """Append the windows (starts, lengths) and blocks (lo, hi) of `tokens` rows of the region
        from row `first_row` (mod rows), wrapping at its end."""
        starts, lengths = windows
        lows, highs = blocks
        row = first_row % self.rows
        left = tokens
        while left:
            end = min(row + left, self.rows)
            lo, hi = -(-row // self.stride), end // self.stride
            if lo >= hi:
                starts.append(row)
                lengths.append(end - row)
            else:
                if lo * self.stride > row:
                    starts.append(row)
                    lengths.append(lo * self.stride - row)
                lows.append(lo)
                highs.append(hi)
                if end > hi * self.stride:
                    starts.append(hi * self.stride)
                    lengths.append(end - hi * self.stride)
            left -= end - row
            row = 0


def union_pass(
    experts: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    n_experts: int,
    scratch: np.ndarray,
    region: PrefillRegion | None = None,
    block_lo: np.ndarray | None = None,
    block_hi: np.ndarray | None = None,
    ranks: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct experts, max tokens per expert and slots of one server pass, per expert-parallel
    rank and layer ((ranks, L) int64 each): the union of the windows (rows starts[i] ..
    starts[i] + lengths[i] − 1) and of the prefill region's blocks [block_lo[b]·stride,
    block_hi[b]·stride). Rank r holds experts r·E/ranks .. (r + 1)·E/ranks − 1."""
    starts, lengths = _check_windows(experts, starts, lengths)
    if scratch.shape != (experts.shape[1], _width(n_experts)) or scratch.dtype != np.int32:
        raise ValueError("scratch must come from union_scratch(n_layers, n_experts)")
    if ranks < 1 or n_experts % ranks:
        raise ValueError(f"{n_experts} experts do not split over {ranks} ranks")
    checkpoints = region.checkpoints if region is not None else _NO_CHECKPOINTS
    lo = _NO_BLOCKS if block_lo is None else np.ascontiguousarray(block_lo, np.int64)
    hi = _NO_BLOCKS if block_hi is None else np.ascontiguousarray(block_hi, np.int64)
    out = np.empty((3, ranks, experts.shape[1]), np.int64)
    try:
        _union_pass(experts, n_experts, starts, lengths, checkpoints, lo, hi, ranks, scratch, out[0], out[1], out[2])
    except ValueError:
        scratch[:] = 0
        raise
    return out[0], out[1], out[2]


_NO_CHECKPOINTS = np.zeros((1, 1, 1), np.int32)
_NO_BLOCKS = np.zeros(0, np.int64)


# ---- batches -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchLanes:
    """B lanes that decode in lockstep, in groups: lane b of group g starts at row starts[g, b]
    and has `length[g]` rows usable in every lane of the group."""

    starts: np.ndarray  # (G, B) int64
    length: np.ndarray  # (G,) int64
    source: str  # "sequences": each lane a different sequence; "offsets": B segments of one sequence
    unused_sequences: int  # sequences left over (fewer than B remained)

    @property
    def batch(self) -> int:
        """Lanes per group B."""
        return int(self.starts.shape[1])

    def describe(self) -> str:
        """One sentence on where the lanes come from."""
        g, b = self.starts.shape
        if self.source == "sequences":
            text = f"{g} groups of {b} different sequences (lane b starting b/{b} of the way in, up to the shortest of each group)"
            return text + (f"; {self.unused_sequences} sequences left over" if self.unused_sequences else "")
        return f"the trace has fewer than {b} sequences: each of its {g} sequences split into {b} equal segments decoding together"


def batch_lanes(seq_starts: np.ndarray, batch: int) -> BatchLanes:
    """Lanes for batches of `batch` sequences: consecutive groups of B sequences when the trace
    has at least B, else every sequence cut into B equal segments (B offsets of one sequence)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    starts = np.asarray(seq_starts, np.int64)
    lengths = np.diff(starts)
    n_seqs = lengths.size
    if n_seqs >= batch:
        groups = n_seqs // batch
        lane_starts = starts[: groups * batch].reshape(groups, batch)
        return BatchLanes(lane_starts, lengths[: groups * batch].reshape(groups, batch).min(axis=1), "sequences", n_seqs - groups * batch)
    segment = lengths // batch
    lane_starts = starts[:-1, None] + segment[:, None] * np.arange(batch)[None, :]
    return BatchLanes(lane_starts, segment, "offsets", 0)


def batch_windows(lanes: BatchLanes, n: int, max_batches: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch passes of n tokens per lane: pass i of a group reads rows s_b + i·n of each lane b
    (consecutive passes, as when every draft is accepted), wrapped into the lane's first L − n + 1
    rows (L = the group's usable length); lanes of different sequences are staggered, lane b
    starting ⌊b·L/B⌋ rows in, as a server's requests are at different positions (aligned lanes
    would line up whatever every sequence shares at the same position, such as a chat template);
    segments of one sequence are already apart (s_b = 0). At most `max_batches` passes, spread
    evenly over them. Returns (group_offsets, starts, lengths) for `union_features_many`."""
    if n < 1:
        raise ValueError(f"pass size n must be >= 1, got {n}")
    per_group = np.maximum(lanes.length // n, 0)
    group = np.repeat(np.arange(per_group.size), per_group)
    offset = (np.arange(group.size) - np.repeat(np.cumsum(per_group) - per_group, per_group)) * n
    if max_batches is not None and group.size > max_batches:
        keep = np.unique(np.linspace(0, group.size - 1, max_batches).round().astype(np.int64))
        group, offset = group[keep], offset[keep]
    b = lanes.batch
    length = lanes.length[group][:, None]
    shift = length * np.arange(b)[None, :] // b if lanes.source == "sequences" else np.zeros((1, b), np.int64)
    starts = (lanes.starts[group] + (offset[:, None] + shift) % (length - n + 1)).reshape(-1)
    return np.arange(0, (group.size + 1) * b, b, dtype=np.int64), starts, np.full(starts.size, n, np.int64)


# ---- speculative passes -----------------------------------------------------------------------


def speculative_passes(accepted: np.ndarray, draft_len: int | np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows of the verify passes of one sequence of `length` rows: pass i verifies
    draft_len[i] + 1 tokens from row p_i (p_0 = 0) and commits accepted[i] + 1, so
    p_{i+1} = p_i + accepted[i] + 1. Passes that would run past the sequence end are dropped
    (the trace has no routing there): the sequence ends at the first that does not fit.
    Returns (first rows, sizes), relative to the sequence.

    A contract-1 trace holds only committed tokens: a pass's rejected drafts are stood in for
    by the rows that follow the accepted ones.
    """
    accepted = np.asarray(accepted, np.int64)
    sizes = np.broadcast_to(np.asarray(draft_len, np.int64), accepted.shape) + 1
    if np.any(accepted < 0) or np.any(accepted >= sizes):
        raise ValueError("accepted counts must lie in 0..draft_len")
    first = np.cumsum(accepted + 1) - (accepted + 1)
    misfit = np.flatnonzero(first + sizes > length)
    used = int(misfit[0]) if misfit.size else first.size
    return first[:used], sizes[:used].copy()


def sample_accepted_geometric(alpha: float, draft_len: int, steps: int, seed: int) -> np.ndarray:
    """Accepted drafts per verify step under geometric acceptance: each draft token accepted with
    probability α until the first rejection, at most draft_len: P(a >= i) = α^i."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha must lie in [0, 1], got {alpha}")
    if draft_len < 0 or steps < 0:
        raise ValueError(f"draft_len and steps must be >= 0, got {draft_len}, {steps}")
    if alpha == 1.0:
        return np.full(steps, draft_len, np.int64)
    leading = np.random.default_rng(seed).geometric(1.0 - alpha, size=steps) - 1  # successes before the first failure
    return np.minimum(leading, draft_len).astype(np.int64)


def geometric_passes(alpha: float, draft_len: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Verify passes of draft_len + 1 tokens over a sequence of `length` rows under geometric
    acceptance α (seeded): (first rows, sizes, accepted counts) of the passes that fit."""
    accepted = sample_accepted_geometric(alpha, draft_len, max(length, 0), seed)  # each step commits >= 1 row
    first, sizes = speculative_passes(accepted, draft_len, length)
    return first, sizes, accepted[: first.size]
