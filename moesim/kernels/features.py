"""Routing features of passes: what a kernel family's time depends on besides the expert's shape.

The counters in this package produce them; `moesim.hw_profiles` turns them into time. Fields
are numpy arrays of one common shape (one element per pass and MoE layer, or means of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingFeatures:
    """Per pass through one MoE layer: tokens n, slots n·K, distinct experts U, max tokens per expert."""

    n_tokens: np.ndarray
    slots: np.ndarray
    distinct_experts: np.ndarray
    max_tokens_per_expert: np.ndarray

    def __post_init__(self) -> None:
        arrays = [
            np.asarray(getattr(self, name), np.float64) for name in ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert")
        ]
        shape = np.broadcast_shapes(*(a.shape for a in arrays))
        for name, array in zip(("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert"), arrays, strict=True):
            object.__setattr__(self, name, np.broadcast_to(array, shape))

    @property
    def shape(self) -> tuple[int, ...]:
        """Common shape of the fields."""
        return self.n_tokens.shape


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
