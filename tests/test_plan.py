"""Measurement plans (issue 28, item 5): the gaps of `predict --out` and `validate --out` as a
plan that `microbench torch --plan` lists (dry run, no device) and measures exactly."""

from __future__ import annotations

import itertools
import json
import tomllib
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import REPO, assert_one_line_error

from moesim.errors import InputError
from moesim.hw_profiles.microbench.plan import read_plan
from moesim.hw_profiles.microbench.routing import pass_features, planned_ids, planned_problem

H200 = REPO / "data" / "h200"
HELD = "qwen3-30b-a3b"


def _achievable(n: int, experts: int, top_k: int) -> set[tuple[int, int]]:
    """Every (U, M) some pass of n tokens, each k distinct of E experts, takes: by brute force."""
    rows = list(itertools.combinations(range(experts), top_k))
    found = set()
    for picks in itertools.product(rows, repeat=n):
        counts = np.bincount(np.array(picks).ravel(), minlength=experts)
        found.add((int(np.count_nonzero(counts)), int(counts.max())))
    return found


@pytest.mark.parametrize(("n", "experts", "top_k"), [(1, 4, 2), (3, 4, 2), (2, 5, 3), (4, 4, 1), (3, 6, 2)])
def test_planned_passes_are_exactly_the_achievable_ones(n: int, experts: int, top_k: int) -> None:
    """`planned_problem` admits exactly the (U, M) a brute force finds, and `planned_ids` draws a
    pass with that U and M, k distinct experts per token."""
    achievable = _achievable(n, experts, top_k)
    admitted = {(u, m) for u in range(1, experts + 1) for m in range(1, n + 1) if planned_problem(n, experts, top_k, u, m) is None}
    assert admitted == achievable
    for u, m in sorted(achievable):
        ids = planned_ids(n, experts, top_k, u, m, seed=u * 31 + m)
        features = pass_features(ids, experts)
        assert ids.shape == (n, top_k) and all(len(set(row)) == top_k for row in ids.tolist())
        assert (int(features.distinct_experts), int(features.max_tokens_per_expert)) == (u, m)
    with pytest.raises(InputError, match="distinct experts"):
        planned_ids(n, experts, top_k, top_k - 1 if top_k > 1 else experts + 1, 1, 0)


@pytest.fixture(scope="module")
def held_out_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """per_slot fitted on the H200 table without one shape; the held-out shape's rows beside it."""
    from moesim.hw_profiles.fitting.calibrate import fit_profile
    from moesim.hw_profiles.schema import write_profile

    folder = tmp_path_factory.mktemp("held")
    table = pl.read_parquet(H200 / "calibration.parquet").filter(pl.col("kernel") == "per_slot")
    table.filter(pl.col("model") != HELD).write_parquet(folder / "fit.parquet")
    table.filter(pl.col("model") == HELD).write_parquet(folder / "held.parquet")
    profile = folder / "profile.toml"
    write_profile(profile, fit_profile(folder / "fit.parquet", "h200-without-qwen3", device_json=H200 / "device.json").profile)
    return profile, folder / "held.parquet"


def test_a_validate_plan_dry_runs_through_torch_listing_exactly_its_rows(cli, tmp_path: Path, held_out_profile) -> None:  # type: ignore[no-untyped-def]
    """validate --out on H200 rows of a shape the profile never saw: plan.toml names every row the
    ladder priced from a fitted or extrapolated rung, and microbench torch --plan --dry-run lists
    exactly those (one per_slot engine each), with no GPU and no torch."""
    profile, held = held_out_profile
    code, _, err = cli("validate", held, "--profile", profile, "--out", tmp_path / "v")
    assert code == 0, err
    predictions = pl.read_parquet(tmp_path / "v" / "predictions.parquet")
    gapped = predictions.filter(pl.col("rung").is_in(["fitted", "extrapolated"]))
    assert gapped.height > 0
    expected = sorted(set(gapped.select("n_tokens", "distinct_experts", "max_tokens_per_expert").iter_rows()))
    plan = read_plan(tmp_path / "v" / "plan.toml")
    assert sorted((p.n_tokens, p.distinct_experts, p.max_tokens_per_expert) for p in plan.passes) == expected
    assert {p.model for p in plan.passes} == {HELD} and {p.family for p in plan.passes} == {"per_slot"}
    share = float((gapped["predicted_us"]).sum() / predictions["predicted_us"].sum())
    assert plan.answer_share == pytest.approx(share)
    code, out, err = cli("microbench", "torch", "--plan", tmp_path / "v" / "plan.toml", "--dry-run", "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert [
        (r["engine"], r["kernel"], r["model"], r["n_tokens"], r["distinct_experts"], r["max_tokens_per_expert"]) for r in listed["rows"]
    ] == [("torch_slot_graph", p.family, p.model, p.n_tokens, p.distinct_experts, p.max_tokens_per_expert) for p in plan.passes]
    # the engines asked for decide: no per-slot engine, no row, one note naming the family
    code, out, err = cli("microbench", "torch", "--plan", tmp_path / "v" / "plan.toml", "--dry-run", "--json", "--engine", "torch_loop")
    assert code == 0, err
    listed = json.loads(out)
    assert listed["rows"] == [] and len(listed["notes"]) == 1 and "per_slot" in listed["notes"][0]
    code, out, err = cli("microbench", "torch", "--plan", tmp_path / "v" / "plan.toml", "--dry-run")
    assert code == 0 and f"{len(plan.passes)} rows would be measured" in out


def test_a_table_the_profile_measured_plans_nothing_and_torch_refuses_it(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The H200 table on the profile calibrated from it: every row exact, an empty plan that says
    so; measuring it is one line (exit 2), nothing written."""
    table = tmp_path / "one.parquet"
    pl.read_parquet(H200 / "calibration.parquet").filter(pl.col("model") == "deepseek-v2-lite").write_parquet(table)
    code, _, err = cli("validate", table, "--profile", "nvidia-h200", "--out", tmp_path / "v")
    assert code == 0, err
    doc = tomllib.loads((tmp_path / "v" / "plan.toml").read_text())
    assert doc["passes"] == [] and doc["answer_share"] == 0.0 and "nothing to measure" in doc["notes"][0]
    code, _, err = cli("microbench", "torch", "--plan", tmp_path / "v" / "plan.toml", "--out", tmp_path / "m")
    assert_one_line_error(code, err, "plan.toml", "'passes'", "no pass to measure")
    assert not (tmp_path / "m").exists()


def test_predict_out_plans_the_passes_of_a_shape_no_row_measured(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Tensor parallel halves each expert's width, a shape the H200 table lacks: the plan's passes
    are the windows' (U, M), their answer share is the fitted and extrapolated expert time of the
    passes (PassCost.rung_us, the predictor's own bookkeeping) over Σ T(n)."""
    from moesim.sim.analysis.predict import predict
    from moesim.sim.analysis.scenario import load_scenario
    from moesim.sim.cost.parallel import Devices

    args = ("predict", "--trace", "esft-vanilla-lite", "--profile", "nvidia-h200", "--max-pass", "4", "--tensor-parallel", "2")
    code, out, err = cli(*args, "--out", tmp_path / "p", "--json")
    assert code == 0, err
    plan = read_plan(tmp_path / "p" / "plan.toml")
    scenario = load_scenario(Path("esft-vanilla-lite"), "nvidia-h200", None, None, "ngram", None, 512, Devices(tensor_parallel=2))
    cost = predict(scenario, 4).cost
    total = cost.total_us()
    gap_us = cost.rung_us[:, 2:].sum(axis=1) / cost.rung_us.sum(axis=1) * cost.expert_us
    assert plan.answer_share == pytest.approx(float(gap_us.sum() / total.sum()), rel=1e-9)
    for n in range(1, 5):
        share = sum(p.time_share for p in plan.passes if p.n_tokens == n)
        assert share == pytest.approx(float(gap_us[n - 1] / total[n - 1]), rel=1e-9)
    assert {p.expert_intermediate for p in plan.passes} == {scenario.model.expert_shape.intermediate}
    assert json.loads(out)["family"] == "per_slot"  # --out changes nothing printed by --json
    code, plain, _ = cli(*args, "--json")
    assert plain == out
    code, listed, err = cli("microbench", "torch", "--plan", tmp_path / "p" / "plan.toml", "--dry-run", "--json")
    assert code == 0 and len(json.loads(listed)["rows"]) == len(plan.passes), err


UNPLANNABLE = [(("--batch", "2"), "--batch > 1"), (("--expert-parallel", "2"), "plan of expert-parallel passes")]


@pytest.mark.parametrize(("extra", "fragment"), UNPLANNABLE)
def test_predict_out_refuses_what_it_cannot_plan_before_writing(cli, tmp_path: Path, extra: tuple[str, ...], fragment: str) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli(
        "predict", "--trace", "esft-vanilla-lite", "--profile", "nvidia-h200", "--max-pass", "2", *extra, "--out", tmp_path / "p"
    )
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "p").exists()


BAD_PLANS = [
    ("distinct_experts = 8", "distinct_experts = 2000", "passes[0].distinct_experts"),
    ("max_tokens_per_expert = 1", "max_tokens_per_expert = 9", "passes[0].max_tokens_per_expert"),
    ('rung = "fitted"', 'rung = "exact"', "passes[0].rung"),
    ('format = "moesim-measurement-plan"', 'format = "plan"', "'format'"),
    ("top_k = 8", "top_k = 200", "passes[0].top_k"),
]


@pytest.mark.parametrize(("old", "new", "key"), BAD_PLANS, ids=[b[2] for b in BAD_PLANS])
def test_a_bad_plan_is_one_line_naming_the_file_and_key(cli, tmp_path: Path, old: str, new: str, key: str) -> None:  # type: ignore[no-untyped-def]
    text = (
        'format = "moesim-measurement-plan"\nversion = 1\n\n[[passes]]\nmodel = "qwen3-30b-a3b"\nhidden = 2048\n'
        'expert_intermediate = 768\nexperts = 128\ntop_k = 8\nfamily = "per_slot"\nn_tokens = 1\ndistinct_experts = 8\n'
        'max_tokens_per_expert = 1\nrung = "fitted"\ntime_share = 0.5\n'
    )
    good = tmp_path / "good.toml"
    good.write_text(text)
    assert cli("microbench", "torch", "--plan", good, "--dry-run")[0] == 0
    assert old in text
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace(old, new))
    code, _, err = cli("microbench", "torch", "--plan", bad, "--dry-run")
    assert_one_line_error(code, err, str(bad), key)


def test_an_mlx_plan_measures_exactly_the_rows_its_dry_run_lists(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`microbench mlx --plan` on this machine's CPU (real mlx_lm): each planned pass through the
    row order of its family at the plan's U and M; the table's rows are the dry run's."""
    pytest.importorskip("mlx_lm")
    shape = {"model": "tiny", "hidden": 64, "expert_intermediate": 64, "experts": 8, "top_k": 2, "weight_format": "F32"}
    passes = [
        {**shape, "family": "per_slot", "n_tokens": 3, "distinct_experts": 4, "max_tokens_per_expert": 3, "time_share": 0.4},
        {**shape, "family": "dedup_gather_sorted", "n_tokens": 5, "distinct_experts": 7, "max_tokens_per_expert": 2},
    ]
    body = "".join("\n[[passes]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in p.items()) for p in passes)
    plan = tmp_path / "plan.toml"
    plan.write_text('format = "moesim-measurement-plan"\nversion = 1\n' + body)
    args = ("microbench", "mlx", "--plan", plan, "--reps", "2", "--warmup", "0", "--layers", "1", "--no-dense-twins")
    code, out, err = cli(*args, "--dry-run", "--json")
    assert code == 0, err
    listed = json.loads(out)["rows"]
    code, _, err = cli(*args, "--out", tmp_path / "m")
    assert code == 0, err
    table = pl.read_parquet(tmp_path / "m" / "measurements.parquet")
    key = ("kernel", "n_tokens", "distinct_experts", "max_tokens_per_expert")
    assert [tuple(r[k] for k in key) for r in table.iter_rows(named=True)] == [tuple(r[k] for k in key) for r in listed]
    assert [tuple(r[k] for k in key) for r in listed] == [("per_slot", 3, 4, 3), ("dedup_gather_sorted", 5, 7, 2)]
    assert set(table["routing"]) == {"planned"} and table["plan_rung"].to_list() == ["fitted", "fitted"]
    code, _, err = cli("microbench", "mlx", "--plan", plan, "--model", "olmoe-1b-7b", "--out", tmp_path / "x")
    assert_one_line_error(code, err, "--plan excludes --model")


def test_a_llama_cpp_plan_measures_the_passes_llama_cpp_runs_in_their_family(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`microbench llama-cpp --plan` on this machine's CPU (real llama.cpp): the passes whose family
    llama.cpp's CPU dispatch runs (dedup_llamacpp_cpu at every n) are designed at the plan's U and M
    and measured, the table's rows are the dry run's; a per_slot pass is a note, not a row."""
    shape = {"model": "tiny", "hidden": 128, "expert_intermediate": 256, "experts": 8, "top_k": 2, "weight_format": "F32"}
    passes = [
        {**shape, "family": "dedup_llamacpp_cpu", "n_tokens": 4, "distinct_experts": 5, "max_tokens_per_expert": 2},
        {**shape, "family": "per_slot", "n_tokens": 3, "distinct_experts": 4, "max_tokens_per_expert": 2},
        {**shape, "family": "dedup_llamacpp_cpu", "n_tokens": 1, "distinct_experts": 2, "max_tokens_per_expert": 1},
    ]
    body = "".join("\n[[passes]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in p.items()) for p in passes)
    plan = tmp_path / "plan.toml"
    plan.write_text('format = "moesim-measurement-plan"\nversion = 1\n' + body)
    args = ["microbench", "llama-cpp", "--plan", plan, "--layers", "1", "--heads", "4", "--reps", "3", "--warmup", "1"]
    args += ["--threads", "1", "--prefix", "4", "--no-subtract-attention"]
    code, out, err = cli(*args, "--dry-run", "--json")
    assert code == 0, err
    listed = json.loads(out)
    key = ("kernel", "n_tokens", "distinct_experts", "max_tokens_per_expert")
    assert [tuple(r[k] for k in key) for r in listed["rows"]] == [("dedup_llamacpp_cpu", 4, 5, 2), ("dedup_llamacpp_cpu", 1, 2, 1)]
    assert len(listed["notes"]) == 1 and "per_slot" in listed["notes"][0]
    code, _, err = cli(*args, "--out", tmp_path / "m")
    assert code == 0, err
    table = pl.read_parquet(tmp_path / "m" / "measurements.parquet")
    assert sorted(tuple(r[k] for k in key) for r in table.iter_rows(named=True)) == sorted(tuple(r[k] for k in key) for r in listed["rows"])
    assert set(table["routing"]) == {"planned"} and set(table["model"]) == {"tiny"}
