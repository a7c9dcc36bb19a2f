"""`moesim profile fit | list | show | derive` and the demo's profile section, run in-process."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import DATA, DemoRun, assert_one_line_error

from moesim.hw_profiles import builtin_names, load_profile
from moesim.hw_profiles.schema import read_profile
from moesim.kernels.features import RoutingFeatures
from moesim.models import ExpertShape

H200_TABLE = DATA / "h200" / "calibration.parquet"


def test_list_json_names_every_builtin(cli) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli("profile", "list", "--json")
    assert code == 0, err
    entries = json.loads(out)
    assert [e["name"] for e in entries] == builtin_names()
    required = {
        *("nvidia-h200", "nvidia-rtx-3090-llamacpp", "nvidia-p40-llamacpp", "nvidia-a100-80gb-vllm", "nvidia-h200-vllm"),
        *("nvidia-h20-vllm", "nvidia-h100-sxm-vllm", "amd-rx-7900-xtx-vulkan", "apple-m2-ultra-metal", "apple-m3-ultra-mlx"),
    }
    assert required <= {e["name"] for e in entries}
    for entry in entries:
        assert {"name", "device", "engine", "engine_version", "status"} <= set(entry) and all(entry[k] for k in ("device", "engine"))
    by_name = {e["name"]: e for e in entries}
    assert by_name["nvidia-h100-sxm-vllm"]["status"] == "datasheet-scaled" and by_name["nvidia-h100-sxm-vllm"]["engine"] == "vLLM fused_moe"
    assert by_name["nvidia-rtx-3090-llamacpp"]["status"] == "published-calibrated"
    assert by_name["apple-m3-ultra-mlx"]["partial"] and by_name["apple-m2-ultra-metal"]["partial"]
    assert {e["backend"] for e in entries} == {"cuda", "metal", "vulkan"}
    code, out, _ = cli("profile", "list")
    assert code == 0 and "datasheet-scaled" in out and "published-calibrated" in out


def test_show_json_has_families_errors_and_r_of_n(cli) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli("profile", "show", "nvidia-h200", "--json", "--model", "qwen3-30b-a3b")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["status"] == "calibrated" and shown["device"]["backend"] == "cuda"
    assert set(shown["families"]) == {"per_slot", "dedup", "dedup_grouped_gemm", "dedup_loop", "dense"}
    assert shown["families"]["dedup"]["heldout_error"]["leave_one_shape_out"]["rows"] == 256
    rows = shown["r_of_n"]["rows"]
    assert shown["r_of_n"]["model"] == "qwen3-30b-a3b" and rows[0]["n"] == 1
    profile = load_profile("nvidia-h200")
    shape = ExpertShape(2048, 768)
    first = rows[0]  # n = 1: every sample has U = K = 8 and one token per expert, so r is exact: u · T_per_slot / T_dedup
    one = RoutingFeatures(np.array([1.0]), np.array([8.0]), np.array([8.0]), np.array([1.0]))
    t_ps, t_d = profile.expert_family("per_slot").time_us(one, shape)[0], profile.expert_family("dedup").time_us(one, shape)[0]
    assert first["distinct_experts"] == 8.0 and first["byte_share_u"] == 1.0
    assert first["r_dedup"] == pytest.approx(t_ps / t_d, rel=1e-12)
    code, out, err = cli("profile", "show", "apple-m4-max")  # the old name of apple-m4-max-metal, for one release
    assert code == 0 and "r = BW_dedup" in out and "Dispatch" in out and "apple-m4-max-metal" in err


def test_show_rejects_a_bad_file_with_one_line(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = (Path(__file__).resolve().parents[1] / "moesim" / "hw_profiles" / "profiles" / "nvidia-h200.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(source.replace('backend = "cuda"', 'backend = "sycl"'))
    code, _, err = cli("profile", "show", bad)
    assert_one_line_error(code, err, "bad.toml", "device.backend", "sycl")
    bad.write_text(source.replace("fixed_us = 24.92", "fixed_us = -3.0"))
    code, _, err = cli("profile", "show", bad)
    assert_one_line_error(code, err, "pass.fixed_us", "-3")
    code, _, err = cli("profile", "show", "no-such-device")
    assert_one_line_error(code, err, "unknown hardware profile", "no-such-device")


def test_derive_writes_a_loadable_what_if(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "fast.toml"
    scales = ("--bandwidth-scale", "1.5", "--compute-scale", "2", "--fixed-us", "10")
    code, _, err = cli("profile", "derive", "nvidia-h200", *scales, "--out", out)
    assert code == 0, err
    derived, base = read_profile(out), load_profile("nvidia-h200")
    assert derived.pass_fixed_us == 10.0 and derived.derived_from == "nvidia-h200"
    assert derived.expert_family("per_slot").hbm_bandwidth_gbps == base.expert_family("per_slot").hbm_bandwidth_gbps * 1.5
    assert tomllib.loads(out.read_text())["sources"]["what-if"]["kind"] == "assumed"
    code, _, err = cli("profile", "derive", "nvidia-h200", "--bandwidth-scale", "-1", "--out", tmp_path / "x.toml")
    assert_one_line_error(code, err, "--bandwidth-scale", "-1")
    assert not (tmp_path / "x.toml").exists()


def test_fit_a_filtered_table_writes_a_profile(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "ps.toml"
    args = ("profile", "fit", H200_TABLE, "--out", out, "--filter", "kernel=per_slot", "--filter", "routing=distinct")
    code, stdout, err = cli(*args)
    assert code == 0, err
    profile = read_profile(out)
    assert profile.name == "ps" and profile.families == ("per_slot", "dense")
    heldout = profile.expert_family("per_slot").heldout_error
    assert heldout.leave_one_shape_out is not None and heldout.leave_one_routing_out is None  # one routing level left
    assert "kernel=per_slot routing=distinct" in profile.sources["table"].note
    assert "per_slot" in stdout and "wrote" in stdout
    rows = pl.read_parquet(H200_TABLE).filter((pl.col("kernel") == "per_slot") & (pl.col("routing") == "distinct"))
    assert heldout.in_sample is not None and heldout.in_sample.rows == rows.height


def test_fit_bad_input_is_one_line_and_writes_nothing(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "p.toml"
    code, _, err = cli("profile", "fit", H200_TABLE, "--out", out, "--filter", "colour=red")
    assert_one_line_error(code, err, "--filter column 'colour'")
    code, _, err = cli("profile", "fit", H200_TABLE, "--out", out, "--filter", "kernel=dense_nothing")
    assert_one_line_error(code, err, "no rows left")
    csv = tmp_path / "m.csv"
    csv.write_text("kernel,n_tokens,time_us\nper_slot,2,5.0\n")
    code, _, err = cli("profile", "fit", csv, "--out", out, "--backend", "cpu")
    assert_one_line_error(code, err, "column 'slots' is missing", "per_slot")
    code, _, err = cli("profile", "fit", H200_TABLE, "--out", tmp_path / "missing" / "p.toml")
    assert_one_line_error(code, err, "does not exist")
    assert not out.exists()


def test_demo_has_the_h200_per_slot_vs_dedup_section(demo_run: DemoRun) -> None:
    assert demo_run.code == 0, demo_run.err
    text = " ".join(demo_run.out.split())  # titles wrap at the terminal's width
    assert "Per-slot vs dedup time of one MoE layer per pass size" in text and "calibrated NVIDIA H200" in text
    table = pl.read_csv(demo_run.out_dir / "perslot_vs_dedup_h200.csv")
    assert table["n"].to_list()[:16] == list(range(1, 17))
    assert table["per_slot_us"].is_sorted() and (table["per_slot_us"] > 0).all()


def test_fit_uses_dense_rows_and_a_catalog_device_without_device_json(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rows = pl.read_parquet(H200_TABLE).filter((pl.col("kernel") == "per_slot") & (pl.col("model") == "qwen3-30b-a3b"))
    dense_bytes = [1e6, 5e6, 2e7, 1e8, 4e8]
    dense = pl.DataFrame(
        {"kernel": "dense", "n_tokens": 1, "time_us": [3.0 + b / 2.0e6 for b in dense_bytes], "bytes_requested": dense_bytes}
    )
    table = tmp_path / "mixed.csv"
    columns = ("kernel", "model", "device", "n_tokens", "time_us", "bytes_requested", "slots", "distinct_experts", "max_tokens_per_expert")
    expert_rows = rows.select(*columns, "hidden", "expert_intermediate", "expert_bytes", "routing")
    pl.concat([expert_rows, dense], how="diagonal_relaxed").write_csv(table)
    out = tmp_path / "mixed.toml"
    code, _, err = cli("profile", "fit", table, "--out", out)
    assert code == 0, err
    profile = read_profile(out)
    assert profile.device.name == "NVIDIA H200 SXM" and profile.provenance_of("roofline.peak_tflops").kind == "datasheet"
    assert profile.dense.launch_us == pytest.approx(3.0, rel=1e-6) and profile.dense.bandwidth_gbps == pytest.approx(2000.0, rel=1e-6)
    assert profile.dense.provenance.kind == "calibrated" and profile.pass_fixed_us == 0.0
    assert profile.provenance_of("pass.fixed_us").kind == "assumed"


def test_list_keeps_every_profile_name_whole_at_80_columns(cli, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from moesim.hw_profiles import builtin_names

    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = cli("profile", "list")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 80
    for name in builtin_names():
        assert any(line.split("│")[1].strip() == name for line in out.splitlines() if line.count("│") > 2), name
