"""Closed-form analyses end to end: JSON shapes, independent recomputation from T(n), uniform
routing against its formulas, errors and extrapolation warnings."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error

from moesim.kernels.features import uniform_distinct_experts
from moesim.models import builtin_names, load_preset
from moesim.sim.analysis.batch import batch_analysis
from moesim.sim.analysis.crossover import crossover_analysis
from moesim.sim.analysis.predict import predict
from moesim.sim.analysis.scenario import extrapolation_warnings, load_scenario, size_ranges
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Sticky, Uniform, synthesize


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("analysis") / "t.arrow"
    write_trace(path, synthesize(load_preset("deepseek-v2-lite"), Sticky(keep_prob=0.3), tokens=400, seqs=4, seed=1))
    return path


@pytest.fixture(scope="module")
def uniform_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("analysis") / "u.arrow"
    write_trace(path, synthesize(load_preset("deepseek-v2-lite"), Uniform(), tokens=1500, seqs=4, seed=2))
    return path


def test_best_draft_json_matches_exhaustive_search_over_predicted_times(cli, trace_path: Path) -> None:  # type: ignore[no-untyped-def]
    alphas = [0.0, 0.5, 0.7, 0.85, 0.95]
    args = ["--trace", trace_path, "--profile", "nvidia-h200", "--max-draft", "6", "--drafter", "qwen3-0.6b"]
    alpha_args = [x for a in alphas for x in ("--alpha", a)]
    code, out, err = cli("best-draft", *args, *alpha_args, "--json")
    assert code == 0, err
    points = json.loads(out)["points"]
    assert [p["alpha"] for p in points] == alphas
    # recompute independently: T(n) from `predict`, drafter steps from the dense family by hand
    scenario = load_scenario(trace_path, "nvidia-h200", "per_slot", drafter="qwen3-0.6b")
    t = predict(scenario, 7).cost.total_us()
    draft = load_preset("qwen3-0.6b")
    dense = scenario.model.profile.dense
    kv = 512 * draft.layers * draft.attention.kv_cache_bytes_per_token()
    step = float(dense.time_us(draft.non_expert_bytes_per_token() + kv, 2.0 * draft.non_expert_params_per_token()))
    for p in points:
        a = p["alpha"]
        speedups = [sum(a**i for i in range(k + 1)) * t[0] / (k * step + t[k]) for k in range(7)]
        best = max(k for k in range(7) if speedups[k] >= max(speedups) * (1 - 1e-12))
        assert p["best_draft"] == best
        assert p["speedup"] == pytest.approx(speedups[best], rel=1e-9)
        assert p["speedup_low"] <= p["speedup"] <= p["speedup_high"]
        assert p["best_draft_low"] <= p["best_draft"] <= p["best_draft_high"]
    assert [p["best_draft"] for p in points] == sorted(p["best_draft"] for p in points)


def test_predict_json_and_intervals(cli, trace_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli("predict", "--trace", trace_path, "--profile", "nvidia-h200", "--family", "best", "--max-pass", "8", "--json")
    assert code == 0, err
    result = json.loads(out)
    times = [p["time_us"] for p in result["passes"]]
    assert all(p["low_us"] < p["time_us"] < p["high_us"] for p in result["passes"])
    assert times == sorted(times)  # more tokens never cost less
    assert sum(result["provenance_share"].values()) == pytest.approx(1.0)


def test_crossover_json_and_uniform_formula(cli, uniform_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli("crossover", "--trace", uniform_path, "--profile", "nvidia-h200", "--max-pass", "24", "--json")
    assert code == 0, err
    result = json.loads(out)
    n = np.arange(1, 25)
    # a uniform trace: u(n) = E(1 - (1 - K/E)^n) / (nK) within 1% (6000 positions x 26 layers)
    np.testing.assert_allclose(result["byte_share"], 64 * (1 - (58 / 64) ** n) / (6 * n), rtol=0.01)
    wins = [int(x) for x in n[np.array(result["byte_share"]) < np.array(result["bandwidth_ratio"])]]
    assert result["dedup_wins"] == wins and result["crossover_n"] == (wins[0] if wins else None)


ADDRESS_SPACE = 4 << 30  # the batch command's own needs fit in 4 GiB; one int64 per request of a billion (8 GB) does not
# one thread per pool in the child: a BLAS or Numba pool reserves address space per core, which would
# tie the limit to the machine's core count
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.mark.parametrize("routing", ["trace", "uniform"])
def test_batch_refuses_a_batch_the_trace_cannot_hold_before_laying_out_its_requests(trace_path: Path, routing: str) -> None:
    """`--batch 1000000000` is one line, exit 2, in a process that could not hold an array of a
    billion requests: every batch size is checked against the trace before any is laid out."""
    args = ["batch", "--trace", trace_path, "--profile", "nvidia-h200", "--alpha", "0.7", "--draft-len", "3"]
    command = [sys.executable, "-m", "moesim", *map(str, args), "--batch", "1,1000000000", "--routing", routing]
    env = {**os.environ, **ONE_THREAD}
    done = subprocess.run(command, capture_output=True, text=True, env=env, preexec_fn=_limited, timeout=300, check=False)
    assert_one_line_error(done.returncode, done.stderr, "too short for a batch of 1000000000 sequences")


def test_batch_uses_union_and_matches_single_pass_prediction(trace_path: Path) -> None:
    scenario = load_scenario(trace_path, "nvidia-h200", "best")
    result = batch_analysis(scenario, 0.8, 3, [1, 4], routing="uniform")
    # uniform routing: the union of B·n slots has N(B·n) distinct experts on average
    np.testing.assert_allclose(result.distinct_experts[1], uniform_distinct_experts(16, 64, 6), rtol=0.03)
    trace_result = batch_analysis(scenario, 0.8, 3, [1])
    assert trace_result.single_us[0] == pytest.approx(predict(scenario, 1).cost.total_us()[0], rel=1e-9)
    moesd = batch_analysis(scenario, 0.8, 3, [2], moesd_slots=True)
    assert moesd.verify_tokens == 3 and moesd.efficiency[0] > batch_analysis(scenario, 0.8, 3, [2]).efficiency[0]


def test_errors_and_extrapolation_warning(cli, trace_path: Path) -> None:  # type: ignore[no-untyped-def]
    base = ["--trace", trace_path, "--profile", "nvidia-h200"]
    assert_one_line_error(*cli("best-draft", *base, "--alpha", "1.5")[::2], "alpha must lie in [0, 1], got 1.5")
    assert_one_line_error(*cli("best-draft", *base, "--alpha", "0.5", "--max-draft", "-1")[::2], "max draft length must be >= 0")
    assert_one_line_error(*cli("predict", *base, "--family", "dedup_fast")[::2], "no family 'dedup_fast'")
    assert_one_line_error(*cli("crossover", *base, "--dedup-family", "dedup_fast")[::2], "no dedup family 'dedup_fast'")
    assert_one_line_error(*cli("batch", *base, "--alpha", "0.5", "--draft-len", "-2")[::2], "draft length must be >= 0")
    assert_one_line_error(*cli("predict", *base, "--profile", "no-such-gpu")[::2], "no-such-gpu")
    code, out, err = cli("batch", *base, "--alpha", "0.8", "--draft-len", "3", "--batch", "1,64", "--family", "best", "--json")
    assert code == 0
    assert "warning: batch of B = 64 lies beyond the calibrated range (extrapolation factor 2.00)" in err
    assert json.loads(out)["batches"][1]["extrapolation"] == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(20))
def test_size_ranges_round_trip(seed: int) -> None:
    sizes = sorted(set(np.random.default_rng(seed).integers(1, 40, size=12).tolist()))
    expanded = []
    for run in size_ranges(sizes).split(", "):
        low, _, high = run.partition("-")
        expanded += list(range(int(low), int(high or low) + 1))
    assert expanded == sizes


def test_extrapolation_warnings_are_one_line_per_call() -> None:
    factor = np.array([1.0, 2.0, 2.0, 1.0, 3.5, 1.0])
    sizes = np.array([1, 2, 3, 4, 5, 6])
    assert extrapolation_warnings("pass", "n", factor, sizes) == [
        "passes of n = 2-3, 5 lie beyond the calibrated range (extrapolation factors 2.00-3.50); the roofline bounds them from below"
    ]
    assert extrapolation_warnings("batch", "B", np.array([1.0, 2.0]), np.array([1, 64])) == [
        "batch of B = 64 lies beyond the calibrated range (extrapolation factor 2.00); the roofline bounds it from below"
    ]
    assert extrapolation_warnings("pass", "n", np.ones(3), np.arange(1, 4)) == []


def test_crossover_range_contains_nominal(trace_path: Path) -> None:
    result = crossover_analysis(load_scenario(trace_path, "nvidia-h200"), "dedup_grouped_gemm", 32)
    low, high = result.crossover_range
    assert result.crossover_n is not None  # grouped GEMM overtakes per-slot within 32 tokens on this trace
    assert low is not None and low <= result.crossover_n
    assert high is None or result.crossover_n <= high


README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_lists_every_builtin_preset() -> None:
    text = " ".join(README.read_text().split())
    presets = text[text.index("Model presets (`moesim/presets.toml`)") : text.index("Any command taking `--model`")]
    for name in builtin_names():
        assert name in presets, name


@pytest.mark.parametrize("drafter", ["ngram", "eagle", "fixed:25", *builtin_names("eagle"), *builtin_names("dense")])
def test_every_drafter_the_readme_names_is_accepted(cli, trace_path: Path, drafter: str) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli("best-draft", "--trace", trace_path, "--profile", "nvidia-h200", "--alpha", "0.8", "--drafter", drafter, "--json")
    assert code == 0, err
    assert json.loads(out)["points"][0]["speedup"] >= 1.0  # speculation off (k = 0) is among the choices


def test_the_eagle_head_preset_is_the_eagle_drafter(cli, trace_path: Path) -> None:  # type: ignore[no-untyped-def]
    base = ["best-draft", "--trace", trace_path, "--profile", "nvidia-h200", "--alpha", "0.5", "--alpha", "0.9", "--json"]
    eagle, head, ngram = (json.loads(cli(*base, "--drafter", name)[1]) for name in ("eagle", "eagle-head", "ngram"))
    assert eagle.pop("config")["options"]["drafter"] == "eagle" and head.pop("config")["options"]["drafter"] == "eagle-head"
    assert eagle == head  # the same answer; only the written config names the drafter as the user did
    assert eagle != ngram  # the head costs draft time that n-gram lookup does not


def test_a_wrong_preset_or_kind_lists_the_accepted_ones(cli, trace_path: Path) -> None:  # type: ignore[no-untyped-def]
    base = ["best-draft", "--trace", trace_path, "--profile", "nvidia-h200", "--alpha", "0.8"]
    drafters = ("ngram", "eagle", "fixed:US", "eagle-head", "qwen2-0.5b", "qwen3-0.6b", "config.json")
    assert_one_line_error(*cli(*base, "--drafter", "nope")[::2], "unknown drafter 'nope'", *drafters)
    assert_one_line_error(*cli(*base, "--drafter", "olmoe-1b-7b")[::2], "'olmoe-1b-7b' is a MoE target, not a draft model", *drafters)
    moe = ", ".join(builtin_names("moe"))
    for model in ("qwen2-0.5b", "eagle-head"):
        code, _, err = cli(*base, "--model", model)
        assert_one_line_error(code, err, f"'{model}' is a draft model, not a MoE target (MoE presets: {moe};")
        assert "draft_for" not in err
    # `profile show` with a dense model ended in a traceback
    assert_one_line_error(*cli("profile", "show", "nvidia-h200", "--model", "qwen3-0.6b")[::2], "not a MoE target", moe)
