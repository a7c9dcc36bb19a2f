"""`moesim validate`: every row predicted as it was measured, metrics against plain recomputation,
the real H200 table in-sample, and one-line errors for mismatched inputs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import DATA, assert_one_line_error
from scipy import stats

from moesim.atomic import MANIFEST
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.fitting.family_fit import family_inputs
from moesim.hw_profiles.ladder.rungs import RUNGS
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.reference import reuse_features_reference
from moesim.models import ExpertShape, load_preset
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.validate.result import ValidateOptions, validate
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Sticky, synthesize

H200 = DATA / "h200" / "calibration.parquet"
PROFILE = load_profile("nvidia-h200")
PRESET = load_preset("deepseek-v2-lite")


@pytest.fixture(scope="module")
def h200() -> dict:  # type: ignore[type-arg]
    result = validate([H200], ValidateOptions("nvidia-h200"))
    return {"result": result, "json": result.to_dict()}


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("validate") / "dsv2.arrow"
    write_trace(path, synthesize(PRESET, Sticky(keep_prob=0.4), tokens=80, seqs=2, seed=5))
    return path


def test_h200_calibration_rows_are_the_exact_rung_and_the_fitted_rung_is_the_fit_s_in_sample(h200: dict) -> None:  # type: ignore[type-arg]
    # every calibration row lies on a knot of its own family: validate returns the measured time
    # (the mean over rows with equal shape, n and features), rung exact; the fitted rung alone
    # gives back the fit's stored in-sample errors
    summary, frame = h200["json"], h200["result"].predictions
    assert summary["rows"] == 952 and summary["extrapolated_rows"] == 0
    assert frame["rung"].unique().to_list() == ["exact"] and (frame["rung_exact_share"] == 1.0).all()
    keys = ["kernel", "model", "n_tokens", "distinct_experts", "max_tokens_per_expert"]
    merged = frame.with_columns(pl.col("time_us").mean().over(keys).alias("knot_us"))
    for kernel in ("per_slot", "dedup_grouped_gemm", "dedup_loop"):  # interpolated in U alone: knots merge rows of equal U
        part = merged.filter(pl.col("kernel") == kernel)
        per_u = part.with_columns(pl.col("time_us").mean().over(["model", "n_tokens", "distinct_experts"]).alias("knot_us"))
        np.testing.assert_allclose(per_u["predicted_us"], per_u["knot_us"], rtol=1e-9)
    dedup = merged.filter(pl.col("kernel") == "dedup")
    np.testing.assert_allclose(dedup["predicted_us"], dedup["knot_us"], rtol=1e-9)
    calibration = pl.read_parquet(H200)
    for family in summary["per_family"]:
        rows = calibration.filter(pl.col("kernel") == family)
        fit = family_inputs(rows, str(H200), family)
        in_sample = PROFILE.expert_family(family).heldout_error.in_sample
        errors = np.abs(PROFILE.expert_family(family).inputs_time_us(fit) / rows["time_us"].to_numpy() - 1.0)
        assert errors.size == in_sample.rows
        assert 100 * np.median(errors) == pytest.approx(100 * in_sample.median, rel=1e-6)
        assert 100 * np.quantile(errors, 0.9) == pytest.approx(100 * in_sample.p90, rel=1e-6)
    assert summary["pearson_r"] == pytest.approx(stats.pearsonr(frame["time_us"], frame["predicted_us"]).statistic, rel=1e-9)
    signed = frame["predicted_us"] / frame["time_us"] - 1
    assert summary["median_abs_pct_error"] == pytest.approx(100 * float(signed.abs().median()), rel=1e-9)  # type: ignore[arg-type]
    assert summary["mean_signed_pct_error"] == pytest.approx(100 * float(signed.mean()), rel=1e-9)  # type: ignore[arg-type]


def test_h200_feature_rows_predict_the_family_time(h200: dict) -> None:  # type: ignore[type-arg]
    frame = h200["result"].predictions
    for row in frame.sample(12, seed=1).iter_rows(named=True):
        family = PROFILE.expert_family(row["kernel"])
        features = RoutingFeatures(row["n_tokens"], row["slots"], row["distinct_experts"], row["max_tokens_per_expert"])
        shape = ExpertShape(row["hidden"], row["expert_intermediate"], "BF16")
        look = family.lookup(features, shape)
        expected = float(look.time_us) * row["layers"]
        assert row["predicted_us"] == pytest.approx(expected, rel=1e-12) and row["rung"] == RUNGS[int(look.rung)]
        epsilon = float(look.epsilon)  # the rung's own bound (exact: the repeatability of the measured point)
        assert row["predicted_low_us"] == pytest.approx(expected * (1 - epsilon)) and row["predicted_high_us"] == pytest.approx(
            expected * (1 + epsilon)
        )


def test_h200_savings_bounds_and_win_sets_by_hand(h200: dict) -> None:  # type: ignore[type-arg]
    summary, frame = h200["json"], h200["result"].predictions
    assert set(summary["families"]) == {"dedup", "dedup_grouped_gemm", "dedup_loop"}
    assert "crossover_measured" not in summary  # several dedup families: per family only
    inside_all = []
    for family, result in summary["families"].items():
        inside = []
        for curve in result["curves"]:
            part = frame.filter((pl.col("model") == curve["curve"]["model"]) & (pl.col("routing") == curve["curve"]["routing"]))
            ps = {r["n_tokens"]: r for r in part.filter(pl.col("kernel") == "per_slot").iter_rows(named=True)}
            dd = {r["n_tokens"]: r for r in part.filter(pl.col("kernel") == family).iter_rows(named=True)}
            common = sorted(set(ps) & set(dd))
            assert curve["n"] == common
            assert curve["dedup_wins_measured"] == [n for n in common if dd[n]["time_us"] < ps[n]["time_us"]]
            assert curve["dedup_wins_predicted"] == [n for n in common if dd[n]["predicted_us"] < ps[n]["predicted_us"]]
            wins = curve["dedup_wins_measured"]
            assert curve["crossover_measured"] == (wins[0] if wins else None)
            for n in common:
                measured = 1 - dd[n]["time_us"] / ps[n]["time_us"]
                low = 1 - dd[n]["predicted_high_us"] / ps[n]["predicted_low_us"]
                high = 1 - dd[n]["predicted_low_us"] / ps[n]["predicted_high_us"]
                inside.append(low <= measured <= high)
        assert result["saving_inside_bound_fraction"] == pytest.approx(np.mean(inside))
        inside_all += inside
    assert summary["saving_inside_bound_fraction"] == pytest.approx(np.mean(inside_all))


def test_one_dedup_family_puts_crossover_at_the_top(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    frame = pl.read_parquet(H200).filter(
        (pl.col("model") == "qwen3-30b-a3b") & (pl.col("routing") == "uniform") & pl.col("kernel").is_in(["per_slot", "dedup"])
    )
    table = tmp_path / "one.csv"
    frame.drop("queue_ahead").write_csv(table)
    code, out, err = cli("validate", table, "--profile", "nvidia-h200", "--json")
    assert code == 0, err
    summary = json.loads(out)
    for key in ("rows", "median_abs_pct_error", "p90_abs_pct_error", "pearson_r", "saving_inside_bound_fraction", "mean_bound_width_pct"):
        assert key in summary
    assert summary["dedup_family"] == "dedup" and list(summary["families"]) == ["dedup"]
    ps = frame.filter(pl.col("kernel") == "per_slot").sort("n_tokens")
    dd = frame.filter(pl.col("kernel") == "dedup").sort("n_tokens")
    wins = [int(n) for n, a, b in zip(ps["n_tokens"], ps["time_us"], dd["time_us"], strict=True) if b < a]
    assert summary["dedup_wins_measured"] == wins and summary["crossover_measured"] == wins[0]
    assert isinstance(summary["dedup_wins_predicted"], list)


def _brute_features(experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct experts and tokens of the busiest expert per layer of a window (rows, L, K), by counting."""
    distinct, busiest = [], []
    for layer in range(experts.shape[1]):
        counts: dict[int, int] = {}
        for row in experts[:, layer, :]:
            for e in row.tolist():
                counts[e] = counts.get(e, 0) + 1
        distinct.append(len(counts))
        busiest.append(max(counts.values()))
    return np.array(distinct), np.array(busiest)


def test_window_rows_count_features_from_the_trace(trace_path: Path, tmp_path: Path) -> None:
    from moesim.tracegen.formats.trace import read_trace

    trace = read_trace(trace_path)
    rows = [
        {"kernel": "per_slot", "n_tokens": 4, "time_us": 900.0, "window_start": 10, "seq": 1, "layers": 3},
        {"kernel": "dedup", "n_tokens": 7, "time_us": 2000.0, "window_start": 0},
        # a trace named relative to the table
        {"kernel": "dedup_grouped_gemm", "n_tokens": 16, "time_us": 2500.0, "window_start": 64, "trace": "local.arrow", "seq": 0},
    ]
    shutil.copy(trace_path, tmp_path / "local.arrow")
    table = tmp_path / "windows.parquet"
    pl.DataFrame(rows).write_parquet(table)
    result = validate([table], ValidateOptions("nvidia-h200", trace=trace_path))
    shape = PRESET.expert_shape("BF16")
    starts = trace.seq_starts
    for row, predicted in zip(rows, result.predictions["predicted_us"], strict=True):
        first = starts[row.get("seq", 0)] + row["window_start"]
        n = row["n_tokens"]
        u, m = _brute_features(trace.experts[first : first + n])
        hist, reads = reuse_features_reference(trace.experts, np.array([0, 1]), np.array([first]), np.array([n]), 64, (8, 16, 32))
        layers = row.get("layers", 26)
        family = PROFILE.expert_family(row["kernel"])
        expected = sum(
            float(family.time_us(RoutingFeatures(n, n * 6, u[i], m[i], hist[0, i], {t: r[0, i] for t, r in reads.items()}), shape))
            for i in range(layers)
        )
        assert predicted == pytest.approx(expected, rel=1e-12)
    assert not result.predictions["extrapolated"].any()


def test_pass_rows_and_speculative_rows(trace_path: Path, tmp_path: Path) -> None:
    # a whole pass = the step-time model over every MoE layer, dense part at the window's end, fixed time
    model = StepTimeModel(PRESET, PROFILE, "dedup_grouped_gemm", "BF16")
    one_token = RoutingFeatures(np.ones((1, 26)), np.full((1, 26), 6.0), np.full((1, 26), 6.0), np.ones((1, 26)))
    t1 = float(model.pass_cost(one_token, np.array([21.0])).total_us()[0])
    rows = [{"kernel": "dedup_grouped_gemm", "n_tokens": 1, "time_us": t1 * 1.1, "window_start": 20, "draft_len": 0,
             "accepted_mean": 0.0, "tokens_per_s": 1e6 / (t1 * 1.1)}]  # fmt: skip
    accepted = {1: 0.9, 2: 1.6, 3: 2.1, 4: 2.4}
    draft_step_us = 300.0
    from moesim.tracegen.formats.trace import read_trace

    trace = read_trace(trace_path)
    for k, a in accepted.items():
        first = int(trace.seq_starts[0]) + 20
        u, m = _brute_features(trace.experts[first : first + k + 1])
        features = RoutingFeatures(*(np.asarray(v, np.float64)[None, :] for v in (np.full(26, k + 1), np.full(26, 6 * (k + 1)), u, m)))
        verify = float(model.pass_cost(features, np.array([20.0 + k + 1])).total_us()[0]) * 0.95
        rows.append({"kernel": "dedup_grouped_gemm", "n_tokens": k + 1, "time_us": verify, "window_start": 20, "draft_len": k,
                     "accepted_mean": a, "tokens_per_s": (1 + a) * 1e6 / (k * draft_step_us + verify)})  # fmt: skip
    table = tmp_path / "spec.parquet"
    pl.DataFrame(rows).write_parquet(table)
    result = validate([table], ValidateOptions("nvidia-h200", trace=trace_path))
    predicted = result.predictions["predicted_us"].to_numpy()
    measured = result.predictions["time_us"].to_numpy()
    assert predicted[0] == pytest.approx(t1, rel=1e-12)
    np.testing.assert_allclose(predicted[1:], measured[1:] / 0.95, rtol=1e-12)
    (curve,) = result.speculative
    assert curve["draft_lens"] == [0, 1, 2, 3, 4]
    # predicted tokens/s swaps the predicted verify time into the measured step: argmax by brute force
    rates = [1e6 / t1] + [(1 + a) * 1e6 / (k * draft_step_us + p) for (k, a), p in zip(accepted.items(), predicted[1:], strict=True)]
    np.testing.assert_allclose(curve["tokens_per_s_predicted"], rates, rtol=1e-9)
    assert curve["best_draft_predicted"] == int(np.argmax(rates))
    assert curve["best_draft_measured"] == int(np.argmax(curve["tokens_per_s_measured"]))
    assert result.to_dict()["best_draft_measured"] == curve["best_draft_measured"]


def test_shape_from_preset_and_extrapolation_flag(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    rows = [
        {"kernel": "per_slot", "n_tokens": 4, "time_us": 100.0, "distinct_experts": 20, "slots": 24, "max_tokens_per_expert": 2,
         "model": "deepseek-v2-lite", "layers": 2},
        # DeepSeek-V3's experts (hidden 7168) were never calibrated: predicted, and flagged
        {"kernel": "per_slot", "n_tokens": 4, "time_us": 100.0, "distinct_experts": 20, "slots": 32, "max_tokens_per_expert": 2,
         "model": "deepseek-v3", "layers": 1},
    ]  # fmt: skip
    table = tmp_path / "shapes.csv"
    pl.DataFrame(rows).write_csv(table)
    result = validate([table], ValidateOptions("nvidia-h200"))
    family = PROFILE.expert_family("per_slot")
    expected = 2 * float(family.time_us(RoutingFeatures(4, 24, 20, 2), PRESET.expert_shape()))
    assert result.predictions["predicted_us"][0] == pytest.approx(expected, rel=1e-12)
    assert result.predictions["extrapolated"].to_list() == [False, True]
    code, _, err = cli("validate", table, "--profile", "nvidia-h200")
    assert code == 0 and "beyond their family's calibrated range" in err and "extrapolation factor" in err


def test_out_writes_predictions_atomically(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "report"
    code, out_text, err = cli("validate", H200, "--profile", "nvidia-h200", "--out", out, "--filter", "model=mixtral-8x7b")
    assert code == 0, err
    assert "Time error per family" in out_text and "crossover" in out_text
    written = pl.read_parquet(out / "predictions.parquet")
    source = pl.read_parquet(H200).filter(pl.col("model") == "mixtral-8x7b")
    rungs = ["rung", "rung_exact_share", "rung_interpolated_share", "rung_fitted_share", "rung_extrapolated_share"]
    assert written.columns == [*source.columns, "predicted_us", "predicted_low_us", "predicted_high_us", *rungs, "extrapolated"]
    assert written.select(source.columns).equals(source)
    # and the list of moesim's files
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "config.toml", "plan.toml", "predictions.parquet"]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line_error(*cli("validate", H200, "--profile", "nvidia-h200", "--out", blocker)[::2], "output folder path is a file")


def test_mismatched_inputs_are_one_line_errors(cli, trace_path: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    def run(rows: list[dict], *extra: object) -> tuple[int, str]:  # type: ignore[type-arg]
        table = tmp_path / "bad.csv"
        pl.DataFrame(rows).write_csv(table)
        code, _, err = cli("validate", table, "--profile", "nvidia-h200", *extra)
        return code, err

    window = {"kernel": "per_slot", "n_tokens": 8, "time_us": 10.0, "window_start": 75}
    assert_one_line_error(*run([window], "--trace", trace_path), "row 0", "window [75, 83)", "80 positions")
    assert_one_line_error(*run([{**window, "window_start": 0, "seq": 2}], "--trace", trace_path), "field 'seq' is 2")
    assert_one_line_error(*run([{**window, "window_start": 0, "model": "qwen3-30b-a3b"}], "--trace", trace_path),
                          "field 'model' is 'qwen3-30b-a3b'", "deepseek-v2-lite")  # fmt: skip
    assert_one_line_error(*run([{**window, "window_start": 0, "experts": 128}], "--trace", trace_path), "field 'experts' is 128")
    assert_one_line_error(*run([{**window, "kernel": "dedup_triton"}], "--trace", trace_path), "'dedup_triton'", "no such expert family")
    assert_one_line_error(*run([{**window, "window_start": 0}]), "needs a trace")
    assert_one_line_error(*run([{**window, "window_start": 0, "trace": "missing.arrow"}]), "missing.arrow", "does not exist")
    assert_one_line_error(*run([{**window, "window_start": 0, "layers": 40}], "--trace", trace_path), "field 'layers' is 40")
    features = {"kernel": "per_slot", "n_tokens": 2, "time_us": 10.0, "distinct_experts": 9, "slots": 12, "max_tokens_per_expert": 1}
    assert_one_line_error(*run([features]), "row 0", "expert shape")
    assert_one_line_error(*run([{**features, "model": "deepseek-v2-lite", "distinct_experts": 13}]), "routing features are inconsistent")
    assert_one_line_error(*run([{"kernel": "per_slot", "n_tokens": 2, "time_us": 10.0}]), "neither routing features")
    assert_one_line_error(*run([{**features, "model": "deepseek-v2-lite", "scope": "layer"}]), "field 'scope'")
    passes = {**window, "window_start": 0, "scope": "pass"}
    assert_one_line_error(*run([{**passes, "context_tokens": "long"}], "--trace", trace_path), "field 'context_tokens'")
    assert_one_line_error(*run([passes], "--trace", trace_path, "--model", "qwen3-30b-a3b"), "does not route like")
    assert_one_line_error(*run([{**window, "window_start": 0}], "--trace", trace_path, "--context-tokens", "-1"), "--context-tokens")
    assert math.isfinite(PROFILE.expert_family("per_slot").heldout_error.epsilon)


def test_leave_one_shape_out_through_validate_reproduces_the_fit_s_held_out_error(tmp_path: Path) -> None:
    # fit per_slot on three shapes, validate the fourth, each in turn: pooled, the errors the fit itself
    # reports as leave-one-shape-out (two independent paths to the same numbers)
    from moesim.hw_profiles.fitting.calibrate import fit_profile
    from moesim.hw_profiles.schema import write_profile
    from moesim.sim.validate.metrics import time_errors

    table = pl.read_parquet(H200).filter(pl.col("kernel") == "per_slot")
    predictions = []
    for shape in sorted(set(table["model"].to_list())):
        fit_rows, held = tmp_path / f"fit-{shape}.parquet", tmp_path / f"held-{shape}.parquet"
        table.filter(pl.col("model") != shape).write_parquet(fit_rows)
        table.filter(pl.col("model") == shape).write_parquet(held)
        profile = tmp_path / f"{shape}.toml"
        write_profile(profile, fit_profile(fit_rows, shape, device_json=DATA / "h200" / "device.json").profile)
        predictions.append(validate([held], ValidateOptions(str(profile))).predictions)
    pooled = time_errors(pl.concat(predictions))
    reported = PROFILE.expert_family("per_slot").heldout_error.leave_one_shape_out
    assert pooled.rows == reported.rows  # type: ignore[union-attr]
    assert pooled.median_abs_pct == pytest.approx(100 * reported.median, rel=1e-6)  # type: ignore[union-attr]
    assert pooled.p90_abs_pct == pytest.approx(100 * reported.p90, rel=1e-6)  # type: ignore[union-attr]
    assert pooled.median_abs_pct <= 5.0  # the goal for this family
