"""The trace-driven cost model of the simulator: each verify pass costs the step-time model applied
to the routing features of the union of the batch's windows in the trace (a `BatchCostModel`).

Prefill (a stated model): a prompt of P tokens runs as ceil(P / chunk) passes of `chunk` tokens
(chunk = `prefill_chunk`, at most the length of the trace's first sequence); each is costed as
a pass over the first positions of the trace's first sequence (real routing of that many
tokens), at the context already prefilled.

A draft tree (`widths`, the verify width at each draft length k) verifies that many consecutive
positions of the request's trace sequence from its position: the routing of a tree's sibling
branches is taken from the trace's next positions (they share their prefix's context), not drawn.
A profile with a spec path (`[speculative]`) adds its `pass_us` to every target forward (verify,
plain decode, prefill chunk) and its overhead O(steps, verified tokens) to every iteration that drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import InputError
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.unions import union_features, union_scratch
from moesim.sim.cost.drafters import Drafter, draft_steps, draft_us
from moesim.sim.cost.steptime import StepTimeModel
from moesim.tracegen.formats.trace import Trace


@dataclass
class TraceBatchCost:
    """Verify passes from the trace's routing through a step-time model; drafting through the drafter."""

    model: StepTimeModel
    trace: Trace
    drafter: Drafter
    prefill_chunk: int = 512
    widths: tuple[int, ...] = ()  # verify width per draft length k (a draft tree); empty: k + 1
    last_distinct_experts: float = field(default=0.0, init=False)
    _scratch: np.ndarray = field(init=False, repr=False)
    _seq_starts: np.ndarray = field(init=False, repr=False)
    _prefill_pass_us: dict[tuple[int, int], float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        g = self.trace.meta.geometry
        if (g.top_k, g.experts, g.moe_layers) != (self.model.preset.top_k, self.model.preset.experts, self.model.preset.moe_layers):
            raise InputError(
                f"trace of '{g.model}' does not route like model '{self.model.preset.name}' (top-k, experts or MoE layers differ)"
            )
        if self.prefill_chunk < 1:
            raise InputError(f"prefill chunk must be >= 1 token, got {self.prefill_chunk}")
        self._scratch = union_scratch(len(g.moe_layers), g.experts)
        self._seq_starts = self.trace.seq_starts

    def features(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray) -> RoutingFeatures:
        """Routing features (per MoE layer) of the union of windows [starts[i], starts[i] + n_tokens[i]) of sequences seqs[i]."""
        rows = self._seq_starts[np.asarray(seqs, np.int64)] + np.asarray(starts, np.int64)
        lengths = np.asarray(n_tokens, np.int64)
        distinct, most = union_features(self.trace.experts, rows, lengths, self.trace.meta.geometry.experts, self._scratch)
        total = float(lengths.sum())
        return RoutingFeatures(np.float64(total), np.float64(total * self.model.preset.top_k), distinct, most)

    def verify_us(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray) -> float:
        """One pass of the whole batch; remembers the mean distinct experts per layer of the union. With
        a draft tree each request verifies its tree's width (its window kept inside its sequence); the
        profile's spec path adds the engine's pass_us."""
        if self.widths:
            seqs = np.asarray(seqs, np.int64)
            n_tokens = np.asarray(self.widths, np.int64)[np.asarray(n_tokens, np.int64) - 1]
            room = self._seq_starts[seqs + 1] - self._seq_starts[seqs] - n_tokens
            starts = np.clip(np.asarray(starts, np.int64), 0, np.maximum(room, 0))
        features = self.features(seqs, starts, n_tokens)
        self.last_distinct_experts = float(np.mean(features.distinct_experts))
        return self.model.pass_time_us(features, float(np.sum(context_tokens)), float(np.size(context_tokens))) + self._pass_us

    def draft_us(self, draft_lens: np.ndarray, context_tokens: np.ndarray) -> float:
        """The drafter's steps for the batch, at the batch's mean context, and the spec path's
        overhead O of the iteration (its steps, every verified token of the batch)."""
        lens = np.asarray(draft_lens)
        if not np.any(lens > 0):
            return 0.0
        drafted = draft_us(self.drafter, lens, float(np.mean(context_tokens)), self.model.dense_family_us)
        spec = self.model.profile.speculative
        if spec is None:
            return drafted
        verified = int(np.sum(np.asarray(self.widths)[lens])) if self.widths else int(np.sum(lens + 1))
        return drafted + spec.overhead_us(draft_steps(self.drafter, int(lens.max())), verified)

    @property
    def _pass_us(self) -> float:
        """The engine's time per target forward beyond the profile's families (its spec path's pass_us; 0 without one)."""
        spec = self.model.profile.speculative
        return spec.pass_us if spec is not None else 0.0

    def _chunk_us(self, tokens: int, context: int) -> float:
        if (tokens, context) not in self._prefill_pass_us:
            features = self.features(np.array([0]), np.array([0]), np.array([tokens]))
            self._prefill_pass_us[(tokens, context)] = self.model.pass_time_us(features, float(context)) + self._pass_us
        return self._prefill_pass_us[(tokens, context)]

    def prefill_us(self, prompt_tokens: int) -> float:
        """ceil(P / chunk) chunked passes (see the module docstring)."""
        chunk = min(self.prefill_chunk, int(self._seq_starts[1] - self._seq_starts[0]))
        total, done = 0.0, 0
        for _ in range(math.ceil(max(prompt_tokens, 0) / chunk)):
            tokens = min(chunk, prompt_tokens - done)
            total += self._chunk_us(tokens, done)
            done += tokens
        return total
