"""The llama.cpp validation pipeline on tiny models: truncation of accepted prefixes (against brute
force and against real runs at a shorter draft length), draft and verify passes, combining
repetitions, the dense twins' fit, the target's preset, and the whole pipeline end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.errors import InputError
from moesim.hw_profiles.fitting.dense_twins import fit_dense_twins
from moesim.hw_profiles.microbench.table import MoeShape
from moesim.hw_profiles.provenance import Provenance
from moesim.models import load_preset
from moesim.sim.cost.measured_passes import draft_passes, truncated_tokens_per_pass, verify_passes
from moesim.sim.validate.llamacpp_cpu import (
    CpuValidationConfig,
    min_over_repetitions,
    preset_from_tiny_spec,
    preset_toml,
    run_cpu_validation,
)
from moesim.tracegen.formats.specrun import read_spec_run
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, build_draft_model, build_tiny_model, expert_weight_bytes, model_bytes
from moesim.tracegen.llamacpp.prompts import prompts_from_texts
from moesim.tracegen.llamacpp.speculate import SpeculateConfig, SpeculativeSession, speculative_run

SPEC = TinyModelSpec(arch="llama", layers=2, experts=8, top_k=2, hidden=64, expert_ff=32, heads=4, kv_heads=2, seed=3)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Mixture of experts route tokens.", "abc"]


@given(st.lists(st.integers(0, 9), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_truncation_against_brute_force(accepted: list[int]) -> None:
    tau = truncated_tokens_per_pass(np.array(accepted), 9)
    for k in range(10):
        assert tau[k] == pytest.approx(sum(min(a, k) + 1 for a in accepted) / len(accepted))
    assert tau[0] == 1.0 and np.all(np.diff(tau) >= 0) and np.all(np.diff(tau) <= 1.0)
    assert tau[9] == pytest.approx(np.mean(accepted) + 1)  # no truncation at the run's own length


def test_truncation_rejects_bad_input() -> None:
    with pytest.raises(InputError):
        truncated_tokens_per_pass(np.array([5]), 4)
    with pytest.raises(InputError):
        truncated_tokens_per_pass(np.array([1]), 4, max_draft=5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("llamacpp-validation")
    target = build_tiny_model(folder / "target.gguf", SPEC)
    draft = build_draft_model(SPEC, 0.3, folder / "draft.gguf")
    prompts = prompts_from_texts(PROMPTS, "prompts")
    out = {}
    for k in (2, 5):
        out[f"k{k}"] = folder / f"k{k}.arrow"
        speculative_run(target, draft, prompts, out[f"k{k}"], SpeculateConfig(draft_len=k, max_tokens=24, n_threads=1))
    out["target"], out["draft"] = target, draft
    return out


def test_first_step_of_a_shorter_run_accepts_the_truncated_prefix(runs: dict[str, Path]) -> None:
    # the first verify step of each sequence starts at the same position with the same context, so
    # greedy acceptance at k = 2 is exactly min(a, 2) of the k = 5 run's first step
    long, short = read_spec_run(runs["k5"]), read_spec_run(runs["k2"])
    first_long = long.steps.filter(pl.col("step") == 0).sort("seq")["accepted"].to_numpy()
    first_short = short.steps.filter(pl.col("step") == 0).sort("seq")["accepted"].to_numpy()
    np.testing.assert_array_equal(first_short, np.minimum(first_long, 2))
    assert 0 < long.steps["accepted"].mean() < 5  # type: ignore[operator]  # acceptance is neither all nor nothing


def _count(experts: np.ndarray) -> tuple[list[int], list[int]]:
    distinct, busiest = [], []
    for layer in range(experts.shape[1]):
        ids, counts = np.unique(experts[:, layer, :], return_counts=True)
        distinct.append(len(ids))
        busiest.append(int(counts.max()))
    return distinct, busiest


def test_verify_and_draft_passes_by_brute_force(runs: dict[str, Path]) -> None:
    run = read_spec_run(runs["k5"])
    features, context = verify_passes(run, 3)
    for i in range(run.steps.height):
        u, m = _count(run.step_experts(i)[:4])
        np.testing.assert_array_equal(features.distinct_experts[i], u)
        np.testing.assert_array_equal(features.max_tokens_per_expert[i], m)
        assert context[i] == run.steps["pos0"][i] + 4
    draft, owner, _ = draft_passes(run)
    steps = run.steps
    assert np.array_equal(np.bincount(owner, minlength=steps.height), steps["drafted"].to_numpy())  # k passes per step
    # a catch-up pass holds two tokens exactly where the previous step of the sequence accepted every draft
    first = np.flatnonzero(np.diff(owner, prepend=-1) != 0)
    two = draft.n_tokens[first, 0] == 2
    previous_all = [
        i > 0 and steps["seq"][i - 1] == steps["seq"][i] and steps["accepted"][i - 1] == steps["drafted"][i - 1]
        for i in range(steps.height)
    ]
    np.testing.assert_array_equal(two, previous_all)
    for i in np.flatnonzero(two)[:5]:
        rows = np.stack([run.experts[run.slot_start[i - 1] + 5], run.experts[run.slot_start[i]]])
        # the last layer computes only the row whose logits the draft asks for: one token, K experts
        assert draft.distinct_experts[first[i]].tolist() == [*_count(rows)[0][:-1], SPEC.top_k]
        assert draft.n_tokens[first[i]].tolist() == [2.0, 1.0]


def test_min_over_repetitions(runs: dict[str, Path]) -> None:
    with SpeculativeSession(runs["target"], runs["draft"], 128, n_threads=1) as session:
        tokens = session.target.tokenize(PROMPTS[0])
        reps = [session.run_prompt(tokens, 3, 12) for _ in range(2)]
        other = session.run_prompt(session.target.tokenize(PROMPTS[1]), 3, 12)
    combined = min_over_repetitions(reps)
    for j, step in enumerate(combined.steps):
        assert step.verify_us == min(r.steps[j].verify_us for r in reps)
        assert step.draft_us == min(r.steps[j].draft_us for r in reps)
        np.testing.assert_array_equal(step.tokens, reps[0].steps[j].tokens)
    assert combined.info.plain_decode_us == min(r.info.plain_decode_us for r in reps)
    with pytest.raises(InputError, match="decoded differently"):
        min_over_repetitions([reps[0], other])


def test_preset_of_a_tiny_model_counts_its_tensors(tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, weight_type="F16", vocab=400)
    preset = preset_from_tiny_spec(spec)
    assert preset.expert_bytes("F16") * spec.experts * spec.layers == expert_weight_bytes(spec)
    # everything but the experts and the input embedding, read once per token (norms are F32 in the file: 2 extra bytes each)
    norms = spec.layers * 2 * spec.hidden + spec.hidden
    file_non_expert = model_bytes(spec) - expert_weight_bytes(spec) - spec.vocab * spec.hidden * 2
    assert preset.non_expert_bytes_per_token("F16") + 2 * norms == pytest.approx(file_non_expert + 2 * spec.hidden)
    path = tmp_path / "preset.toml"
    path.write_text(preset_toml(preset))
    assert load_preset(path) == preset


def test_dense_twins_recover_known_rates(tmp_path: Path) -> None:
    # dense twins timed by a machine with known bandwidth, FLOP rate and fixed time: the fit recovers them
    bandwidth_gbps, tflops, fixed_us = 40.0, 0.08, 250.0
    from moesim.hw_profiles.fitting.dense_twins import TwinBytes

    spec = TinyModelSpec(arch="llama", layers=1, experts=0, top_k=0, hidden=256, expert_ff=64, heads=4, kv_heads=1, vocab=300,
                         weight_type="F16", dense_ff=16)  # fmt: skip
    twin = TwinBytes.of(spec)
    rows = []
    for routing in ("same", "uniform"):
        for n in (1, 2, 4, 8, 16):
            layer = twin.layer_bytes / (bandwidth_gbps * 1e3) + 2 * twin.layer_params * n / (tflops * 1e6)
            head = twin.head_bytes / (bandwidth_gbps * 1e3) + 2 * twin.head_params * n / (tflops * 1e6)
            t_l = fixed_us + head + layer
            rows.append({"model": "shape", "routing": routing, "n_tokens": n, "layers_differenced": 1,
                         "reps_us_dense_L": [t_l + 30.0, t_l], "reps_us_dense_2L": [t_l + layer, t_l + layer + 50.0]})  # fmt: skip
    (tmp_path / "provenance.json").write_text(
        json.dumps(
            {"runs": [{"config": {"shape": {"model": "shape"}, "statistic": "min"}, "models": {"dense_L": dataclasses.asdict(spec)}}]}
        )
    )
    fit = fit_dense_twins(pl.DataFrame(rows), tmp_path / "measurements.parquet", Provenance("calibrated", "t", "0"))
    assert fit.dense.bandwidth_gbps == pytest.approx(bandwidth_gbps, rel=1e-6)
    assert fit.dense.tflops == pytest.approx(tflops, rel=1e-6)
    assert fit.pass_fixed_us == pytest.approx(fixed_us, rel=1e-6)
    assert fit.dense.heldout_error.leave_one_routing_out.median == pytest.approx(0.0, abs=1e-6)  # type: ignore[union-attr]


def test_dense_twins_of_the_real_cpu_table() -> None:
    from moesim.hw_profiles.fitting.calibrate import fit_profile

    profile = fit_profile(DATA / "cpu" / "measurements.parquet", "cpu", backend="cpu").profile
    dense = profile.dense
    assert dense.provenance.kind == "calibrated" and profile.provenance_of("families.dense.bandwidth_gbps").kind == "calibrated"
    assert profile.provenance_of("pass.fixed_us").kind == "calibrated"
    # the twins read ~18 MB of attention weights per layer in 0.5-0.6 ms at one token: tens of GB/s, not the table's expert peak
    assert 10 < dense.bandwidth_gbps < 200 and 0 < profile.pass_fixed_us < 2000
    assert dense.heldout_error.leave_one_routing_out is not None and dense.heldout_error.epsilon < 0.5


def test_unresolvable_dense_twins_leave_the_dense_family_assumed(tmp_path: Path) -> None:
    # twins whose 2L model timed no slower than its L model (noise on a tiny or busy machine): the
    # expert families are still fitted, the dense family stays assumed, and the profile says why
    import shutil

    from moesim.hw_profiles.fitting.calibrate import fit_profile

    shutil.copy(DATA / "cpu" / "provenance.json", tmp_path / "provenance.json")
    table = pl.read_parquet(DATA / "cpu" / "measurements.parquet")
    table.with_columns(pl.col("reps_us_dense_L").alias("reps_us_dense_2L")).write_parquet(tmp_path / "measurements.parquet")
    profile = fit_profile(tmp_path / "measurements.parquet", "cpu", backend="cpu").profile
    assert profile.provenance_of("families.dense.bandwidth_gbps").kind == "assumed"
    assert any(note.startswith("dense twins not used") for note in profile.notes)
    assert profile.expert_families


def test_pipeline_end_to_end_on_a_tiny_shape(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    config = CpuValidationConfig(
        draft_lens=(1, 3), repetitions=2, max_tokens=10, shape=MoeShape("tiny", 64, 32, 8, 2, "F32"), heads=4, kv_heads=2, vocab=300,
        bench_reps=2, bench_warmup=1, bench_pass_sizes=(1, 2, 3, 4), min_expert_bytes=0, prompts=("hello world", "abc"), noise=0.3,
    )  # fmt: skip
    result = run_cpu_validation(config, tmp_path / "out")
    out = tmp_path / "out"
    for name in ("profile.toml", "target-preset.toml", "prompts.txt", "per_k.csv", "from_source.csv", "summary.json"):
        assert (out / name).is_file(), name
    per_k = pl.read_csv(out / "per_k.csv")
    assert per_k["draft_len"].to_list() == [0, 1, 3]
    run = read_spec_run(out / "runs" / "spec-k3.arrow")
    tokens = float((run.steps["accepted"].cast(pl.Float64) + 1).sum())
    measured = tokens * 1e6 / float((run.steps["draft_us"] + run.steps["verify_us"]).sum())
    assert per_k.filter(pl.col("draft_len") == 3)["tokens_per_s"][0] == pytest.approx(measured)
    # τ from truncating the k = 3 run at k = 3 is the run's own
    assert per_k["tokens_per_pass_from_source"][2] == pytest.approx(per_k["tokens_per_pass"][2])
    assert set(result.summary["best_draft"]) == {
        "measured",
        "predicted_from_source",
        "predicted_on_measured_passes",
        "predicted_from_source_any_k",
    }
    # the same runs through `moesim validate`: tokens/s with the measured acceptance and drafting time
    code, text, err = cli(
        "validate", out / "runs" / "spec-k1.arrow", out / "runs" / "spec-k3.arrow", "--profile", out / "profile.toml",
        "--model", out / "target-preset.toml", "--json",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(text)
    (curve,) = summary["speculative"]
    assert curve["draft_lens"] == [0, 1, 3]
    np.testing.assert_allclose(curve["tokens_per_s_measured"][1:], per_k["tokens_per_s"].to_list()[1:], rtol=1e-9)
    assert summary["rows"] == sum(read_spec_run(out / "runs" / f"spec-k{k}.arrow").steps.height for k in (1, 3))


def test_committed_cpu_validation_is_what_the_code_computes(cli) -> None:  # type: ignore[no-untyped-def]
    # the comparison in data/cpu-validation (and docs/validation.md) recomputed from the committed runs,
    # profile and preset; and `moesim validate` on the same runs measures the same tokens/s
    from moesim.hw_profiles import load_profile
    from moesim.sim.cost.steptime import StepTimeModel
    from moesim.sim.validate.draft_lengths import validate_draft_lengths

    folder = DATA / "cpu-validation"
    runs = [read_spec_run(folder / "runs" / f"spec-k{k}.arrow") for k in (1, 2, 4, 8, 16)]
    model = StepTimeModel(
        load_preset(folder / "target-preset.toml"), load_profile(str(folder / "profile.toml")), "dedup_llamacpp_cpu", "F16"
    )
    per_k = validate_draft_lengths(runs, model).per_k
    committed = pl.read_csv(folder / "per_k.csv")
    assert per_k.columns == committed.columns
    for column in per_k.columns:
        np.testing.assert_allclose(per_k[column].to_numpy().astype(float), committed[column].to_numpy().astype(float), rtol=1e-9)
    code, out, err = cli(
        "validate", *(folder / "runs" / f"spec-k{k}.arrow" for k in (1, 2, 4, 8, 16)), "--profile", folder / "profile.toml",
        "--model", folder / "target-preset.toml", "--json",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    (curve,) = summary["speculative"]
    np.testing.assert_allclose(curve["tokens_per_s_measured"][1:], committed["tokens_per_s"].to_list()[1:], rtol=1e-9)
    assert summary["best_draft_measured"] == 0 == summary["best_draft_predicted"]
    assert summary["rows"] == sum(r.steps.height for r in runs) and summary["extrapolated_rows"] == 0
