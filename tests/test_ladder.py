"""The lookup ladder: barycentric weights against brute force, rung choice, the shipped profile's
rungs and bounds, the pass-level transfer's acceptance rule, and the TOML tables."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import polars as pl
import pytest
from conftest import DATA

from moesim.errors import ConfigError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.families import ExpertInputs
from moesim.hw_profiles.fitting.derive import derive_profile
from moesim.hw_profiles.fitting.ladder_fit import WholePasses, fit_transfer
from moesim.hw_profiles.ladder.interpolate import barycentric
from moesim.hw_profiles.ladder.rungs import EXACT, EXTRAPOLATED, FITTED, INTERPOLATED, RUNGS, ladder_times
from moesim.hw_profiles.ladder.tables import read_grid, read_transfer
from moesim.kernels.features import RoutingFeatures
from moesim.models import ExpertShape

PROFILE = load_profile("nvidia-h200")


def _cross(o: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    return float((a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0]))


def _in_triangle(p: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> bool:
    signs = [_cross(a, b, p), _cross(b, c, p), _cross(c, a, p)]
    return all(s >= -1e-9 for s in signs) or all(s <= 1e-9 for s in signs)


def _brute_barycentric(knots: np.ndarray, p: np.ndarray) -> np.ndarray | None:
    """Weights from any knot triangle holding p (solved by hand), or None outside every one."""
    for i, j, k in itertools.combinations(range(len(knots)), 3):
        a, b, c = knots[i], knots[j], knots[k]
        area = _cross(a, b, c)
        if abs(area) < 1e-12 or not _in_triangle(p, a, b, c):
            continue
        w = np.zeros(len(knots))
        w[i], w[j], w[k] = _cross(p, b, c) / area, _cross(a, p, c) / area, _cross(a, b, p) / area
        return w
    return None


def test_one_dimension_is_linear_interpolation() -> None:
    knots = np.array([[40.0], [6.0], [64.0]])
    query = np.array([[6.0], [20.0], [50.0], [64.0], [70.0], [3.0]])
    weights, inside = barycentric(knots, query)
    values = np.array([2.0, 1.0, 5.0])
    assert inside.tolist() == [True, True, True, True, False, False]
    np.testing.assert_allclose((weights @ values)[:4], np.interp(query[:4, 0], [6.0, 40.0, 64.0], [1.0, 2.0, 5.0]))
    assert np.all(weights[~inside] == 0)


def test_two_dimensions_match_brute_force_triangles() -> None:
    rng = np.random.default_rng(3)
    for knots in (np.array([[6.0, 16.0], [49.0, 4.0], [64.0, 2.0]]), rng.uniform(0, 60, size=(6, 2))):
        points = rng.uniform(-5, 70, size=(400, 2))
        weights, inside = barycentric(knots, points)
        for p, w, ok in zip(points, weights, inside, strict=True):
            brute = _brute_barycentric(knots, p)
            assert ok == (brute is not None)
            if ok:
                assert w.min() >= -1e-9 and w.sum() == pytest.approx(1.0)
                np.testing.assert_allclose(w @ knots, p, atol=1e-7)  # reproduces the point: any affine function exactly
                if len(knots) == 3:
                    np.testing.assert_allclose(w, brute, atol=1e-9)


def test_degenerate_knot_sets() -> None:
    weights, inside = barycentric(np.array([[6.0, 1.0]]), np.array([[6.0, 1.0], [6.0, 2.0]]))
    assert inside.tolist() == [True, False] and weights[0, 0] == 1.0
    line = np.array([[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]])  # collinear: only points on the line are bracketed
    weights, inside = barycentric(line, np.array([[1.0, 1.0], [1.0, 2.0]]))
    assert inside.tolist() == [True, False]
    np.testing.assert_allclose(weights[0], [0.5, 0.5, 0.0])


def test_rungs_of_ladder_times() -> None:
    knots = np.array([[6.0], [40.0], [64.0]])
    measured, fitted_at_knots = np.array([100.0, 300.0, 420.0]), np.array([110.0, 290.0, 400.0])
    features = np.array([[6.0], [20.0], [64.0], [80.0], [30.0]])
    fitted = np.array([110.0, 200.0, 400.0, 500.0, 250.0])
    extrapolated = np.array([False, False, False, False, True])
    time, rung = ladder_times(knots, measured, fitted_at_knots, features, fitted, extrapolated)
    assert rung.tolist() == [EXACT, INTERPOLATED, EXACT, FITTED, EXTRAPOLATED]
    residual = np.interp(20.0, [6.0, 40.0, 64.0], measured - fitted_at_knots)
    np.testing.assert_allclose(time, [100.0, 200.0 + residual, 420.0, 500.0, 250.0])


def test_shipped_profile_rungs_on_calibration_and_between_its_knots() -> None:
    family = PROFILE.expert_family("per_slot")
    shape = ExpertShape(2048, 1408)  # DeepSeek-V2-Lite's experts (top-6)
    grid = family.grid
    label = "2048x1408:17301504:k6"
    knots = grid.knots(label, 8.0)
    u = np.sort(grid.distinct_experts[knots])
    between = (u[0] + u[1]) / 2
    features = RoutingFeatures(8.0, 48.0, np.array([u[0], between, u[-1]]), 4.0)
    look = family.lookup(features, shape)
    assert [RUNGS[r] for r in look.rung] == ["exact", "interpolated", "exact"]
    np.testing.assert_allclose(look.time_us[[0, 2]], [grid.time_us[knots][grid.distinct_experts[knots] == v][0] for v in (u[0], u[-1])])
    fitted = family.shape_fits.get(label, family).inputs_time_us(ExpertInputs.of(features, shape))
    assert look.time_us[1] != fitted[1]  # the knots' residuals moved it
    assert look.epsilon[1] == family.rung_errors.one_layer["interpolated"].p90
    far = family.lookup(RoutingFeatures(512.0, 3072.0, 64.0, 60.0), shape)  # n beyond the calibrated range
    assert RUNGS[int(far.rung)] == "extrapolated" and far.epsilon == family.rung_errors.one_layer["extrapolated"].p90
    unseen = family.lookup(RoutingFeatures(8.0, 16.0, 10.0, 2.0), ExpertShape(2048, 1408))  # a top-2 model of that shape: no knots
    assert RUNGS[int(unseen.rung)] == "fitted"


def test_pass_transfer_applies_only_what_generalises() -> None:
    rng = np.random.default_rng(0)
    rows = 200
    models = np.repeat(["a", "b"], rows // 2)
    layers_us = rng.uniform(500, 5000, rows)
    layers = np.where(models == "a", 26.0, 32.0)
    frame = pl.DataFrame({"kernel": ["per_slot"] * rows, "model": models})
    for truth, applied in ((0.9, True), (1.0, False)):
        measured = truth * layers_us * (1 + rng.normal(0, 0.003, rows))
        passes = WholePasses(frame.with_columns(pl.Series("time_us", measured)), layers_us, np.zeros((rows, 4)), layers)
        fit = fit_transfer(passes, "per_slot", "passes").transfer
        assert fit.applied == applied
        assert fit.a == pytest.approx(truth, abs=0.003) if applied else (fit.a, fit.b_us) == (1.0, 0.0)
        assert fit.models == ("a", "b") and fit.identity["rows"] == rows
    one_model = WholePasses(
        frame.with_columns(pl.lit("a").alias("model"), pl.Series("time_us", layers_us)), layers_us, np.zeros((rows, 4)), layers
    )
    lone = fit_transfer(one_model, "per_slot", "passes").transfer
    assert not lone.applied and "one model" in lone.note


def test_shipped_whole_pass_evidence() -> None:
    # the shipped profile was fitted with the whole passes: no pass term generalised (a = 1, b = 0)
    for name, family in PROFILE.expert_families.items():
        transfer = family.pass_transfer
        assert transfer is not None and not transfer.applied and (transfer.a, transfer.b_us) == (1.0, 0.0), name
        assert family.rung_errors.whole_pass and family.bound_basis.endswith("whole-pass leave-one-model-out per rung")
    assert PROFILE.sources["passes"].sha256 == hashlib.sha256((DATA / "h200" / "fulldepth" / "passes.parquet").read_bytes()).hexdigest()
    engine = load_profile("nvidia-h100-sxm-vllm").expert_family("dedup_fused_bm16")  # an engine profile: no knots
    assert engine.grid is None and engine.rung_errors is None and engine.bound_basis == "dedup_fused_bm16: one-layer fit"
    derived = derive_profile(PROFILE, "what-if", bandwidth_scale=1.5).expert_family("dedup")  # another device: the H200's knots dropped
    assert derived.grid is None and not derived.shape_fits and derived.rung_errors is None and derived.pass_transfer is None


def test_bad_ladder_tables_are_one_line_naming_the_key() -> None:
    table = {"source": "table", "interpolate": ["distinct_experts"], "shape": ["2048x1408:17301504:k6"], "n_tokens": [1],
             "slots": [6], "distinct_experts": [6], "max_tokens_per_expert": [1], "chunk_reads": [6.0], "cached_rereads": [0.0],
             "time_us": [10.0], "repeats": [1]}  # fmt: skip
    grid, source = read_grid(table, "families.per_slot.grid", "p.toml")
    assert source == "table" and grid.knots("2048x1408:17301504:k6", 1.0).tolist() == [0]
    for key, value, fragment in (
        ("time_us", [], "holds 0 values"),
        ("shape", ["2048"], "is not HIDDEN"),
        ("interpolate", ["U"], "must list"),
    ):
        with pytest.raises(ConfigError, match=fragment) as info:
            read_grid({**table, key: value}, "families.per_slot.grid", "p.toml")
        assert str(info.value).startswith("p.toml: key 'families.per_slot.grid.") and "\n" not in str(info.value)
    transfer = {"source": "passes", "a": 1.1, "b_us": 0.0, "applied": False, "kind": "a", "models": [], "note": "",
                "identity": {}, "candidate": {}}  # fmt: skip
    with pytest.raises(ConfigError, match="a must be 1"):
        read_transfer(transfer, "families.dedup.pass_transfer", "p.toml")


def test_row_weights_pull_the_fit_towards_their_rows() -> None:
    # one coefficient, two rows that disagree by 10 %: a heavy weight on a row makes the fit reproduce it
    from moesim.hw_profiles.fitting.family_fit import solve_relative

    design, measured = np.array([[1.0], [1.0]]), np.array([100.0, 110.0])
    for heavy, target in ((0, 100.0), (1, 110.0)):
        weights = np.where(np.arange(2) == heavy, 1e6, 1.0)
        assert solve_relative(design, measured, row_weights=weights)[0] == pytest.approx(target, rel=1e-3)
    assert 100.0 < solve_relative(design, measured)[0] < 110.0
