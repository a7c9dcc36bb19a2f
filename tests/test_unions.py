"""Unions of windows (batches, speculative passes): Numba against the numpy reference, against the
per-window scan, and the pass alignment and geometric sampler against plain Python and closed forms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_locality import random_routing
from test_windows import make, routing

from moesim.kernels.reference import union_features_reference
from moesim.kernels.unions import (
    batch_lanes,
    batch_windows,
    geometric_passes,
    sample_accepted_geometric,
    speculative_passes,
    union_features,
    union_features_many,
    union_scratch,
)
from moesim.kernels.windows import window_features


@settings(max_examples=120, deadline=None)
@given(params=routing, group_sizes=st.lists(st.integers(0, 6), max_size=8), parallel=st.booleans())
def test_unions_equal_reference(params: dict, group_sizes: list[int], parallel: bool) -> None:
    experts, _, n_experts, _ = make(params)
    n_layers, k = experts.shape[1], experts.shape[2]
    rng = np.random.default_rng(params["seed"] + 1)
    n_rows = experts.shape[0]
    offsets = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int64)
    windows = int(offsets[-1])
    sizes = rng.integers(0, 9, windows).clip(max=n_rows)  # ragged, 0 allowed
    starts = np.array([rng.integers(0, n_rows - s + 1) for s in sizes], np.int64)
    ref_u, ref_m, counts = union_features_reference(experts, offsets, starts, sizes, n_experts)
    got = union_features_many(experts, offsets, starts, sizes, n_experts, histogram=True, parallel=parallel)
    assert np.array_equal(got.distinct_experts, ref_u) and np.array_equal(got.max_tokens_per_expert, ref_m)
    assert np.array_equal(got.n_tokens, [sizes[offsets[g] : offsets[g + 1]].sum() for g in range(len(group_sizes))])
    hist = got.tokens_per_expert_histogram
    expected = np.stack([np.bincount(counts[:, layer].ravel(), minlength=hist.shape[1]) for layer in range(n_layers)])
    expected[:, 0] = 0
    assert np.array_equal(hist, expected)
    features = got.routing_features()
    assert np.array_equal(features.slots[:, 0], got.n_tokens * k)
    # the per-iteration call, reusing one scratch
    scratch = union_scratch(n_layers, n_experts)
    for g in range(len(group_sizes)):
        part = slice(offsets[g], offsets[g + 1])
        u, m = union_features(experts, starts[part], sizes[part], n_experts, scratch)
        assert np.array_equal(u, ref_u[g]) and np.array_equal(m, ref_m[g])
    assert not scratch.any()


def test_one_window_union_equals_window_scan() -> None:
    """Two independent kernels: the union of a single window is that window's U and M."""
    experts, starts = random_routing(np.random.default_rng(7), [60, 50], 3, 12, 3)
    scan = window_features(experts, starts, 12, 10)
    for t in (9, 25, 59, 69, 109):
        for n in range(1, 11):
            if not scan.valid(n)[t]:
                continue
            u, m = union_features(experts, [t - n + 1], [n], 12)
            assert np.array_equal(u, scan.distinct_experts[t, :, n - 1]) and np.array_equal(m, scan.max_tokens_per_expert[t, :, n - 1])


def test_batch_lanes_and_windows() -> None:
    starts = np.array([0, 100, 180, 300, 350])  # lengths 100, 80, 120, 50
    lanes = batch_lanes(starts, 2)
    assert lanes.source == "sequences" and lanes.unused_sequences == 0
    assert lanes.starts.tolist() == [[0, 100], [180, 300]] and lanes.length.tolist() == [80, 50]
    assert "2 groups of 2 different sequences" in lanes.describe()
    three = batch_lanes(starts, 3)
    assert three.unused_sequences == 1 and three.length.tolist() == [80]
    offsets = batch_lanes(starts, 8)  # fewer sequences than lanes: 8 segments of each sequence
    assert offsets.source == "offsets" and "fewer than 8 sequences" in offsets.describe()
    assert offsets.starts[0].tolist() == [0, 12, 24, 36, 48, 60, 72, 84] and offsets.length.tolist() == [12, 10, 15, 6]
    group_offsets, first, sizes = batch_windows(lanes, 30)
    # group 0 (80 rows): passes at 0, 30; lane 1 starts 40 rows later, wrapped into rows 0..50: 40, 19.
    # group 1 (50 rows): one pass; lane 1 starts 25 rows later, wrapped into rows 0..20: 4
    assert group_offsets.tolist() == [0, 2, 4, 6]
    assert first.tolist() == [0, 140, 30, 119, 180, 304] and set(sizes.tolist()) == {30}
    _, first, _ = batch_windows(lanes, 1, max_batches=3)
    # 130 passes (80 + 50): numbers 0, 64 and 129 = group 0 offset 0, group 0 offset 64, group 1 offset 49
    assert first.reshape(-1, 2).tolist() == [[0, 140], [64, 100 + (64 + 40) % 80], [229, 300 + (49 + 25) % 50]]
    _, first, _ = batch_windows(offsets, 5)  # segments of one sequence: no extra shift
    assert first[:8].tolist() == [0, 12, 24, 36, 48, 60, 72, 84]
    assert batch_windows(lanes, 81)[0].tolist() == [0]
    with pytest.raises(ValueError):
        batch_lanes(starts, 0)


def plain_passes(accepted: list[int], draft_len: list[int], length: int) -> tuple[list[int], list[int]]:
    first, out_first, out_size = 0, [], []
    for a, k in zip(accepted, draft_len, strict=True):
        if first + k + 1 > length:
            break
        out_first.append(first)
        out_size.append(k + 1)
        first += a + 1
    return out_first, out_size


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=30), length=st.integers(0, 60))
def test_speculative_passes_equal_plain_loop(steps: list[tuple[int, int]], length: int) -> None:
    draft = [k for k, _ in steps]
    accepted = [min(a, k) for k, a in steps]
    first, size = speculative_passes(np.array(accepted, np.int64), np.array(draft, np.int64), length)
    assert (first.tolist(), size.tolist()) == plain_passes(accepted, draft, length)


def test_geometric_acceptance() -> None:
    """P(accepted >= i) = α^i for i <= k, so E[accepted] = Σ_{i=1..k} α^i; 200 000 draws give a
    standard error below 0.004 on the mean (std <= k), we allow 0.02."""
    alpha, k, steps = 0.7, 5, 200_000
    accepted = sample_accepted_geometric(alpha, k, steps, seed=1)
    assert accepted.min() >= 0 and accepted.max() <= k
    assert accepted.mean() == pytest.approx(sum(alpha**i for i in range(1, k + 1)), abs=0.02)
    for i in range(1, k + 1):
        assert np.mean(accepted >= i) == pytest.approx(alpha**i, abs=0.01)
    assert np.array_equal(sample_accepted_geometric(alpha, k, 50, seed=3), sample_accepted_geometric(alpha, k, 50, seed=3))
    assert not sample_accepted_geometric(0.0, k, 100, seed=0).any()
    assert np.all(sample_accepted_geometric(1.0, k, 100, seed=0) == k)
    first, size, acc = geometric_passes(alpha, k, 500, seed=2)
    assert np.all(size == k + 1) and first[0] == 0 and first[-1] + k + 1 <= 500
    assert np.array_equal(np.diff(first), acc[:-1] + 1)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="alpha"):
            sample_accepted_geometric(bad, k, 10, seed=0)
    with pytest.raises(ValueError, match="accepted"):
        speculative_passes(np.array([3]), 2, 10)


def test_pass_features_follow_the_passes() -> None:
    """Features of real verify passes: group g is exactly the window of pass g."""
    experts, _ = random_routing(np.random.default_rng(5), [80], 2, 10, 2)
    first, size, _ = geometric_passes(0.6, 3, 80, seed=4)
    got = union_features_many(experts, np.arange(first.size + 1), first, size, 10)
    ref_u, ref_m, _ = union_features_reference(experts, np.arange(first.size + 1), first, size, 10)
    assert np.array_equal(got.distinct_experts, ref_u) and np.array_equal(got.max_tokens_per_expert, ref_m)
    assert np.all(got.byte_share() <= 1.0)


def test_wide_ids_and_out_of_range_ids() -> None:
    """uint16 ids (models with more than 256 experts) take the checked path; an id >= E is an
    error with either width, and the caller's scratch stays usable."""
    experts, _ = random_routing(np.random.default_rng(9), [40], 2, 12, 3)
    wide = experts.astype(np.uint16) * 30  # ids up to 330
    starts, lengths = np.array([0, 10, 25]), np.array([5, 7, 3])
    ref_u, ref_m, _ = union_features_reference(wide, np.array([0, 3]), starts, lengths, 400)
    scratch = union_scratch(2, 400)
    u, m = union_features(wide, starts, lengths, 400, scratch)
    assert np.array_equal(u, ref_u[0]) and np.array_equal(m, ref_m[0])
    for ids, n_experts in ((wide, 300), (experts, 5)):
        scratch = union_scratch(2, n_experts)
        with pytest.raises(ValueError, match="expert id"):
            union_features(ids, starts, lengths, n_experts, scratch)
        assert not scratch.any()


def test_bad_windows() -> None:
    experts = np.zeros((5, 1, 1), np.uint8)
    with pytest.raises(ValueError, match="outside"):
        union_features(experts, [3], [3], 2)
    with pytest.raises(ValueError, match="expert id"):
        union_features(experts + 2, [0], [2], 2)
    with pytest.raises(ValueError, match="group_offsets"):
        union_features_many(experts, [0, 2], [0], [1], 2)
