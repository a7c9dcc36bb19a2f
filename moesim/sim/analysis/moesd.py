"""MoESD's batch model of expert activation (Huang et al., NeurIPS 2025) under uniform routing.

Its N(t), the experts t tokens activate, is `moesim.kernels.features.uniform_distinct_experts`."""

from __future__ import annotations

import math

import numpy as np


def full_activation_tokens(experts: int, top_k: int, fraction: float = 0.95) -> int:
    """Tokens needed for N(t) >= fraction·E: ⌈log_(1−K/E)(1 − fraction)⌉."""
    if top_k >= experts:
        return 1
    return math.ceil(math.log(1.0 - fraction) / math.log(1.0 - top_k / experts))


def target_efficiency(single_token_us: np.ndarray, verify_us: np.ndarray) -> np.ndarray:
    """MoESD's target efficiency T_T(B, 1) / T_T(B, γ): how close to free verification is."""
    return np.asarray(single_token_us, np.float64) / np.asarray(verify_us, np.float64)
