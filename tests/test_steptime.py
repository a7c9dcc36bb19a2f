"""The step-time model against its composition written out by hand, and the expected-cost path
(feature distributions) against the per-window path."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.errors import InputError
from moesim.hw_profiles import load_profile
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.windows import summarize_windows, window_features
from moesim.models import load_preset
from moesim.sim.cost.steptime import DENSE_KERNELS_PER_LAYER, StepTimeModel
from moesim.tracegen.routing.synth import Sticky, synthesize

PROFILE = load_profile("nvidia-h200")
PRESET = load_preset("deepseek-v2-lite")


def small_trace():  # type: ignore[no-untyped-def]
    return synthesize(PRESET, Sticky(keep_prob=0.4), tokens=96, seqs=2, seed=3)


def test_pass_cost_equals_hand_composition() -> None:
    trace = small_trace()
    wf = window_features(trace.experts, trace.seq_starts, 64, 4)
    features = wf.routing_features(4)  # (windows, 26)
    model = StepTimeModel(PRESET, PROFILE, "per_slot")
    cost = model.pass_cost(features, 1000.0)
    family = PROFILE.expert_family("per_slot")
    shape = PRESET.expert_shape("BF16")
    dense = PROFILE.dense
    weights = PRESET.non_expert_params_per_token() * 2.0
    kv = 1000.0 * PRESET.layers * (512 + 64) * 2.0  # MLA caches the latent (512) and the rope key (64)
    for w in (0, 7, len(features.distinct_experts) - 1):
        u, m = features.distinct_experts[w], features.max_tokens_per_expert[w]
        expert = sum(float(family.time_us(RoutingFeatures(4.0, 24.0, u[layer], m[layer]), shape)) for layer in range(26))
        dense_us = dense.launch_us * DENSE_KERNELS_PER_LAYER * 27 + (weights + kv) / (dense.bandwidth_gbps * 1e3)
        dense_us += 2.0 * PRESET.non_expert_params_per_token() * 4 / (dense.tflops * 1e6)
        assert cost.total_us()[w] == pytest.approx(expert + dense_us + PROFILE.pass_fixed_us, rel=1e-12)
    assert np.all(cost.low_us < cost.total_us()) and np.all(cost.total_us() < cost.high_us)
    assert sum(cost.provenance_share().values()) == pytest.approx(1.0)
    # the simulator's lean path gives the same nominal time
    one = RoutingFeatures(4.0, 24.0, features.distinct_experts[3], features.max_tokens_per_expert[3])
    assert model.pass_time_us(one, 1000.0) == pytest.approx(cost.total_us()[3], rel=1e-12)


def test_expected_cost_equals_mean_over_windows() -> None:
    trace = small_trace()
    summary = summarize_windows(trace.experts, trace.seq_starts, 64, 8)
    wf = window_features(trace.experts, trace.seq_starts, 64, 8)
    for engine in ("per_slot", "dedup", "dedup_grouped_gemm"):
        model = StepTimeModel(PRESET, PROFILE, engine)
        expected = model.expected_pass_cost([summary.feature_distribution(n) for n in range(1, 9)], 512.0)
        for n in (1, 3, 8):
            per_window = model.pass_cost(wf.routing_features(n), 512.0).total_us()
            assert expected.total_us()[n - 1] == pytest.approx(per_window.mean(), rel=1e-9)


def test_best_engine_takes_the_cheapest_family() -> None:
    trace = small_trace()
    summary = summarize_windows(trace.experts, trace.seq_starts, 64, 16)
    dists = [summary.feature_distribution(n) for n in range(1, 17)]
    times = {e: StepTimeModel(PRESET, PROFILE, e).expected_pass_cost(dists).total_us() for e in PROFILE.expert_families}
    best = StepTimeModel(PRESET, PROFILE, "best").expected_pass_cost(dists)
    np.testing.assert_allclose(best.total_us(), np.min(np.stack(list(times.values())), axis=0), rtol=1e-12)
    for n, family in enumerate(best.family):
        assert times[str(family)][n] == pytest.approx(best.total_us()[n])


def test_bad_engine_and_dense_model() -> None:
    with pytest.raises(InputError, match="no family 'nope'"):
        StepTimeModel(PRESET, PROFILE, "nope")
    dense = StepTimeModel(load_preset("qwen3-0.6b"), PROFILE)
    with pytest.raises(InputError, match="has no experts"):
        dense.pass_cost(RoutingFeatures(np.ones(1), np.ones(1), np.ones(1), np.ones(1)))


def test_dense_target_pass_by_hand() -> None:
    """A dense target's pass: launches + (weights + KV) / bandwidth + 2·params·n / FLOP rate + fixed."""
    preset = load_preset("opt-30b")
    model = StepTimeModel(preset, PROFILE)
    d = PROFILE.dense
    weights = preset.non_expert_params_per_token() * 2.0
    kv = preset.layers * 2 * 56 * 128 * 2.0 * 900.0
    flops = 2.0 * preset.non_expert_params_per_token() * 5
    expected = d.launch_us * 8 * 48 + (weights + kv) / (d.bandwidth_gbps * 1e3) + flops / (d.tflops * 1e6)
    assert model.dense_pass_us(5, 900.0) == pytest.approx(expected + PROFILE.pass_fixed_us, rel=1e-12)


def test_pass_tables_and_the_compiled_path_agree_exactly() -> None:
    """A pass size is costed by the compiled family evaluation until it has been seen often enough
    to get (U, M) tables; both give the same bits (engine best: the cheapest of four families)."""
    from moesim.sim.cost.steptime import TABLE_AFTER_PASSES

    model = StepTimeModel(PRESET, PROFILE, "best")  # 26 MoE layers, 64 experts, top-6
    rng = np.random.default_rng(1)
    for n in (1, 4, 9, 33):
        passes = [(rng.integers(1, min(64, 6 * n) + 1, 26), rng.integers(1, n + 1, 26)) for _ in range(TABLE_AFTER_PASSES + 3)]
        times = [model.counts_pass_us(n, u, m, 500.0) for u, m in passes]
        assert (model.families[0], n) in model._time_tables
        assert times == [model.counts_pass_us(n, u, m, 500.0) for u, m in passes]
