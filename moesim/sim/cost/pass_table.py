"""What the simulator asks of a cost model, and the simplest one: a table of pass times by size.

The SimPy server never counts bytes: it asks a `BatchCostModel` for the time of each verify
pass, each drafting step and each prefill, or of a mixed pass (decode and verify tokens beside
prefill chunks). The trace-driven implementation (the step-time model applied to the union of
the batch's windows in the trace) lives in `moesim.sim.cost.trace_batch`; `TablePassCost` serves
closed-form checks and precomputed-cost runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moesim.errors import ConfigError


@dataclass(frozen=True)
class PrefillChunks:
    """The prefill chunks of a mixed pass: chunk j prefills tokens[j] prompt positions from position
    starts[j] of a request decoding trace sequence seqs[j]; it attends to its prompt so far."""

    seqs: np.ndarray
    starts: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def context(self) -> float:
        """Positions the chunks attend to: each chunk's last position, summed."""
        return float((self.starts + self.tokens).sum())


NO_CHUNKS = PrefillChunks(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


class BatchCostModel(Protocol):
    """Times (µs) of the passes of one server iteration."""

    def verify_us(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray) -> float:
        """One target pass verifying, for each request i of the batch, n_tokens[i] positions of trace
        sequence seqs[i] starting at position starts[i], at a context of context_tokens[i] tokens."""
        ...

    def draft_us(self, draft_lens: np.ndarray, context_tokens: np.ndarray) -> float:
        """Drafting draft_lens[i] tokens for each request of the batch (0 where a request does not speculate)."""
        ...

    def prefill_us(self, prompt_tokens: int) -> float:
        """Prefill of one request's prompt."""
        ...

    def mixed_us(
        self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray, chunks: PrefillChunks
    ) -> float:
        """One target pass verifying the windows (as `verify_us`) and prefilling the chunks (chunked prefill beside decode)."""
        ...


@dataclass(frozen=True)
class TablePassCost:
    """Pass times looked up by batch tokens: verify = target_us[total tokens − 1] (beyond the table:
    linear extrapolation from its last two entries), draft = draft_step_us · max draft length
    (requests draft in lockstep), prefill = prefill_us_per_token · prompt tokens."""

    target_us: np.ndarray  # target_us[n - 1]: a pass of n tokens
    draft_step_us: float = 0.0
    prefill_us_per_token: float = 0.0

    def __post_init__(self) -> None:
        table = np.asarray(self.target_us, np.float64)
        if table.ndim != 1 or table.size < 1 or not np.all(np.isfinite(table)) or np.any(table <= 0):
            raise ConfigError("pass-cost table 'target_us' must be a non-empty list of positive times")
        if self.draft_step_us < 0 or self.prefill_us_per_token < 0:
            raise ConfigError("pass-cost table: 'draft_step_us' and 'prefill_us_per_token' must be >= 0")
        object.__setattr__(self, "target_us", table)

    def pass_us(self, total_tokens: int) -> float:
        """Time of one target pass of `total_tokens` tokens."""
        table = self.target_us
        if total_tokens <= table.size:
            return float(table[total_tokens - 1])
        slope = table[-1] - table[-2] if table.size > 1 else table[-1]
        return float(table[-1] + slope * (total_tokens - table.size))

    def verify_us(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray) -> float:
        """Looked up by the batch's total tokens."""
        return self.pass_us(int(np.sum(n_tokens)))

    def draft_us(self, draft_lens: np.ndarray, context_tokens: np.ndarray) -> float:
        """Drafting steps run in lockstep: the longest draft sets the time."""
        return self.draft_step_us * float(np.max(draft_lens, initial=0))

    def prefill_us(self, prompt_tokens: int) -> float:
        """Linear in prompt tokens."""
        return self.prefill_us_per_token * prompt_tokens

    def mixed_us(
        self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray, chunks: PrefillChunks
    ) -> float:
        """Looked up by the pass's total tokens, verified and prefilled."""
        return self.pass_us(int(np.sum(n_tokens)) + int(np.sum(chunks.tokens)))
