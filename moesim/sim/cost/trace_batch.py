"""The trace-driven cost model of the simulator: each verify pass costs the step-time model applied
to the routing features of the union of the batch's windows in the trace (a `BatchCostModel`);
and the cost model of a dense target, which needs no trace (`DenseBatchCost`).

Prefill (a stated model): a prompt of P tokens runs as ceil(P / chunk) passes of `chunk` tokens
(chunk = `prefill_chunk`, at most the length of the trace's first sequence); each is costed as
a pass over the first positions of the trace's first sequence (real routing of that many
tokens), at the context already prefilled.

Mixed passes (chunked prefill beside decode): the union of the decode windows and of every
prefill chunk's tokens. A chunk's prompt positions route like rows of the trace's *prefill
region* (its first ≤ 4096 rows, `moesim.kernels.unions.PrefillRegion`): position p of a request
decoding sequence s reads region row (first row of s + p) mod R, so requests sharing a sequence
share their prompt's routing, as they share its text. A chunk attends to its prompt so far (its
context is its last position). Over expert-parallel ranks every pass goes through the union
of the windows and chunks per rank (`union_pass`).

A draft tree (`widths`, the verify width at each draft length k) verifies that many consecutive
positions of the request's trace sequence from its position: the routing of a tree's sibling
branches is taken from the trace's next positions (they share their prefix's context), not drawn.
A profile with engine terms (`[speculative]`) prices every target forward (verify, plain decode,
prefill chunk, mixed pass) with the engine's time per forward inside the step-time model
(`StepTimeModel.engine_us`), and adds its overhead O(steps, verified tokens) to every iteration
that drafts (a separate draft model's steps each a whole forward of its layers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import InputError
from moesim.hw_profiles.speculative import SpecPath
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.unions import PrefillRegion, union_features, union_pass, union_scratch
from moesim.sim.cost.drafters import Drafter, FixedDrafter, draft_model_layers, draft_steps, draft_us
from moesim.sim.cost.fast_pass import NEED_PYTHON, NEED_TABLE, OUTSIDE, STRAY_ID, pass_total_us, scratch_for
from moesim.sim.cost.pass_table import NO_CHUNKS, PrefillChunks
from moesim.sim.cost.steptime import StepTimeModel
from moesim.tracegen.formats.trace import Trace


def spec_overhead_us(
    spec: SpecPath | None,
    drafter: Drafter,
    draft_len: int,
    verified_tokens: int,
    requests: int,
    target_layers: int,
    scale: dict[str, float] | None = None,
) -> float:
    """O of one speculative iteration (`SpecPath.overhead_us`): the drafter's steps at draft length
    k (a separate draft model's each a whole forward), every verified token of the batch; 0 without a [speculative] table."""
    if spec is None:
        return 0.0
    return spec.overhead_us(draft_steps(drafter, draft_len), verified_tokens, draft_model_layers(drafter), requests, target_layers, scale)


@dataclass
class _Drafting:
    """Drafting, the spec path's terms and the non-mixed prefill, shared by the trace-driven and the
    dense cost models."""

    model: StepTimeModel
    drafter: Drafter
    prefill_chunk: int
    widths: tuple[int, ...]
    _prefill_pass_us: dict[tuple[int, int], float]

    @property
    def free(self) -> bool:
        """A drafter of no cost (n-gram lookup): every draft costs 0 µs."""
        return isinstance(self.drafter, FixedDrafter) and self.drafter.step_time_us == 0.0

    def verify_tokens(self, n_tokens: np.ndarray) -> np.ndarray:
        """Tokens each request verifies: its tree's width at its draft length n − 1 (n without a tree)."""
        return np.asarray(self.widths, np.int64)[np.asarray(n_tokens, np.int64) - 1] if self.widths else n_tokens

    def draft_us(self, draft_lens: np.ndarray, context_tokens: np.ndarray) -> float:
        """The drafter's steps for the batch, at the batch's mean context, and the spec path's
        overhead O of the iteration (its steps, every verified token of the batch)."""
        lens = np.asarray(draft_lens)
        if not np.any(lens > 0):
            return 0.0
        context = float(context_tokens.sum()) / context_tokens.size
        drafted = 0.0 if self.free else draft_us(self.drafter, lens, context, self.model.dense_family_us)
        spec = self.model.profile.speculative
        if spec is None:
            return drafted
        verified = int(np.sum(np.asarray(self.widths)[lens])) if self.widths else int(np.sum(lens + 1))
        return drafted + spec_overhead_us(spec, self.drafter, int(lens.max()), verified, int(lens.size), self.model.preset.layers)

    def chunked_prefill_us(self, prompt_tokens: int, chunk: int, pass_us: Callable[[int, int], float]) -> float:
        """ceil(P / chunk) passes of at most `chunk` tokens at the context already prefilled."""
        total, done = 0.0, 0
        for _ in range(math.ceil(max(prompt_tokens, 0) / chunk)):
            tokens = min(chunk, prompt_tokens - done)
            key = (tokens, done)
            if key not in self._prefill_pass_us:
                self._prefill_pass_us[key] = pass_us(tokens, done)
            total += self._prefill_pass_us[key]
            done += tokens
        return total


@dataclass
class TraceBatchCost:
    """Verify passes from the trace's routing through a step-time model; drafting through the drafter."""

    model: StepTimeModel
    trace: Trace
    drafter: Drafter
    prefill_chunk: int = 512
    widths: tuple[int, ...] = ()  # verify width per draft length k (a draft tree); empty: k + 1
    compiled: bool = True  # False: the reference path (union counters, then the model's numpy lookups)
    last_distinct_experts: float = field(default=0.0, init=False)
    _scratch: np.ndarray = field(init=False, repr=False)
    _fast: tuple[np.ndarray, ...] = field(init=False, repr=False)
    _out: np.ndarray = field(init=False, repr=False)
    _seq_starts: np.ndarray = field(init=False, repr=False)
    _drafting: _Drafting = field(init=False, repr=False)
    _region: PrefillRegion | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        g = self.trace.meta.geometry
        if (g.top_k, g.experts, g.moe_layers) != (self.model.preset.top_k, self.model.preset.experts, self.model.preset.moe_layers):
            raise InputError(
                f"trace of '{g.model}' does not route like model '{self.model.preset.name}' (top-k, experts or MoE layers differ)"
            )
        if self.prefill_chunk < 1:
            raise InputError(f"prefill chunk must be >= 1 token, got {self.prefill_chunk}")
        self._scratch = union_scratch(len(g.moe_layers), g.experts)
        self._fast = scratch_for(len(g.moe_layers), g.experts, self.trace.expert_masks if self.compiled else None)
        self._out = np.zeros(2)
        self._seq_starts = self.trace.seq_starts
        self._drafting = _Drafting(self.model, self.drafter, self.prefill_chunk, self.widths, {})

    def features(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray) -> RoutingFeatures:
        """Routing features (per MoE layer) of the union of windows [starts[i], starts[i] + n_tokens[i]) of sequences seqs[i]."""
        rows = self._seq_starts[np.asarray(seqs, np.int64)] + np.asarray(starts, np.int64)
        lengths = np.asarray(n_tokens, np.int64)
        distinct, most = union_features(self.trace.experts, rows, lengths, self.trace.meta.geometry.experts, self._scratch)
        total = float(lengths.sum())
        return RoutingFeatures(np.float64(total), np.float64(total * self.model.preset.top_k), distinct, most)

    def _tree_windows(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """With a draft tree, each request's window is its tree's width, kept inside its sequence."""
        if not self.widths:
            return starts, n_tokens
        seqs = np.asarray(seqs, np.int64)
        n_tokens = self._drafting.verify_tokens(n_tokens)
        room = self._seq_starts[seqs + 1] - self._seq_starts[seqs] - n_tokens
        return np.clip(np.asarray(starts, np.int64), 0, np.maximum(room, 0)), n_tokens

    def verify_us(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray) -> float:
        """One pass of the whole batch; remembers the mean distinct experts per layer of the union. With
        a draft tree each request verifies its tree's width; the engine's time per forward is the model's."""
        if self.model.parallel.ranks > 1:
            return self.mixed_us(seqs, starts, n_tokens, context_tokens, NO_CHUNKS)
        starts, n_tokens = self._tree_windows(seqs, starts, n_tokens)
        rows = self._seq_starts[seqs] + starts
        if self.compiled:
            context, sequences = float(context_tokens.sum()), float(context_tokens.size)
            return self.compiled_pass_us(rows, n_tokens, _NO_BLOCKS, _NO_BLOCKS, int(n_tokens.sum()), context, sequences)
        distinct, most = union_features(self.trace.experts, rows, n_tokens, self.trace.meta.geometry.experts, self._scratch)
        self.last_distinct_experts = float(distinct.sum()) / distinct.size
        passes = float(context_tokens.size)
        return self.model.counts_pass_us(int(n_tokens.sum()), distinct, most, float(context_tokens.sum()), passes)

    def mixed_us(
        self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray, chunks: PrefillChunks
    ) -> float:
        """The union of the windows (a draft tree's widths) and the chunks (see the module docstring), per
        expert-parallel rank (the engine's time per forward is the model's)."""
        starts, n_tokens = self._tree_windows(seqs, starts, n_tokens)
        if not n_tokens.size and not chunks.tokens.any():
            return 0.0  # chunks of empty prompts alone: no pass runs
        return self._ranked_us(seqs, starts, n_tokens, context_tokens, chunks)

    def _ranked_us(
        self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray, chunks: PrefillChunks
    ) -> float:
        rows = self._seq_starts[seqs] + starts
        lengths = n_tokens
        lo = hi = NO_CHUNKS.seqs
        if len(chunks):
            if self._region is None:
                self._region = PrefillRegion.of(self.trace.experts, self.trace.meta.geometry.experts)
            windows: tuple[list[int], list[int]] = ([], [])
            blocks: tuple[list[int], list[int]] = ([], [])
            for seq, start, tokens in zip(chunks.seqs.tolist(), chunks.starts.tolist(), chunks.tokens.tolist(), strict=True):
                self._region.pieces(int(self._seq_starts[seq]) + start, tokens, windows, blocks)
            rows = np.concatenate([rows, np.array(windows[0], np.int64)])
            lengths = np.concatenate([lengths, np.array(windows[1], np.int64)])
            lo, hi = np.array(blocks[0], np.int64), np.array(blocks[1], np.int64)
        experts = self.trace.meta.geometry.experts
        ranks = self.model.parallel.ranks
        total = int(n_tokens.sum()) + int(chunks.tokens.sum())
        context = float(context_tokens.sum()) + chunks.context
        passes = float(context_tokens.size + len(chunks))
        if self.compiled and ranks == 1:
            return self.compiled_pass_us(rows, lengths, lo, hi, total, context, passes)
        distinct, most, slots = union_pass(self.trace.experts, rows, lengths, experts, self._scratch, self._region, lo, hi, ranks)
        layer_distinct = distinct.sum(axis=0)
        self.last_distinct_experts = float(layer_distinct.sum()) / layer_distinct.size
        return self.model.rank_pass_us(distinct, most, slots, total, context, passes)

    def compiled_pass_us(
        self,
        rows: np.ndarray,
        lengths: np.ndarray,
        lo: np.ndarray,
        hi: np.ndarray,
        n_tokens: int,
        context: float,
        sequences: float,
    ) -> float:
        """One pass on one device in one compiled call (`moesim.sim.cost.fast_pass`): windows of the
        trace's rows (first rows, lengths), the prefill region's blocks (lo, hi) of a mixed pass; a
        size without tables whose families are priced by their ladder (not `compiled`) is priced
        from the counted features by `counts_pass_us`, as the reference path prices it."""
        tables = self.model.pass_tables
        tables.ensure(n_tokens)
        region = self._region.checkpoints if self._region is not None else _NO_CHECKPOINTS
        args = (self.trace.experts, rows, lengths, rows.size, region, lo, hi, lo.size, self._fast, n_tokens, context, sequences)
        status = pass_total_us(*args, tables.arrays(), tables.dense, tables.comm, self._out)
        if status == NEED_TABLE:
            self.model.table_pass_size(n_tokens)
            status = pass_total_us(*args, tables.arrays(), tables.dense, tables.comm, self._out)
        if status == STRAY_ID:
            raise ValueError("expert id >= n_experts")
        if status == OUTSIDE:
            raise ValueError(f"a window lies outside rows 0..{self.trace.experts.shape[0]}")
        self.last_distinct_experts = float(self._out[1])
        if status == NEED_PYTHON:
            features = self._fast[1]
            return self.model.counts_pass_us(n_tokens, features[0], features[1], context, sequences)
        return float(self._out[0])

    def draft_us(self, draft_lens: np.ndarray, context_tokens: np.ndarray) -> float:
        """The drafter's steps for the batch, at the batch's mean context, and the spec path's overhead."""
        return self._drafting.draft_us(draft_lens, context_tokens)

    def _chunk_us(self, tokens: int, context: int) -> float:
        if self.model.parallel.ranks > 1:
            return self._ranked_us(_ZERO, _ZERO, np.array([tokens]), np.array([context]), NO_CHUNKS)
        features = self.features(np.array([0]), np.array([0]), np.array([tokens]))
        return self.model.pass_time_us(features, float(context))

    def prefill_us(self, prompt_tokens: int) -> float:
        """ceil(P / chunk) chunked passes (see the module docstring)."""
        chunk = min(self.prefill_chunk, int(self._seq_starts[1] - self._seq_starts[0]))
        return self._drafting.chunked_prefill_us(prompt_tokens, chunk, self._chunk_us)


@dataclass
class DenseBatchCost:
    """A dense target (no experts, no trace): every pass is the dense family on its tokens and
    context (`StepTimeModel.dense_pass_us`); drafting as `TraceBatchCost`; a prompt's prefill in
    passes of `prefill_chunk` tokens; a draft tree verifies its widths."""

    model: StepTimeModel
    drafter: Drafter
    prefill_chunk: int = 512
    widths: tuple[int, ...] = ()  # verify width per draft length k (a draft tree); empty: k + 1
    last_distinct_experts: float = field(default=math.nan, init=False)
    _drafting: _Drafting = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise InputError(f"prefill chunk must be >= 1 token, got {self.prefill_chunk}")
        self._drafting = _Drafting(self.model, self.drafter, self.prefill_chunk, self.widths, {})

    def verify_us(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray) -> float:
        """The dense pass of the batch's tokens at its summed context."""
        tokens = float(np.sum(self._drafting.verify_tokens(n_tokens)))
        return self.model.dense_pass_us(tokens, float(np.sum(context_tokens)), float(np.size(context_tokens)))

    def mixed_us(
        self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray, chunks: PrefillChunks
    ) -> float:
        """The dense pass of the verified and prefilled tokens, each chunk at its prompt so far."""
        tokens = float(np.sum(self._drafting.verify_tokens(n_tokens))) + float(chunks.tokens.sum())
        passes = float(np.size(context_tokens) + len(chunks))
        return self.model.dense_pass_us(tokens, float(np.sum(context_tokens)) + chunks.context, passes)

    def draft_us(self, draft_lens: np.ndarray, context_tokens: np.ndarray) -> float:
        """The drafter's steps for the batch, at the batch's mean context."""
        return self._drafting.draft_us(draft_lens, context_tokens)

    def prefill_us(self, prompt_tokens: int) -> float:
        """ceil(P / chunk) dense passes at the context already prefilled."""
        return self._drafting.chunked_prefill_us(
            prompt_tokens, self.prefill_chunk, lambda tokens, done: self.model.dense_pass_us(tokens, done)
        )


_ZERO = np.zeros(1, np.int64)
_NO_BLOCKS = np.zeros(0, np.int64)
_NO_CHECKPOINTS = np.zeros((1, 1, 1), np.int32)
