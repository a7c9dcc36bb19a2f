"""A trace's pass features, one home (issue 28): the routing features of the passes the closed
forms and sweeps cost, with one set of messages.

- Windows (B = 1): every window of n consecutive positions within a sequence, counted exactly —
  for n <= 64 all sizes at once (`kernels.windows`) with the windows' mean reuse features attached
  (`kernels.reuse.with_mean_reuse`), above one n at a time (`kernels.sliding`) — as a distribution
  of (U, M) cells with their probabilities (`window_distributions`).
- Batch unions (B > 1): B lanes decoding in lockstep (`kernels.unions.batch_lanes`), up to
  `max_batches` passes of n tokens per lane spread evenly over them (`batch_windows`), each the
  union of its B·n slots (`kernels.reuse.group_features`), through the disk cache (`moesim.cache`),
  keyed by the content of the trace's expert ids and of the windows (`batch_union_features`,
  `batch_distributions`: each pass and layer equally likely).
- Sampled passes: under expert parallelism the (U, M) distribution of a window says nothing of how
  its experts fall on the ranks, so a pass size is costed over up to SAMPLED_WINDOWS windows of the
  trace (spread evenly), each counted per rank (`kernels.unions.union_pass`) and priced at each
  layer's slowest rank (`StepTimeModel.ranked_pass_cost`); a batch's passes likewise, one cost per
  union (`union_pass_cost`), and the mean of sampled passes' costs (`mean_costs`).

A verify pass of a draft tree of width w is a pass of w tokens per sequence; the server's own
passes (mixed passes of chunked prefill, a batch's verify windows at each request's position) are
counted per iteration where they happen (`moesim.sim.cost.trace_batch`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moesim.cache import content_digest, group
from moesim.errors import InputError
from moesim.hw_profiles.ladder.rungs import RUNGS
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.reuse import DEFAULT_TILES, group_features, window_reuse_means, with_mean_reuse
from moesim.kernels.sliding import sliding_distribution
from moesim.kernels.unions import BatchLanes, batch_lanes, batch_windows, union_pass, union_scratch
from moesim.kernels.windows import MAX_PASS_LIMIT, summarize_windows
from moesim.sim.cost.steptime import PassCost, StepTimeModel
from moesim.tracegen.formats.trace import Trace

Distribution = tuple[RoutingFeatures, np.ndarray]  # features of every cell, and each cell's probability
Windows = tuple[np.ndarray, np.ndarray, np.ndarray]  # group offsets, first rows, lengths (`batch_windows`' layout)
SAMPLED_WINDOWS = 256  # passes sampled per pass size where the windows' distribution does not serve


def check_sizes(trace: Trace, sizes: np.ndarray) -> np.ndarray:
    """The pass sizes, none longer than the trace's longest sequence (one line otherwise)."""
    longest = int(trace.seq_lengths().max())
    if int(np.max(sizes)) > longest:
        raise InputError(f"pass size {int(np.max(sizes))} exceeds the trace's longest sequence ({longest} positions)")
    return sizes


def window_distributions(trace: Trace, sizes: np.ndarray) -> list[Distribution]:
    """Per pass size n, every (U, M) the trace's windows of n positions take with its probability:
    counted exactly, for n <= 64 all at once (`kernels.windows`) with the windows' mean reuse
    features attached (`kernels.reuse.with_mean_reuse`), above one n at a time (`kernels.sliding`)."""
    check_sizes(trace, sizes)
    experts = trace.meta.geometry.experts
    small = [int(n) for n in sizes if n <= MAX_PASS_LIMIT]
    summary = summarize_windows(trace.experts, trace.seq_starts, experts, max(small)) if small else None
    reuse = window_reuse_means(trace.experts, trace.seq_starts, experts, max(small)) if small else None
    out = []
    for n in (int(n) for n in sizes):
        if n > MAX_PASS_LIMIT:  # the counts alone: re-reads at the working-set distance
            out.append(sliding_distribution(trace.experts, trace.seq_starts, experts, n))
            continue
        features, probability = summary.feature_distribution(n)  # type: ignore[union-attr]
        out.append((with_mean_reuse(features, probability, reuse, n), probability))  # type: ignore[arg-type]
    return out


def mean_distinct_experts(trace: Trace, sizes: np.ndarray, distributions: list[Distribution]) -> np.ndarray:
    """E[U] per pass size over windows and layers (up to 64 from the window summary's per-layer
    sums, above from the distribution)."""
    small = int(max((n for n in sizes if n <= MAX_PASS_LIMIT), default=0))
    means = (
        summarize_windows(trace.experts, trace.seq_starts, trace.meta.geometry.experts, small).mean_distinct_experts() if small else None
    )
    return np.array(
        [means[n - 1] if n <= MAX_PASS_LIMIT else float(p @ f.distinct_experts) for n, (f, p) in zip(sizes, distributions, strict=True)]
    )


def _too_short(batch: int, n: int, where: str) -> InputError:
    """The one message of a batch that does not fit the trace."""
    return InputError(f"the trace is too short for a batch of {batch} sequences of {n} tokens each ({where}); lower the pass size or batch")


def fitting_lanes(trace: Trace, batch: int, n: int) -> BatchLanes:
    """The trace's lanes for a batch of `batch` sequences (`kernels.unions.batch_lanes`), checked
    to hold a pass of n tokens per lane (one line otherwise, before any lane is laid out)."""
    lengths = trace.seq_lengths()
    if lengths.size < batch and int(lengths.max()) // batch < n:  # before laying out a lane per request
        raise _too_short(batch, n, f"{lengths.size} sequences, the longest of {int(lengths.max())} positions")
    lanes = batch_lanes(trace.seq_starts, batch)
    longest = int(lanes.length.max(initial=0))
    if longest < n:
        raise _too_short(batch, n, f"{lanes.describe()}; the longest lane has {longest} positions")
    return lanes


def batch_pass_windows(trace: Trace, batch: int, n: int, max_batches: int) -> tuple[Windows, BatchLanes]:
    """Up to `max_batches` passes of `batch` lanes of n tokens each, spread evenly (`batch_windows`), and their lanes."""
    lanes = fitting_lanes(trace, batch, n)
    return batch_windows(lanes, n, max_batches), lanes


WINDOW_FEATURES = "window-features"  # the disk cache's kind of `cached_group_features` entries
_TRACE_DIGESTS: dict[int, tuple[np.ndarray, str]] = {}  # id of a trace's ids → (the array, kept alive; its content digest)


def _trace_digest(trace: Trace) -> str:
    experts = trace.experts
    entry = _TRACE_DIGESTS.get(id(experts))
    if entry is None or entry[0] is not experts:
        if len(_TRACE_DIGESTS) >= 8:
            _TRACE_DIGESTS.clear()
        entry = _TRACE_DIGESTS[id(experts)] = (experts, content_digest(experts, trace.seq_starts, trace.meta.geometry.experts))
    return entry[1]


def cached_group_features(trace: Trace, offsets: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> RoutingFeatures:
    """`group_features` of groups of windows of the trace, through the disk cache (`moesim.cache`):
    keyed by the content of the trace's expert ids and of the windows, built once per cache."""
    experts, n_experts = trace.experts, trace.meta.geometry.experts
    disk = group(WINDOW_FEATURES, _trace_digest(trace), offsets, starts, lengths)
    grid, f8 = (offsets.size - 1, experts.shape[1]), np.dtype(np.float64)
    names = ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert")
    shapes = {**{name: (grid, f8) for name in names}, "reread_histogram": ((*grid, n_experts + 1), f8)}
    shapes |= {f"chunk_reads_{t}": (grid, f8) for t in DEFAULT_TILES}
    arrays = disk.load("features", shapes) if disk is not None else None
    if arrays is not None:
        reads = {t: arrays[f"chunk_reads_{t}"] for t in DEFAULT_TILES}
        return RoutingFeatures(*(arrays[name] for name in names), arrays["reread_histogram"], reads)
    f = group_features(experts, n_experts, offsets, starts, lengths)
    if disk is not None:
        built = {name: np.asarray(getattr(f, name), np.float64) for name in (*names, "reread_histogram")}
        reads = {f"chunk_reads_{t}": np.asarray(r, np.float64) for t, r in (f.chunk_reads or {}).items()}
        disk.store("features", built | reads, compress=True)  # mostly zeros: the histogram's long distances
    return f


def batch_union_features(trace: Trace, batch: int, n: int, max_batches: int) -> tuple[RoutingFeatures, Windows, BatchLanes]:
    """Features (passes, MoE layers) of the unions of up to `max_batches` passes of `batch` lanes of n
    tokens each, through the disk cache; the windows they count and their lanes."""
    windows, lanes = batch_pass_windows(trace, batch, n, max_batches)
    return cached_group_features(trace, *windows), windows, lanes


def batch_distributions(trace: Trace, batch: int, sizes: np.ndarray, max_batches: int) -> tuple[list[Distribution], np.ndarray]:
    """Per pass size n (tokens per lane): the features of the batch unions, each (pass, layer)
    equally likely, and their mean distinct experts per layer."""
    distributions, distinct = [], []
    for n in (int(n) for n in sizes):
        f = batch_union_features(trace, batch, n, max_batches)[0]
        flat = RoutingFeatures(
            f.n_tokens.ravel(), f.slots.ravel(), f.distinct_experts.ravel(), f.max_tokens_per_expert.ravel(),
            f.reread_histogram.reshape(-1, f.reread_histogram.shape[-1]), {t: r.ravel() for t, r in f.chunk_reads.items()},
        )  # fmt: skip
        distributions.append((flat, np.full(flat.shape, 1.0 / flat.shape[0])))
        distinct.append(float(f.distinct_experts.mean()))
    return distributions, np.asarray(distinct)


def pass_distributions(trace: Trace, batch: int, sizes: np.ndarray, max_batches: int) -> tuple[list[Distribution], np.ndarray]:
    """Per-layer feature distributions of passes of B·n tokens (B sequences, n each) for every n of
    `sizes`, and the mean distinct experts per layer: B = 1 every window of the trace, exactly;
    B > 1 the batch unions (`batch_distributions`)."""
    if batch == 1:
        distributions = window_distributions(trace, sizes)
        return distributions, mean_distinct_experts(trace, sizes, distributions)
    return batch_distributions(trace, batch, sizes, max_batches)


# ---- passes sampled from the trace and their costs (expert parallel: each layer at its slowest rank) ----


def rank_counts(
    trace: Trace, offsets: np.ndarray, starts: np.ndarray, lengths: np.ndarray, ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct experts, max tokens per expert and slots per group of windows, rank and MoE layer:
    (groups, ranks, L) each."""
    experts = trace.meta.geometry.experts
    scratch = union_scratch(trace.experts.shape[1], experts)
    out = np.empty((3, len(offsets) - 1, ranks, trace.experts.shape[1]), np.int64)
    for g in range(len(offsets) - 1):
        rows = slice(int(offsets[g]), int(offsets[g + 1]))
        out[:, g] = union_pass(trace.experts, starts[rows], lengths[rows], experts, scratch, ranks=ranks)
    return out[0], out[1], out[2]


def ranked_costs(
    model: StepTimeModel, trace: Trace, windows: tuple[np.ndarray, np.ndarray, np.ndarray], context_tokens: float, sequences: float
) -> tuple[PassCost, np.ndarray]:
    """Per group of windows (`batch_windows`' layout): its cost at each layer's slowest rank, and
    its distinct experts per layer (all ranks together)."""
    offsets, starts, lengths = windows
    distinct, most, slots = rank_counts(trace, offsets, starts, lengths, model.parallel.ranks)
    tokens = np.add.reduceat(lengths, offsets[:-1]) if lengths.size else np.zeros(0)
    return model.ranked_pass_cost(distinct, most, slots, tokens, context_tokens, sequences), distinct.sum(axis=1)


def sampled_expected_costs(model: StepTimeModel, trace: Trace, sizes: np.ndarray, context_tokens: float) -> PassCost:
    """One pass of each size over up to SAMPLED_WINDOWS of the trace's windows, expert parallel: the mean of their costs."""
    windows = [batch_pass_windows(trace, 1, int(n), SAMPLED_WINDOWS)[0] for n in sizes]
    return mean_costs([ranked_costs(model, trace, w, context_tokens, 1.0)[0] for w in windows])


def union_pass_cost(
    model: StepTimeModel, trace: Trace, batch: int, n: int, max_batches: int, context_tokens: int
) -> tuple[PassCost, np.ndarray, str]:
    """Pass costs of `batch` sequences of n tokens each, each at `context_tokens`, over the trace's batch
    windows (one per window, `batch_union_features`), their mean distinct experts per layer, and
    where the lanes came from; expert parallel, each layer at its slowest rank."""
    context = float(batch * context_tokens)
    if model.parallel.ranks > 1:
        windows, lanes = batch_pass_windows(trace, batch, n, max_batches)
        cost, distinct = ranked_costs(model, trace, windows, context, float(batch))
        return cost, distinct, lanes.describe()
    features, _, lanes = batch_union_features(trace, batch, n, max_batches)
    cost = model.pass_cost(features, context, float(batch))
    return cost, features.distinct_experts, lanes.describe()


def batch_expected_costs(
    model: StepTimeModel, trace: Trace, batch: int, sizes: np.ndarray, context_tokens: int, max_batches: int = SAMPLED_WINDOWS
) -> tuple[PassCost, np.ndarray]:
    """Per pass size n: the mean cost of the trace's passes of `batch` sequences of n tokens each
    (`union_pass_cost`, `mean_costs`), and their mean distinct experts per layer."""
    passes = [union_pass_cost(model, trace, batch, int(n), max_batches, context_tokens) for n in sizes]
    return mean_costs([cost for cost, _, _ in passes]), np.array([float(np.mean(distinct)) for _, distinct, _ in passes])


def mean_costs(costs: list[PassCost]) -> PassCost:
    """One PassCost per entry: each entry's parts averaged over its windows (ε and extrapolation:
    the largest of its windows, the family: the one most of its windows took)."""
    first = costs[0]
    kinds = dict.fromkeys(k for c in costs for k in c.provenance_us)
    return dataclasses.replace(
        first,
        expert_us=np.array([np.mean(c.expert_us) for c in costs]),
        dense_us=np.array([np.mean(c.dense_us) for c in costs]),
        comm_us=np.array([np.mean(c.comm_us) for c in costs]),
        comm_epsilon=np.array([np.max(c.comm_epsilon) for c in costs]),
        expert_epsilon=np.array([np.max(c.expert_epsilon, initial=0.0) for c in costs]),
        family=np.array([_most_common(c.family) for c in costs]),
        extrapolation=np.array([np.max(c.extrapolation) for c in costs]),
        provenance_us={k: np.array([np.mean(c.provenance_us.get(k, 0.0)) for c in costs]) for k in kinds},
        expert_by_family_us={},
        rung_us=np.stack([np.asarray(c.rung_us).reshape(-1, len(RUNGS)).mean(axis=0) for c in costs]),
        bound_basis="; ".join(dict.fromkeys(c.bound_basis for c in costs)),
        engine_parts_us={k: np.array([np.mean(c.engine_parts_us[k]) for c in costs]) for k in first.engine_parts_us},
    )


def _most_common(values: np.ndarray) -> str:
    """The value most entries hold (the first of the ties)."""
    names, counts = np.unique(np.ravel(values).astype(str), return_counts=True)
    return str(names[np.argmax(counts)])
