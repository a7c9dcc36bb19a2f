"""Acceptance streams in bulk: the compiled SeedSequence + PCG64 against numpy's own Generators, bit
for bit, and `bind_many` against `bind` draw for draw (over several blocks)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.kernels.pcg import entropy_words, pcg64_state, seed_state, stream_uniforms
from moesim.sim.serving.acceptance import (
    BLOCK_DRAWS,
    Geometric,
    Position,
    Recorded,
    Regime,
    Tree,
    bind_many,
    geometric_count,
    survival_count,
)

TAG = 0xACCE  # the acceptance streams' tag: default_rng([seed, TAG, request_id])
SEEDS = (0, 1, 2**32 + 5, 2**63 - 1)
SIZES = (1, 7, 256, BLOCK_DRAWS)
# 5,000 request ids: small ones and ids of one and two 32-bit words at the edges
RIDS = np.concatenate([np.arange(4992), [2**32 - 1, 2**32, 2**32 + 1, 2**40 + 3, 2**53, 2**62, 2**63 - 2, 2**63 - 1]]).astype(np.int64)
ENTROPIES = [
    [0], [1], [2**32 - 1], [2**32], [2**64 - 1], [2**128 + 7], [0, 0], [3, TAG, 0],
    [1, 2, 3, 4], [1, 2, 3, 4, 5], list(range(11)), [2**63 - 1, TAG, 2**63 - 1],
]  # fmt: skip
BLOCK_MODELS = (Geometric(alpha=0.7), Geometric(alpha=0.0), Geometric(alpha=1.0), Position(alphas=(0.9, 0.6, 0.3)), Tree(alpha=0.6))


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint64)


@pytest.mark.parametrize("entropy", ENTROPIES)
def test_seed_state_is_numpys_pcg64_state(entropy: list[int]) -> None:
    """PCG64(SeedSequence(entropy)): entropy shorter than, equal to and longer than the pool, multi-word ints."""
    assert pcg64_state(seed_state(entropy)) == np.random.PCG64(entropy).state


@given(st.lists(st.integers(0, 2**96), min_size=1, max_size=9))
@settings(max_examples=300, deadline=None)
def test_seed_state_matches_numpy_for_any_entropy(entropy: list[int]) -> None:
    assert pcg64_state(seed_state(entropy)) == np.random.PCG64(entropy).state


def test_entropy_words_are_32_bit_words_lowest_first() -> None:
    """0 is one word; a larger int its base-2³² digits, lowest first (brute force by division)."""
    values = [0, 5, 2**32 - 1, 2**32, 2**63 - 1, 3 * 2**64 + 2**32 + 9]
    expected: list[int] = []
    for v in values:
        digits = [v % 2**32]
        while v >= 2**32:
            v //= 2**32
            digits.append(v % 2**32)
        expected += digits
    assert entropy_words(values).tolist() == expected
    with pytest.raises(ValueError, match="non-negative"):
        entropy_words([1, -1])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("size", SIZES)
def test_stream_uniforms_are_numpys_bit_for_bit(seed: int, size: int) -> None:
    """For each of 5,000 request ids: 1 − default_rng([seed, TAG, rid]).random(size), and the state after."""
    ids = RIDS if size < BLOCK_DRAWS else RIDS[::5]  # the 4096-draw case on 1,000 ids (time)
    u, offsets, states = stream_uniforms((seed, TAG), ids, np.full(ids.size, size))
    assert offsets.tolist() == list(range(0, size * ids.size + 1, size))
    for i, rid in enumerate(ids.tolist()):
        rng = np.random.default_rng([seed, TAG, rid])
        assert np.array_equal(_bits(u[offsets[i] : offsets[i + 1]]), _bits(1.0 - rng.random(size))), rid
        assert pcg64_state(states[i]) == rng.bit_generator.state, rid


def test_stream_uniforms_ragged_sizes() -> None:
    """Mixed sizes (0 included) laid end to end; each stream continues from its state as numpy's does."""
    sizes = np.array([0, 1, 3, 0, 256, 7, 4096, 2])
    ids = np.arange(sizes.size) * 7919
    u, offsets, states = stream_uniforms((11, TAG), ids, sizes)
    assert u.size == sizes.sum()
    for i, rid in enumerate(ids.tolist()):
        rng = np.random.default_rng([11, TAG, rid])
        assert np.array_equal(_bits(u[offsets[i] : offsets[i + 1]]), _bits(1.0 - rng.random(sizes[i])))
        assert pcg64_state(states[i]) == rng.bit_generator.state
    with pytest.raises(ValueError, match="non-negative"):
        stream_uniforms((0, TAG), np.array([-1]), np.array([1]))


def test_counts_of_stacked_uniforms_equal_per_request_counts() -> None:
    """np.log, the division, floor and the comparisons are elementwise: the counts of a stacked array
    equal those of each piece counted alone, bit for bit, at every length and alignment."""
    rng = np.random.default_rng(5)
    lengths = np.concatenate([np.arange(1, 70), rng.integers(1, 600, 200)])
    u = 1.0 - rng.random(int(lengths.sum()))
    u[::97] = 1.0  # the closed end
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    survival = np.array([0.9, 0.55, 0.3, 0.1, 0.0])
    stacked_log = np.log(u)
    for alpha in (0.05, 0.7, 0.999):
        stacked = geometric_count(u, alpha, 6)
        for lo, hi in itertools.pairwise(bounds):
            piece = u[lo:hi].copy()
            assert np.array_equal(geometric_count(piece, alpha, 6), stacked[lo:hi])
            assert np.array_equal(_bits(np.log(piece)), _bits(stacked_log[lo:hi]))
    stacked = survival_count(u, survival)
    for lo, hi in itertools.pairwise(bounds):
        assert np.array_equal(survival_count(u[lo:hi].copy(), survival), stacked[lo:hi])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", BLOCK_MODELS, ids=lambda m: f"{m.name}-{getattr(m, 'alpha', None)}")
def test_bind_many_first_blocks_equal_bind(model, seed: int) -> None:
    """The first block of each of 5,000 requests (outputs cycling 1, 7, 256, 2·BLOCK_DRAWS) equals bind's."""
    outputs = np.resize([1, 7, 256, 2 * BLOCK_DRAWS], RIDS.size)
    ids = RIDS if seed == 0 else RIDS[::10]  # the other seeds on 500 ids (time)
    outputs = outputs[: ids.size]
    bulk = bind_many(model, ids.tolist(), outputs.tolist(), 6, seed)
    assert len(bulk) == ids.size
    for rid, n, request in zip(ids.tolist(), outputs.tolist(), bulk, strict=True):
        reference = model.bind(rid, n, 6, seed)
        reference.refill()
        assert type(request) is type(reference)
        assert request._rng is None  # no Generator made for the first block
        assert request.at == 0
        assert np.array_equal(request.counts, reference.counts), rid
        assert np.array_equal(request.expected_tokens(0), reference.expected_tokens(0))


@pytest.mark.parametrize("model", BLOCK_MODELS[:1] + BLOCK_MODELS[3:], ids=lambda m: m.name)
@pytest.mark.parametrize("seed", [1, 2**63 - 1])
def test_bind_many_draws_continue_over_blocks(model, seed: int) -> None:
    """Draw for draw over four blocks: the lazily made Generator continues each stream where the
    compiled draws left it."""
    ids = [3, 2**32 + 1, 2**63 - 1, 41, 977]
    outputs = [1, 7, 30, BLOCK_DRAWS + 5, 2]
    bulk = bind_many(model, ids, outputs, 5, seed)
    for rid, n, request in zip(ids, outputs, bulk, strict=True):
        reference = model.bind(rid, n, 5, seed)
        block = min(n, BLOCK_DRAWS)
        draws = 4 * block + 1
        assert [request.draw(0) for _ in range(draws)] == [reference.draw(0) for _ in range(draws)], rid
        assert request._rng.bit_generator.state == reference._rng.bit_generator.state


def test_bind_many_place_handed_back_by_the_lane() -> None:
    """The lane reads a bulk first block as an array and hands its place back through `at`: the Python
    loop's draws go on from there, into the next blocks, as the reference's."""
    model = Geometric(alpha=0.8)
    for at in (0, 5, 40):
        (request,) = bind_many(model, [12], [40], 6, 3)
        reference = model.bind(12, 40, 6, 3)
        [reference.draw(0) for _ in range(at)]
        request.at = at
        assert [request.draw(0) for _ in range(100)] == [reference.draw(0) for _ in range(100)]


def test_bind_stream_is_default_rng_of_seed_tag_and_id() -> None:
    """The per-request path: counts of 1 − default_rng([seed, TAG, rid]).random(block) (the stream's definition)."""
    model = Geometric(alpha=0.65)
    for rid, n in [(0, 1), (9, 50), (2**40, 300)]:
        u = 1.0 - np.random.default_rng([4, TAG, rid]).random(n)
        request = model.bind(rid, n, 7, 4)
        assert [request.draw(0) for _ in range(n)] == np.minimum(np.floor(np.log(u) / np.log(0.65)), 7).astype(int).tolist()


@pytest.mark.parametrize(
    "model",
    [Geometric(beta=(6.0, 4.0)), Regime(alphas=(0.2, 0.9), mean_phase_tokens=5.0), Recorded(accepted=(0, 3, 1, 2), draft_len=3)],
    ids=lambda m: m.name,
)
def test_bind_many_falls_back_to_bind(model) -> None:
    """Models that draw before their blocks (a Beta α) or depend on the position: bind, request by request."""
    assert model.block_factory(3) is None
    ids, outputs = [0, 5, 2**33], [40, 3, 100]
    for rid, n, request in zip(ids, outputs, bind_many(model, ids, outputs, 3, 2), strict=True):
        reference = model.bind(rid, n, 3, 2)
        assert [request.draw(p) for p in range(60)] == [reference.draw(p) for p in range(60)]
    assert bind_many(Geometric(alpha=0.5), [], [], 3, 0) == []
