"""Engine time beyond the kernels (issue 24): the terms, their table, the fit from rows, the shared rows' descriptions."""

from __future__ import annotations

import dataclasses

import polars as pl
import pytest

from moesim.errors import ConfigError
from moesim.hw_profiles.engines.host import ENGINE_HOSTS, engine_of
from moesim.hw_profiles.provenance import Provenance
from moesim.hw_profiles.speculative import NO_GRAPH_LIMIT, SPEC_TERMS, spec_path_from_table
from moesim.sim.engine import describe, fit_engine_terms
from moesim.sim.engine.fit import forward_model, run_parts, step_equations
from moesim.sim.engine.rows import forward_time_us, token_time_us

SOURCES = {"s": Provenance("assumed", note="test")}


def _fail(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where} {what}")


def test_a_table_written_before_issue_24_loads_with_no_launches_and_no_graph_limit() -> None:
    spec = spec_path_from_table({"pass_us": 100.0, "iteration_us": 50.0, "source": "s"}, "speculative", SOURCES, _fail)
    assert spec.launch_us_per_layer == 0.0 and spec.graph_max_tokens == NO_GRAPH_LIMIT and not spec.verify_eager
    assert spec.forward_us(4096, 80) == 100.0
    assert spec.overhead_us(3, 4) == 50.0


def test_forward_pays_launches_beyond_the_captured_size_and_on_an_eager_verify() -> None:
    table = {"pass_us": 100.0, "launch_us_per_layer": 10.0, "graph_max_tokens": 8, "verify_eager": True, "source": "s"}
    spec = spec_path_from_table(table, "speculative", SOURCES, _fail)
    assert spec.forward_us(8, 32) == 100.0
    assert spec.forward_us(9, 32) == 100.0 + 320.0
    assert spec.overhead_us(1, 2, target_layers=32) == 320.0  # a verify inside the captured sizes run eager
    assert spec.overhead_us(1, 9, target_layers=32) == 0.0  # wider: its forward pays the launches (forward_us)
    # a draft model's step is a whole forward of its layers (in the graph at one row), plus draft_step_us
    spec = dataclasses.replace(spec, draft_step_us=5.0, iteration_us=1.0)
    assert spec.overhead_us(2, 6, draft_model_layers=24) == 1.0 + 2 * (5.0 + 100.0)
    assert spec.overhead_us(2, 6, draft_model_layers=24, scale={"pass_us": 2.0}) == 1.0 + 2 * (5.0 + 200.0)


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"graph_max_tokens": -1}, "graph_max_tokens"),
        ({"verify_eager": "yes"}, "verify_eager"),
        ({"uncertainty": {"pass_us": -0.1}}, "uncertainty"),
        ({"kinds": {"pass_us": "guessed"}}, "kinds"),
        ({"launch_us_per_layer": -2.0}, "launch_us_per_layer"),
    ],
)
def test_bad_engine_terms_are_one_line_naming_the_field(table: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        spec_path_from_table({"source": "s", **table}, "speculative", SOURCES, _fail)


def test_engine_of_reads_the_sources_engine_names() -> None:
    assert engine_of("vLLM V1", "July 2025 (~v0.9.2)") == "vllm-v1"
    assert engine_of("vLLM V0 benchmark_latency", "Dec 2023 (~v0.2.6)") == "vllm-v0"
    assert engine_of("vLLM (V0/V1 not in excerpt)", "~v0.8.3 (Apr 2025)") == "vllm-v1"
    assert engine_of("vLLM (V0/V1 not in excerpt)", "~v0.6.1") == "vllm-v0"
    assert engine_of("llama.cpp llama-speculative (baseline llama-cli)") == "llama.cpp"
    assert engine_of("LM Studio mlx-engine (MLX-LM)") == "mlx-lm"
    assert engine_of("TensorRT-LLM (Triton tensorrtllm backend)") == "tensorrt-llm"
    assert engine_of("SGLang") == "sglang"
    assert engine_of("exllama") is None


def test_units_of_the_sources() -> None:
    assert forward_time_us(200.0, "t/s", 4) == pytest.approx(20_000.0)
    assert forward_time_us(7.07, "TPOT ms", 1) == pytest.approx(7070.0)
    assert token_time_us(4.37, "TPOT ms") == pytest.approx(4370.0)
    assert token_time_us(250.0, "output throughput tok/s") == pytest.approx(4000.0)
    assert token_time_us(40.0, "Generation tokens-per-sec") == pytest.approx(25_000.0)  # "generation" is no ratio
    with pytest.raises(ConfigError, match="ratio"):
        token_time_us(1.5, "speedup ratio (x)")


def test_every_shared_row_is_described_or_left_out_with_a_reason() -> None:
    described = describe()
    steps = {("decode steps", r) for r in described.steps["row"]}
    runs = {("speculative runs", r) for r in described.runs["row"]}
    left = {(x["table"], x["row"]) for x in described.left_out}
    assert len(steps) + len(runs) + len(left) == 110 + 292
    assert not (steps | runs) & left
    assert all(x["reason"] and x["reason"] != "not described" for x in described.left_out)


def test_llama_cpp_prompt_tests_run_the_output_head_once_per_chunk_on_one_row() -> None:
    steps = {r["row"]: r for r in describe().steps.iter_rows(named=True)}
    # pp512 at microbatch U: 512/U forwards, the head on the last one's last row; ppN in one forward: the head on one row
    assert (steps[26]["head_share"], steps[26]["logit_rows"]) == (1 / 512, 1)
    assert (steps[57]["head_share"], steps[57]["logit_rows"]) == (16 / 512, 1)
    assert (steps[13]["head_share"], steps[13]["logit_rows"]) == (1.0, 1)
    # generating rows (tg128, llama-cli eval) and vLLM's scorer: the head on every token of every forward
    assert (steps[5]["head_share"], steps[5]["logit_rows"]) == (1.0, 1)
    assert steps[24]["head_share"] == 1.0
    assert all(r["head_share"] == 1.0 and r["logit_rows"] == r["tokens_per_forward"] for k, r in steps.items() if k >= 84)


def test_the_step_time_model_prices_the_head_on_the_passes_and_rows_that_run_it() -> None:
    model = forward_model("llama-3.1-8b", "nvidia-rtx-3090", "F16", 1)
    n, context = 8, 2048.0
    every = model.dense_pass_us(n, context)
    assert model.dense_pass_us(n, context, logits=(1.0, n)) == pytest.approx(every, rel=1e-12)
    head = model.preset.lm_head_params()
    dense = model.profile.dense
    skipped = float(dense.time_us(head * 2.0, 2.0 * head * n, 0.0))  # F16: 2 bytes a weight
    assert every - model.dense_pass_us(n, context, logits=(0.0, 0)) == pytest.approx(skipped, rel=1e-9)
    one_row = float(dense.time_us(0.0, 2.0 * head * (n - 1), 0.0))
    assert every - model.dense_pass_us(n, context, logits=(1.0, 1)) == pytest.approx(one_row, rel=1e-9)


def _synthetic(terms: dict[str, float]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Shared vLLM V1 and llama.cpp rows with their measured times replaced by kernels + the given terms."""
    described = describe()
    steps = described.steps.filter(pl.col("engine_key") == "llama.cpp")
    runs = described.runs.filter(pl.col("engine_key").is_in(["llama.cpp", "vllm-v1"]))
    step_us = [e.predicted_us(terms) for e in step_equations(steps)]
    parts = run_parts(runs)
    iteration = [p.iteration.predicted_us(terms) / p.tau for p in parts]
    baseline = [p.baseline.predicted_us(terms) for p in parts]
    steps = steps.with_columns(pl.Series("time_us", step_us))
    runs = runs.with_columns(pl.Series("token_us", iteration), pl.Series("baseline_token_us", baseline))
    return steps, runs


def test_the_fit_recovers_the_terms_the_rows_were_made_with_and_lists_every_row() -> None:
    # chains at batch 1 verify k + 1 tokens after k steps: verified_token_us is not separable from
    # iteration_us + draft_step_us on these rows, so the rows are made without it
    terms = {"pass_us": 900.0, "launch_us_per_layer": 12.0, "iteration_us": 700.0, "draft_step_us": 150.0, "verified_token_us": 0.0}
    steps, runs = _synthetic(terms)
    fit = fit_engine_terms(steps, runs, "llama.cpp", source_file="synthetic", sha256="0" * 64)
    for term in SPEC_TERMS:
        assert getattr(fit.spec, term) == pytest.approx(terms[term], rel=1e-6, abs=1e-6), term
    assert "not separated" in fit.spec.basis["verified_token_us"]
    assert fit.spec.heldout_error == pytest.approx(0.0, abs=1e-6)
    used = {(r.row, r.variant) for r in fit.spec.provenance.rows}
    assert {(int(r), "decode step") for r in steps["row"]} <= used
    assert {(int(r), "speculative run") for r in runs["row"]} <= used
    assert fit.spec.graph_max_tokens == ENGINE_HOSTS["llama.cpp"].graph_max_tokens
    assert all(fit.spec.kinds[t] == "calibrated" for t in SPEC_TERMS if terms[t])


def test_a_term_no_row_separates_is_zero_and_says_so() -> None:
    described = describe()
    steps = described.steps.filter(pl.col("engine_key") == "vllm-v1")  # one plain decode step: pass_us only
    fit = fit_engine_terms(steps, described.runs.clear(), "vllm-v1", source_file="x", sha256="0" * 64)
    assert fit.spec.pass_us > 0
    assert fit.spec.iteration_us == 0.0 and "no row separates it" in fit.spec.basis["iteration_us"]
    assert fit.spec.uncertainty["pass_us"] == pytest.approx(0.5)  # one source: the assumed half-width


def test_every_forward_of_the_step_time_model_pays_the_engine_and_its_launches_beyond_the_graph() -> None:
    import numpy as np

    from moesim.hw_profiles import load_profile
    from moesim.hw_profiles.builtin import with_spec_path
    from moesim.models import load_preset
    from moesim.sim.cost.steptime import StepTimeModel

    preset = load_preset("qwen3-30b-a3b")
    base = with_spec_path(load_profile("nvidia-h200-vllm"), None)
    table = {"pass_us": 500.0, "launch_us_per_layer": 7.0, "graph_max_tokens": 4, "source": "s"}
    spec = spec_path_from_table(table, "speculative", SOURCES, _fail)
    plain, timed = StepTimeModel(preset, base, "dispatch"), StepTimeModel(preset, with_spec_path(base, spec), "dispatch")
    distinct, most = np.full(len(preset.moe_layers), 8), np.full(len(preset.moe_layers), 1)
    for n, extra in ((2, 500.0), (4, 500.0), (5, 500.0 + 7.0 * preset.layers)):
        assert timed.counts_pass_us(n, distinct, most, 100.0) == pytest.approx(plain.counts_pass_us(n, distinct, most, 100.0) + extra)
        assert timed.dense_pass_us(n, 100.0) == pytest.approx(plain.dense_pass_us(n, 100.0) + extra)
    tables = timed.pass_tables
    tables.ensure(8)
    assert tables.comm[3] == 500.0 and tables.comm[8] == 500.0 + 7.0 * preset.layers  # the compiled pass's per-size constants
    cost = timed.pass_cost(uniform_features(preset, 6))
    assert cost.total_us() == pytest.approx(plain.pass_cost(uniform_features(preset, 6)).total_us() + 500.0 + 7.0 * preset.layers)
    assert set(cost.engine_parts_us) == {"pass_us", "launch_us_per_layer"}


def uniform_features(preset, n_tokens: int):  # type: ignore[no-untyped-def]
    """One pass's features, every MoE layer alike: n tokens, n·K slots, as many distinct experts, one token each."""
    import numpy as np

    from moesim.kernels.features import RoutingFeatures

    layers = np.ones(len(preset.moe_layers))
    slots = float(n_tokens * preset.top_k)
    return RoutingFeatures(n_tokens * layers, slots * layers, min(slots, preset.experts) * layers, layers)


def test_the_built_in_serving_profile_carries_engine_terms_so_the_lane_tests_cover_them() -> None:
    from moesim.hw_profiles import load_profile

    spec = load_profile("nvidia-h200-vllm").speculative  # tests/test_lane.py compares the lane with the Python loop on it
    assert spec is not None and spec.pass_us > 0 and spec.overhead_us(1, 4) > 0
