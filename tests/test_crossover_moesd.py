"""Dedup win windows and MoESD's formulas against closed forms and brute force."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.kernels.features import uniform_distinct_experts
from moesim.sim.analysis.crossover import bandwidth_ratio, byte_share, uniform_crossover, win_window
from moesim.sim.analysis.moesd import full_activation_tokens
from moesim.sim.analysis.speculation import target_efficiency


def test_uniform_crossover_matches_issue_figures() -> None:
    # E = 64, K = 6: u(7) = 0.759 > 0.75 > u(8) = 0.727; u(17) > 0.5 > u(18)
    assert uniform_crossover(64, 6, 0.75) == 8
    assert uniform_crossover(64, 6, 0.5) == 18
    assert uniform_crossover(64, 6, 0.005) is None  # u(n) >= E/(n·K) = 0.0104 at n = 1024


def test_u_below_r_iff_dedup_faster() -> None:
    rng = np.random.default_rng(0)
    n = np.arange(1, 65)
    per_slot = 10 + 5 * n + rng.random(64)
    dedup = 40 + 2.5 * n + rng.random(64)
    share = 64 * (1 - (58 / 64) ** n) / (6 * n)
    r = bandwidth_ratio(per_slot, dedup, share)
    window = win_window(n, per_slot, dedup)
    assert window.dedup_wins == [int(x) for x in n[share < r]]
    assert window.crossover_n == window.dedup_wins[0]


def test_win_window_can_close_again() -> None:
    n = np.arange(1, 8)
    window = win_window(n, np.array([5, 5, 5, 5, 5, 5, 5.0]), np.array([6, 4, 4, 6, 6, 4, 6.0]))
    assert window.crossover_n == 2 and window.dedup_wins == [2, 3, 6]
    assert win_window(n, np.ones(7), np.ones(7) * 2).crossover_n is None


def test_byte_share_and_moesd() -> None:
    assert byte_share(np.array([6.0]), np.array([1]), 6)[0] == 1.0
    # N(t) agrees with a Monte-Carlo union of uniform top-k sets
    rng = np.random.default_rng(1)
    union = [len(set(np.concatenate([rng.permutation(64)[:6] for _ in range(10)]).tolist())) for _ in range(4000)]
    assert uniform_distinct_experts(10, 64, 6) == pytest.approx(np.mean(union), abs=0.15)
    t = full_activation_tokens(64, 6)
    assert uniform_distinct_experts(t, 64, 6) >= 0.95 * 64 > uniform_distinct_experts(t - 1, 64, 6)
    assert target_efficiency(np.array([10.0]), np.array([12.5]))[0] == pytest.approx(0.8)
