"""Passes the closed forms cost from sampled windows: expert parallel (per-rank counts, each
layer at its slowest rank: `StepTimeModel.ranked_pass_cost`), and the mean of sampled passes' costs.

Under expert parallelism the (U, M) distribution of a window says nothing of how its experts fall
on the ranks, so a pass size is costed over up to SAMPLED_WINDOWS windows of the trace (spread
evenly, `kernels.unions.batch_windows`), each counted per rank (`kernels.unions.union_pass`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moesim.hw_profiles.ladder.rungs import RUNGS
from moesim.kernels.unions import union_pass, union_scratch
from moesim.sim.cost.pass_features import batch_pass_windows, batch_union_features
from moesim.sim.cost.steptime import PassCost, StepTimeModel
from moesim.tracegen.formats.trace import Trace

SAMPLED_WINDOWS = 256


def rank_counts(
    trace: Trace, offsets: np.ndarray, starts: np.ndarray, lengths: np.ndarray, ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct experts, max tokens per expert and slots per group of windows, rank and MoE layer:
    (groups, ranks, L) each."""
    experts = trace.meta.geometry.experts
    scratch = union_scratch(trace.experts.shape[1], experts)
    out = np.empty((3, len(offsets) - 1, ranks, trace.experts.shape[1]), np.int64)
    for group in range(len(offsets) - 1):
        rows = slice(int(offsets[group]), int(offsets[group + 1]))
        out[:, group] = union_pass(trace.experts, starts[rows], lengths[rows], experts, scratch, ranks=ranks)
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
    windows (one per window, `moesim.sim.cost.pass_features`), their mean distinct experts per layer,
    and where the lanes came from; expert parallel, each layer at its slowest rank."""
    context = float(batch * context_tokens)
    if model.parallel.ranks > 1:
        windows, lanes = batch_pass_windows(trace, batch, n, max_batches)
        cost, distinct = ranked_costs(model, trace, windows, context, float(batch))
        return cost, distinct, lanes.describe()
    features, _, lanes = batch_union_features(trace, batch, n, max_batches)
    cost = model.pass_cost(features, context, float(batch))
    return cost, features.distinct_experts, lanes.describe()


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
