"""Importers of benchmark outputs: small hand-written examples of each format, their scopes and
times by hand, the shared public table, and one-line errors for bad tables."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import polars as pl
import pytest
from conftest import REPO, assert_one_line_error

from moesim.errors import InputError
from moesim.hw_profiles.importers import TABLE_FORMATS, ImportOptions, import_table, parse_rows

PUBLIC = REPO / "data" / "public-bench" / "moe_pass_times.csv"

MARKDOWN = """\
| model                          |       size |     params | backend    | ngl | n_ubatch |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | --: | -------: | --------------: | -------------------: |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CUDA       |  99 |        1 |           pp512 |        101.23 ± 0.45 |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CUDA       |  99 |        8 |           pp512 |        512.34 ± 2.10 |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CUDA       |  99 |      512 |  pp512 @ d4096 |       3012.10 ± 11.0 |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CUDA       |  99 |      512 |           tg128 |        150.00 ± 0.50 |

build: 050fc7f3 (7123)
"""

FIELDS = "build_commit,build_number,gpu_info,backends,model_type,n_batch,n_ubatch,n_prompt,n_gen,n_depth,avg_ns,avg_ts"
RECORDS = [
    {"build_commit": "050fc7f3", "build_number": 7123, "gpu_info": "NVIDIA GeForce RTX 3090", "backends": "CUDA",
     "model_type": "deepseek2 16B Q4_0", "n_batch": 2048, "n_ubatch": 8, "n_prompt": 512, "n_gen": 0, "n_depth": 0,
     "avg_ns": 999315000, "avg_ts": 512.342},
    {"build_commit": "050fc7f3", "build_number": 7123, "gpu_info": "NVIDIA GeForce RTX 3090", "backends": "CUDA",
     "model_type": "deepseek2 16B Q4_0", "n_batch": 2048, "n_ubatch": 512, "n_prompt": 0, "n_gen": 128, "n_depth": 0,
     "avg_ns": 853333333, "avg_ts": 150.0},
]  # fmt: skip


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_format_is_registered_once() -> None:
    assert TABLE_FORMATS.names() == ["public-bench", "llama-bench-csv", "llama-bench-json", "llama-bench-jsonl", "llama-batched-bench",
                                 "benchmark-moe", "test-backend-ops", "llama-bench"]  # fmt: skip


def test_llama_bench_markdown_scopes_and_times(tmp_path: Path) -> None:
    fmt, frame = import_table(_write(tmp_path, "b.md", MARKDOWN), options=ImportOptions(device="RTX 3090"))
    assert fmt == "llama-bench" and frame["scope"].unique().to_list() == ["pass"]
    assert frame["model"].unique().to_list() == ["qwen3-30b-a3b"] and frame["dtype"][0] == "Q4_K"
    rows = frame.to_dicts()
    one, eight, deep, decode = rows
    assert one["time_us"] == pytest.approx(1 / 101.23 * 1e6) and one["passes"] == 512
    assert one["context_tokens"] == pytest.approx(1 * (512 + 1) / 2) and one["head_share"] == pytest.approx(1 / 512)
    assert eight["time_us"] == pytest.approx(8 / 512.34 * 1e6) and eight["passes"] == 64
    assert deep["n_tokens"] == 512 and deep["passes"] == 1 and deep["context_tokens"] == pytest.approx(4096 + (512 + 1) / 2)
    assert decode["n_tokens"] == 1 and decode["passes"] == 128 and decode["head_share"] == 1.0
    assert decode["time_us"] == pytest.approx(1e6 / 150.0) and decode["context_tokens"] == pytest.approx(129 / 2)
    assert one["engine_version"] == "050fc7f3 (b7123)" and one["device"] == "RTX 3090"


def test_compare_layout_has_one_variant_per_column_and_refuses_to_mix(tmp_path: Path) -> None:
    text = (
        "| Model | Microbatch size | Test | t/s master | t/s PR | Speedup |\n|---|--:|---|--:|--:|--:|\n"
        "| deepseek2 16B Q4_0 | 1 | pp512 | 180.5 | 181.0 | 1.00 |\n| deepseek2 16B Q4_0 | 2 | pp512 | 79.0 | 181.0 | 2.29 |\n"
    )
    path = _write(tmp_path, "cmp.md", text)
    with pytest.raises(InputError, match=r"mixes variants .*master.*PR"):
        import_table(path, options=ImportOptions(device="RTX 3090"))
    _, frame = import_table(path, options=ImportOptions(device="RTX 3090", filters=("variant=PR",)))
    assert frame["time_us"].to_list() == pytest.approx([1e6 / 181.0, 2e6 / 181.0])


def test_csv_json_jsonl_give_the_same_rows(tmp_path: Path) -> None:
    csv_text = FIELDS + "\n" + "\n".join(",".join(f'"{r[f]}"' for f in FIELDS.split(",")) for r in RECORDS) + "\n"
    json_text = json.dumps(RECORDS, indent=4)
    jsonl_text = "\n".join(json.dumps(r) for r in RECORDS) + "\n"
    frames = {}
    for name, text in (("b.csv", csv_text), ("b.json", json_text), ("b.jsonl", jsonl_text)):
        fmt, frames[name] = import_table(_write(tmp_path, name, text))
        assert fmt == f"llama-bench-{name.split('.')[1]}"
    same = ["n_tokens", "time_us", "passes", "context_tokens", "head_share", "model", "dtype", "device", "engine", "engine_version"]
    assert frames["b.csv"].select(same).equals(frames["b.json"].select(same)) and frames["b.json"].select(same).equals(
        frames["b.jsonl"].select(same)
    )
    rows = frames["b.csv"].to_dicts()
    assert rows[0]["time_us"] == pytest.approx(999315000 / 1e3 / 64) and rows[0]["device"] == "NVIDIA GeForce RTX 3090"
    assert rows[1]["time_us"] == pytest.approx(853333333 / 1e3 / 128) and rows[1]["n_tokens"] == 1


def test_batched_bench_table_and_jsonl(tmp_path: Path) -> None:
    table = (
        "main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0\n\n"
        "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
        "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
        "|   128 |     64 |    1 |    192 |    0.081 |  1580.25 |    0.375 |   170.90 |    0.456 |   421.05 |\n"
        "|   128 |     64 |    9 |   1728 |    0.502 |  2294.82 |    2.257 |   255.20 |    2.759 |   626.31 |\n"
    )
    jsonl = '{"pp": 128, "tg": 64, "pl": 9, "n_kv": 1728, "t_pp": 0.502, "speed_pp": 2294.82, "t_tg": 2.257, "speed_tg": 255.2}\n'
    options = ImportOptions(model="qwen3-30b-a3b", device="RX 7900 XTX", weight_format="Q4_K_M")
    _, frame = import_table(_write(tmp_path, "bb.txt", table), options=options)
    nine = frame.to_dicts()[1]
    assert nine["n_tokens"] == 9 and nine["passes"] == 64 and nine["time_us"] == pytest.approx(2.257e6 / 64)
    assert nine["context_tokens"] == pytest.approx(9 * (128 + 65 / 2)) and nine["logit_rows"] == 9 and nine["sequences"] == 9
    fmt, frame = import_table(_write(tmp_path, "bb.jsonl", jsonl), options=options)
    assert fmt == "llama-batched-bench" and frame["time_us"][0] == pytest.approx(2.257e6 / 64)
    with pytest.raises(InputError, match="--model PRESET and --format"):
        import_table(tmp_path / "bb.txt", options=ImportOptions(device="x"))


INSERT = "INSERT INTO test_backend_ops (op_name, op_params, supported, time_us, n_runs, backend_name, device_description) VALUES "
GPU = "NVIDIA GeForce RTX 3090"


def test_backend_ops_sql_and_fused_cases(tmp_path: Path) -> None:
    sql = (
        "CREATE TABLE IF NOT EXISTS test_backend_ops (op_name TEXT, op_params TEXT, supported INTEGER, time_us REAL, n_runs INTEGER, "
        "backend_name TEXT, device_description TEXT);\n"
        f"{INSERT}('MUL_MAT_ID', 'type_a=q4_0,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=8,k=2048', 1, 48.9, 2046, 'CUDA0', '{GPU}');\n"
        f"{INSERT}('MUL_MAT_ID', 'type_a=f16,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=32,k=2048,o=2', 1, 80.0, 10, 'CUDA0', '{GPU}');\n"
    )
    fmt, frame = import_table(_write(tmp_path, "ops.sql", sql))
    assert fmt == "test-backend-ops" and frame["device"].unique().to_list() == ["NVIDIA GeForce RTX 3090"]
    assert frame["time_us_matrix"].to_list() == pytest.approx([48.9, 40.0])  # o = 2 chained products: per product
    assert frame["time_us"].to_list() == pytest.approx([3 * 48.9, 120.0]) and frame["scope"].unique().to_list() == ["op"]


def test_benchmark_moe_output(tmp_path: Path) -> None:
    text = (
        "Namespace(model='mistralai/Mixtral-8x7B-v0.1', tp_size=2, enable_expert_parallel=False, dtype='auto', tune=False)\n"
        "Batch size: 1, config: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 32, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 1, 'SPLIT_K': 1}\n"
        "Kernel time: 99.00 us\n"
        "Batch size: 32, config: {'BLOCK_SIZE_M': 64, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 32, 'GROUP_SIZE_M': 8, 'SPLIT_K': 1}\n"
        "Kernel time: 447.00 us\n"
    )
    fmt, frame = import_table(_write(tmp_path, "moe.txt", text), options=ImportOptions(device="NVIDIA H20"))
    assert fmt == "benchmark-moe" and frame["kernel"].to_list() == ["dedup_fused_bm16", "dedup_fused_bm64"]
    assert frame["expert_intermediate"].unique().to_list() == [7168] and frame["dtype"][0] == "BF16"  # tp 2 shards the intermediate
    assert frame["time_us"].to_list() == [99.0, 447.0] and frame["n_tokens"].to_list() == [1, 32]
    with pytest.raises(InputError, match="does not name the device"):
        import_table(tmp_path / "moe.txt")


def test_public_table_rows_and_filters() -> None:
    assert parse_rows("331-333,340") == (331, 332, 333, 340)
    _, vulkan = import_table(PUBLIC, options=ImportOptions(rows=tuple(range(331, 341))))
    assert vulkan["engine"].unique().to_list() == ["llama.cpp Vulkan"] and vulkan["n_tokens"].to_list() == [
        1,
        2,
        4,
        8,
        9,
        12,
        16,
        24,
        32,
        64,
    ]
    assert vulkan["time_us"][4] == pytest.approx(9 / 255.19 * 1e6, rel=1e-3)  # B / aggregate S_TG
    _, vllm = import_table(PUBLIC, options=ImportOptions(filters=("device=NVIDIA H200", "variant=default config")))
    assert vllm.height == 18 and vllm["scope"].unique().to_list() == ["op"] and vllm["hidden"][0] == 2816
    assert vllm["time_us"][0] == pytest.approx(189.2)
    _, ops = import_table(PUBLIC, options=ImportOptions(rows=(309, 311)))
    assert ops["time_us"][0] == pytest.approx(3 * 2 * 768 * 2048 * 32 * 8 / 0.40e6)  # TFLOPS -> µs, x3 matrices
    with pytest.raises(InputError, match=r"mixes .*devices"):
        import_table(PUBLIC, options=ImportOptions(filters=("model=deepseek2 16B Q4_0", "variant=master")))


def _bad_public(tmp_path: Path) -> Path:
    """The public table with row 331's unit blanked and row 332's model unknown."""
    rows = list(csv.reader(PUBLIC.open()))
    header = rows[0]
    rows[331][header.index("unit")] = ""
    rows[332][header.index("model")] = "Mystery-MoE 7B Q4_0"
    path = tmp_path / "public.csv"
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return path


@pytest.mark.parametrize(
    ("rows", "fragments"),
    [
        ("331", ("row 331", "'unit'", "empty")),
        ("332", ("row 332", "unknown model", "Mystery-MoE")),
        ("340,484", ("mixes 2 devices",)),
        ("462", ("row 462", "GB/s effective")),
    ],
)
def test_bad_public_rows_are_one_line(tmp_path: Path, cli, rows: str, fragments: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("profile", "import", _bad_public(tmp_path), "--out", tmp_path / "t.csv", "--rows", rows)
    assert_one_line_error(code, err, *fragments)
    assert not (tmp_path / "t.csv").exists()


def test_unknown_layouts_are_one_line(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    weird = _write(tmp_path, "weird.md", "| name | speed |\n|---|---|\n| a | 1 |\n")
    code, _, err = cli("profile", "import", weird, "--out", tmp_path / "t.csv")
    assert_one_line_error(code, err, "weird.md", "unknown table layout")
    bad_md = _write(tmp_path, "bad.md", "| model | size | test |\n|---|---|---|\n| deepseek2 16B Q4_0 | 1 GiB | pp512 |\n")
    code, _, err = cli("profile", "import", bad_md, "--out", tmp_path / "t.csv", "--device", "RTX 3090")
    assert_one_line_error(code, err, "bad.md", "unknown column layout", "t/s")
    unknown_model = _write(tmp_path, "m.md", MARKDOWN.replace("qwen3moe 30B.A3B", "zebra 7B"))
    code, _, err = cli("profile", "import", unknown_model, "--out", tmp_path / "t.csv", "--device", "RTX 3090")
    assert_one_line_error(code, err, "m.md", "unknown model", "zebra 7B")
    csv_shaped = _write(tmp_path, "other.csv", "a,b\n1,2\n")
    code, _, err = cli("profile", "import", csv_shaped, "--out", tmp_path / "t.csv")
    assert_one_line_error(code, err, "other.csv", "unknown table layout")


def test_import_cli_writes_a_contract_table(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "vulkan.parquet"
    code, stdout, err = cli("profile", "import", PUBLIC, "--rows", "331-340", "--out", out)
    assert code == 0, err and "10 rows of public-bench" in stdout
    frame = pl.read_parquet(out)
    assert frame.height == 10 and set(frame.columns) >= {"kernel", "n_tokens", "time_us", "scope", "passes", "context_tokens", "source_row"}
    assert frame["source_row"].to_list() == list(range(331, 341)) and all(math.isfinite(t) for t in frame["time_us"])
