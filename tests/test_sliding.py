"""Exact features of wide windows (kernels.sliding) against plain Python, and against the bitmask
counter where both count (n <= 64); pass sizes up to 4096 in predict, crossover and batch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from moesim.kernels.sliding import sliding_distribution
from moesim.kernels.unions import union_features_many
from moesim.kernels.windows import summarize_windows
from moesim.models import load_preset
from moesim.sim.analysis.batch import batch_analysis
from moesim.sim.analysis.predict import predict
from moesim.sim.analysis.scenario import load_scenario, pass_sizes
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Sticky, synthesize


def _brute(experts: np.ndarray, starts: np.ndarray, n: int) -> Counter:
    """(U, M) of every window and layer, counted by hand."""
    joint: Counter = Counter()
    for s in range(len(starts) - 1):
        for t in range(starts[s], starts[s + 1] - n + 1):
            for layer in range(experts.shape[1]):
                counts = Counter(experts[t : t + n, layer].ravel().tolist())
                joint[(len(counts), max(counts.values()))] += 1
    return joint


def _as_counter(features, probability: np.ndarray, total: int) -> Counter:  # type: ignore[no-untyped-def]
    return Counter(
        {
            (int(u), int(m)): round(p * total)
            for u, m, p in zip(features.distinct_experts, features.max_tokens_per_expert, probability, strict=True)
        }
    )


@pytest.mark.parametrize("n", [1, 3, 17, 65, 130])
def test_sliding_window_matches_a_plain_count(n: int) -> None:
    rng = np.random.default_rng(n)
    lengths = [150, 40, 200]
    rows = sum(lengths)
    experts = np.stack([np.stack([rng.choice(24, 4, replace=False) for _ in range(3)]) for _ in range(rows)]).astype(np.uint16)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    features, probability = sliding_distribution(experts, starts, 24, n)
    brute = _brute(experts, starts, n)
    assert _as_counter(features, probability, sum(brute.values())) == brute
    if n <= 64:
        summary = summarize_windows(experts, starts, 24, n)
        expected, p_expected = summary.feature_distribution(n)
        assert _as_counter(expected, p_expected, sum(brute.values())) == brute


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wide") / "qwen.arrow"
    write_trace(path, synthesize(load_preset("qwen3-30b-a3b"), Sticky(keep_prob=0.4), tokens=4200, seqs=1, seed=3, weight_format="BF16"))
    return path


def test_predict_and_crossover_run_to_4096_tokens_on_an_engine_profile(long_trace: Path, cli) -> None:  # type: ignore[no-untyped-def]
    assert list(pass_sizes(300)) == [*range(1, 65), 96, 128, 192, 256, 300]
    scenario = load_scenario(long_trace, "nvidia-h200-vllm")
    result = predict(scenario, sizes=[1, 64, 128, 129, 4096])
    families = list(result.cost.family)
    assert families == ["dedup_fused_bm16", "dedup_fused_bm16", "dedup_fused_bm16", "dedup_fused_bm64", "dedup_fused_bm64"]  # M <= E = 128
    assert np.all(np.diff(result.cost.total_us()) > 0)
    code, out, err = cli(
        "crossover",
        "--trace",
        long_trace,
        "--profile",
        "nvidia-rtx-3090-llamacpp",
        "--format",
        "Q4_K",
        "--pass-sizes",
        "1,8,64,512,4096",
        "--json",
    )
    assert code == 0, err
    assert '"dedup_family": "dedup_mmq"' in out
    code, _, err = cli("predict", "--trace", long_trace, "--profile", "nvidia-h200-vllm", "--pass-sizes", "5000")
    assert code == 2 and "1..4096" in err


def test_batch_counts_a_4096_token_union_exactly(long_trace: Path) -> None:
    scenario = load_scenario(long_trace, "nvidia-h200-vllm", context_tokens=0)
    result = batch_analysis(scenario, alpha=0.5, draft_len=7, batches=[512], max_batches=2)
    trace = scenario.trace
    segment = trace.seq_lengths()[0] // 512
    starts = np.arange(512) * segment
    union = union_features_many(trace.experts, np.array([0, 512]), starts, np.full(512, 8), trace.meta.geometry.experts)
    by_hand = [
        len(set(trace.experts[np.concatenate([np.arange(s, s + 8) for s in starts]), layer].ravel().tolist())) for layer in range(48)
    ]
    assert union.distinct_experts[0].tolist() == by_hand
    assert result.verify_tokens * 512 == 4096 and result.verify_us[0] > result.single_us[0]
