"""Locality counters against plain-Python brute force, closed forms and invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.kernels.locality import experts_used, mean_distinct_experts, reuse


def random_routing(rng: np.random.Generator, lengths: list[int], n_layers: int, n_experts: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    total = sum(lengths)
    experts = np.empty((total, n_layers, k), np.uint8)
    for t in range(total):
        for layer in range(n_layers):
            # a small pool makes repeats (and long gaps) common
            pool = rng.permutation(n_experts)[: max(k, n_experts // 2)]
            experts[t, layer] = rng.choice(pool, k, replace=False)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return experts, starts


def brute_mean_distinct(experts: np.ndarray, starts: np.ndarray, max_pass: int) -> np.ndarray:
    n_layers = experts.shape[1]
    out = np.full((n_layers, max_pass), np.nan)
    for n in range(1, max_pass + 1):
        for layer in range(n_layers):
            counts = []
            for s in range(len(starts) - 1):
                for a in range(starts[s], starts[s + 1] - n + 1):
                    counts.append(len(set(experts[a : a + n, layer].ravel().tolist())))
            if counts:
                out[layer, n - 1] = sum(counts) / len(counts)
    return out


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 25), min_size=1, max_size=4),
    n_layers=st.integers(1, 3),
    n_experts=st.integers(2, 12),
    k=st.integers(1, 4),
    max_pass=st.integers(1, 20),
    seed=st.integers(0, 2**31),
)
def test_mean_distinct_equals_brute_force(lengths: list[int], n_layers: int, n_experts: int, k: int, max_pass: int, seed: int) -> None:
    k = min(k, n_experts)
    experts, starts = random_routing(np.random.default_rng(seed), lengths, n_layers, n_experts, k)
    fast = mean_distinct_experts(experts, starts, n_experts, max_pass)
    np.testing.assert_allclose(fast, brute_mean_distinct(experts, starts, max_pass), rtol=1e-12, equal_nan=True)


def test_mean_distinct_invariants_and_uniform_formula() -> None:
    rng = np.random.default_rng(5)
    n_experts, k, tokens = 64, 6, 4000
    experts = np.stack([rng.permutation(n_experts)[:k] for _ in range(tokens)])[:, None, :].astype(np.uint8)
    starts = np.array([0, tokens])
    u = mean_distinct_experts(experts, starts, n_experts, 32)[0]
    n = np.arange(1, 33)
    assert u[0] == k  # u(1) = 1 exactly
    assert np.all(np.diff(u) >= 0) and np.all(u <= np.minimum(n * k, n_experts))
    # independent uniform top-k sets: E(1 - (1 - K/E)^n); windows overlap, so the standard
    # error is larger than for independent samples: 2% covers it for 4000 tokens
    np.testing.assert_allclose(u, n_experts * (1 - (1 - k / n_experts) ** n), rtol=0.02)


def brute_reuse(experts: np.ndarray, starts: np.ndarray, d: int) -> np.ndarray:
    n_layers, k = experts.shape[1], experts.shape[2]
    shared = np.zeros(n_layers)
    pairs = 0
    for s in range(len(starts) - 1):
        for t in range(starts[s], starts[s + 1] - d):
            pairs += 1
            for layer in range(n_layers):
                shared[layer] += len(set(experts[t, layer].tolist()) & set(experts[t + d, layer].tolist()))
    return shared / (k * pairs) if pairs else np.full(n_layers, np.nan)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3), seed=st.integers(0, 2**31), max_d=st.integers(1, 5))
def test_reuse_equals_brute_force(lengths: list[int], seed: int, max_d: int) -> None:
    experts, starts = random_routing(np.random.default_rng(seed), lengths, 2, 10, 3)
    fast = reuse(experts, starts, 10, max_d)
    for d in range(1, max_d + 1):
        np.testing.assert_allclose(fast[:, d - 1], brute_reuse(experts, starts, d), equal_nan=True)


def test_experts_used() -> None:
    experts = np.array([[[0, 1], [2, 3]], [[1, 4], [2, 3]]], np.uint8)
    assert experts_used(experts, 8).tolist() == [3, 2]


def test_bad_max_pass() -> None:
    with pytest.raises(ValueError):
        mean_distinct_experts(np.zeros((1, 1, 1), np.uint8), np.array([0, 1]), 2, 0)
