"""Per-window routing features: the Numba scan against the numpy reference, the reference against
plain-Python brute force, the invariants of U and M, and the uniform-routing closed form."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_locality import random_routing

from moesim.kernels.locality import mean_distinct_experts
from moesim.kernels.reference import summary_reference, window_features_reference
from moesim.kernels.windows import (
    histogram_percentiles,
    iter_window_features,
    summarize_windows,
    window_count,
    window_features,
)
from moesim.models import load_preset
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.routing.synth import Uniform

routing = st.fixed_dictionaries(
    {
        "lengths": st.lists(st.integers(1, 40), min_size=1, max_size=4),
        "n_layers": st.integers(1, 3),
        "n_experts": st.integers(2, 16),
        "k": st.integers(1, 4),
        "max_pass": st.integers(1, 24),
        "seed": st.integers(0, 2**31),
    }
)


def make(params: dict) -> tuple[np.ndarray, np.ndarray, int, int]:
    k = min(params["k"], params["n_experts"])
    experts, starts = random_routing(np.random.default_rng(params["seed"]), params["lengths"], params["n_layers"], params["n_experts"], k)
    return experts, starts, params["n_experts"], params["max_pass"]


def brute_window_features(experts: np.ndarray, starts: np.ndarray, max_pass: int) -> tuple[np.ndarray, np.ndarray]:
    """U and M by counting each window's ids with Python sets: (T, L, N), by last row."""
    n_rows, n_layers, _ = experts.shape
    u = np.zeros((n_rows, n_layers, max_pass), int)
    m = np.zeros((n_rows, n_layers, max_pass), int)
    for s in range(len(starts) - 1):
        for t in range(starts[s], starts[s + 1]):
            for n in range(1, min(max_pass, t - starts[s] + 1) + 1):
                for layer in range(n_layers):
                    ids = experts[t - n + 1 : t + 1, layer].ravel().tolist()
                    u[t, layer, n - 1] = len(set(ids))
                    m[t, layer, n - 1] = max(ids.count(e) for e in set(ids))
    return u, m


@settings(max_examples=60, deadline=None)
@given(params=routing)
def test_reference_equals_brute_force(params: dict) -> None:
    experts, starts, n_experts, max_pass = make(params)
    u, m = window_features_reference(experts, starts, n_experts, max_pass)
    bu, bm = brute_window_features(experts, starts, max_pass)
    assert np.array_equal(u, bu) and np.array_equal(m, bm)


@settings(max_examples=120, deadline=None)
@given(params=routing, cut=st.tuples(st.floats(0, 1), st.floats(0, 1)), block=st.integers(1, 50), parallel=st.booleans())
def test_fast_path_equals_reference(params: dict, cut: tuple[float, float], block: int, parallel: bool) -> None:
    experts, starts, n_experts, max_pass = make(params)
    n_rows = experts.shape[0]
    u, m = window_features_reference(experts, starts, n_experts, max_pass)
    fast = window_features(experts, starts, n_experts, max_pass)
    assert np.array_equal(fast.distinct_experts, u) and np.array_equal(fast.max_tokens_per_expert, m)
    # any range of last rows, and block by block
    r0, r1 = sorted(int(c * n_rows) for c in cut)
    part = window_features(experts, starts, n_experts, max_pass, (r0, r1))
    ref_u, ref_m = window_features_reference(experts, starts, n_experts, max_pass, (r0, r1))
    assert np.array_equal(part.distinct_experts, ref_u) and np.array_equal(part.max_tokens_per_expert, ref_m)
    blocks = [
        (b.distinct_experts.copy(), b.max_tokens_per_expert.copy())
        for b in iter_window_features(experts, starts, n_experts, max_pass, block)
    ]
    assert np.array_equal(np.concatenate([b[0] for b in blocks]), u) and np.array_equal(np.concatenate([b[1] for b in blocks]), m)
    # the summary of the windows ending at rows >= r0 is the reference's arrays reduced
    summary = summarize_windows(experts, starts, n_experts, max_pass, count_from=r0, parallel=parallel)
    joint, sum_u, sum_u2, sum_m = summary_reference(u[r0:], m[r0:], n_experts, summary.top_k)
    assert np.array_equal(summary.joint, joint)
    assert np.array_equal(summary.sum_distinct_experts, sum_u) and np.array_equal(summary.sum_sq_distinct_experts, sum_u2)
    assert np.array_equal(summary.sum_max_tokens_per_expert, sum_m)


@settings(max_examples=60, deadline=None)
@given(params=routing)
def test_invariants(params: dict) -> None:
    experts, starts, n_experts, max_pass = make(params)
    k = experts.shape[2]
    f = window_features(experts, starts, n_experts, max_pass)
    n = np.arange(1, max_pass + 1)
    u, m = f.distinct_experts.astype(int), f.max_tokens_per_expert.astype(int)
    valid = u > 0
    assert np.array_equal(valid, (m > 0))
    # u(1) = 1 exactly: one token's K experts are distinct
    assert np.all(u[:, :, 0] == k) and np.all(m[:, :, 0] == 1)
    # K <= U <= min(n·K, E) and 1 <= M <= n; M·U >= n·K (the busiest expert has at least the mean)
    assert np.all(np.where(valid, (u >= k) & (u <= np.minimum(n * k, n_experts)), True))
    assert np.all(np.where(valid, (m >= 1) & (m <= n) & (m * u >= n * k), True))
    # growing a window (one more row at its start) never loses an expert nor a token
    grows = valid[:, :, 1:]
    assert np.all(np.where(grows, np.diff(u, axis=2) >= 0, True)) and np.all(np.where(grows, np.diff(m, axis=2) >= 0, True))
    assert np.all(np.where(grows, np.diff(u, axis=2) <= k, True))
    # windows counted per n
    summary = summarize_windows(experts, starts, n_experts, max_pass)
    assert np.array_equal(summary.windows(), window_count(starts, max_pass))
    assert np.array_equal(valid[:, 0, :].sum(axis=0), window_count(starts, max_pass))


@settings(max_examples=60, deadline=None)
@given(params=routing)
def test_summary_statistics(params: dict) -> None:
    experts, starts, n_experts, max_pass = make(params)
    n_layers, k = experts.shape[1], experts.shape[2]
    u, m = window_features_reference(experts, starts, n_experts, max_pass)
    summary = summarize_windows(experts, starts, n_experts, max_pass)
    mean_u = summary.mean_distinct_experts()
    assert mean_u[0] == k and summary.byte_share()[0] == 1.0  # u(1) = 1 exactly
    # the mean-only gap-histogram kernel agrees with the per-window scan
    np.testing.assert_allclose(
        mean_distinct_experts(experts, starts, n_experts, max_pass), summary.mean_distinct_experts_per_layer(), rtol=1e-12, equal_nan=True
    )
    for n in range(1, max_pass + 1):
        values = u[:, :, n - 1][u[:, 0, n - 1] > 0]
        if values.size == 0:
            assert np.isnan(mean_u[n - 1])
            continue
        maxima = m[:, :, n - 1][u[:, 0, n - 1] > 0]
        assert mean_u[n - 1] == pytest.approx(values.mean(), rel=1e-12)
        assert summary.mean_max_tokens_per_expert()[n - 1] == pytest.approx(maxima.mean(), rel=1e-12)
        np.testing.assert_allclose(summary.std_distinct_experts_per_layer()[:, n - 1], values.std(axis=0), atol=1e-9)
        expected = np.percentile(values, [0, 10, 50, 90, 100], method="inverted_cdf")
        assert np.array_equal(summary.distinct_experts_percentiles([0, 10, 50, 90, 100])[:, n - 1], expected)
        assert summary.max_tokens_percentiles([90])[0, n - 1] == np.percentile(maxima, 90, method="inverted_cdf")
        features, probability = summary.feature_distribution(n)
        assert probability.sum() == pytest.approx(1.0)
        assert np.sum(probability * features.distinct_experts) == pytest.approx(values.mean())
        assert np.all(features.slots == n * k) and features.shape == probability.shape
    assert summary.mean_features().shape == (max_pass,) and summary.n_layers == n_layers


def test_merged_chunks_equal_whole() -> None:
    """Windows ending before row 40 (from the first 40 rows alone) plus those ending at or after it."""
    experts, starts = random_routing(np.random.default_rng(3), [30, 7, 45], 2, 10, 3)
    whole = summarize_windows(experts, starts, 10, 8)
    later = summarize_windows(experts, starts, 10, 8, count_from=40)
    first = summarize_windows(experts[:40], np.array([0, 30, 37, 40]), 10, 8)
    merged = first.merge(later)
    assert np.array_equal(merged.joint, whole.joint) and np.array_equal(merged.sum_max_tokens_per_expert, whole.sum_max_tokens_per_expert)


def test_histogram_percentiles_match_numpy() -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(0, 9, 500)
    hist = np.bincount(values, minlength=9)
    for q in (0, 1, 10, 33.3, 50, 90, 99.9, 100):
        assert histogram_percentiles(hist, q)[0] == np.percentile(values, q, method="inverted_cdf")
    assert np.isnan(histogram_percentiles(np.zeros(4), 50)[0])


def test_uniform_routing_matches_closed_form() -> None:
    """Independent uniform top-K sets: E[U(n)] = E·(1 − (1 − K/E)^n).

    Tolerance: per window Var(U) = E·p(1−p) + E(E−1)(q₂ − (1−p)²), p = 1 − (1−K/E)^n,
    q₂ = ((E−K)(E−K−1)/(E(E−1)))^n; the mean over W windows of n rows overlapping at most
    2n−1 at a time, in L independent layers, has a standard error of at most
    sqrt(Var·(2n−1)/(W·L)). We allow 4 of those (the draw is seeded, so the test is
    deterministic; 4 sigma keeps it meaningful)."""
    preset = load_preset("deepseek-v2-lite")  # 64 routed experts, top-6
    geometry = TraceGeometry.from_preset(preset)
    e, k = geometry.experts, geometry.top_k
    experts = Uniform().generate(geometry, 2000, 3, seed=11)[:, :4]  # 3 sequences x 2000 tokens, 4 layers
    starts = np.arange(0, experts.shape[0] + 1, 2000)
    max_pass = 32
    summary = summarize_windows(experts, starts, e, max_pass)
    n = np.arange(1, max_pass + 1)
    p = 1 - (1 - k / e) ** n
    q2 = ((e - k) * (e - k - 1) / (e * (e - 1))) ** n
    var = np.maximum(e * p * (1 - p) + e * (e - 1) * (q2 - (1 - p) ** 2), 0.0)  # 0 at n = 1 (U = K)
    standard_error = np.sqrt(var * (2 * n - 1) / (summary.windows() * experts.shape[1]))
    deviation = summary.mean_distinct_experts() - e * p
    assert summary.mean_distinct_experts()[0] == k
    assert np.all(np.abs(deviation[1:]) <= 4 * standard_error[1:]), (deviation / standard_error).round(2)


def test_bad_arguments() -> None:
    experts = np.zeros((3, 1, 2), np.uint8)
    experts[:, 0, 1] = 1
    starts = np.array([0, 3])
    with pytest.raises(ValueError, match="max_pass"):
        window_features(experts, starts, 4, 0)
    with pytest.raises(ValueError, match="max_pass"):
        summarize_windows(experts, starts, 4, 65)
    with pytest.raises(ValueError, match="below n_experts"):
        window_features(experts + 3, starts, 4, 2)
    with pytest.raises(ValueError, match="seq_starts"):
        window_features(experts, np.array([0, 2]), 4, 2)
    with pytest.raises(ValueError, match="unsigned"):
        window_features(experts.astype(np.int64), starts, 4, 2)
