"""Reuse features (re-read distances, tile reads) against plain-Python definitions and closed forms."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.kernels.features import RoutingFeatures
from moesim.kernels.reference import reuse_features_reference, window_reuse_means_reference
from moesim.kernels.reuse import cached_rereads, reuse_features_many, stream_histogram, window_reuse_means


def _routing(rows: int, layers: int, experts: int, top_k: int, seed: int, sticky: float = 0.0) -> np.ndarray:
    """Top-k without repeats per token; with `sticky`, each expert of the previous token kept with that probability."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, layers, top_k), np.uint16)
    for layer in range(layers):
        previous: list[int] = []
        for t in range(rows):
            kept = [e for e in previous if rng.random() < sticky][:top_k]
            rest = [int(e) for e in rng.permutation(experts) if e not in kept][: top_k - len(kept)]
            out[t, layer] = previous = kept + rest
    return out


@pytest.mark.parametrize(("experts", "top_k", "sticky"), [(8, 2, 0.0), (16, 4, 0.5), (12, 3, 0.9)])
def test_group_features_match_the_definitions(experts: int, top_k: int, sticky: float) -> None:
    routing = _routing(40, 3, experts, top_k, seed=experts, sticky=sticky)
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 9, size=12)
    starts = np.array([rng.integers(0, 40 - n + 1) for n in lengths])
    offsets = np.array([0, 1, 3, 4, 7, 9, 12])  # groups of one to three windows (a batch's union)
    fast = reuse_features_many(routing, offsets, starts, lengths, experts, (2, 3, 16))
    hist, reads = reuse_features_reference(routing, offsets, starts, lengths, experts, (2, 3, 16))
    np.testing.assert_array_equal(fast.reread_histogram, hist)
    for tile in (2, 3, 16):
        np.testing.assert_array_equal(fast.chunk_reads[tile], reads[tile])


def test_closed_forms_same_and_cyclic_routing() -> None:
    n, k, e = 9, 4, 16
    same = np.tile(np.arange(k, dtype=np.int64), n)
    hist = stream_histogram(same, e)
    assert hist[k] == (n - 1) * k and hist.sum() == (n - 1) * k  # every re-read sees the other K − 1 experts
    cyclic = np.arange(n * k) % e  # `distinct`: as many distinct experts as possible
    hist = stream_histogram(cyclic, e)
    assert hist[e] == n * k - e and hist.sum() == n * k - e
    one = reuse_features_many(same.reshape(n, 1, k).astype(np.uint8), np.array([0, 1]), np.array([0]), np.array([n]), e, (4, 8))
    assert one.chunk_reads[4][0, 0] == k * int(np.ceil(n / 4)) and one.chunk_reads[8][0, 0] == k * int(np.ceil(n / 8))


def test_window_means_match_every_window() -> None:
    routing = _routing(30, 2, 10, 3, seed=5, sticky=0.6)
    seq_starts = np.array([0, 7, 30])  # a short sequence: windows never cross a sequence end
    fast = window_reuse_means(routing, seq_starts, 10, 9, (2, 4))
    hist, reads = window_reuse_means_reference(routing, seq_starts, 10, 9, (2, 4))
    np.testing.assert_allclose(fast.reread_histogram, hist, rtol=1e-12)
    for tile in (2, 4):
        np.testing.assert_allclose(fast.chunk_reads[tile], reads[tile], rtol=1e-12)


def test_cached_rereads_and_selection() -> None:
    hist = np.array([[0, 0, 3, 0, 5]], np.float64)  # 3 re-reads at distance 2, 5 at distance 4
    got = cached_rereads(hist, expert_bytes=10.0, cache_bytes=30.0)
    assert got[0] == pytest.approx(3 * 1.0 + 5 * 30.0 / 40.0)
    features = RoutingFeatures(np.ones((2, 3)), 2.0, 2.0, 1.0, np.ones((2, 3, 5)), {16: np.arange(6.0).reshape(2, 3)})
    part = features.select((slice(None), slice(0, 2)))
    assert part.shape == (2, 2) and part.reread_histogram.shape == (2, 2, 5) and part.chunk_reads[16].tolist() == [[0, 1], [3, 4]]
