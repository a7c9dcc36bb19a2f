"""Importing llama.cpp's `test-backend-ops perf -o MUL_MAT_ID` console output.

The sample follows the console printer of tests/test-backend-ops.cpp (ggml-org/llama.cpp):
backend header, device description, `  OP(params):  N runs -  T us/run - F MFLOP/run - R GFLOPS`
with ANSI colours, `not supported` lines and MUL_MAT_ID_FUSION cases. The numbers are made up for
the test; they are not measurements.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error

from moesim.errors import InputError
from moesim.hw_profiles.measurements.table import load_measurements
from moesim.hw_profiles.microbench.backend_ops import backend_of, parse_backend_ops_perf
from moesim.hw_profiles.microbench.llamacpp_kernels import llamacpp_family

BLUE, RESET = "\x1b[1;34m", "\x1b[0m"


def _line(type_a: str, n: int, us: float, runs: int = 1000, m: int = 768, k: int = 2048, op: str = "MUL_MAT_ID", extra: str = "") -> str:
    params = f"type_a={type_a},type_b=f32,n_mats=128,n_used=8,b=0,m={m},n={n},k={k}{extra}"
    mflop = 2 * m * k * n * 8 / 1e6
    rate = f"{BLUE}{mflop / us * 1e-3:6.2f} GFLOPS{RESET}"
    return f"  {op}({params}):          {runs:8d} runs - {us:8.2f} us/run - {mflop:6.2f} MFLOP/run - {rate}"


SAMPLE = "\n".join(
    [
        "ggml_cuda_init: found 1 CUDA devices:",
        "  Device 0: NVIDIA GeForce RTX 4090, compute capability 8.9, VMM: yes",
        "Testing 2 devices",
        "",
        "Backend 1/2: CUDA0",
        "  Device description: NVIDIA GeForce RTX 4090",
        "  Device memory: 24080 MB (23664 MB free)",
        "",
        _line("q4_0", 1, 20.5),
        _line("q4_0", 1, 22.0, op="MUL_MAT_ID_FUSION", extra=",o=1"),
        _line("q4_0", 32, 180.25),
        _line("f16", 8, 95.0),
        _line("iq2_xs", 8, 30.0),
        "  MUL_MAT_ID(type_a=bf16,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=1,k=2048): not supported",
        f"  Backend CUDA0: {BLUE}OK{RESET}",
        "Backend 2/2: CPU",
        "  Skipping CPU backend",
        "2/2 backends passed",
    ]
)


def test_parse_keeps_only_timed_mul_mat_id_cases() -> None:
    cases = parse_backend_ops_perf(SAMPLE)
    assert [(c.type_a, c.n, c.time_us) for c in cases] == [("q4_0", 1, 20.5), ("q4_0", 32, 180.25), ("f16", 8, 95.0), ("iq2_xs", 8, 30.0)]
    assert {c.device for c in cases} == {"NVIDIA GeForce RTX 4090"} and {c.backend_name for c in cases} == {"CUDA0"}
    assert cases[0].m == 768 and cases[0].k == 2048 and cases[0].n_mats == 128 and cases[0].n_used == 8 and cases[0].runs == 1000


def test_import_writes_layer_equivalent_rows(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "perf.txt"
    log.write_text(SAMPLE)
    code, _, err = cli("microbench", "import-backend-ops", log, "--out", tmp_path / "t")
    assert code == 0, err
    assert "1 cases of type iq2_xs skipped" in err
    table = load_measurements(tmp_path / "t" / "measurements.parquet")
    assert table["n_tokens"].to_list() == [1, 32, 8]
    # CUDA: per-slot (MMVQ) up to 8 tokens, deduplicating above
    assert table["kernel"].to_list() == ["per_slot", "dedup_llamacpp_cuda", "per_slot"]
    assert table["time_us"].to_list() == pytest.approx([3 * 20.5, 3 * 180.25, 3 * 95.0])
    assert table["time_us_matrix"].to_list() == [20.5, 180.25, 95.0]
    assert table["expert_bytes"].to_list() == pytest.approx([3 * 768 * 2048 * 18 / 32, 3 * 768 * 2048 * 18 / 32, 3 * 768 * 2048 * 2])
    assert table["slots"].to_list() == [8, 256, 64]
    for row in table.iter_rows(named=True):  # E[U] = E(1 - (1 - k/E)^n) under the tool's uniform routing
        expected = 128 * (1 - (1 - 8 / 128) ** row["n_tokens"])
        assert row["distinct_experts_expected"] == pytest.approx(expected)
        assert row["distinct_experts"] == round(expected) and row["features"] == "expected"
    assert table["max_tokens_per_expert"].to_list()[0] == 1  # one token: no expert twice
    provenance = json.loads((tmp_path / "t" / "provenance.json").read_text())
    assert provenance["skipped_types"] == {"iq2_xs": 1} and provenance["cases"] == 4


def test_backend_override_and_families() -> None:
    assert backend_of("CUDA0") == "cuda" and backend_of("MTL0") == "metal" and backend_of("CPU") == "cpu"
    assert backend_of("Vulkan0") == "vulkan"
    with pytest.raises(InputError, match="SYCL0"):
        backend_of("SYCL0")
    assert llamacpp_family("cpu", 1) == "dedup_llamacpp_cpu"
    assert [llamacpp_family("metal", n) for n in (31, 32)] == ["per_slot", "dedup_llamacpp_metal"]
    assert llamacpp_family("cuda", 16, per_slot_max_tokens=16) == "per_slot"


def test_bad_logs_give_one_line(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    empty = tmp_path / "empty.txt"
    empty.write_text("Backend 1/1: CUDA0\n  MUL_MAT(type_a=f16,...): 10 runs - 1.00 us/run\n")
    code, _, err = cli("microbench", "import-backend-ops", empty, "--out", tmp_path / "o")
    assert_one_line_error(code, err, "empty.txt", "no timed MUL_MAT_ID lines")
    broken = tmp_path / "broken.txt"
    broken.write_text("  MUL_MAT_ID(type_a=f16,type_b=f32,n_mats=x,n_used=8,b=0,m=1,n=1,k=1):  5 runs -  1.0 us/run\n")
    code, _, err = cli("microbench", "import-backend-ops", broken, "--out", tmp_path / "o")
    assert_one_line_error(code, err, "broken.txt", "line 1", "column 'n_mats'", "must be an integer")
    vulkan = tmp_path / "vk.txt"
    vulkan.write_text("Backend 1/1: SYCL0\n" + _line("f16", 1, 5.0) + "\n")
    code, _, err = cli("microbench", "import-backend-ops", vulkan, "--out", tmp_path / "o")
    assert_one_line_error(code, err, "SYCL0", "--backend")
    assert cli("microbench", "import-backend-ops", vulkan, "--backend", "cuda", "--out", tmp_path / "o")[0] == 0
    assert load_measurements(tmp_path / "o" / "measurements.parquet")["kernel"].to_list() == ["per_slot"]
    code, _, err = cli("microbench", "import-backend-ops", tmp_path / "missing.txt", "--out", tmp_path / "o2")
    assert_one_line_error(code, err, "missing.txt", "no such file")
