"""Whole passes (data/h200/fulldepth): the moe-trace importer, validate's rung column, predict's rung
share, and the leave-one-model-out evaluation of bench/validate_whole_passes.py on a subset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from conftest import DATA, assert_one_line_error

from moesim.hw_profiles import load_profile
from moesim.hw_profiles.fitting.ladder_fit import WholePasses, predict_whole_passes
from moesim.hw_profiles.ladder.rungs import RUNGS
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.reference import reuse_features_reference, union_features_reference
from moesim.models import load_preset
from moesim.sim.validate.whole_passes import curves, lomo_predictions, naive_same_shape
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.importers import detect_source, import_routing

FULLDEPTH = DATA / "h200" / "fulldepth"
PASSES = FULLDEPTH / "passes.parquet"
PROFILE = load_profile("nvidia-h200")


@pytest.fixture(scope="module")
def mixtral_n4(tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    from moesim.cli import main

    out = tmp_path_factory.mktemp("passes") / "out"
    code = main(["validate", str(PASSES), "--profile", "nvidia-h200", "--filter", "model=mixtral-8x7b", "--filter", "n_tokens=4",
                 "--out", str(out), "--json"])  # fmt: skip
    assert code == 0
    return pl.read_parquet(out / "predictions.parquet")


def test_moe_trace_importer_maps_layers_and_checks_the_geometry(tmp_path: Path) -> None:
    path = FULLDEPTH / "traces" / "deepseek-v2-lite_p0.50.parquet"
    assert detect_source(path) == "moe-trace"
    geometry = TraceGeometry.from_preset(load_preset("deepseek-v2-lite"))
    trace = import_routing(path, geometry)
    raw = pl.read_parquet(path)
    first_layer = raw.filter((pl.col("layer") == raw["layer"].min()) & (pl.col("token") == 3)).sort("slot")["expert"].to_list()
    assert trace.experts.shape == (512, 26, 6) and trace.experts[3, 0].tolist() == first_layer  # ids 1..26 -> MoE layers in order
    with pytest.raises(Exception, match="metadata field 'E'"):
        import_routing(path, TraceGeometry.from_preset(load_preset("qwen1.5-moe-a2.7b")))
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({}), tmp_path / "plain.parquet")
    assert detect_source(tmp_path / "plain.parquet") == "table"


def test_validate_writes_the_rung_of_every_row(mixtral_n4: pl.DataFrame) -> None:
    frame = mixtral_n4
    assert frame.height == 240 and set(frame["rung"].unique()) <= set(RUNGS)
    shares = frame.select([f"rung_{r}_share" for r in RUNGS]).to_numpy()
    np.testing.assert_allclose(shares.sum(axis=1), 1.0)
    worst = [RUNGS[max(i for i in range(4) if s[i] > 0)] for s in shares]
    assert frame["rung"].to_list() == worst


def test_whole_pass_rows_are_the_sum_of_their_layers_counted_by_hand(mixtral_n4: pl.DataFrame) -> None:
    from moesim.tracegen.importers import open_trace

    preset = load_preset("mixtral-8x7b")
    shape = preset.expert_shape("BF16")
    for row in mixtral_n4.sample(6, seed=2).iter_rows(named=True):
        trace = open_trace(FULLDEPTH / "traces" / f"{row['trace']}.parquet")
        start, n = row["window_start"], row["n_tokens"]
        u, m, _ = union_features_reference(trace.experts, np.array([0, 1]), np.array([start]), np.array([n]), 8)
        hist, reads = reuse_features_reference(trace.experts, np.array([0, 1]), np.array([start]), np.array([n]), 8, (8, 16, 32))
        family = PROFILE.expert_family(row["kernel"])
        expected = sum(
            float(family.time_us(RoutingFeatures(n, 2 * n, u[0, i], m[0, i], hist[0, i], {t: r[0, i] for t, r in reads.items()}), shape))
            for i in range(32)
        )
        assert row["predicted_us"] == pytest.approx(expected, rel=1e-9)


def test_lomo_evaluation_is_reproducible_and_agrees_with_validate(mixtral_n4: pl.DataFrame) -> None:
    families = PROFILE.expert_families
    passes = predict_whole_passes(PASSES, families)
    keep = (passes.frame["n_tokens"] <= 4).to_numpy() & passes.frame["kernel"].is_in(["per_slot", "dedup"]).to_numpy()
    subset = WholePasses(passes.frame.filter(pl.Series(keep)), passes.layers_us[keep], passes.rung_us[keep], passes.layers[keep])
    first, bound = lomo_predictions(subset, families)
    again, bound_again = lomo_predictions(subset, families)
    assert np.array_equal(first, again) and np.array_equal(bound, bound_again)
    frame = subset.frame.with_columns(pl.Series("moesim", first))
    key = ["kernel", "trace", "window_start", "n_tokens"]
    joined = frame.join(mixtral_n4.select(*key, "predicted_us"), on=key, how="inner")
    assert joined.height == 160  # per_slot and dedup of the Mixtral rows at n = 4
    np.testing.assert_allclose(joined["moesim"], joined["predicted_us"], rtol=1e-12)  # no pass term generalised: a = 1, b = 0
    calibration = pl.read_parquet(DATA / "h200" / "calibration.parquet")
    naive = naive_same_shape(frame, calibration)
    for i in (0, 500, frame.height - 1):
        row = frame.row(i, named=True)
        knots = calibration.filter(
            (pl.col("model") == row["model"]) & (pl.col("kernel") == row["kernel"]) & (pl.col("n_tokens") == row["n_tokens"])
        )
        points = sorted(
            {u: float(knots.filter(pl.col("distinct_experts") == u)["time_us"].mean()) for u in knots["distinct_experts"]}.items()
        )
        mean_u = row["distinct_experts"] / row["layers"]
        lo = max([p for p in points if p[0] <= mean_u], default=points[0])
        hi = min([p for p in points if p[0] >= mean_u], default=points[-1])
        per_layer = lo[1] if hi[0] == lo[0] else lo[1] + (mean_u - lo[0]) * (hi[1] - lo[1]) / (hi[0] - lo[0])
        assert naive[i] == pytest.approx(per_layer * row["layers"], rel=1e-12)
    found = curves(frame.with_columns(pl.Series("moesim_bound", bound)), "moesim", "moesim_bound")
    assert {c.trace for c in found} == set(frame["trace"].unique()) and all(c.family == "dedup" for c in found)
    for c in found:
        assert set(c.wins_predicted) <= set(c.n) and c.crossover_predicted == (c.wins_predicted[0] if c.wins_predicted else None)


def test_predict_reports_the_share_of_time_per_rung(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "ds.arrow"
    code, _, err = cli(
        "trace", "import", FULLDEPTH / "traces" / "deepseek-v2-lite_p0.00.parquet", "--model", "deepseek-v2-lite", "--out", trace
    )
    assert code == 0, err
    for engine in ("per_slot", "dedup", "best"):
        code, out, err = cli("predict", "--trace", trace, "--profile", "nvidia-h200", "--family", engine, "--max-pass", "8", "--json")
        assert code == 0, err
        result = json.loads(out)
        share = result["rung_share"]
        assert set(share) == set(RUNGS) and sum(share.values()) == pytest.approx(1.0)
        assert all(p["rung"] in RUNGS for p in result["passes"]) and "extrapolation" in result["passes"][0]
    assert result["passes"][0]["rung"] == "exact"  # n = 1: every layer is a calibration point
    code, out, err = cli("predict", "--trace", trace, "--profile", "nvidia-h200-vllm", "--max-pass", "4", "--json")
    share = json.loads(out)["rung_share"]  # an engine profile has no knots: its fitted model, in or beyond its range
    assert code == 0 and share["exact"] == share["interpolated"] == 0.0 and share["fitted"] + share["extrapolated"] == pytest.approx(1.0)


def test_a_bare_trace_name_that_resolves_nowhere_is_one_line(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    table = tmp_path / "passes.parquet"
    pl.read_parquet(PASSES).head(2).with_columns(pl.lit("nowhere_p0.50").alias("trace")).write_parquet(table)
    code, _, err = cli("validate", table, "--profile", "nvidia-h200")
    assert_one_line_error(code, err, "field 'trace' is 'nowhere_p0.50'", "traces")
