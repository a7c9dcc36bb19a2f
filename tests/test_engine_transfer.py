"""Engine profiles that transfer: a user's run of a shared llama-bench series fitted on half its
sizes predicts the other half, with the engine source's kernel switch unless the rows contradict
it; the pooled engine fit (one fit per engine over its devices, each through its datasheet)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import REPO

from moesim.hw_profiles.builtin import load_profile
from moesim.hw_profiles.catalog import catalog
from moesim.hw_profiles.fitting.bench_fit import fit_bench_output, predicted_rows
from moesim.hw_profiles.fitting.engine_builtins import fit_recipe, recipe_rows
from moesim.hw_profiles.fitting.engine_validation import all_recipes
from moesim.hw_profiles.fitting.engine_validation import leave_one_device_out as scaled_out
from moesim.hw_profiles.fitting.pooled.data_limits import (
    build_shape_spread,
    build_spread,
    interior,
    leave_one_size_out,
    model_out_seen,
    repeat_spread,
    represented,
)
from moesim.hw_profiles.fitting.pooled.engine_pool import fit_pool
from moesim.hw_profiles.fitting.pooled.pool_validation import (
    PairBound,
    engine_parts,
    leave_one_device_out,
    like,
    pair_kind,
    stated_transfer,
)
from moesim.hw_profiles.fitting.pooled.routing_share import ROUTED_SHARES, choose_share
from moesim.hw_profiles.fitting.whole_pass import uniform_features
from moesim.hw_profiles.importers import ImportOptions, import_table
from moesim.hw_profiles.importers.rows import decode_scope, prompt_scope

TABLE = REPO / "data" / "public-bench" / "moe_pass_times.csv"


def _half(series: tuple[int, ...], first: int) -> tuple[float, str, int | None, int | None]:
    """Fit rows series[first::2] as a user's run; (median |error| on the other half, the switch's sentence, limits)."""
    result = fit_bench_output(TABLE, "mine", ImportOptions(rows=series[first::2]))
    _, held = import_table(TABLE, "public-bench", ImportOptions(rows=series[1 - first :: 2]))
    errors = np.abs(predicted_rows(held, result.fit.profile)["error_%"].drop_nulls().to_numpy())
    assert errors.size == held.height
    return float(np.median(errors)), result.choice.sentence(), result.learned_limit, result.source_limit


@pytest.mark.parametrize(("tokens", "ubatch", "depth"), [(512, 512, 0), (2048, 256, 0), (512, 128, 4096), (7, 1, 3)])
def test_a_prompt_token_attends_over_what_the_causal_mask_lets_it_read(tokens: int, ubatch: int, depth: int) -> None:
    """Against the mask itself: pass j of a ppN @ dD test holds U query rows over D + j·U keys, row i
    (0-based) masked beyond key D + (j-1)·U + i; the context is the mean of the unmasked keys per row."""
    scope = prompt_scope(tokens, ubatch, depth)
    attended = []
    for j in range(1, scope.passes + 1):
        keys = depth + j * scope.n_tokens
        attended.extend(np.tril(np.ones((scope.n_tokens, keys)), k=keys - scope.n_tokens).sum(axis=1))
    assert scope.context_tokens == pytest.approx(np.mean(attended))


def test_a_decode_token_attends_over_its_whole_context() -> None:
    """B sequences of one new token each, at contexts pp + j (j = 1..N): every row sees all of its sequence's keys."""
    scope = decode_scope(64, sequences=4, prompt_tokens=128)
    assert scope.context_tokens == pytest.approx(4 * np.mean([128 + j for j in range(1, 65)]))


# shared series (rows of the public table) whose build runs the engine's current dispatch
CURRENT = {
    "RX 7900 XTX Vulkan, llama-batched-bench B = 1..64": tuple(range(331, 341)),
    "W7800 Vulkan, llama-bench pp1024..pp32768 at ub 128..2048": tuple(range(429, 460, 2)),
}


@pytest.mark.parametrize("name", sorted(CURRENT))
@pytest.mark.parametrize("first", [0, 1])
def test_half_the_sizes_predict_the_other_half_with_the_sources_switch(name: str, first: int) -> None:
    median, sentence, learned, source = _half(CURRENT[name], first)
    assert median < 5.0, (name, first, median)
    assert learned == source == 8 and "the engine source's" in sentence


def test_an_older_build_contradicts_the_source_and_the_run_says_by_how_much() -> None:
    """RTX 3090, DeepSeek-V2-Lite pp512 at ub 1..256 on a 2025-08 build (MMQ from 2 tokens): the half
    with sizes 1, 4, 16, 64, 256 jumps between 1 and 4 tokens, where the current source's 8 puts no
    switch: the limit moves to 1 (the source's limit of that build era; the other half predicted at
    5.3 %, docs/validation.md: MMQ's fixed time per layer carries the jump, not a bandwidth). The half
    without a size below the jump keeps the source's 8."""
    series = tuple(range(32, 49, 2))
    median, sentence, learned, source = _half(series, 0)
    assert (learned, source) == (1, 8) and median < 6.0
    assert "moved by this run from the engine source's 8" in sentence and "between 1 and 4 tokens" in sentence
    assert "%" in sentence  # by how much: the fit's mean error at either limit
    _, sentence, learned, _ = _half(series, 1)
    assert learned == 8 and "no cliff" in sentence


def test_a_run_never_drops_the_per_slot_kernel() -> None:
    for series in (tuple(range(32, 49, 2)), tuple(range(17, 30, 2)), tuple(range(331, 341))):
        for first in (0, 1):
            result = fit_bench_output(TABLE, "mine", ImportOptions(rows=series[first::2]))
            assert result.learned_limit is not None and result.learned_limit >= 1
            assert "per_slot" in result.fit.profile.expert_families


def test_a_measured_size_is_inside_the_calibrated_range_whatever_its_routing() -> None:
    from moesim.hw_profiles.families import ExpertInputs
    from moesim.kernels.features import RoutingFeatures

    result = fit_bench_output(TABLE, "mine", ImportOptions(rows=tuple(range(331, 341))))
    profile = result.fit.profile
    family = profile.expert_family("per_slot")
    shape = result.fit.rows[0].shape
    for distinct in (8.0, 16.0):  # a trace's routing: fewer distinct experts than random tokens give
        x = ExpertInputs.of(RoutingFeatures(np.float64(2), np.float64(16), np.float64(distinct), np.float64(2)), shape)
        assert float(family.calibrated_range.factor(x)) == 1.0
    x = ExpertInputs.of(RoutingFeatures(np.float64(200), np.float64(1600), np.float64(128), np.float64(20)), shape)
    assert float(profile.expert_family("dedup_matmul_id").calibrated_range.factor(x)) > 1.0  # 200 tokens: never measured


def test_a_fixed_time_timed_at_one_pass_size_is_left_to_the_work() -> None:
    """The Radeon Pro VII's four Vulkan rows are all at n = 512: no fixed time per pass is fitted on
    them (the first pass put a whole 1 s pass there, 21x off on the RX 7900 XTX's sizes 1..64)."""
    recipes = {item.name: item for item in all_recipes()}
    source, target = recipes["amd-radeon-pro-vii-vulkan"], recipes["amd-rx-7900-xtx-vulkan"]
    fit = fit_recipe(source)
    assert {r.n_tokens for r in fit.rows} == {512}
    assert fit.profile.pass_fixed_us == 0.0 and any("timed at one pass size only" in note for note in fit.profile.notes)
    stats = scaled_out(target, source, fit).stats()
    assert stats is not None and stats.median < 1.0


def test_a_pair_further_apart_states_no_smaller_uncertainty() -> None:
    """The stated transfer bound: the engine's own for the pair's kind, else that kind's largest over
    the engines, never under the engine's bound for a nearer kind."""
    bounds = {
        ("A", "like"): PairBound("A", "like", 2.0, 2),
        ("B", "other vendor"): PairBound("B", "other vendor", 1.5, 4),
        ("C", "other vendor"): PairBound("C", "other vendor", 3.0, 2),
        ("C", "like"): PairBound("C", "like", 0.5, 2),
    }
    assert stated_transfer(bounds, "A", "like").bound == 2.0
    assert stated_transfer(bounds, "A", "unlike").bound == 2.0  # no 'unlike' pair anywhere: A's nearer kind
    assert stated_transfer(bounds, "A", "other vendor").bound == 3.0  # A has none: the largest over engines
    assert stated_transfer(bounds, "C", "other vendor").bound == 3.0
    assert stated_transfer(bounds, "B", "like").bound == 2.0  # B has no like pair: the largest like bound over engines
    assert stated_transfer(bounds, "B", "unlike") is bounds[("B", "other vendor")]  # nothing nearer anywhere: the farther kind
    assert stated_transfer(bounds, "D", "like") is None
    p40, rtx3090, mi100 = (catalog()[key] for key in ("nvidia-p40", "nvidia-rtx-3090", "amd-mi100"))
    assert (pair_kind(p40, rtx3090), pair_kind(rtx3090, mi100), pair_kind(rtx3090, rtx3090)) == ("unlike", "other vendor", "like")


@pytest.fixture(scope="module")
def vllm() -> list:  # type: ignore[type-arg]
    return engine_parts("vLLM fused_moe", TABLE, "dispatch")


def test_the_pooled_fit_gives_each_device_its_datasheet_and_a_factor_only_where_it_has_rows(vllm) -> None:  # type: ignore[no-untyped-def]
    a100, h200, h20 = vllm
    pool = fit_pool([(p, list(p.rows)) for p in (h200, h20)])
    assert set(pool.factors) == {"nvidia-h200", "nvidia-h20"} and pool.factor("nvidia-a100-80gb") == 1.0
    assert math.prod(pool.factors.values()) == pytest.approx(1.0)
    at_a100, at_h200 = pool.profile(a100), pool.profile(h200)
    family = next(iter(at_a100.expert_families))
    ratio = at_a100.expert_family(family).hbm_bandwidth_gbps / at_h200.expert_family(family).hbm_bandwidth_gbps
    expected = catalog()["nvidia-a100-80gb"].peak_bandwidth_gbps / catalog()["nvidia-h200"].peak_bandwidth_gbps
    assert ratio == pytest.approx(expected * pool.factor("nvidia-h200"))
    for profile, spec in ((at_a100, "nvidia-a100-80gb"), (at_h200, "nvidia-h200")):
        for f in profile.expert_families.values():
            assert f.hbm_bandwidth_gbps <= catalog()[spec].peak_bandwidth_gbps * (1 + 1e-9)  # θ_bytes >= 1: never above the peak


def test_leave_one_device_out_never_fits_on_the_held_out_device(vllm) -> None:  # type: ignore[no-untyped-def]
    a100, h200, h20 = vllm
    judged = leave_one_device_out([a100, h200, h20], a100, "others")
    assert judged is not None and np.isfinite(judged.predicted_us).all()
    changed = [(p, [r if p is not a100 else r.__class__(**{**r.__dict__, "time_us": r.time_us * 10}) for r in p.rows]) for p in vllm]
    again = fit_pool([(p, rows) for p, rows in changed if p is not a100])
    assert np.allclose(again.predict(a100, a100.rows), judged.predicted_us)  # the held-out device's times never enter
    assert like(a100.spec, h200.spec) and not like(catalog()["nvidia-p40"], catalog()["nvidia-rtx-3090"])


def test_profile_notes_are_plain_words(tmp_path, cli) -> None:  # type: ignore[no-untyped-def]
    """No coefficient names in the notes ('per_slot.fixed@<build>', 'absorbed in', a build 'unknown (b0)')."""
    from moesim.hw_profiles import builtin_names, load_profile
    from moesim.hw_profiles.schema import read_profile

    run = tmp_path / "run.md"
    run.write_text((REPO / "examples" / "llama-bench-synthetic.md").read_text().replace("build: 0000000 (0)", "build: unknown (0)"))
    assert cli("profile", "fit", run, "--device", "RTX 3090", "--out", tmp_path / "p.toml")[0] == 0
    profiles = [load_profile(name) for name in builtin_names()] + [read_profile(tmp_path / "p.toml")]
    for profile in profiles:
        for note in profile.notes:
            assert not any(word in note for word in (".fixed", ".bytes", ".compute", "@", "absorbed", "(b0)")), (profile.name, note)


def test_leave_one_model_out_counts_the_rows_whose_build_and_format_stay_in_the_fit() -> None:
    rows = [("a", "b1", "Q4_0"), ("b", "b1", "Q4_0"), ("b", "b2", "F16"), ("c", "b2", "Q4_0")]
    assert represented(rows) == (2, 4)  # a and b share b1 / Q4_0; b's F16 and c's Q4_0 on b2 are alone


def test_the_tables_floors_counted_by_hand() -> None:
    """Two builds of one config at ub 1 and 2 (10 / 20 and 20 / 30 t/s): times per token 1/10 against
    1/20 and 1/20 against 1/30; T = n / value, so T_b(2)/T_b(1) = (2/30)/(1/20) = 4/3 against 1."""
    common = {"device": "D", "backend": "CUDA", "model": "m", "quant": "Q4_0", "test": "pp512", "unit": "t/s", "notes": ""}
    records = [
        {**common, "source_url": "s", "variant": "a", "ubatch": "1", "value": "10"},
        {**common, "source_url": "s", "variant": "a", "ubatch": "2", "value": "20", "notes": "value ± 0.5"},
        {**common, "source_url": "s", "variant": "b", "ubatch": "1", "value": "20"},
        {**common, "source_url": "s", "variant": "b", "ubatch": "2", "value": "30"},
        {**common, "source_url": "s", "variant": "b", "ubatch": "4", "value": "5", "unit": "us"},  # not a rate: left out
    ]
    assert repeat_spread(records) == pytest.approx([0.5 / 20])
    assert sorted(build_spread(records)) == pytest.approx([1 / 3, 1 / 2])
    assert build_shape_spread(records) == pytest.approx([1 / 3])


def test_leave_one_size_out_predicts_every_size_of_a_device_and_tells_interior_sizes() -> None:
    """The MI100's rows: Qwen3.5 at 256..2048 (one build), gpt-oss-20b at 16 and 32 (another): only
    Qwen3.5's 512 and 1024 lie between sizes their model and build also ran."""
    item = next(i for i in all_recipes() if i.name == "amd-mi100-hip")
    judged = leave_one_size_out(item)
    assert judged is not None and np.isfinite(judged.predicted_us).all()
    assert [r.n_tokens for r, inside in zip(judged.rows, interior(judged), strict=True) if inside] == [512, 1024]
    assert not np.allclose(judged.predicted_us, fit_recipe(item).in_sample_us)  # not the in-sample fit


def test_leave_one_model_out_by_what_the_fit_saw_is_the_built_ins_split_and_its_oracle_touches_only_unseen_builds() -> None:
    """The MI100's two models ran two builds and two formats: no held-out row has its build or format
    in the other model's rows. The plain split is the profile's own held-out error, row for row; the
    oracle (the unseen build at its own fixed times, fitted on both models' rows) moves every row."""
    item = next(i for i in all_recipes() if i.name == "amd-mi100-hip")
    found = model_out_seen(item)
    assert found is not None and not found.build_seen.any() and not found.format_seen.any()
    np.testing.assert_allclose(found.judged.predicted_us, fit_recipe(item).heldout_us)
    assert (found.oracle.predicted_us != found.judged.predicted_us).all()
    rtx = model_out_seen(next(i for i in all_recipes() if i.name == "nvidia-rtx-3090-llamacpp"))
    assert rtx is not None and rtx.build_seen.any() and (~rtx.build_seen).any()
    seen = rtx.build_seen & np.isfinite(rtx.judged.predicted_us)
    np.testing.assert_array_equal(rtx.oracle.predicted_us[seen], rtx.judged.predicted_us[seen])  # a build the fit ran keeps its times
    assert model_out_seen(next(i for i in all_recipes() if i.name == "nvidia-p40-llamacpp")) is None  # one model


def test_tokens_routed_over_a_share_of_the_experts_touch_what_sampling_them_touches() -> None:
    """Against sampling: m tokens, each picking K distinct experts uniformly among e = share·E of them."""
    rng = np.random.default_rng(7)
    experts, top_k, share, tokens = 64, 6, 0.5, 12
    hot = int(share * experts)
    touched = [len({int(e) for _ in range(tokens) for e in rng.choice(hot, top_k, replace=False)}) for _ in range(4000)]
    features = uniform_features(tokens, experts, top_k, share)
    assert float(features.distinct_experts) == pytest.approx(np.mean(touched), rel=0.01)
    assert float(uniform_features(1, experts, top_k, share).distinct_experts) == pytest.approx(top_k)  # one token: K whatever the share
    assert float(uniform_features(tokens, experts, top_k, 0.01).distinct_experts) == pytest.approx(top_k)  # never under K experts


def test_only_llama_bench_passes_take_a_routed_share() -> None:
    """A share routes a llama-bench pass's tokens; the RX 7900 XTX's rows are llama-batched-bench decodes
    (one token id in every sequence) and keep every expert. No built-in ships a share (a nested choice
    predicts held-out rows worse: docs/validation.md), so every profile routes over all."""
    recipes = {item.name: item for item in all_recipes()}
    rows = recipe_rows(recipes["nvidia-rtx-3090-llamacpp"])
    assert {r.routed_share for r in rows} == {1.0}
    assert {r.routed_share for r in recipe_rows(recipes["amd-rx-7900-xtx-vulkan"])} == {1.0}
    batched = next(r for r in recipe_rows(recipes["amd-rx-7900-xtx-vulkan"]) if r.sequences > 1)
    assert batched.routed_over(0.5).routed_share == 1.0 and rows[0].routed_over(0.7).routed_share == 0.7
    names = ("nvidia-rtx-3090-llamacpp", "nvidia-rtx-4090-llamacpp", "apple-m3-max-metal", "amd-rx-7900-xtx-vulkan", "nvidia-h200-vllm")
    assert {load_profile(name).bench_routed_share for name in names} == {1.0}


def test_the_share_chosen_on_the_metal_rows_is_the_least_held_out_error() -> None:
    """The Metal engine's seven rows (two devices): the share chosen on all of them is the candidate of
    least held-out error, under 1 (the optimistic choice bench/validate_engine_transfer.py reports)."""
    items = [item for item in all_recipes() if item.engine == "llama.cpp Metal"]
    chosen, errors = choose_share(items)
    assert set(errors) == set(ROUTED_SHARES) and errors[chosen] == min(errors.values())
    assert errors[chosen] < errors[1.0]  # the share is learned, not the default
