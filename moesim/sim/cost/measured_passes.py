"""Passes of measured speculative runs (contract 2), as the step-time model sees them.

A verify step feeds the target `drafted + 1` tokens in one pass; the draft decodes a catch-up
pass (the previous step's bonus token, after its last draft when every draft was accepted) and
then one token at a time. Greedy acceptance accepts a prefix of the drafts, and attention is
causal, so a step truncated to its first k drafts is what a k-draft step at the same position
would have been: it accepts min(a, k) drafts, its verify pass routes like the first k + 1 slots.
"""

from __future__ import annotations

import numpy as np

from moesim.errors import InputError
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.unions import union_features_many
from moesim.sim.cost.steptime import StepTimeModel
from moesim.tracegen.formats.specrun import SpecRun


def truncated_tokens_per_pass(accepted: np.ndarray, draft_len: int, max_draft: int | None = None) -> np.ndarray:
    """τ(k) = mean over steps of min(a, k) + 1, for k = 0..max_draft (default draft_len): steps that
    drafted `draft_len` tokens, truncated to their first k drafts."""
    accepted = np.asarray(accepted, np.int64)
    top = draft_len if max_draft is None else max_draft
    if accepted.size == 0 or top > draft_len or np.any((accepted < 0) | (accepted > draft_len)):
        raise InputError(f"truncation needs steps that accepted 0..{draft_len} of {draft_len} drafts, and k <= {draft_len}")
    k = np.arange(top + 1)
    return (np.minimum(accepted[:, None], k[None, :]) + 1).mean(axis=0)


def _union(run: SpecRun, offsets: list[int], starts: list[int], lengths: list[int]) -> RoutingFeatures:
    union = union_features_many(run.experts, np.asarray(offsets), np.asarray(starts), np.asarray(lengths), run.meta.geometry.experts)
    return union.routing_features()


def verify_passes(run: SpecRun, draft_len: int | None = None) -> tuple[RoutingFeatures, np.ndarray]:
    """Features (steps, MoE layers) of each verify pass, as measured or truncated to draft_len + 1
    slots, and the KV length each pass reads (its first position + its tokens)."""
    starts = run.slot_start[:-1]
    sizes = np.diff(run.slot_start) if draft_len is None else np.full(starts.size, draft_len + 1)
    if np.any(sizes > np.diff(run.slot_start)):
        raise InputError(f"cannot truncate steps of {int(np.diff(run.slot_start).min()) - 1} drafts to {draft_len}")
    features = _union(run, list(range(starts.size + 1)), list(starts), list(sizes))
    return features, run.steps["pos0"].to_numpy().astype(np.float64) + sizes


def draft_passes(run: SpecRun, draft_len: int | None = None) -> tuple[RoutingFeatures, np.ndarray, np.ndarray]:
    """The draft's passes of each step (as measured, or with steps truncated to draft_len drafts):
    the catch-up pass (the bonus token of the previous step, after the last draft when all were
    accepted), then draft_len − 1 one-token passes, each routed like the target routed those
    tokens. The draft asks for the last row's logits only, and llama.cpp computes only the rows
    whose logits are asked for in the model's last layer: there a catch-up pass of two tokens
    routes one. Returns features (passes, MoE layers), each pass's step and its KV length."""
    steps = run.steps
    drafted = steps["drafted"].to_numpy().astype(np.int64)
    accepted = steps["accepted"].to_numpy().astype(np.int64)
    seq = steps["seq"].to_numpy()
    pos0 = steps["pos0"].to_numpy().astype(np.int64)
    k = drafted if draft_len is None else np.full(drafted.size, draft_len)
    offsets, starts, lengths, owner, context = [0], [], [], [], []
    for i, first in enumerate(run.slot_start[:-1]):
        # catch-up: after a step that accepted all its (kept) drafts, the draft also decodes the last one
        previous_all = i > 0 and seq[i - 1] == seq[i] and min(accepted[i - 1], k[i - 1]) == k[i - 1]
        if previous_all:
            starts.append(run.slot_start[i - 1] + k[i - 1])
            lengths.append(1)
        starts.append(first)
        lengths.append(1)
        offsets.append(len(starts))
        owner.append(i)
        context.append(pos0[i] + 1)
        for j in range(1, k[i]):
            starts.append(first + j)
            lengths.append(1)
            offsets.append(len(starts))
            owner.append(i)
            context.append(pos0[i] + j + 1)
    features = _union(run, offsets, starts, lengths)
    g = run.meta.geometry
    if g.moe_layers[-1] == g.layers - 1:  # the last layer is a MoE layer: one output row there
        k_top = float(g.top_k)
        names = ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert")
        last = [np.array(getattr(features, name), np.float64) for name in names]
        for array, value in zip(last, (1.0, k_top, k_top, 1.0), strict=True):
            array[:, -1] = value
        features = RoutingFeatures(*last)
    return features, np.asarray(owner), np.asarray(context, np.float64)


def _per_step(values: np.ndarray, owner: np.ndarray, steps: int) -> np.ndarray:
    return np.bincount(owner, weights=values, minlength=steps)


def predicted_step_times(run: SpecRun, model: StepTimeModel, draft_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Predicted draft and verify time of every step (µs), as measured or truncated to draft_len."""
    verify, verify_context = verify_passes(run, draft_len)
    features, owner, context = draft_passes(run, draft_len)
    draft = model.pass_cost(features, context).total_us()
    return _per_step(draft, owner, run.steps.height), model.pass_cost(verify, verify_context).total_us()


def plain_decode_us(model: StepTimeModel, context_tokens: np.ndarray) -> np.ndarray:
    """Predicted one-token passes (every MoE layer routes the token to K distinct experts)."""
    k, layers = model.preset.top_k, len(model.preset.moe_layers)
    ones = np.ones((np.size(context_tokens), layers))
    return model.pass_cost(RoutingFeatures(ones, ones * k, ones * k, ones), np.asarray(context_tokens, np.float64)).total_us()
