"""Hardware profiles: the time model, the fit, held-out errors on the real H200 table, TOML round trip,
validation, built-ins, derive, and uniform-routing features against closed forms."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import tomllib
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import DATA

from moesim.errors import ConfigError, InputError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.builtin import CALIBRATED
from moesim.hw_profiles.families import CalibratedRange, ExpertFamily, ExpertInputs, Roofline
from moesim.hw_profiles.fitting.calibrate import fit_profile
from moesim.hw_profiles.fitting.derive import derive_profile
from moesim.hw_profiles.fitting.family_fit import fit_terms, leave_one_group_out, structure_for
from moesim.hw_profiles.heldout import ErrorStats, HeldoutError
from moesim.hw_profiles.provenance import Provenance
from moesim.hw_profiles.report import dedup_comparison, uniform_routing_features
from moesim.hw_profiles.schema import profile_from_dict, profile_to_toml, read_profile
from moesim.kernels.features import RoutingFeatures
from moesim.models import ExpertShape

H200_TABLE = DATA / "h200" / "calibration.parquet"
PROFILES = Path(__file__).resolve().parents[1] / "moesim" / "hw_profiles" / "profiles"
ROOF = Roofline(4800.0, 989.0)
PROVENANCE = Provenance("calibrated", "t.parquet", "0" * 64)


@pytest.fixture(scope="module")
def h200_report():  # type: ignore[no-untyped-def]
    return fit_profile(H200_TABLE, "nvidia-h200")


def _family(structure_t: int, **overrides: object) -> ExpertFamily:
    structure = structure_for(structure_t)
    values: dict[str, object] = dict(
        name="dedup" if structure_t != 1 else "per_slot",
        structure=structure,
        fixed_us=12.0,
        hbm_bandwidth_gbps=4000.0,
        cache_bandwidth_gbps=9000.0,
        cache_bytes=30e6,
        compute_tflops=tuple(40.0 / (1 + i) for i in range(structure.n_rates)),
        serial_ns=tuple(0.1 * i for i in range(structure.n_rates)),
        per_expert_us=0.5 if structure_t == 0 else 0.0,
        per_slot_us=0.0,
        calibrated_range=CalibratedRange({"n_tokens": (1.0, 128.0), "slots": (2.0, 1024.0), "expert_bytes": (9e6, 4e8)}),
        heldout_error=HeldoutError(transfer=0.1),
        provenance=PROVENANCE,
        roofline=ROOF,
    )
    values.update(overrides)
    return ExpertFamily(**values)  # type: ignore[arg-type]


def _reference_time_us(family: ExpertFamily, n: int, k: int, loads: list[int], shape: ExpertShape) -> float:
    """The documented formula, one pass, in plain Python from per-expert token counts."""
    u, s, cmax = len(loads), n * k, max(loads)
    t = family.structure.tokens_per_read
    b = shape.expert_bytes
    if t == 1:
        reads, chunks, tokens = s, 1, 1
    elif t == 0:
        reads, chunks, tokens = u, 1, cmax
    else:
        chunks = math.ceil(s / u / t - 1e-9)
        reads, tokens = u * chunks, min(cmax, t)
    hit = min(1.0, family.cache_bytes / (u * b))
    time = family.fixed_us + family.per_expert_us * u + family.per_slot_us * s
    time += b * (u + (reads - u) * (1 - hit)) / (family.hbm_bandwidth_gbps * 1e3)
    time += b * (reads - u) * hit / (family.cache_bandwidth_gbps * 1e3)
    variant = 0
    if family.structure.variants:
        variant = next(i for i, w in enumerate(family.structure.variants) if w >= min(cmax, t))
    time += s * 6 * shape.hidden * shape.intermediate / (family.compute_tflops[variant] * 1e6)
    time += family.serial_ns[variant] * 1e-3 * tokens * chunks * (shape.hidden + shape.intermediate)
    floor = max(u * b / (ROOF.peak_bandwidth_gbps * 1e3), s * 6 * shape.hidden * shape.intermediate / (ROOF.peak_tflops * 1e6))
    return max(time, floor)


@pytest.mark.parametrize("tokens_per_read", [0, 1, 16])
def test_time_matches_plain_python_reference(tokens_per_read: int) -> None:
    rng = np.random.default_rng(tokens_per_read)
    family = _family(tokens_per_read)
    shape = ExpertShape(2048, 1408)
    experts, k = 64, 6
    cases = []
    for n in [1, 2, 3, 5, 9, 16, 17, 40, 128]:
        picks = np.array([rng.choice(experts, k, replace=False) for _ in range(n)])
        if n % 2:
            picks[:] = picks[0]  # every token picks the same experts: c = n
        loads = np.bincount(picks.ravel(), minlength=experts)
        cases.append((n, [int(c) for c in loads if c]))
    features = RoutingFeatures(
        n_tokens=np.array([n for n, _ in cases], float),
        slots=np.array([n * k for n, _ in cases], float),
        distinct_experts=np.array([len(loads) for _, loads in cases], float),
        max_tokens_per_expert=np.array([max(loads) for _, loads in cases], float),
    )
    expected = [_reference_time_us(family, n, k, loads, shape) for n, loads in cases]
    np.testing.assert_allclose(family.time_us(features, shape), expected, rtol=1e-12)


@pytest.mark.parametrize(
    ("profile", "weight_format"),
    [
        ("nvidia-h200", "BF16"),
        ("nvidia-l40-vllm", "BF16"),
        ("nvidia-rtx-3090-llamacpp", "Q4_0"),
        ("nvidia-rtx-3090-llamacpp", "F16"),
        ("apple-m2-ultra-metal", "Q8_0"),
        ("amd-rx-7900-xtx-vulkan", "Q4_K"),  # whole tiles of 32, 64 or 128 columns (`tile_doubling`)
    ],
)
def test_compiled_time_equals_the_vectorised_one(profile: str, weight_format: str) -> None:
    """`fast_time_us` (one compiled loop) gives `time_us`'s bits for every family, also at empty
    passes and beyond the calibrated range; `fast_layers_us` sums the slowest rank per layer."""
    rng = np.random.default_rng(7)
    shape = ExpertShape(2048, 768, weight_format)
    n = rng.integers(1, 4000, 600).astype(float)
    slots = n * 8
    distinct = np.minimum(rng.integers(0, 129, 600), slots).astype(float)
    most = np.minimum(rng.integers(0, 600, 600), n).astype(float)
    slots[:4] = distinct[:4] = most[:4] = 0.0
    for family in load_profile(profile).expert_families.values():
        # engine profiles carry no ladder knots: their families run compiled; the lab H200 (knots,
        # re-read terms) takes the ladder's numpy path behind the same call
        assert family.compiled == (profile != "nvidia-h200"), family.name
        vectorised = family.time_us(RoutingFeatures(n, slots, distinct, most), shape)
        assert np.array_equal(family.fast_time_us(slots, distinct, most, shape, 8), vectorised)
        grid = (slots[:48].reshape(4, 12), distinct[:48].reshape(4, 12), most[:48].reshape(4, 12))
        expected = family.time_us(RoutingFeatures(grid[0] / 8, *grid), shape).max(axis=0).sum()
        assert family.fast_layers_us(*grid, shape, 8) == pytest.approx(expected, rel=1e-12)


def test_fit_recovers_a_known_family_exactly() -> None:
    """Noise-free times from known coefficients: the fit's predictions match and its rates recover them."""
    truth = _family(16, per_expert_us=0.0, cache_bandwidth_gbps=12000.0)
    rng = np.random.default_rng(1)
    rows = 300
    n = rng.integers(1, 129, rows).astype(float)
    k = rng.choice([2, 4, 6, 8], rows).astype(float)
    s = n * k
    cmax = np.minimum(n, rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 64, 128], rows))  # every tile variant, and chunked rows
    u = np.ceil(rng.uniform(s / cmax, s))  # U·c >= S: the busiest expert holds at least the mean load
    hidden = rng.choice([2048.0, 4096.0], rows)
    intermediate = rng.choice([768.0, 1408.0, 14336.0], rows)
    x = ExpertInputs.from_arrays(n, s, u, cmax, 6.0 * hidden * intermediate, hidden, intermediate)
    measured = truth.model_time_us(x)
    fitted = fit_terms(x, measured, [structure_for(16)], truth.cache_bytes, [None, None])
    c = fitted.coefficients
    assert c["fixed"] == pytest.approx(truth.fixed_us, rel=1e-6)
    assert 1 / (c["hbm"] * 1e3) == pytest.approx(truth.hbm_bandwidth_gbps, rel=1e-6)
    assert 1 / (c["cache"] * 1e3) == pytest.approx(truth.cache_bandwidth_gbps, rel=1e-6)
    for width, rate in zip(truth.structure.variants, truth.compute_tflops, strict=True):
        assert 1 / (c[f"compute{width}"] * 1e6) == pytest.approx(rate, rel=1e-5)


def test_leave_one_group_out_matches_a_loop() -> None:
    x = ExpertInputs.from_arrays(np.arange(1, 9), np.arange(1, 9), np.ones(8), np.ones(8), 1e6, 1.0, 1.0)
    measured = np.arange(1.0, 9.0) * 2.0
    groups = np.array(list("aabbccdd"))
    calls = []

    def mean_predictor(train: np.ndarray, test: np.ndarray) -> np.ndarray:
        calls.append(train.copy())
        return np.full(int(test.sum()), measured[train].mean())

    pooled, per_group = leave_one_group_out(x, measured, groups, mean_predictor)
    errors = []
    for g in "abcd":
        held = groups == g
        errors += list(measured[~held].mean() / measured[held] - 1)
    assert pooled == ErrorStats.from_errors(np.array(errors))
    assert [g for g, _ in per_group] == list("abcd") and len(calls) == 4
    assert leave_one_group_out(x, measured, np.array(["a"] * 8), mean_predictor) == (None, [])


def test_epsilon_is_the_worse_held_out_p90_with_transfer() -> None:
    stats = ErrorStats(0.02, 0.08, 0.2, 10)
    heldout = HeldoutError(stats, ErrorStats(0.03, 0.06, 0.1, 10), None, transfer=0.15)
    assert heldout.epsilon == pytest.approx(math.sqrt(0.08**2 + 0.15**2))
    assert heldout.epsilon_median == pytest.approx(math.sqrt(0.03**2 + 0.15**2))
    assert math.isnan(HeldoutError().epsilon)


# ---- the real H200 table --------------------------------------------------------------------


@pytest.mark.parametrize(("family", "goal"), [("per_slot", 0.05), ("dedup", 0.05), ("dedup_grouped_gemm", 0.08)])
def test_h200_held_out_errors_meet_the_goals(h200_report, family: str, goal: float) -> None:  # type: ignore[no-untyped-def]
    heldout = h200_report.profile.expert_family(family).heldout_error
    assert heldout.leave_one_shape_out is not None and heldout.leave_one_routing_out is not None
    assert heldout.leave_one_shape_out.rows == heldout.leave_one_routing_out.rows == 256
    assert heldout.leave_one_shape_out.median <= goal
    assert heldout.leave_one_routing_out.median <= goal


def test_h200_fit_records_provenance_and_cache_note(h200_report) -> None:  # type: ignore[no-untyped-def]
    profile = h200_report.profile
    assert set(profile.families) == {"per_slot", "dedup", "dedup_grouped_gemm", "dedup_loop", "dense"}
    digest = hashlib.sha256(H200_TABLE.read_bytes()).hexdigest()
    for name in profile.expert_families:
        expected = Provenance("calibrated", "calibration.parquet", digest, note=profile.sources["table"].note)
        assert profile.family(name).provenance == expected
    assert profile.provenance_of("roofline.peak_bandwidth_gbps").kind == "datasheet"
    assert profile.provenance_of("families.per_slot.cache_bytes").kind == "assumed"
    assert profile.provenance_of("families.dense.bandwidth_gbps").file == "device.json"
    assert profile.dense.bandwidth_gbps == 4493.5 and profile.pass_fixed_us == 24.92
    assert profile.device.backend == "cuda" and profile.device.driver_version == "580.159.04"
    assert any("above the peak" in note for note in h200_report.notes)  # same-expert per-slot reads hit L2


def test_round_trip_gives_identical_predictions(h200_report, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    profile = h200_report.profile
    path = tmp_path / "p.toml"
    path.write_text(profile_to_toml(profile))
    loaded = read_profile(path)
    features = uniform_routing_features(7, 64, 6, 32, 0)
    shape = ExpertShape(2048, 1408)
    for name in profile.expert_families:
        before, after = profile.expert_family(name), loaded.expert_family(name)
        assert np.array_equal(before.time_us(features, shape), after.time_us(features, shape))
        assert before.heldout_error == after.heldout_error and before.calibrated_range == after.calibrated_range
    assert np.array_equal(profile.dense.time_us([1e9, 2e6], [3e9, 0.0]), loaded.dense.time_us([1e9, 2e6], [3e9, 0.0]))
    assert profile_to_toml(loaded) == path.read_text()


def test_shipped_h200_profile_is_the_documented_fit(h200_report) -> None:  # type: ignore[no-untyped-def]
    shipped = load_profile(CALIBRATED)
    assert shipped.sources["table"].sha256 == hashlib.sha256(H200_TABLE.read_bytes()).hexdigest()
    features = uniform_routing_features(12, 128, 8, 16, 3)
    shape = ExpertShape(2048, 768)
    for name in shipped.expert_families:
        np.testing.assert_allclose(
            shipped.expert_family(name).time_us(features, shape),
            h200_report.profile.expert_family(name).time_us(features, shape),
            rtol=1e-7,
        )


def test_extrapolation_factor_and_roofline_floor() -> None:
    profile = load_profile(CALIBRATED)
    family = profile.expert_family("per_slot")
    shape = ExpertShape(2048, 1408)
    inside = RoutingFeatures(np.array([4.0]), np.array([24.0]), np.array([20.0]), np.array([2.0]))
    beyond = RoutingFeatures(np.array([256.0]), np.array([1536.0]), np.array([64.0]), np.array([40.0]))
    assert family.extrapolation_factor(inside, shape)[0] == 1.0
    assert family.extrapolation_factor(beyond, shape)[0] == pytest.approx(2.0)
    big = ExpertShape(8192, 28672)  # expert bytes 4x the largest calibrated
    assert family.extrapolation_factor(inside, big)[0] == pytest.approx(3 * 8192 * 28672 * 2 / 352321536)
    empty = RoutingFeatures(np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2))
    for name in profile.expert_families:  # a layer no token is routed to costs nothing and extrapolates nothing
        assert np.all(profile.expert_family(name).time_us(empty, shape) == 0.0)
        assert np.all(profile.expert_family(name).extrapolation_factor(empty, shape) == 1.0)
    rng = np.random.default_rng(5)
    n = rng.integers(1, 4096, 200).astype(float)
    u = np.minimum(n * 8, rng.integers(1, 256, 200)).astype(float)
    features = RoutingFeatures(n, n * 8, u, np.minimum(n, np.ceil(n * 8 / u)))
    for name in profile.expert_families:
        times = profile.expert_family(name).time_us(features, big)
        assert np.all(times >= u * big.expert_bytes / (profile.roofline.peak_bandwidth_gbps * 1e3) * (1 - 1e-12))


# ---- validation ---------------------------------------------------------------------------


def _h200_dict() -> dict:
    return tomllib.loads((PROFILES / f"{CALIBRATED}.toml").read_text())


@pytest.mark.parametrize(
    ("mutate", "fragments"),
    [
        (lambda d: d["families"]["per_slot"].__setitem__("fixed_us", -1.0), ["families.per_slot.fixed_us", ">= 0", "-1"]),
        (lambda d: d["families"]["dedup"].pop("hbm_bandwidth_gbps"), ["families.dedup.hbm_bandwidth_gbps", "missing"]),
        (lambda d: d["device"].__setitem__("backend", "rocm"), ["device.backend", "rocm"]),
        (lambda d: d["families"]["dedup"].pop("source"), ["families.dedup.source", "provenance"]),
        (lambda d: d["families"]["per_slot"].__setitem__("source", "nowhere"), ["families.per_slot.source", "nowhere"]),
        (lambda d: d["roofline"].__setitem__("peak_tflops", 0.0), ["roofline.peak_tflops", "> 0"]),
        (lambda d: d["families"]["dedup"].__setitem__("compute_tflops", [1.0]), ["families.dedup.compute_tflops", "5 numbers"]),
        (lambda d: d["families"]["dedup"]["calibrated_range"].pop("slots"), ["families.dedup.calibrated_range.slots", "missing"]),
        (lambda d: d["families"].__setitem__("mystery", {}), ["families.mystery", "not a family name"]),
        (lambda d: d["sources"]["table"].__setitem__("sha256", "abc"), ["sources.table.sha256"]),
        (lambda d: d["sources"]["datasheet"].pop("citation"), ["sources.datasheet.citation"]),
        (lambda d: d["families"]["per_slot"].__setitem__("typo_us", 1.0), ["families.per_slot.typo_us", "unknown"]),
        (lambda d: d["families"]["per_slot"].pop("heldout_error"), ["families.per_slot.heldout_error", "missing"]),
        (lambda d: d["pass"].__setitem__("bench_routed_share", 1.5), ["pass.bench_routed_share", "at most 1", "1.5"]),
        (lambda d: d["pass"].__setitem__("bench_routed_share", 0.0), ["pass.bench_routed_share", "> 0"]),
    ],
)
def test_bad_profiles_give_one_line_naming_the_field(mutate, fragments: list[str]) -> None:  # type: ignore[no-untyped-def]
    data = _h200_dict()
    mutate(data)
    with pytest.raises(ConfigError) as info:
        profile_from_dict(data, "bad.toml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("bad.toml: ")
    for fragment in fragments:
        assert fragment in message


def test_bandwidth_above_peak_is_accepted_with_a_note() -> None:
    data = _h200_dict()
    data["families"]["dedup_grouped_gemm"]["hbm_bandwidth_gbps"] = 9000.0
    profile = profile_from_dict(data, "ok.toml")
    assert any("dedup_grouped_gemm.hbm_bandwidth_gbps = 9000" in note and "cache hits" in note for note in profile.all_notes())


def test_unknown_profile_and_family() -> None:
    with pytest.raises(InputError, match="unknown hardware profile 'tpu'"):
        load_profile("tpu")
    with pytest.raises(InputError, match="no family 'dedup_x'"):
        load_profile(CALIBRATED).family("dedup_x")


# ---- derive, routing, comparison ----------------------------------------------------------


def test_derive_scales_bandwidth_and_compute_terms_only() -> None:
    base = load_profile(CALIBRATED)
    derived = derive_profile(base, "half", bandwidth_scale=0.5, compute_scale=2.0, pass_fixed_us=5.0)
    assert derived.pass_fixed_us == 5.0 and derived.status == "derived" and derived.derived_from == CALIBRATED
    for name in base.expert_families:
        a, b = base.expert_family(name), derived.expert_family(name)
        assert b.hbm_bandwidth_gbps == a.hbm_bandwidth_gbps * 0.5
        assert b.compute_tflops == tuple(rate * 2.0 for rate in a.compute_tflops)
        assert (b.fixed_us, b.serial_ns, b.per_expert_us) == (a.fixed_us, a.serial_ns, a.per_expert_us)
        assert b.heldout_error == a.heldout_error
    assert derived.roofline == Roofline(2400.0, 1978.0)
    # a pass that only reads distinct experts once (grouped GEMM, no compute term): bytes time doubles exactly
    family_a, family_b = base.expert_family("dedup_grouped_gemm"), derived.expert_family("dedup_grouped_gemm")
    features = RoutingFeatures(np.array([8.0]), np.array([48.0]), np.array([30.0]), np.array([3.0]))
    shape = ExpertShape(2048, 1408)
    x = ExpertInputs.of(features, shape)  # the fitted terms: a derived profile drops the base device's ladder knots
    bytes_a = family_a.model_time_us(x) - family_a.fixed_us - family_a.per_expert_us * 30
    bytes_b = family_b.model_time_us(x) - family_b.fixed_us - family_b.per_expert_us * 30
    assert family_a.grid is not None and family_b.grid is None and not family_b.shape_fits
    np.testing.assert_allclose(bytes_b, 2 * bytes_a, rtol=1e-12)
    with pytest.raises(InputError, match="--bandwidth-scale"):
        derive_profile(base, "bad", bandwidth_scale=0.0)


def test_uniform_routing_features_match_closed_forms() -> None:
    for n, experts, k in [(1, 64, 6), (4, 8, 2), (16, 128, 8), (64, 60, 4)]:
        f = uniform_routing_features(n, experts, k, 4000, 0)
        assert np.all(f.slots == n * k) and np.all(f.max_tokens_per_expert <= n)
        expected = experts * (1 - (1 - k / experts) ** n)
        assert f.distinct_experts.mean() == pytest.approx(expected, rel=0.01)
    assert uniform_routing_features(1, 64, 6, 10, 0).max_tokens_per_expert.max() == 1.0


def test_comparison_r_rule_and_costs() -> None:
    profile = load_profile(CALIBRATED)
    shape = ExpertShape(2048, 1408)
    table = dedup_comparison(profile, shape, 64, 6, pass_sizes=(1, 2, 4, 8, 16, 64), samples=16)
    for row in table.iter_rows(named=True):
        for family in profile.dedup_families:
            faster = row[f"{family}_us"] < row["per_slot_us"]
            assert faster == (row["byte_share_u"] < row[f"r_{family}"])
    assert table["per_slot_us"].is_sorted() and table["byte_share_u"].is_sorted(descending=True)
    assert table.filter(pl.col("n") == 1)["byte_share_u"][0] == 1.0


def test_dense_family_time() -> None:
    dense = load_profile(CALIBRATED).dense
    expected = dense.launch_us * 3 + 2e9 / (dense.bandwidth_gbps * 1e3) + 4e12 / (dense.tflops * 1e6)
    assert dense.time_us(2e9, 4e12, kernels=3) == pytest.approx(expected)
    no_compute = dataclasses.replace(dense, tflops=math.inf)
    assert no_compute.time_us(1e9, 1e15) == pytest.approx(dense.launch_us + 1e9 / (dense.bandwidth_gbps * 1e3))
