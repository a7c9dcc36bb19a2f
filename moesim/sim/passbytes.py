"""Expert bytes a pass requests, per-slot vs dedup, from a trace's routing and its geometry.

Per MoE layer and pass of n tokens: a per-slot engine requests n·K·b_e bytes, a deduplicating
engine U(n)·b_e, U = distinct experts the pass selects (b_e = bytes of one expert).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from moesim.kernels.locality import mean_distinct_experts
from moesim.tracegen.trace import Trace


def uniform_distinct_experts(n_tokens: np.ndarray | int, experts: int, top_k: int) -> np.ndarray:
    """Expected distinct experts under uniform routing: E·(1 − (1 − K/E)^n)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** np.asarray(n_tokens, np.float64))


def pass_bytes_table(trace: Trace, max_pass: int) -> pl.DataFrame:
    """Per pass size n: mean distinct experts per layer, byte share u(n), per-slot and dedup bytes
    per pass summed over MoE layers, and the uniform-routing prediction for comparison."""
    g = trace.meta.geometry
    per_layer = mean_distinct_experts(trace.experts, trace.seq_starts, g.experts, max_pass)
    n = np.arange(1, max_pass + 1)
    mean_u = per_layer.mean(axis=0)
    n_layers = len(g.moe_layers)
    return pl.DataFrame(
        {
            "n": n,
            "mean_distinct_experts": mean_u,
            "uniform_distinct_experts": uniform_distinct_experts(n, g.experts, g.top_k),
            "byte_share": mean_u / (n * g.top_k),
            "per_slot_bytes": n * g.top_k * g.expert_bytes * n_layers,
            "dedup_bytes": mean_u * g.expert_bytes * n_layers,
        }
    )
