"""Judge a routing trace against another (synthetic against real) on what matters downstream.

Per MoE layer: the distribution of distinct experts U(n) over windows of n = 1..64 tokens (mean,
p10, p90; windows lie inside one sequence, a sequence shorter than n gives none), the reuse at
lags 1..8 (mean |S_t ∩ S_t+d| / K), the busiest expert's share of the layer's slots, and the
distinct experts of the union of B sequences' windows (B lanes: B different sequences drawn at
random, each window at a uniformly random start, so lanes are staggered, not aligned). Errors of
U(n) are relative, per layer and per layer group (the group's mean U), the worst over n; reuse
errors are differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.kernels.locality import mean_distinct_experts, reuse
from moesim.kernels.unions import union_features_many
from moesim.kernels.windows import iter_window_features
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.routing.synth import RoutingGenerator, synthesize_layout

MAX_WINDOW = 64
REUSE_LAGS = 8
UNION_BATCHES = (1, 2, 4, 8, 16, 32, 64)
UNION_WINDOWS = (1, 4, 8)
UNION_DRAWS = 256
U_TOLERANCE = 0.03  # the acceptance's relative tolerance on mean distinct experts
REUSE_TOLERANCE = 0.02  # and on reuse at lag 1


@dataclass(frozen=True)
class RoutingStats:
    """What a trace's routing looks like downstream, per MoE layer."""

    distinct_mean: np.ndarray  # (L, 64) mean U(n), NaN where no window of n tokens exists
    distinct_p10: np.ndarray  # (L, 64)
    distinct_p90: np.ndarray  # (L, 64)
    windows: np.ndarray  # (64,) windows of each size
    reuse: np.ndarray  # (L, 8)
    busiest_share: np.ndarray  # (L,) the busiest expert's share of the layer's slots
    union: np.ndarray  # (len(UNION_WINDOWS), len(UNION_BATCHES), L) mean distinct experts of B lanes' windows


def _window_distribution(trace: Trace, max_window: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and n, p10 and p90 of U over windows (exact quantiles of the counts' histogram)."""
    g = trace.meta.geometry
    n_layers = len(g.moe_layers)
    top = min(max_window * g.top_k, g.experts)
    hist = np.zeros((n_layers, max_window, top + 1), np.int64)
    cell = (np.arange(n_layers)[:, None] * max_window + np.arange(max_window)[None, :]) * (top + 1)
    for block in iter_window_features(trace.experts, trace.seq_starts, g.experts, max_window):
        u = block.distinct_experts.astype(np.int64)  # (R, L, N); 0 where the window would leave its sequence
        hist += np.bincount((cell[None] + u).reshape(-1), minlength=hist.size).reshape(hist.shape)
    hist[:, :, 0] = 0
    cdf = np.cumsum(hist, axis=2) / np.maximum(hist.sum(axis=2, keepdims=True), 1)
    quantile = [np.argmax(cdf >= q, axis=2).astype(np.float64) for q in (0.1, 0.9)]
    empty = hist.sum(axis=2) == 0
    return tuple(np.where(empty, np.nan, v) for v in quantile)  # type: ignore[return-value]


def _union_lanes(seq_starts: np.ndarray, batch: int, n: int, draws: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """`draws` groups of `batch` windows of n tokens: distinct sequences (a random permutation,
    repeated when batch exceeds the sequences), each window at a uniformly random start."""
    lengths = np.diff(seq_starts)
    usable = np.flatnonzero(lengths >= n)
    seqs = np.stack([np.resize(rng.permutation(usable), batch) for _ in range(draws)]).reshape(-1)
    starts = seq_starts[seqs] + rng.integers(0, lengths[seqs] - n + 1)
    return np.arange(0, (draws + 1) * batch, batch, dtype=np.int64), starts, np.full(starts.size, n, np.int64)


def routing_stats(trace: Trace, seed: int = 0, max_window: int = MAX_WINDOW) -> RoutingStats:
    """The downstream statistics of a trace (unions from `seed`)."""
    g = trace.meta.geometry
    starts = trace.seq_starts
    p10, p90 = _window_distribution(trace, max_window)
    counts = np.zeros((len(g.moe_layers), g.experts), np.int64)
    for layer in range(counts.shape[0]):
        counts[layer] = np.bincount(trace.experts[:, layer, :].reshape(-1).astype(np.intp), minlength=g.experts)
    rng = np.random.default_rng(seed)
    union = np.stack(
        [
            np.stack(
                [
                    union_features_many(trace.experts, *_union_lanes(starts, b, n, UNION_DRAWS, rng), g.experts).distinct_experts.mean(
                        axis=0
                    )
                    for b in UNION_BATCHES
                ]
            )
            for n in UNION_WINDOWS
        ]
    )
    lengths = np.diff(starts)
    return RoutingStats(
        distinct_mean=mean_distinct_experts(trace.experts, starts, g.experts, max_window),
        distinct_p10=p10,
        distinct_p90=p90,
        windows=np.maximum(lengths[:, None] - np.arange(1, max_window + 1)[None, :] + 1, 0).sum(axis=0),
        reuse=reuse(trace.experts, starts, g.experts, REUSE_LAGS),
        busiest_share=counts.max(axis=1) / counts.sum(axis=1),
        union=union,
    )


LAYER_GROUPINGS = {
    "per layer": None,
    "1, 2-3, 4-26": ((0,), (1, 2), tuple(range(3, 26))),
    "thirds": (tuple(range(0, 9)), tuple(range(9, 18)), tuple(range(18, 26))),
    "all layers": (tuple(range(26)),),
}


@dataclass(frozen=True)
class Verdict:
    """How far a predicted trace's statistics land from a judged trace's."""

    worst_layer_u: float  # max over layers and n of |U_pred / U_judged − 1|
    layers_within_u: int  # layers within U_TOLERANCE at every n
    layers: int
    pooled_u: float  # the same for the mean over layers
    worst_layer_reuse_1: float  # max over layers of |reuse_1 gap|
    layers_within_reuse_1: int
    pooled_reuse_1: float  # mean over layers, signed (predicted − judged)
    grouped_u: dict[str, float]  # worst over the groups of a grouping and over n


def _relative(predicted: np.ndarray, judged: np.ndarray) -> np.ndarray:
    """|predicted/judged − 1| where both are defined (n with windows in both), else 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(predicted / judged - 1)
    return np.nan_to_num(rel, nan=0.0)


def judge(predicted: RoutingStats, judged: RoutingStats, groupings: dict[str, tuple[tuple[int, ...], ...] | None] | None = None) -> Verdict:
    """Compare the mean distinct experts and lag-1 reuse of two traces of one geometry."""
    groupings = LAYER_GROUPINGS if groupings is None else groupings
    rel = _relative(predicted.distinct_mean, judged.distinct_mean)  # (L, N)
    gap = predicted.reuse[:, 0] - judged.reuse[:, 0]
    n_layers = rel.shape[0]
    grouped = {}
    for name, groups in groupings.items():
        if groups is None:
            grouped[name] = float(rel.max())
            continue
        if max(max(g) for g in groups) >= n_layers:
            continue
        grouped[name] = max(
            float(_relative(predicted.distinct_mean[list(g)].mean(axis=0), judged.distinct_mean[list(g)].mean(axis=0)).max())
            for g in groups
        )
    return Verdict(
        worst_layer_u=float(rel.max()),
        layers_within_u=int((rel.max(axis=1) <= U_TOLERANCE).sum()),
        layers=n_layers,
        pooled_u=float(_relative(predicted.distinct_mean.mean(axis=0), judged.distinct_mean.mean(axis=0)).max()),
        worst_layer_reuse_1=float(np.abs(gap).max()),
        layers_within_reuse_1=int((np.abs(gap) <= REUSE_TOLERANCE).sum()),
        pooled_reuse_1=float(gap.mean()),
        grouped_u=grouped,
    )


def synthetic_like(trace: Trace, generator: RoutingGenerator, copies: int, seed: int) -> Trace:
    """A synthetic trace of the trace's geometry on `copies` repetitions of its sequence lengths."""
    return synthesize_layout(trace.meta.geometry, generator, np.tile(trace.seq_lengths(), copies), seed)
