"""MoESD's batch model of expert activation (Huang et al., NeurIPS 2025) under uniform routing.

Its N(t), the experts t tokens activate, is `moesim.kernels.features.uniform_distinct_experts`; its
target efficiency T(B, 1) / T(B, γ) is `moesim.sim.analysis.speculation.target_efficiency`."""

from __future__ import annotations

import math


def full_activation_tokens(experts: int, top_k: int, fraction: float = 0.95) -> int:
    """Tokens needed for N(t) >= fraction·E: ⌈log_(1−K/E)(1 − fraction)⌉."""
    if top_k >= experts:
        return 1
    return math.ceil(math.log(1.0 - fraction) / math.log(1.0 - top_k / experts))
