"""Routing features of passes: what a kernel family's time depends on besides the expert's shape.

The counters in this package produce them; `moesim.hw_profiles` turns them into time. Fields
are numpy arrays of one common shape (one element per pass and MoE layer, or means of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIELDS = ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert")


@dataclass(frozen=True)
class RoutingFeatures:
    """Per pass through one MoE layer: tokens n, slots n·K, distinct experts U, max tokens per expert;
    optionally how the pass re-reads experts (`moesim.kernels.reuse`): `reread_histogram`
    (shape + (E + 1,): re-reads by LRU stack distance) and `chunk_reads` ({tile T: Σ_e ceil(c_e/T)}).
    Without them a time model assumes what the four counts imply (docs/profiles.md)."""

    n_tokens: np.ndarray
    slots: np.ndarray
    distinct_experts: np.ndarray
    max_tokens_per_expert: np.ndarray
    reread_histogram: np.ndarray | None = None
    chunk_reads: dict[int, np.ndarray] | None = None

    def __post_init__(self) -> None:
        arrays = [np.asarray(getattr(self, name), np.float64) for name in FIELDS]
        shape = np.broadcast_shapes(*(a.shape for a in arrays))
        for name, array in zip(FIELDS, arrays, strict=True):
            object.__setattr__(self, name, np.broadcast_to(array, shape))
        if self.reread_histogram is not None:
            hist = np.asarray(self.reread_histogram, np.float64)
            object.__setattr__(self, "reread_histogram", np.broadcast_to(hist, shape + hist.shape[-1:]))
        if self.chunk_reads is not None:
            reads = {int(t): np.broadcast_to(np.asarray(r, np.float64), shape) for t, r in self.chunk_reads.items()}
            object.__setattr__(self, "chunk_reads", reads)

    @property
    def shape(self) -> tuple[int, ...]:
        """Common shape of the fields."""
        return self.n_tokens.shape

    def select(self, index: object, shape: tuple[int, ...] | None = None) -> RoutingFeatures:
        """The features at `index` of the leading axes (numpy indexing), optionally broadcast to `shape`."""

        def part(array: np.ndarray, trailing: tuple[int, ...] = ()) -> np.ndarray:
            chosen = array[index]  # type: ignore[index]
            return chosen if shape is None else np.broadcast_to(chosen, shape + trailing)

        hist = None if self.reread_histogram is None else part(self.reread_histogram, self.reread_histogram.shape[-1:])
        reads = None if self.chunk_reads is None else {t: part(r) for t, r in self.chunk_reads.items()}
        return RoutingFeatures(*(part(getattr(self, name)) for name in FIELDS), hist, reads)


def uniform_distinct_experts(n_tokens: np.ndarray | float, experts: int, top_k: int) -> np.ndarray:
    """Expected distinct experts of n tokens under independent uniform routing: E·(1 − (1 − K/E)^n)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** np.asarray(n_tokens, np.float64))


def consecutive_runs(values: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """Runs of consecutive integers in sorted distinct values: [1, 2, 3, 5] -> [(1, 3), (5, 5)]."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs
