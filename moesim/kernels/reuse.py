"""Reuse features of passes (Numba): how far apart a per-slot kernel re-reads an expert, and how
often a tiled kernel re-reads one, per pass and MoE layer.

A per-slot kernel reads its expert once per slot, slots in token-major order (slot t·K + j of the
pass). A re-read of expert e at slot s, whose previous read in the pass was at slot p, has LRU
stack distance

    d(s) = |{distinct experts among slots p+1 .. s}|      (e itself counted once; `same` routing: d = K)

so d·b_e bytes were streamed between the two reads, and a cache of C bytes keeps the expert with
share min(1, C / (d·b_e)). `reread_histogram[..., d]` counts the re-reads at distance d
(d = 1..E; column 0 is 0), so any capacity can be evaluated later (`cached_rereads`). A kernel
that serves up to T tokens of an expert per weight read reads expert e ceil(c_e / T) times
(c_e = slots on e): `chunk_reads[T]` = Σ_e ceil(c_e / T) (T = 16: the hand-written dedup kernel).

- `reuse_features_many`: per group of windows (the layout of `unions.union_features_many`: a
  group's slots in window order, then token order) and MoE layer.
- `stream_histogram`: one slot stream (calibration routings simulated without a trace).
- `window_reuse_means`: per pass size n = 1..N, the means over every window of n consecutive
  positions (pooled over MoE layers) of the histogram and of the chunk reads, for the expected
  pass costs over a trace. A slot's distance does not depend on the window holding it, and a
  window of n rows holds both reads of a re-read whose rows are g apart in n − g start positions
  (within its sequence): one scan of the trace gives every n at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.kernels.features import RoutingFeatures
from moesim.kernels.jit import njit
from moesim.kernels.unions import union_features_many

DEFAULT_TILES = (8, 16, 32)  # the tokens-per-read of the tiled structures a profile fit tries


@njit(inline="always")
def _touch(stack, size, e):  # noqa: ANN001, ANN202
    """Move expert e to the top of the LRU stack (stack[0] = most recent); return (its distance
    before the move, 0 for a first read, and the new size)."""
    position = -1
    for i in range(size):
        if stack[i] == e:
            position = i
            break
    if position < 0:
        position = size
        size += 1
        distance = 0
    else:
        distance = position + 1
    for i in range(position, 0, -1):
        stack[i] = stack[i - 1]
    stack[0] = e
    return distance, size


@njit
def _groups(experts, n_experts, group_offsets, starts, lengths, tiles, hist, reads):  # noqa: ANN001, ANN202
    """hist[g, l, d] and reads[i, g, l] (tile tiles[i]) of every group (see the module docstring)."""
    _, n_layers, k = experts.shape
    stack = np.empty(n_experts, np.int64)
    counts = np.zeros(n_experts, np.int64)
    for g in range(group_offsets.shape[0] - 1):
        for layer in range(n_layers):
            size = 0
            for w in range(group_offsets[g], group_offsets[g + 1]):
                for t in range(starts[w], starts[w] + lengths[w]):
                    for j in range(k):
                        e = np.intp(experts[t, layer, j])
                        if e >= n_experts:
                            raise ValueError("expert id >= n_experts")
                        distance, size = _touch(stack, size, e)
                        hist[g, layer, distance] += distance > 0
                        counts[e] += 1
            for e in range(n_experts):
                c = counts[e]
                if c:
                    for i in range(tiles.shape[0]):
                        reads[i, g, layer] += (c + tiles[i] - 1) // tiles[i]
                counts[e] = 0
        hist[g, :, 0] = 0


@dataclass(frozen=True)
class ReuseFeatures:
    """Per group (or pass) and MoE layer: re-reads by LRU stack distance, and reads per tile width."""

    reread_histogram: np.ndarray  # (G, L, E + 1) int64, column d = re-reads at distance d
    chunk_reads: dict[int, np.ndarray]  # tile T -> (G, L) int64: Σ_e ceil(c_e / T)


def reuse_features_many(
    experts: np.ndarray,
    group_offsets: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    n_experts: int,
    tiles: tuple[int, ...] = DEFAULT_TILES,
) -> ReuseFeatures:
    """Reuse features of every group of windows (layout of `unions.union_features_many`)."""
    offsets = np.ascontiguousarray(group_offsets, np.int64)
    starts = np.ascontiguousarray(starts, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    if experts.ndim != 3:
        raise ValueError(f"experts must be a (T, L, K) array of ids, got shape {experts.shape}")
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != starts.size or np.any(np.diff(offsets) < 0):
        raise ValueError("group_offsets must rise from 0 to the number of windows")
    if starts.size and (starts.min() < 0 or lengths.min() < 0 or (starts + lengths).max() > experts.shape[0]):
        raise ValueError(f"a window lies outside rows 0..{experts.shape[0]}")
    tile_array = _tiles(tiles)
    n_groups, n_layers = offsets.size - 1, experts.shape[1]
    hist = np.zeros((n_groups, n_layers, n_experts + 1), np.int64)
    reads = np.zeros((tile_array.size, n_groups, n_layers), np.int64)
    _groups(experts, n_experts, offsets, starts, lengths, tile_array, hist, reads)
    return ReuseFeatures(hist, {int(t): reads[i] for i, t in enumerate(tile_array)})


def _tiles(tiles: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(tiles, np.int64).reshape(-1)
    if array.size and array.min() < 1:
        raise ValueError(f"tile widths must be >= 1, got {tiles}")
    return array


@njit
def _stream(stream, n_experts, hist):  # noqa: ANN001, ANN202
    stack = np.empty(n_experts, np.int64)
    size = 0
    for s in range(stream.shape[0]):
        distance, size = _touch(stack, size, np.intp(stream[s]))
        hist[distance] += distance > 0


@njit
def _streams(streams, n_experts, hist):  # noqa: ANN001, ANN202
    for i in range(streams.shape[0]):
        _stream(streams[i], n_experts, hist[i])


def stream_histogram(stream: np.ndarray, n_experts: int) -> np.ndarray:
    """(..., E + 1) re-reads by LRU stack distance of slot streams (last axis: ids in 0..E−1, in read order)."""
    ids = np.asarray(stream, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
        raise ValueError("expert id outside 0..n_experts-1")
    flat = np.ascontiguousarray(ids.reshape(-1, ids.shape[-1] if ids.ndim else 0))
    hist = np.zeros((flat.shape[0], n_experts + 1), np.int64)
    _streams(flat, n_experts, hist)
    return hist.reshape((*ids.shape[:-1], n_experts + 1))


@njit
def _window_means(experts, seq_starts, n_experts, max_pass, tiles, hist_sum, reads_sum, windows):  # noqa: ANN001, ANN202
    """Sums over all windows of n = 1..max_pass rows (pooled over layers) of the histogram, the
    chunk reads per tile, and the window count per n."""
    _, n_layers, k = experts.shape
    stack = np.empty(n_experts, np.int64)
    last_row = np.empty(n_experts, np.int64)
    counts = np.zeros(n_experts, np.int64)
    for q in range(seq_starts.shape[0] - 1):
        lo, hi = seq_starts[q], seq_starts[q + 1]
        for n in range(1, max_pass + 1):
            windows[n - 1] += max(0, hi - lo - n + 1)
        for layer in range(n_layers):
            size = 0
            for t in range(lo, hi):
                for j in range(k):
                    e = np.intp(experts[t, layer, j])
                    distance, size = _touch(stack, size, e)
                    if distance > 0:
                        gap = t - last_row[e]
                        for n in range(gap + 1, max_pass + 1):
                            first = max(lo, t - n + 1)
                            final = min(last_row[e], hi - n)
                            if final >= first:
                                hist_sum[n - 1, distance] += final - first + 1
                    last_row[e] = t
            # chunk reads: slide a window of n rows over the sequence, per n
            for n in range(1, max_pass + 1):
                if hi - lo < n:
                    break
                for i in range(tiles.shape[0]):
                    tile = tiles[i]
                    total = 0
                    for t in range(lo, hi):
                        for j in range(k):
                            e = np.intp(experts[t, layer, j])
                            total += counts[e] % tile == 0  # c -> c + 1 starts a new read
                            counts[e] += 1
                        if t - lo >= n:
                            for j in range(k):
                                e = np.intp(experts[t - n, layer, j])
                                counts[e] -= 1
                                total -= counts[e] % tile == 0
                        if t - lo >= n - 1:
                            reads_sum[i, n - 1] += total
                    for t in range(max(lo, hi - n), hi):
                        for j in range(k):
                            counts[np.intp(experts[t, layer, j])] = 0


def window_reuse_means(
    experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, max_pass: int, tiles: tuple[int, ...] = DEFAULT_TILES
) -> ReuseFeatures:
    """Per pass size n = 1..max_pass, means over every window of n rows and over the MoE layers:
    `reread_histogram` (N, E + 1) float, `chunk_reads[T]` (N,) float (NaN where no window fits)."""
    if max_pass < 1:
        raise ValueError(f"max_pass must be >= 1, got {max_pass}")
    starts = np.ascontiguousarray(seq_starts, np.int64)
    tile_array = _tiles(tiles)
    hist_sum = np.zeros((max_pass, n_experts + 1), np.float64)
    reads_sum = np.zeros((tile_array.size, max_pass), np.float64)
    windows = np.zeros(max_pass, np.float64)
    if experts.shape[0]:
        _window_means(experts, starts, n_experts, max_pass, tile_array, hist_sum, reads_sum, windows)
    per = windows * experts.shape[1]
    with np.errstate(invalid="ignore", divide="ignore"):
        hist = hist_sum / per[:, None]
        reads = reads_sum / per[None, :]
    return ReuseFeatures(hist, {int(t): reads[i] for i, t in enumerate(tile_array)})


def cached_rereads(histogram: np.ndarray, expert_bytes: np.ndarray | float, cache_bytes: float) -> np.ndarray:
    """H = Σ_d hist[..., d]·min(1, C / (d·b_e)): re-reads the cache serves (last axis = d)."""
    hist = np.asarray(histogram, np.float64)
    distance = np.arange(hist.shape[-1], dtype=np.float64)
    distance[0] = np.inf
    share = np.minimum(1.0, cache_bytes / (distance * np.asarray(expert_bytes, np.float64)[..., None]))
    return (hist * share).sum(axis=-1)


def group_features(
    experts: np.ndarray, n_experts: int, group_offsets: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> RoutingFeatures:
    """Per group of windows (the layout of `unions.union_features_many`) and MoE layer: the counts
    of `unions` with the reuse features of this module, shape (groups, L)."""
    counts = union_features_many(experts, group_offsets, starts, lengths, n_experts).routing_features()
    reuse = reuse_features_many(experts, group_offsets, starts, lengths, n_experts)
    return RoutingFeatures(
        counts.n_tokens, counts.slots, counts.distinct_experts, counts.max_tokens_per_expert, reuse.reread_histogram, reuse.chunk_reads
    )


def window_features(experts: np.ndarray, n_experts: int, starts: np.ndarray, lengths: np.ndarray) -> RoutingFeatures:
    """`group_features` of single windows (rows starts[i]..starts[i]+lengths[i]-1): shape (windows, L)."""
    return group_features(experts, n_experts, np.arange(len(starts) + 1), starts, lengths)


def with_mean_reuse(features: RoutingFeatures, probability: np.ndarray, means: ReuseFeatures, n: int) -> RoutingFeatures:
    """Cells of a feature distribution of pass size n (`windows.WindowSummary.feature_distribution`)
    with the window means of pass size n attached, so that every time model linear in the re-reads
    gets their expectation exactly: each cell's histogram is the mean scaled to its own S − U
    re-reads, its tile reads its U plus the mean excess over U."""
    u = features.distinct_experts
    mean_u = float(np.sum(probability * u))
    hist = np.asarray(means.reread_histogram[n - 1], np.float64)
    total = float(hist.sum())
    rereads = features.slots - u
    scale = np.where(total > 0, rereads / max(total, 1e-300), 0.0)
    cells_hist = scale[..., None] * hist
    reads = {t: u + max(float(r[n - 1]) - mean_u, 0.0) for t, r in means.chunk_reads.items()}
    return RoutingFeatures(features.n_tokens, features.slots, u, features.max_tokens_per_expert, cells_hist, reads)
