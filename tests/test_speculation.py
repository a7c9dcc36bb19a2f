"""Closed forms of speculative decoding against brute force and the properties they must have."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.errors import InputError
from moesim.sim.analysis.speculation import (
    best_draft,
    break_even_alpha,
    check_acceptance,
    check_draft_lengths,
    relative_cost,
    speedup,
    speedup_table,
    staircase,
    tokens_per_pass,
)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_tokens_per_pass_matches_sampled_geometric_acceptance(alpha: float, k: int) -> None:
    rng = np.random.default_rng(11)
    draws = rng.random((200_000, max(k, 1)))[:, :k] < alpha
    accepted = np.where(draws.all(axis=1), k, np.argmin(draws, axis=1)) if k else np.zeros(len(draws))
    sampled = (accepted + 1).mean()
    stderr = (accepted + 1).std() / np.sqrt(len(draws))
    assert tokens_per_pass(k, alpha) == pytest.approx(sampled, abs=5 * stderr + 1e-12)


def test_tokens_per_pass_sum_form_near_one() -> None:
    for alpha in (1 - 1e-9, 1 - 1e-7, 1 - 1e-4, 0.5):
        direct = sum(alpha**i for i in range(8))
        assert tokens_per_pass(7, alpha) == pytest.approx(direct, rel=1e-9)


def exhaustive_best(alpha: float, cost: np.ndarray) -> int:
    values = [sum(alpha**i for i in range(k + 1)) / cost[k] for k in range(len(cost))]
    top = max(values)
    return max(k for k, v in enumerate(values) if v >= top * (1 - 1e-12))


def test_best_draft_equals_exhaustive_argmax() -> None:
    rng = np.random.default_rng(2)
    for _ in range(50):
        cost = np.concatenate([[1.0], 1.0 + np.cumsum(rng.random(12) * 0.4)])
        alphas = rng.random(40)
        k_star, s_star = best_draft(alphas, cost)
        assert [exhaustive_best(a, cost) for a in alphas] == k_star.tolist()
        np.testing.assert_allclose(s_star, speedup(k_star, alphas, cost))


@settings(max_examples=300, deadline=None)
@given(cost=st.lists(st.floats(0.05, 50.0), min_size=1, max_size=17))
def test_best_draft_is_non_decreasing_in_alpha(cost: list[float]) -> None:
    alphas = np.linspace(0, 1, 501)
    k_star, _ = best_draft(alphas, np.asarray(cost))
    assert np.all(np.diff(k_star) >= 0)


def test_staircase_thresholds_are_where_exhaustive_argmax_changes() -> None:
    cost = np.array([1.0, 1.15, 1.3, 1.42, 1.6, 1.85, 2.2, 2.6])
    steps = staircase(cost)
    assert steps[0][0] == 0.0
    assert [k for _, k in steps] == sorted(k for _, k in steps)
    for (alpha, k), (next_alpha, _) in zip(steps, [*steps[1:], (1.0, None)], strict=True):
        # inside each step the exhaustive argmax is k; just below the threshold it is not
        for a in np.linspace(alpha, next_alpha, 7)[1:-1]:
            assert exhaustive_best(a, cost) == k
        if alpha > 0:
            assert exhaustive_best(alpha - 1e-9, cost) != k


def test_break_even_alpha_solves_tau_equals_cost() -> None:
    cost = np.array([1.0, 1.2, 1.5, 2.0, 5.5])
    alpha = break_even_alpha(np.arange(5), cost)
    assert np.isnan(alpha[0])  # k = 0 is plain decoding: it never beats itself
    np.testing.assert_allclose(tokens_per_pass(np.arange(1, 4), alpha[1:4]), cost[1:4], rtol=1e-9)
    assert np.isnan(alpha[4])  # C(4) = 5.5 > 5 = τ(4, 1): never pays
    table = speedup_table(np.array([alpha[2] - 1e-6, alpha[2] + 1e-6]), cost)
    assert table[0, 2] < 1 < table[1, 2]


def test_relative_cost_and_input_checks() -> None:
    np.testing.assert_allclose(relative_cost(np.array([0.0, 1.0, 2.0]), np.array([10.0, 12.0, 13.0])), [1.0, 1.3, 1.5])
    with pytest.raises(InputError, match=r"alpha must lie in \[0, 1\], got 1.5"):
        check_acceptance([0.5, 1.5])
    with pytest.raises(InputError, match="draft length must be >= 0, got -1"):
        check_draft_lengths([-1, 2])
