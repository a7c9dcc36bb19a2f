"""Every example of issue 26 as a named case: the hostile input gives one line on stderr and exit
code 2, changes no file, and its valid neighbour (the same command with the value a user would
mean) still succeeds. (`best-draft --batch 4` is the engine-time issue's.)"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, REPO, assert_one_line_error

from moesim.errors import InputError
from moesim.hw_profiles.microbench.routing import parse_pass_sizes
from moesim.models import load_preset
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Uniform, synthesize

SIM = (REPO / "examples" / "sim-selfcheck.toml").read_text()
TREE_SIM = """[run]
seed = 3
requests = 2
[workload]
prompt_tokens = 16
output_tokens = 40
[arrivals]
kind = "closed"
concurrency = 1
[batching]
max_batch = 1
[trace]
synth = "uniform"
tokens = 256
seqs = 2
[cost]
kind = "steptime"
[target]
model = "qwen3-30b-a3b"
profile = "nvidia-h200-vllm"
[drafter]
kind = "eagle3"
tree = "paths=[[0],[0,0],[0,1]]"
[acceptance]
model = "tree"
alpha = 0.7
[policy]
name = "static"
k = K
"""
MARKDOWN = """\
| model                          |       size |     params | backend    | ngl | n_ubatch |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | --: | -------: | --------------: | -------------------: |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CUDA       |  99 |        UBATCH |           TEST |        101.23 ± 0.45 |

build: 050fc7f3 (7123)
"""
RECORD = {
    "build_commit": "050fc7f3", "build_number": 7123, "gpu_info": "NVIDIA GeForce RTX 3090", "backends": "CUDA",
    "model_type": "deepseek2 16B Q4_0", "n_batch": 2048, "n_ubatch": 8, "n_prompt": 512, "n_gen": 0, "n_depth": 0,
    "avg_ns": 999315000, "avg_ts": 512.342,
}  # fmt: skip
FIELDS = list(RECORD)
MOE = (
    "Namespace(model='mistralai/Mixtral-8x7B-v0.1', tp_size=2, enable_expert_parallel=False, dtype='auto', tune=False)\n"
    "Batch size: 1, config: {'BLOCK_SIZE_M': @B@, 'BLOCK_SIZE_N': 32, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 1, 'SPLIT_K': 1}\n"
    "Kernel time: @T@ us\n"
)
BATCHED = (
    "main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0\n\n"
    "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
    "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
    "|   128 |   @TG@ |    9 |   1728 |    0.502 |  2294.82 |    2.257 |   255.20 |    2.759 |   626.31 |\n"
)
OPS = (
    "INSERT INTO test_backend_ops (op_name, op_params, supported, time_us, n_runs, backend_name, device_description) VALUES "
    "('MUL_MAT_ID', 'type_a=q4_0,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=N,k=2048', 1, 48.9, 2046, "
    "'CUDA0', 'NVIDIA GeForce RTX 3090');\n"
)


def _csv(record: dict[str, object]) -> str:
    return ",".join(FIELDS) + "\n" + ",".join(f'"{record[f]}"' for f in FIELDS) + "\n"


@dataclass(frozen=True)
class Example:
    """One example: the files it writes, the bad command line, the neighbour's; each names files
    relative to the test's folder ({trace}: a small trace)."""

    name: str
    files: dict[str, str]
    bad: tuple[str, ...]
    fragments: tuple[str, ...]
    good_files: dict[str, str] = field(default_factory=dict)
    good: tuple[str, ...] | None = None  # default: the bad command on the good files


BEST = ("best-draft", "--trace", "{trace}", "--profile", "nvidia-h200", "--alpha", "0.7")
IMPORT = ("profile", "import", "b.txt", "--out", "t.csv", "--device", "RTX 3090")
BATCHED_IMPORT = (*IMPORT, "--model", "qwen3-30b-a3b", "--format", "Q4_K_M")
DEEP_JSON = "[" * 100000 + "]" * 100000
ACCEPT = "seq,accepted,drafted\n0,1,4\n0,COUNT,4\n0,2,4\n"

EXAMPLES = [
    # the importers (issue: tracebacks on numbers real files can hold)
    Example(
        "llama-bench md n_ubatch 0",
        {"b.txt": MARKDOWN.replace("UBATCH", "0").replace("TEST", "pp512")},
        IMPORT,
        ("b.txt", "line 3", "n_ubatch"),
        {"b.txt": MARKDOWN.replace("UBATCH", "8").replace("TEST", "pp512")},
    ),
    Example(
        "llama-bench md pp0",
        {"b.txt": MARKDOWN.replace("UBATCH", "8").replace("TEST", "pp0")},
        IMPORT,
        ("b.txt", "line 3", "test"),
        {"b.txt": MARKDOWN.replace("UBATCH", "8").replace("TEST", "pp512")},
    ),
    Example(
        "llama-bench md test with a non-ASCII digit",
        {"b.txt": MARKDOWN.replace("UBATCH", "8").replace("TEST", "pp５12")},
        IMPORT,
        ("b.txt", "line 3", "test"),
        {"b.txt": MARKDOWN.replace("UBATCH", "8").replace("TEST", "pp512")},
    ),
    Example(
        "llama-bench csv n_ubatch 0",
        {"b.txt": _csv({**RECORD, "n_ubatch": 0})},
        IMPORT,
        ("b.txt", "line 2", "n_ubatch"),
        {"b.txt": _csv(RECORD)},
    ),
    Example(
        "llama-bench json 1e999",
        {"b.txt": json.dumps([RECORD]).replace("999315000", "1e999")},
        IMPORT,
        ("b.txt", "avg_ns", "finite"),
        {"b.txt": json.dumps([RECORD])},
    ),
    Example(
        "llama-bench json inf count",
        {"b.txt": json.dumps([RECORD]).replace('"n_prompt": 512', '"n_prompt": Infinity')},
        IMPORT,
        ("b.txt", "n_prompt"),
        {"b.txt": json.dumps([RECORD])},
    ),
    Example(
        "llama-bench jsonl deep JSON",
        {"b.txt": json.dumps(RECORD).replace('"n_depth": 0', f'"n_depth": {DEEP_JSON}') + "\n"},
        IMPORT,
        ("b.txt", "line 1", "nested"),
        {"b.txt": json.dumps(RECORD) + "\n"},
    ),
    Example(
        "llama-bench jsonl a count of thousands of digits",
        {"b.txt": json.dumps(RECORD).replace('"n_gen": 0', '"n_gen": ' + "9" * 3000) + "\n"},
        IMPORT,
        ("b.txt", "line 1"),
        {"b.txt": json.dumps(RECORD) + "\n"},
    ),
    Example(
        "benchmark_moe 1.2.3 us",
        {"b.txt": MOE.replace("@B@", "16").replace("@T@", "1.2.3")},
        IMPORT,
        ("b.txt", "line 3", "Kernel time"),
        {"b.txt": MOE.replace("@B@", "16").replace("@T@", "99.0")},
    ),
    Example(
        "benchmark_moe block size as a word",
        {"b.txt": MOE.replace("@B@", "'sixteen'").replace("@T@", "99.0")},
        IMPORT,
        ("b.txt", "line 2", "BLOCK_SIZE_M"),
        {"b.txt": MOE.replace("@B@", "16").replace("@T@", "99.0")},
    ),
    Example(
        "batched-bench inf count",
        {"b.txt": BATCHED.replace("@TG@", " inf")},
        BATCHED_IMPORT,
        ("b.txt", "line 5", "tg"),
        {"b.txt": BATCHED.replace("@TG@", "  64")},
    ),
    Example(
        "test-backend-ops n = 10^9",
        {"b.txt": OPS.replace("n=N", "n=1000000000")},
        ("profile", "import", "b.txt", "--out", "t.csv"),
        ("b.txt", "line 1", "column 'n'", "GB"),
        {"b.txt": OPS.replace("n=N", "n=8")},
    ),
    Example(
        "microbench import-backend-ops n = 10^9",
        {"b.txt": OPS.replace("n=N", "n=1000000000")},
        ("microbench", "import-backend-ops", "b.txt", "--out", "o"),
        ("b.txt", "column 'n'"),
        {"b.txt": OPS.replace("n=N", "n=8")},
    ),
    # TOML and spec strings
    Example(
        "TOML deeply nested arrays",
        {"s.toml": SIM + "\n[extra]\nx = " + "[" * 3000 + "]" * 3000 + "\n"},
        ("simulate", "s.toml", "--out", "o"),
        ("s.toml", "nested"),
        {"s.toml": SIM},
    ),
    Example(
        "TOML deeply nested tables",
        {"s.toml": SIM + "\n" + "\n".join("[" + ".".join(["a"] * i) + "]" for i in range(1, 80)) + "\n"},
        ("simulate", "s.toml", "--out", "o"),
        ("s.toml", "nested"),
        {"s.toml": SIM},
    ),
    Example(
        "TOML an integer of thousands of digits in an int field",
        {"s.toml": SIM.replace("seed = 7", "seed = " + "9" * 5000)},
        ("simulate", "s.toml", "--out", "o"),
        ("s.toml",),
        {"s.toml": SIM},
    ),
    Example(
        "TOML an integer of thousands of digits in a float field",
        {"s.toml": SIM.replace("alpha = 0.7", "alpha = " + "9" * 3000)},
        ("simulate", "s.toml", "--out", "o"),
        ("s.toml", "alpha"),
        {"s.toml": SIM},
    ),
    Example(
        "TOML pages = 2^63",
        {"s.toml": SIM + "\n[memory]\npages = 9223372036854775808\n"},
        ("simulate", "s.toml", "--out", "o"),
        ("s.toml", "memory.pages"),
        {"s.toml": SIM + "\n[memory]\npages = 300\n"},
    ),
    Example(
        "[memory] pages = 1 completes no request",
        {"s.toml": SIM + "\n[memory]\npages = 1\n"},
        ("simulate", "s.toml", "--out", "o"),
        ("s.toml", "memory.pages", "never run"),
        {"s.toml": SIM + "\n[memory]\npages = 300\n"},
    ),
    Example(
        "duration_s = 1e300",
        {"s.toml": SIM.replace("requests = 4", "requests = 0\nduration_s = 1e300")},
        ("simulate", "s.toml", "--out", "o"),
        ("s.toml", "duration_s"),
        {"s.toml": SIM.replace("requests = 4", "requests = 0\nduration_s = 0.5")},
    ),
    Example(
        "a study of 10^7 cells",
        {
            "s.toml": SIM
            + "\n[study]\nbatches = ["
            + ", ".join(str(b) for b in range(1, 10001))
            + "]\n"
            + '[study.workloads.a]\nmodel = "geometric"\nalpha = 0.7\n'
            + "".join(f'[[study.policies]]\nname = "static"\nk = {k % 4 + 1}\n' for k in range(1000))
        },
        ("simulate", "s.toml", "--out", "o"),
        ("s.toml", "study", "cells", "hours"),
        {
            "s.toml": SIM
            + '\n[study]\nbatches = [1]\n[study.workloads.a]\nmodel = "geometric"\nalpha = 0.7\n'
            + '[[study.policies]]\nname = "static"\nk = 2\n'
        },
    ),
    Example(
        "topk=²", {}, (*BEST, "--drafter", "eagle3,topk=²"), ("topk", "²"), good=(*BEST, "--drafter", "eagle3,topk=2", "--max-draft", "2")
    ),
    Example("dflash: with 400 digits", {}, (*BEST, "--drafter", "dflash:" + "9" * 400), ("dflash",), good=(*BEST, "--drafter", "dflash:5")),
    Example(
        "paths=[[0],[1e400]]",
        {},
        (*BEST, "--drafter", "eagle3,paths=[[0],[1e400]]"),
        ("paths",),
        good=(*BEST, "--drafter", "eagle3,paths=[[0],[1]]"),
    ),
    Example("fixed:inf", {}, (*BEST, "--drafter", "fixed:inf"), ("fixed:inf", "0..1000000000"), good=(*BEST, "--drafter", "fixed:5")),
    Example("fixed:1e308", {}, (*BEST, "--drafter", "fixed:1e308"), ("fixed:1e308",), good=(*BEST, "--drafter", "fixed:5")),
    # the README's tree and the trees shallower than k
    Example(
        "best-draft --max-draft deeper than a paths tree",
        {},
        (*BEST, "--drafter", "eagle3,paths=[[0],[0,0],[0,1]]", "--max-draft", "3"),
        ("--max-draft 3", "depth 2"),
        good=(*BEST, "--drafter", "eagle3,paths=[[0],[0,0],[0,1]]"),
    ),
    Example(
        "simulate with a paths tree shallower than k",
        {"s.toml": TREE_SIM.replace("K", "3")},
        ("simulate", "s.toml", "--out", "o"),
        ("s.toml", "policy", "depth 2"),
        {"s.toml": TREE_SIM.replace("K", "2")},
    ),
    # acceptance options
    Example(
        "--accept-len 2.4@1000000",
        {},
        (*BEST, "--accept-len", "2.4@1000000"),
        ("--accept-len", "1000000"),
        good=(*BEST, "--accept-len", "2.4@3"),
    ),
    Example("--accept-len 2.4@-1", {}, (*BEST, "--accept-len", "2.4@-1"), ("--accept-len", "-1"), good=(*BEST, "--accept-len", "2.4@3")),
    Example("--accept-len NaN", {}, (*BEST, "--accept-len", "nan@3"), ("--accept-len",), good=(*BEST, "--accept-len", "2.4@3")),
    Example("--depth-rates 1e400", {}, (*BEST, "--depth-rates", "0.8,1e400"), ("--depth-rates",), good=(*BEST, "--depth-rates", "0.8,0.6")),
    Example(
        "--accept-run negative counts",
        {"a.csv": ACCEPT.replace("COUNT", "-1")},
        (*BEST, "--accept-run", "a.csv"),
        ("a.csv", ">= 0"),
        {"a.csv": ACCEPT.replace("COUNT", "3")},
    ),
    Example(
        "--accept-run NaN counts",
        {"a.csv": ACCEPT.replace("COUNT", "NaN")},
        (*BEST, "--accept-run", "a.csv"),
        ("a.csv", "integer"),
        {"a.csv": ACCEPT.replace("COUNT", "3")},
    ),
    Example(
        "--accept-run strings as counts",
        {"a.csv": ACCEPT.replace("COUNT", "many")},
        (*BEST, "--accept-run", "a.csv"),
        ("a.csv", "integer"),
        {"a.csv": ACCEPT.replace("COUNT", "3")},
    ),
    Example(
        "--accept-run more accepted than drafted",
        {"a.csv": ACCEPT.replace("COUNT", "7")},
        (*BEST, "--accept-run", "a.csv"),
        ("a.csv", "more than the 4 tokens drafted"),
        {"a.csv": ACCEPT.replace("COUNT", "3")},
    ),
    Example(
        "--accept-run 10^9 drafted tokens",
        {"a.csv": ACCEPT.replace(",4\n", ",1000000000\n").replace("COUNT", "3")},
        (*BEST, "--accept-run", "a.csv"),
        ("a.csv", "1000000000"),
        {"a.csv": ACCEPT.replace("COUNT", "3")},
    ),
    # sizes of lists
    Example(
        "--rows 1-100000000000",
        {},
        ("profile", "import", str(DATA / "public-bench" / "moe_pass_times.csv"), "--out", "t.csv", "--rows", "1-100000000000"),
        ("--rows", "100,000,000,000 values"),
        good=("profile", "import", str(DATA / "public-bench" / "moe_pass_times.csv"), "--out", "t.csv", "--rows", "331-340"),
    ),
    Example(
        "--rows 1-1e11",
        {},
        ("profile", "import", str(DATA / "public-bench" / "moe_pass_times.csv"), "--out", "t.csv", "--rows", "1-1e11"),
        ("--rows", "1e11"),
        good=("profile", "import", str(DATA / "public-bench" / "moe_pass_times.csv"), "--out", "t.csv", "--rows", "331-340"),
    ),
    Example(
        "--pass-sizes 1-1e11",
        {},
        ("predict", "--trace", "{trace}", "--profile", "nvidia-h200", "--pass-sizes", "1-1e11"),
        ("--pass-sizes",),
        good=("predict", "--trace", "{trace}", "--profile", "nvidia-h200", "--pass-sizes", "1,2,4"),
    ),
    # inputs: profile import replaced the user's CSV
    Example(
        "profile import b.csv --out b.csv",
        {"b.csv": _csv(RECORD)},
        ("profile", "import", "b.csv", "--out", "b.csv"),
        ("b.csv", "is an input"),
        good=("profile", "import", "b.csv", "--out", "t.csv"),
    ),
]


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "t.arrow"
    write_trace(path, synthesize(load_preset("olmoe-1b-7b"), Uniform(), 64, 2, seed=3))
    return path


def _args(args: tuple[str, ...], trace: Path) -> list[str]:
    return [a.replace("{trace}", str(trace)) for a in args]


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_each_example_is_one_line_and_its_neighbour_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli, trace: Path, example: Example
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    for name, text in example.files.items():
        (tmp_path / name).write_text(text)
    before = _digests(tmp_path)
    code, _, err = cli(*_args(example.bad, trace))
    assert_one_line_error(code, err, *example.fragments)
    assert _digests(tmp_path) == before  # no file changed, none written, no temporary left
    for name, text in example.good_files.items():
        (tmp_path / name).write_text(text)
    code, _, err = cli(*_args(example.good or example.bad, trace))
    assert code == 0, err


def test_the_readme_tree_example_runs(cli, trace: Path) -> None:  # type: ignore[no-untyped-def]
    """`best-draft --drafter 'eagle3,paths=[[0],[0,0],[0,1]]'` (the README's static tree) ended in an
    IndexError: its draft lengths now stop at the tree's depth."""
    code, out, err = cli(*_args(BEST, trace), "--drafter", "eagle3,paths=[[0],[0,0],[0,1]]", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert len(result["relative_cost"]) == 3 and result["verify_tokens"] == [1, 2, 4]  # k = 0, 1, 2: the root, [0], then all three nodes


def test_pass_size_ranges_are_counted_before_they_are_listed() -> None:
    with pytest.raises(InputError, match=r"in 1\.\.65536, got 100000000000"):
        parse_pass_sizes("1-100000000000")
    with pytest.raises(InputError, match="names 65,536 values, more than 4,096"):
        parse_pass_sizes("1-65536")
    with pytest.raises(InputError, match="pass sizes"):
        parse_pass_sizes("1-1e11")
    assert parse_pass_sizes("1-4,8") == (1, 2, 3, 4, 8)
    assert np.array_equal(parse_pass_sizes("16,1-2"), [1, 2, 16])
