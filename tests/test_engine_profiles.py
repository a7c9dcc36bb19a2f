"""Engine profiles: the built-ins are current and obey physics, their provenance lists the rows they
were fitted on, the fit's accounting is the step-time model's, and predict follows the dispatch."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from fitted_files import same_fitted_toml

from moesim.hw_profiles import builtin_names, load_profile
from moesim.hw_profiles.builtin import CALIBRATED, RENAMED_PROFILES
from moesim.hw_profiles.catalog import catalog
from moesim.hw_profiles.engines import ENGINES
from moesim.hw_profiles.fitting.engine_builtins import RECIPES, SCALED
from moesim.hw_profiles.fitting.regenerate import engine_builtins
from moesim.hw_profiles.fitting.whole_pass import predict_us, uniform_features
from moesim.hw_profiles.schema import profile_to_toml
from moesim.kernels.features import RoutingFeatures
from moesim.models import builtin_names as builtin_presets
from moesim.models import load_preset
from moesim.sim.cost.steptime import StepTimeModel
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Uniform, synthesize

TABLE = REPO / "data" / "public-bench" / "moe_pass_times.csv"
PROFILES = REPO / "moesim" / "hw_profiles" / "profiles"


@pytest.fixture(scope="module")
def built() -> tuple[dict, dict]:  # type: ignore[type-arg]
    return engine_builtins(TABLE)


def test_shipped_engine_profiles_are_current(built) -> None:  # type: ignore[no-untyped-def]
    profiles, _ = built
    for name, profile in profiles.items():
        shipped, fitted = (PROFILES / f"{name}.toml").read_text(), profile_to_toml(profile)
        assert same_fitted_toml(shipped, fitted), f"run python -m moesim.hw_profiles.fitting.regenerate ({name})"
    assert sorted(builtin_names()) == sorted([CALIBRATED, *profiles])
    assert set(RENAMED_PROFILES.values()) <= set(profiles)


def test_every_engine_builtin_obeys_physics() -> None:
    for name in builtin_names():
        profile = load_profile(name)
        if name == CALIBRATED:
            continue
        assert profile.dispatch is not None and profile.status in ("published-calibrated", "datasheet-scaled")
        assert profile.device.engine in ENGINES and profile.device.engine_version
        peak = profile.roofline.peak_bandwidth_gbps
        for family in profile.expert_families.values():
            assert family.hbm_bandwidth_gbps <= peak * (1 + 1e-12), (name, family.name)  # no family below the roofline floor
            assert all(rate <= peak * (1 + 1e-12) for rate in family.format_bandwidth_gbps.values())
            assert family.heldout_error.epsilon > 0 and family.provenance.problem() is None
            if family.floor_tflops < math.inf:  # an engine's FLOP rate only where the family has none, and below the peak
                assert all(math.isinf(rate) for rate in family.compute_tflops) and family.floor_tflops < profile.roofline.peak_tflops
        assert profile.dense.bandwidth_gbps <= peak * (1 + 1e-12)
        formats = sorted({fmt for rule in profile.dispatch.rules for fmt in rule.formats} or {"BF16"})
        for preset_name, fmt in [(p, f) for p in builtin_presets("moe") for f in formats]:
            preset = load_preset(preset_name)
            shape = preset.expert_shape(fmt)
            one = RoutingFeatures(np.float64(1), np.float64(preset.top_k), np.float64(preset.top_k), np.float64(1))
            if "per_slot" in profile.expert_families:  # no dedup family faster than per-slot at one token
                per_slot = float(profile.expert_family("per_slot").time_us(one, shape))
                for dedup in profile.dedup_families:
                    assert float(profile.expert_family(dedup).time_us(one, shape)) >= per_slot * (1 - 1e-9), (name, dedup, preset_name, fmt)
            many = RoutingFeatures(np.float64(256), np.float64(256 * preset.top_k), np.float64(preset.experts), np.float64(8))
            for family in profile.expert_families.values():  # never below the roofline of the bytes and FLOPs a pass needs
                floor = profile.roofline.floor_us(
                    preset.experts * shape.expert_bytes, 256 * preset.top_k * 6.0 * shape.hidden * shape.intermediate
                )
                assert float(family.time_us(many, shape)) >= float(floor) * (1 - 1e-12)


def test_scaled_profiles_come_from_the_same_engine_only() -> None:
    for item in SCALED:
        profile, base = load_profile(item.name), load_profile(item.base)
        assert profile.status == "datasheet-scaled" and profile.derived_from == item.base
        assert profile.device.engine == base.device.engine and set(profile.expert_families) == set(base.expert_families)
        ratio = catalog()[item.device].peak_bandwidth_gbps / base.roofline.peak_bandwidth_gbps
        for family_name, family in profile.expert_families.items():
            assert family.hbm_bandwidth_gbps == pytest.approx(base.expert_family(family_name).hbm_bandwidth_gbps * ratio)
            assert family.heldout_error.epsilon > base.expert_family(family_name).heldout_error.epsilon
    h100 = load_profile("nvidia-h100-sxm-vllm")
    assert h100.derived_from == "nvidia-h200-vllm" and h100.device.engine == "vLLM fused_moe"


def test_provenance_lists_exactly_the_rows_fitted(built) -> None:  # type: ignore[no-untyped-def]
    _, fits = built
    table = list(csv.DictReader(TABLE.open()))
    for item in RECIPES:
        profile = load_profile(item.name)
        source = profile.sources["public-bench"]
        assert source.kind == "calibrated" and source.file == "data/public-bench/moe_pass_times.csv"
        rows = [row.row for row in source.rows]
        assert rows == [r for group in item.groups for r in group.rows] == [r.source_row for r in fits[item.name].rows]
        for fitted in source.rows:
            row = table[fitted.row - 1]
            assert (fitted.source, fitted.variant, fitted.n_tokens) == (row["source_url"], row["variant"], int(row["ubatch"]))


def test_fit_accounting_is_the_step_time_models(built) -> None:  # type: ignore[no-untyped-def]
    """A decode-like pass (every row with logits, head on every pass: the row's n tokens one per
    sequence, each at the row's context, so sliding windows cut each query alike) costs the same
    through the fit's accounting and through StepTimeModel, for every calibrated engine profile with whole passes."""
    _, fits = built
    for name in ("nvidia-rtx-3090-llamacpp", "amd-rx-7900-xtx-vulkan"):
        fit = fits[name]
        profile = load_profile(name)
        for row in fit.rows:
            changes = {
                "head_share": 1.0,
                "logit_rows": row.n_tokens,
                "sequences": row.n_tokens,
                "passes": 1,
                "context_tokens": row.context_tokens * row.n_tokens,
                "dense_format": row.shape.weight_format,
                "dispatch": profile.dispatch,
            }
            decode = row.__class__(**{**row.__dict__, **changes})
            model = StepTimeModel(decode.preset, profile, "dispatch", row.shape.weight_format)
            layers = len(decode.preset.moe_layers)
            features = uniform_features(row.n_tokens, row.experts, row.top_k, row.routed_share)
            features = RoutingFeatures(
                *(np.full(layers, float(getattr(features, f))) for f in ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert"))
            )
            expected = float(model.pass_cost(features, decode.context_tokens, float(row.n_tokens)).total_us())
            assert predict_us(decode, profile) == pytest.approx(expected, rel=1e-9)


def test_heldout_predictions_never_see_their_own_row(built) -> None:  # type: ignore[no-untyped-def]
    from moesim.hw_profiles.fitting.engine_fit import fit_engine

    _, fits = built
    fit = fits["nvidia-rtx-3090-llamacpp"]
    frame_rows = list(fit.rows)
    gemma = [i for i, r in enumerate(frame_rows) if r.model == "gemma-4-26b-a4b"]
    changed = [r.__class__(**{**r.__dict__, "time_us": r.time_us * (3.0 if i in gemma else 1.0)}) for i, r in enumerate(frame_rows)]
    recipe = next(item for item in RECIPES if item.name == "nvidia-rtx-3090-llamacpp")
    from moesim.hw_profiles.fitting import engine_builtins

    frame = engine_builtins.profile_frame(recipe, TABLE)
    refit = fit_engine(changed, ENGINES.create(recipe.engine), frame)
    np.testing.assert_allclose(refit.heldout_us[gemma], fit.heldout_us[gemma])  # gemma's own times never enter its prediction
    assert not np.allclose(refit.in_sample_us[gemma], fit.in_sample_us[gemma])


CASES = [
    ("deepseek-v2-lite", "Q4_0", "nvidia-rtx-3090-llamacpp", {1: "per_slot", 8: "per_slot", 9: "dedup_mmq"}),
    ("gpt-oss-20b", "MXFP4", "nvidia-rtx-3090-llamacpp", {7: "per_slot", 8: "dedup_mmq"}),
    ("qwen3-30b-a3b", "Q4_K", "nvidia-rtx-3090-llamacpp", {8: "per_slot", 9: "dedup_mmq"}),
    ("qwen3-30b-a3b", "Q4_K", "nvidia-p40-llamacpp", {5: "per_slot", 6: "dedup_mmq"}),
    ("qwen3-30b-a3b", "FP8", "nvidia-h100-sxm-vllm", {1: "dedup_fused_bm64", 16: "dedup_fused_bm64"}),
    ("qwen3-30b-a3b", "BF16", "nvidia-h200-vllm", {1: "dedup_fused_bm16", 16: "dedup_fused_bm16"}),
    ("gemma-4-26b-a4b", "BF16", "nvidia-h200-vllm", {1: "dedup_fused_bm16", 16: "dedup_fused_bm16"}),
    ("qwen3-30b-a3b", "Q4_K", "amd-rx-7900-xtx-vulkan", {8: "per_slot", 9: "dedup_matmul_id"}),
]


@pytest.mark.parametrize(("model", "fmt", "profile", "expected"), CASES)
def test_predict_follows_the_dispatch_and_names_the_family(model, fmt, profile, expected, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "t.arrow"
    write_trace(trace, synthesize(load_preset(model), Uniform(), tokens=40, seqs=2, seed=1, weight_format=fmt))
    code, out, err = cli("predict", "--trace", trace, "--profile", profile, "--max-pass", "16", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["family"] == "dispatch"
    family = {row["n"]: row["family"] for row in result["passes"]}
    assert all(family[n] == name for n, name in expected.items()), family
    hw = load_profile(profile)
    preset = load_preset(model)
    rule = hw.dispatch.family_for(fmt, np.arange(1, 17), preset.experts, preset.top_k)
    assert [family[n] for n in range(1, 17)] == list(rule)
    code, out, _ = cli("predict", "--trace", trace, "--profile", profile, "--max-pass", "4", "--json", "--family", "best")
    assert code == 0 and json.loads(out)["family"] == "best"


def test_llama_cpp_has_no_fp8_kernel_and_says_so(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "t.arrow"
    write_trace(trace, synthesize(load_preset("qwen3-30b-a3b"), Uniform(), tokens=20, seqs=1, seed=1, weight_format="FP8"))
    code, _, err = cli("predict", "--trace", trace, "--profile", "nvidia-rtx-3090-llamacpp", "--max-pass", "4")
    assert code == 2 and "no kernel for weight format FP8" in err and len(err.strip().splitlines()) == 1


def test_sweep_runs_engine_profiles_with_and_without_a_per_slot_kernel(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "sweep.toml"
    config.write_text(
        "[grid]\nmodels = ['qwen3-30b-a3b']\nprofiles = ['nvidia-rtx-3090-llamacpp', 'nvidia-h200-vllm']\n"
        "engines = ['dispatch', 'best']\nalpha = [0.5]\nmax_draft = 2\nmax_pass = 3\nweight_format = 'BF16'\n"
    )
    code, _, err = cli("sweep", config, "--out", tmp_path / "s.parquet")
    assert code == 0, err
    import polars as pl

    rows = pl.read_parquet(tmp_path / "s.parquet").filter((pl.col("record") == "pass") & (pl.col("engine") == "dispatch"))
    families = {(r["profile"], r["n"]): r["family"] for r in rows.iter_rows(named=True)}
    assert families[("nvidia-h200-vllm", 1)] == "dedup_fused_bm16" and families[("nvidia-rtx-3090-llamacpp", 3)] == "dedup_mmf"
