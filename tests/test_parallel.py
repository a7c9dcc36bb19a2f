"""Several devices: collectives, tensor- and expert-parallel pass times against hand formulas, KV
heads per device; the mixed pass of chunked prefill against a brute-force union."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.errors import ConfigError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.catalog import LinkSpec, link_spec
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.unions import PrefillRegion, union_pass, union_scratch
from moesim.models import ExpertShape, load_preset
from moesim.sim.cost.drafters import make_drafter
from moesim.sim.cost.parallel import Parallelism, all_reduce_us, all_to_all_us
from moesim.sim.cost.pass_table import PrefillChunks
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.cost.trace_batch import TraceBatchCost
from moesim.tracegen.routing.synth import Sticky, synthesize

LINK = LinkSpec("l", "test link", 200.0, 3.0, "assumed", "test")
PROFILE = load_profile("nvidia-h200")
PRESET = load_preset("deepseek-v2-lite")  # 27 layers, the first dense; 64 experts, top-6; MLA
TRACE = synthesize(PRESET, Sticky(keep_prob=0.3), tokens=256, seqs=4, seed=5)


def test_collectives_by_hand() -> None:
    assert all_reduce_us(1e6, 1, LINK) == 0.0
    assert all_reduce_us(1e6, 2, LINK) == pytest.approx(2 * 3.0 + 1e6 / 200e3)
    assert all_reduce_us(1e6, 4, LINK) == pytest.approx(2 * 3 * 3.0 + 2 * 3 / 4 * 1e6 / 200e3)
    assert all_to_all_us(1e6, 4, LINK) == pytest.approx(3 * 3.0 + 3 / 4 * 1e6 / 200e3)


def test_kv_heads_per_device() -> None:
    qwen = load_preset("qwen2-57b-a14b")  # GQA, 4 KV heads of 128, 28 layers
    assert Parallelism(2, link=LINK).kv_bytes_per_token(qwen, 2.0) == 28 * 2 * 2 * 128 * 2
    assert Parallelism(8, link=LINK).kv_bytes_per_token(qwen, 2.0) == 28 * 2 * 1 * 128 * 2  # replicated: one head each
    assert Parallelism(4, link=LINK).kv_bytes_per_token(PRESET, 2.0) == 27 * (512 + 64) * 2  # MLA's latent on every device
    with pytest.raises(ConfigError, match="do not split over 3"):
        Parallelism(3, True, LINK).check(PRESET)


def rows_of(seqs: np.ndarray, starts: np.ndarray, n: np.ndarray) -> list[int]:
    return [int(TRACE.seq_starts[s] + p) for s, st, k in zip(seqs, starts, n, strict=True) for p in range(st, st + k)]


def counts_of(rows: list[int]) -> np.ndarray:
    """Slots per (MoE layer, expert) of the rows, by brute force."""
    counts = np.zeros((TRACE.experts.shape[1], PRESET.experts), np.int64)
    for r in rows:
        for layer in range(TRACE.experts.shape[1]):
            for e in TRACE.experts[r, layer]:
                counts[layer, e] += 1
    return counts


WINDOWS = (np.array([0, 1, 2, 3, 1]), np.array([5, 40, 100, 7, 120]), np.array([4, 3, 1, 4, 2]))
CONTEXT = np.array([300, 500, 200, 800, 100])


def dense_by_hand(model: StepTimeModel, devices: int, n: int, context: float) -> float:
    d = PROFILE.dense
    weights = PRESET.non_expert_params_per_token() * 2.0 / devices
    kv = 27 * (512 + 64) * 2.0 * context
    flops = 2.0 * PRESET.non_expert_params_per_token() / devices * n
    return float(d.time_us(weights + kv, flops, 8 * 27)) + PROFILE.pass_fixed_us


def test_tensor_parallel_pass_by_hand() -> None:
    """TP 2: every layer's expert time on experts of half the intermediate width, the dense part
    halved (MLA's KV replicated), and two all-reduces per layer of n × hidden × 2 bytes."""
    model = StepTimeModel(PRESET, PROFILE, "per_slot", parallel=Parallelism(2, False, LINK))
    cost = TraceBatchCost(model, TRACE, make_drafter("ngram", PRESET))
    counts = counts_of(rows_of(*WINDOWS))
    n = int(WINDOWS[2].sum())
    features = RoutingFeatures(np.float64(n), np.float64(n * 6), (counts > 0).sum(axis=1), counts.max(axis=1))
    family = PROFILE.expert_family("per_slot")
    expert = float(family.time_us(features, ExpertShape(2048, 704, "BF16")).sum())
    comm = 2 * 27 * all_reduce_us(n * 2048 * 2.0, 2, LINK)
    expected = expert + dense_by_hand(model, 2, n, float(CONTEXT.sum())) + comm
    assert cost.verify_us(*WINDOWS, CONTEXT) == pytest.approx(expected, rel=1e-12)


def test_expert_parallel_pass_by_hand() -> None:
    """EP 4: device r holds experts 16r..16r+15 whole; each MoE layer costs its slowest device
    (distinct experts, max tokens and slots routed there); dense part TP over the 4; one
    all-reduce per layer, one more per dense layer, a dispatch and a combine all-to-all per MoE layer."""
    model = StepTimeModel(PRESET, PROFILE, "dedup", parallel=Parallelism(4, True, LINK))
    cost = TraceBatchCost(model, TRACE, make_drafter("ngram", PRESET))
    counts = counts_of(rows_of(*WINDOWS))
    n = int(WINDOWS[2].sum())
    family = PROFILE.expert_family("dedup")
    shape = PRESET.expert_shape("BF16")
    expert = 0.0
    for layer in range(counts.shape[0]):
        times = []
        for r in range(4):
            block = counts[layer, 16 * r : 16 * r + 16]
            f = RoutingFeatures(np.float64(block.sum() / 6), np.float64(block.sum()), np.int64((block > 0).sum()), np.int64(block.max()))
            times.append(float(family.time_us(f, shape)))
        expert += max(times)
    activations = n * 2048 * 2.0
    reduce, exchange = all_reduce_us(activations, 4, LINK), all_to_all_us(activations * 6 / 4, 4, LINK)
    comm = 27 * reduce + 1 * reduce + 2 * 26 * exchange
    expected = expert + dense_by_hand(model, 4, n, float(CONTEXT.sum())) + comm
    assert cost.verify_us(*WINDOWS, CONTEXT) == pytest.approx(expected, rel=1e-12)


def test_one_device_is_unchanged() -> None:
    """Parallelism(1) is the single-device model: same numbers as before the field existed."""
    plain = TraceBatchCost(StepTimeModel(PRESET, PROFILE, "best"), TRACE, make_drafter("ngram", PRESET))
    counts = counts_of(rows_of(*WINDOWS))
    n = int(WINDOWS[2].sum())
    features = RoutingFeatures(np.float64(n), np.float64(n * 6), (counts > 0).sum(axis=1), counts.max(axis=1))
    assert plain.verify_us(*WINDOWS, CONTEXT) == plain.model.pass_time_us(features, float(CONTEXT.sum()))
    assert plain.model.comm_us(n) == 0.0


@pytest.mark.parametrize("ranks", [1, 2])
def test_mixed_pass_is_the_union_of_windows_and_chunks(ranks: int) -> None:
    """Decode windows plus two prefill chunks: the union counted over the windows' rows and the
    chunks' rows of the prefill region (position p of a request on sequence s: region row
    (first row of s + p) mod R), at the decode contexts plus each chunk's last position."""
    parallel = Parallelism(ranks, ranks > 1, LINK if ranks > 1 else None)
    model = StepTimeModel(PRESET, PROFILE, "dedup", parallel=parallel)
    cost = TraceBatchCost(model, TRACE, make_drafter("ngram", PRESET))
    chunk_seqs, chunk_starts, chunk_tokens = np.array([2, 3]), np.array([0, 700]), np.array([150, 400])
    got = cost.mixed_us(*WINDOWS, CONTEXT, PrefillChunks(chunk_seqs, chunk_starts, chunk_tokens))
    region = PrefillRegion.of(TRACE.experts, PRESET.experts)
    assert region.rows == 1024
    rows = rows_of(*WINDOWS)
    for s, st, c in zip(chunk_seqs, chunk_starts, chunk_tokens, strict=True):
        rows += [int((TRACE.seq_starts[s] + st + i) % region.rows) for i in range(c)]
    counts = counts_of(rows)
    n = int(WINDOWS[2].sum() + chunk_tokens.sum())
    context = float(CONTEXT.sum() + (chunk_starts + chunk_tokens).sum())
    per = PRESET.experts // ranks
    distinct = np.stack([(counts[:, r * per : (r + 1) * per] > 0).sum(axis=1) for r in range(ranks)])
    most = np.stack([counts[:, r * per : (r + 1) * per].max(axis=1) for r in range(ranks)])
    slots = np.stack([counts[:, r * per : (r + 1) * per].sum(axis=1) for r in range(ranks)])
    assert got == model.rank_pass_us(distinct, most, slots, n, context)
    assert cost.last_distinct_experts == pytest.approx(float(np.mean((counts > 0).sum(axis=1))))


def test_union_pass_against_brute_force() -> None:
    """The kernel's per-rank distinct experts, max tokens and slots of windows plus region blocks,
    on random windows and chunks (partial ends counted as windows, whole stretches as checkpoints)."""
    rng = np.random.default_rng(0)
    region = PrefillRegion.of(TRACE.experts, PRESET.experts, max_rows=400, stride=16)
    assert region.rows == 400 and region.checkpoints.shape == (26, 26, 64)
    scratch = union_scratch(26, 64)
    for _ in range(60):
        count = int(rng.integers(0, 4))
        starts, lengths = rng.integers(0, 1000, count), rng.integers(1, 9, count)
        windows: tuple[list[int], list[int]] = ([], [])
        blocks: tuple[list[int], list[int]] = ([], [])
        chunks = [(int(rng.integers(0, 5000)), int(rng.integers(1, 900))) for _ in range(int(rng.integers(0, 3)))]
        for first, tokens in chunks:
            region.pieces(first, tokens, windows, blocks)
        all_starts = np.array([*starts, *windows[0]], np.int64)
        all_lengths = np.array([*lengths, *windows[1]], np.int64)
        lo, hi = np.array(blocks[0], np.int64), np.array(blocks[1], np.int64)
        ranks = int(rng.choice([1, 2, 4]))
        u, m, s = union_pass(TRACE.experts, all_starts, all_lengths, 64, scratch, region, lo, hi, ranks)
        rows = [int(r) for st, ln in zip(starts, lengths, strict=True) for r in range(st, st + ln)]
        rows += [(first + i) % 400 for first, tokens in chunks for i in range(tokens)]
        counts = counts_of(rows)
        per = 64 // ranks
        for r in range(ranks):
            block = counts[:, r * per : (r + 1) * per]
            assert np.array_equal(u[r], (block > 0).sum(axis=1))
            assert np.array_equal(m[r], block.max(axis=1))
            assert np.array_equal(s[r], block.sum(axis=1))
    assert not scratch.any()


def test_link_catalog() -> None:
    a800 = link_spec("nvlink3-a800")
    assert (a800.bandwidth_gbps, a800.kind) == (200.0, "datasheet")
    with pytest.raises(ConfigError, match="unknown link 'x'"):
        link_spec("x")
