"""The union counted from expert bitmasks against the id-counting kernel and a plain-Python count:
the same U, M, S per layer and Σ U, on random and adversarial windows, for E a multiple of 64 or not;
the masks against their definition; the fallbacks (stray or repeated ids, no memory)."""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest

import moesim.machine
from moesim.kernels.bitsets import MASKS_OK, MASKS_REPEATED, MASKS_STRAY, bitset_union, fill_masks, mask_words, union_planes
from moesim.kernels.unions import PrefillRegion
from moesim.models import load_preset
from moesim.sim.cost.fast_pass import count_ids, count_union, scratch_for
from moesim.tracegen.routing.synth import Sticky, synthesize

NO_BLOCKS = np.zeros(0, np.int64)
NO_REGION = np.zeros((1, 1, 1), np.int32)


def _routing(rng: np.random.Generator, n_rows: int, n_layers: int, n_experts: int, k: int, hot: int | None = None) -> np.ndarray:
    """(T, L, K) distinct ids per token and layer; with `hot`, every token also selects expert `hot`."""
    ids = np.argsort(rng.random((n_rows, n_layers, n_experts)), axis=2)[:, :, :k]
    if hot is not None:
        has = (ids == hot).any(axis=2)
        ids[:, :, 0] = np.where(has, ids[:, :, 0], hot)  # `hot` replaces the first id where it is missing
    dtype = np.uint8 if n_experts <= 256 else np.uint16
    return ids.astype(dtype)


def _masks(experts: np.ndarray, n_experts: int) -> np.ndarray:
    masks = np.empty((experts.shape[0] + 1, experts.shape[1], mask_words(n_experts)), np.uint64)
    assert fill_masks(experts, n_experts, masks) == MASKS_OK
    return masks


def _brute(experts: np.ndarray, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """U, M, S per layer by counting in plain Python."""
    n_layers = experts.shape[1]
    out = np.zeros((3, n_layers), np.int64)
    for layer in range(n_layers):
        tokens = [t for r, n in zip(rows.tolist(), lengths.tolist(), strict=True) for t in range(r, r + n)]
        counts = Counter(int(e) for t in tokens for e in experts[t, layer])
        out[:, layer] = len(counts), max(counts.values(), default=0), sum(counts.values())
    return out


def _both(experts: np.ndarray, masks: np.ndarray, n_experts: int, rows: np.ndarray, lengths: np.ndarray) -> tuple:
    """(Σ U, features) from the bitmasks and from counting ids (today's kernel, the reference)."""
    n_layers = experts.shape[1]
    planes, group, _ = union_planes(n_layers, n_experts)
    got = np.full((3, n_layers), -7, np.int64)
    total = bitset_union(masks, rows, lengths, rows.size, experts.shape[2], planes, group, got)
    counts = np.zeros((n_layers, n_experts + 1), np.int32)
    ref = np.full((3, n_layers), -7, np.int64)
    ref_total = count_ids(experts, rows, lengths, rows.size, NO_REGION, NO_BLOCKS, NO_BLOCKS, 0, n_experts, counts, ref)
    assert not counts.any()
    return (total, got), (ref_total, ref)


@pytest.mark.parametrize("n_experts", [64, 128, 256, 100, 160, 8, 65])
def test_masks_hold_each_tokens_experts(n_experts: int) -> None:
    rng = np.random.default_rng(n_experts)
    experts = _routing(rng, 37, 3, n_experts, min(8, n_experts))
    masks = _masks(experts, n_experts)
    assert masks.shape == (38, 3, -(-n_experts // 64)) and not masks[-1].any()
    for t in range(37):
        for layer in range(3):
            bits = {64 * w + b for w in range(masks.shape[2]) for b in range(64) if int(masks[t, layer, w]) >> b & 1}
            assert bits == {int(e) for e in experts[t, layer]}


@pytest.mark.parametrize(("n_experts", "k"), [(64, 8), (128, 8), (256, 8), (100, 6), (160, 6), (65, 4), (8, 2)])
def test_random_windows_equal_the_counting_kernel(n_experts: int, k: int) -> None:
    rng = np.random.default_rng(n_experts * 10 + k)
    experts = _routing(rng, 300, 5, n_experts, k)
    masks = _masks(experts, n_experts)
    for trial in range(60):
        n = int(rng.integers(0, 40))
        lengths = rng.integers(0, 9, n).astype(np.int64)
        rows = np.array([rng.integers(0, 300 - s + 1) for s in lengths], np.int64)
        (total, got), (ref_total, ref) = _both(experts, masks, n_experts, rows, lengths)
        assert np.array_equal(got, ref) and total == ref_total == ref[0].sum(), trial
        if trial < 10:
            assert np.array_equal(got, _brute(experts, rows, lengths))


def test_adversarial_windows() -> None:
    """Repeated rows, overlapping windows, one token, no token, all tokens on one expert (M from 1
    to 300: up to 9 planes, the eights carried through every plane)."""
    rng = np.random.default_rng(5)
    n_experts = 160
    experts = _routing(rng, 400, 4, n_experts, 8, hot=131)  # expert 131 in every token, in the last, partial word
    masks = _masks(experts, n_experts)
    cases = [
        (np.array([7]), np.array([1])),  # one token
        (np.array([7, 7, 7]), np.array([1, 1, 1])),  # one token three times
        (np.array([10, 12, 11]), np.array([6, 6, 6])),  # overlapping
        (np.array([3, 3]), np.array([0, 0])),  # no token
        (np.array([0, 5]), np.array([0, 4])),  # an empty window first
        (np.array([0]), np.array([400])),  # every row: M = 400
        (np.array([20] * 40), np.array([2] * 40)),  # two rows 40 times: M = 80 (> 64)
        (np.arange(0, 300, 3), np.full(100, 3)),  # 300 tokens
    ]
    cases += [(np.zeros(1), np.array([n])) for n in range(1, 70)]  # every length of one window across the groups of 8
    for rows, lengths in cases:
        rows, lengths = np.asarray(rows, np.int64), np.asarray(lengths, np.int64)
        (total, got), (ref_total, ref) = _both(experts, masks, n_experts, rows, lengths)
        assert np.array_equal(got, ref) and total == ref_total, (rows[:3], lengths[:3])
        assert np.array_equal(got, _brute(experts, rows, lengths))
        assert got[1].tolist() == [int(lengths.sum())] * 4  # the hot expert is in every token


def test_count_union_takes_the_masks_and_falls_back() -> None:
    """`count_union` through the masks and through counting (no masks, or a pass with blocks) agree;
    an id >= E keeps its status path: the trace has no masks, counting finds it (−1)."""
    rng = np.random.default_rng(9)
    experts = _routing(rng, 100, 6, 128, 8)
    with_masks, without = scratch_for(6, 128, _masks(experts, 128)), scratch_for(6, 128)
    rows, lengths = np.array([3, 50, 51], np.int64), np.array([4, 4, 4], np.int64)
    totals = [count_union(experts, rows, lengths, 3, NO_REGION, NO_BLOCKS, NO_BLOCKS, 0, s[0], s[1]) for s in (with_masks, without)]
    assert totals[0] == totals[1] and np.array_equal(with_masks[1], without[1])
    assert np.array_equal(with_masks[1], _brute(experts, rows, lengths))
    stray = experts.copy()
    stray[52, 2, 5] = 200  # in the second window
    masks = np.empty((101, 6, 2), np.uint64)
    assert fill_masks(stray, 128, masks) == MASKS_STRAY
    repeated = experts.copy()
    repeated[60, 2, 5] = repeated[60, 2, 4]
    assert fill_masks(repeated, 128, masks) == MASKS_REPEATED
    assert fill_masks(experts, 100, masks) == MASKS_STRAY  # ids 100..127: inside the last word, beyond E
    assert count_union(stray, rows, lengths, 3, NO_REGION, NO_BLOCKS, NO_BLOCKS, 0, without[0], without[1]) == -1
    assert count_union(stray, rows[:1], lengths[:1], 1, NO_REGION, NO_BLOCKS, NO_BLOCKS, 0, without[0], without[1]) >= 0


def test_a_trace_keeps_its_masks_or_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    preset = load_preset("qwen3-30b-a3b")
    trace = synthesize(preset, Sticky(keep_prob=0.3), 64, 3, 0)
    masks = trace.expert_masks
    assert masks is not None and trace.expert_masks is masks  # built once
    assert np.array_equal(masks, _masks(trace.experts, preset.experts))
    copy = pickle.loads(pickle.dumps(trace))
    assert "expert_masks" not in copy.__dict__ and np.array_equal(copy.expert_masks, masks)  # sent without them
    other = synthesize(preset, Sticky(keep_prob=0.3), 64, 3, 0)
    monkeypatch.setattr(moesim.machine, "available_memory_bytes", lambda: 1000)
    assert other.expert_masks is None  # would not fit: unions count ids


# Mixed passes: windows plus blocks of the prefill region's checkpoints (`bitset_union_blocks`).

STRIDE = 16


def _brute_blocks(experts: np.ndarray, rows: np.ndarray, lengths: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """U, M, S per layer in plain Python, a block [lo, hi) being the rows lo·16 .. hi·16 − 1."""
    block_rows = [r for b_lo, b_hi in zip(lo.tolist(), hi.tolist(), strict=True) for r in range(b_lo * STRIDE, b_hi * STRIDE)]
    all_rows = np.concatenate([rows, np.array(block_rows, np.int64)])
    return _brute(experts, all_rows, np.concatenate([lengths, np.ones(len(block_rows), np.int64)]))


def _mixed(experts: np.ndarray, n_experts: int, rows: np.ndarray, lengths: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple:
    """(Σ U, features) of a mixed pass through the bitmasks (`count_union` with masks) and by
    counting ids (`count_ids`, the reference), on the region of the trace's first 320 rows."""
    n_layers = experts.shape[1]
    region = PrefillRegion.of(experts, n_experts, max_rows=320, stride=STRIDE).checkpoints
    union, got, _ = scratch_for(n_layers, n_experts, _masks(experts, n_experts))
    got[:] = -7
    total = count_union(experts, rows, lengths, rows.size, region, lo, hi, lo.size, union, got)
    assert not union[0].any() and not union[4].any()  # the counts and the dense tally are left zero
    counts = np.zeros((n_layers, n_experts + 1), np.int32)
    ref = np.full((3, n_layers), -7, np.int64)
    ref_total = count_ids(experts, rows, lengths, rows.size, region, lo, hi, lo.size, n_experts, counts, ref)
    return (total, got), (ref_total, ref)


@pytest.mark.parametrize(("n_experts", "k"), [(64, 8), (128, 8), (160, 6), (256, 8), (100, 6)])
def test_random_mixed_passes_equal_the_counting_kernel(n_experts: int, k: int) -> None:
    """Random windows (none to 40) and blocks (none to 4, empty ones too) of a 320-row region."""
    rng = np.random.default_rng(n_experts * 7 + k)
    experts = _routing(rng, 400, 5, n_experts, k)
    for trial in range(60):
        n = int(rng.integers(0, 41)) if trial % 5 else 0  # every fifth pass: blocks only
        lengths = rng.integers(0, 9, n).astype(np.int64)
        rows = np.array([rng.integers(0, 400 - s + 1) for s in lengths], np.int64)
        n_blocks = int(rng.integers(0, 5))
        lo = rng.integers(0, 21, n_blocks).astype(np.int64)
        hi = np.array([rng.integers(a, 21) for a in lo.tolist()], np.int64)  # hi == lo: an empty block
        (total, got), (ref_total, ref) = _mixed(experts, n_experts, rows, lengths, lo, hi)
        assert np.array_equal(got, ref) and total == ref_total == ref[0].sum(), trial
        if trial < 10:
            assert np.array_equal(got, _brute_blocks(experts, rows, lengths, lo, hi)), trial


def _routing_without(rng: np.random.Generator, n_rows: int, n_layers: int, n_experts: int, k: int, hot: int, absent: int) -> np.ndarray:
    """Like `_routing` with expert `hot` in every token, and expert `absent` in none."""
    ids = _routing(rng, n_rows, n_layers, n_experts - 1, k, hot=hot - (hot > absent)).astype(np.int64)
    return (ids + (ids >= absent)).astype(np.uint8)


@pytest.mark.parametrize("n_experts", [64, 128, 160, 256])
def test_the_largest_count_from_a_block_the_windows_or_both(n_experts: int) -> None:
    """Expert a is in every token of rows 0..199 and in none after, expert b the other way round:
    M of a long block and a few windows is a's count in the block (closed form: its rows), M of
    a short block and many window tokens is b's count in the windows; an expert in every row
    counts both. One window only, one block only, no block and no window."""
    rng = np.random.default_rng(n_experts)
    a, b = n_experts - 3, 1  # a in the last word
    experts = np.concatenate([_routing_without(rng, 200, 4, n_experts, 8, a, b), _routing_without(rng, 200, 4, n_experts, 8, b, a)])
    cases = {
        "block": (np.array([210, 300]), np.array([5, 7]), np.array([0]), np.array([12]), 12 * STRIDE),
        "windows": (np.arange(220, 320, 10), np.full(10, 10), np.array([1]), np.array([2]), 100),
        "windows again": (np.array([250] * 30), np.array([8] * 30), np.array([0, 3]), np.array([1, 4]), 240),
        "one window": (np.array([330]), np.array([3]), np.array([0]), np.array([0]), 3),
        "one block": (np.zeros(0, np.int64), np.zeros(0, np.int64), np.array([2]), np.array([9]), 7 * STRIDE),
        "nothing": (np.zeros(0, np.int64), np.zeros(0, np.int64), np.array([4]), np.array([4]), 0),
    }
    for name, (rows, lengths, lo, hi, most) in cases.items():
        rows, lengths, lo, hi = (np.asarray(x, np.int64) for x in (rows, lengths, lo, hi))
        (total, got), (ref_total, ref) = _mixed(experts, n_experts, rows, lengths, lo, hi)
        assert np.array_equal(got, ref) and total == ref_total, name
        assert np.array_equal(got, _brute_blocks(experts, rows, lengths, lo, hi)), name
        assert got[1].tolist() == [most] * 4, name
        assert got[2].tolist() == [8 * (int(lengths.sum()) + STRIDE * int((hi - lo).sum()))] * 4, name
    hot = _routing(rng, 400, 4, n_experts, 8, hot=n_experts - 1)  # in every token: M = window tokens + block rows
    both = [
        (np.array([5, 250, 251]), np.array([4, 9, 9]), np.array([0, 10]), np.array([3, 20])),
        (np.array([0, 0]), np.array([400, 400]), np.array([0]), np.array([20])),  # 800 window tokens: 10 planes
    ]
    for rows, lengths, lo, hi in both:
        (total, got), (ref_total, ref) = _mixed(hot, n_experts, rows, lengths, lo, hi)
        assert np.array_equal(got, ref) and total == ref_total
        assert got[1].tolist() == [int(lengths.sum()) + STRIDE * int((hi - lo).sum())] * 4


def test_a_prefill_chunk_through_the_masks() -> None:
    """A decode batch plus a 512-token chunk cut by `PrefillRegion.pieces` (its partial ends as
    windows, a block between, wrapping at the region's end): `count_union` with the trace's masks
    equals it without them."""
    preset = load_preset("qwen3-30b-a3b")
    trace = synthesize(preset, Sticky(keep_prob=0.3), 600, 4, 1)
    region = PrefillRegion.of(trace.experts, preset.experts, max_rows=1000, stride=STRIDE)
    n_layers = trace.experts.shape[1]
    with_masks, without = scratch_for(n_layers, preset.experts, trace.expert_masks), scratch_for(n_layers, preset.experts)
    for first in (0, 5, 17, 700, 990):
        starts, lengths, lows, highs = list(range(1000, 2400, 45)), [4] * 32, [], []
        region.pieces(first, 512, (starts, lengths), (lows, highs))
        assert lows, first  # a block in every chunk
        args = [np.array(x, np.int64) for x in (starts, lengths)] + [len(starts), region.checkpoints]
        args += [np.array(lows, np.int64), np.array(highs, np.int64), len(lows)]
        totals = [count_union(trace.experts, *args, s[0], s[1]) for s in (with_masks, without)]
        assert totals[0] == totals[1] and np.array_equal(with_masks[1], without[1]), first
