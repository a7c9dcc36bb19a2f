"""Corruptions of the surfaces of issue 26 for the fuzz suite (tests/test_input_fuzz.py): the
engine importers' text outputs, drafter specs and trees, acceptance options, a recorded run's
counts, the serving sections of a simulation config, the cache variables and output manifests.

A text case replaces one token of a valid document (a number, a word, a cell) with a hostile
value, or drops, doubles or truncates a line; a spec case does the same to a spec string. Each
boundary must read the case, or refuse it with a MoesimError of one line (naming the file where
there is one); any other exception fails the test, and nothing in the folder may change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from moesim.errors import MoesimError

HOSTILE = [
    "0", "-1", "1e999", "-1e999", "inf", "-inf", "nan", "NaN", "Infinity", "1.2.3", "²", "٣", "１２", "9" * 400, "", " ", "sixteen",
    "0x10", "1_000", "1e-400", "4294967296", "9223372036854775808", "-0", "+5", "5.", ".5", "1e308", "null", "true", "[]", "{}",
    "[" * 200 + "]" * 200, '"', "'", "|", ",", "\\", "\u202e", "\x00",
]  # fmt: skip
_TOKEN = re.compile(r"[^\s|,:;{}\[\]()'\"=]+")


@st.composite
def corrupted_text(draw: st.DrawFn, text: str) -> str:
    """`text` with one token replaced by a hostile or random value, or a line dropped, doubled or cut."""
    action = draw(st.sampled_from(["token", "token", "token", "token", "drop", "double", "cut"]))
    lines = text.splitlines(keepends=True)
    if action == "token":
        tokens = list(_TOKEN.finditer(text))
        match = tokens[draw(st.integers(0, len(tokens) - 1))]
        value = draw(st.one_of(st.sampled_from(HOSTILE), st.text(max_size=5), st.integers(-(2**70), 2**70).map(str)))
        return text[: match.start()] + value + text[match.end() :]
    i = draw(st.integers(0, len(lines) - 1))
    if action == "drop":
        return "".join(lines[:i] + lines[i + 1 :])
    if action == "double":
        return "".join(lines[: i + 1] + lines[i:])
    return text[: draw(st.integers(0, len(text)))]


@dataclass(frozen=True)
class TextKind:
    """A text input: its file name, its valid text, and the boundary reading the file."""

    name: str
    file: str
    text: str
    read: Callable[[Path], Any]


def check_text(kind: TextKind, folder: Path, text: str, snapshot: Callable[[Path], dict[str, Any]]) -> str:
    """Write `text` as the kind's file and read it: 'ok' or 'refused' (one line naming the file);
    any other exception, a changed folder or a temporary left fails."""
    path = folder / kind.file
    path.write_text(text, errors="surrogatepass")
    before = snapshot(folder)
    try:
        kind.read(path)
        outcome = "ok"
    except MoesimError as exc:
        message = str(exc)
        assert "\n" not in message and path.name in message, (kind.name, message)
        outcome = "refused"
    assert snapshot(folder) == before, kind.name
    assert not list(folder.rglob("*.part")), kind.name
    return outcome


def check_spec(read: Callable[[str], Any], spec: str) -> str:
    """Read a spec string: 'ok' or 'refused' (one line); any other exception fails."""
    try:
        read(spec)
        return "ok"
    except MoesimError as exc:
        assert "\n" not in str(exc), str(exc)
        return "refused"


MANIFEST_NAMES = st.one_of(
    st.sampled_from(["summary.json", "../victim.txt", "/tmp/victim.txt", "sub/x.json", ".hidden.json", "link.json", "victim.tex",
                     "requests.arrow", "x" * 300 + ".json", "a\x00b.json", "..", ".", "", "report"]),
    st.text(max_size=12),
)  # fmt: skip


@st.composite
def corrupted_manifest(draw: st.DrawFn, manifest: dict[str, Any]) -> str:
    """A moesim output manifest with entries added (hostile names, right or wrong digests), its
    format or structure changed, or not JSON at all."""
    doc = json.loads(json.dumps(manifest))
    action = draw(st.sampled_from(["file", "file", "folder", "format", "structure", "text"]))
    if action == "file":
        doc["files"][draw(MANIFEST_NAMES)] = draw(st.sampled_from(["right", "0" * 64, "zz", 7, None]))
    elif action == "folder":
        doc["folders"].append(draw(st.one_of(MANIFEST_NAMES, st.integers())))
    elif action == "format":
        doc["format"] = draw(st.sampled_from(["moesim-outputs/1", "moesim-outputs/3", "", None, 2]))
    elif action == "structure":
        doc[draw(st.sampled_from(["files", "folders", "extra"]))] = draw(st.sampled_from([[], {}, "x", None, [["a"]]]))
    else:
        return draw(st.sampled_from(["", "{", "[" * 100, "null", "[]", '{"format": NaN}']))
    return json.dumps(doc)


# ---- the valid documents ----------------------------------------------------------------------

LLAMA_BENCH_MD = """\
| model                          |       size |     params | backend    | ngl | n_ubatch |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | --: | -------: | --------------: | -------------------: |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CUDA       |  99 |        8 |           pp512 |        512.34 ± 2.10 |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CUDA       |  99 |      512 |  pp512 @ d4096 |       3012.10 ± 11.0 |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CUDA       |  99 |      512 |           tg128 |        150.00 ± 0.50 |

build: 050fc7f3 (7123)
"""
RECORDS = [
    {"build_commit": "050fc7f3", "build_number": 7123, "gpu_info": "NVIDIA GeForce RTX 3090", "backends": "CUDA",
     "model_type": "deepseek2 16B Q4_0", "n_batch": 2048, "n_ubatch": 8, "n_prompt": 512, "n_gen": 0, "n_depth": 0,
     "avg_ns": 999315000, "avg_ts": 512.342},
    {"build_commit": "050fc7f3", "build_number": 7123, "gpu_info": "NVIDIA GeForce RTX 3090", "backends": "CUDA",
     "model_type": "deepseek2 16B Q4_0", "n_batch": 2048, "n_ubatch": 512, "n_prompt": 0, "n_gen": 128, "n_depth": 0,
     "avg_ns": 853333333, "avg_ts": 150.0},
]  # fmt: skip
LLAMA_BENCH_CSV = ",".join(RECORDS[0]) + "\n" + "".join(",".join(f'"{v}"' for v in r.values()) + "\n" for r in RECORDS)
BATCHED_TABLE = (
    "main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0\n\n"
    "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
    "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
    "|   128 |     64 |    1 |    192 |    0.081 |  1580.25 |    0.375 |   170.90 |    0.456 |   421.05 |\n"
    "|   128 |     64 |    9 |   1728 |    0.502 |  2294.82 |    2.257 |   255.20 |    2.759 |   626.31 |\n"
)
BATCHED_JSONL = (
    '{"pp": 128, "tg": 64, "pl": 1, "n_kv": 192, "t_pp": 0.081, "speed_pp": 1580.25, "t_tg": 0.375, "speed_tg": 170.9}\n'
    '{"pp": 128, "tg": 64, "pl": 9, "n_kv": 1728, "t_pp": 0.502, "speed_pp": 2294.82, "t_tg": 2.257, "speed_tg": 255.2}\n'
)
BENCHMARK_MOE = (
    "Namespace(model='mistralai/Mixtral-8x7B-v0.1', tp_size=2, enable_expert_parallel=False, dtype='auto', tune=False)\n"
    "Batch size: 1, config: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 32, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 1, 'SPLIT_K': 1}\n"
    "Kernel time: 99.00 us\n"
    "Batch size: 32, config: {'BLOCK_SIZE_M': 64, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 32, 'GROUP_SIZE_M': 8, 'SPLIT_K': 1}\n"
    "Kernel time: 447.00 us\n"
)
BACKEND_OPS = (
    "Backend 1/2: CUDA0\n  Device description: NVIDIA GeForce RTX 4090\n"
    "  MUL_MAT_ID(type_a=q4_0,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=1,k=2048):      1000 runs -    20.50 us/run - 25.2 MFLOP/run\n"
    "  MUL_MAT_ID(type_a=q4_0,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=8,k=2048):      1000 runs -    48.90 us/run - 201 MFLOP/run\n"
    "  MUL_MAT_ID(type_a=f16,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=32,k=2048,o=2):   500 runs -    80.00 us/run - 805 MFLOP/run\n"
)
BACKEND_OPS_SQL = (
    "INSERT INTO test_backend_ops (op_name, op_params, supported, time_us, n_runs, backend_name, device_description) VALUES "
    "('MUL_MAT_ID', 'type_a=q4_0,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=8,k=2048', 1, 48.9, 2046, 'CUDA0', 'RTX 3090');\n"
    "INSERT INTO test_backend_ops (op_name, op_params, supported, time_us, n_runs, backend_name, device_description) VALUES "
    "('MUL_MAT_ID', 'type_a=f16,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=32,k=2048,o=2', 1, 80.0, 10, 'CUDA0', 'RTX 3090');\n"
)
ACCEPTED_RUN = "seq,accepted,drafted\n0,1,4\n0,4,4\n0,0,4\n1,2,4\n1,3,4\n"
DRAFTER_SPECS = [
    "eagle3,topk=4,tokens=8", "eagle3,paths=[[0],[0,0],[0,1]]", "dflash:5", "fixed:5", "ngram:3", "eagle3:32000", "mtp",
    "medusa,topk=2", "suffix:1.5", "qwen3-0.6b",
]  # fmt: skip
ACCEPT_OPTIONS = ["2.4@3", "1.8@2", "3.5@7"]
DEPTH_RATES = ["0.8,0.6,0.5", "0.9", "0.7,0.7"]
SERVING = {
    "run": {"seed": 3, "requests": 3},
    "workload": {"prompt_tokens": 16, "output_tokens": 24},
    "arrivals": {"kind": "poisson", "rate_per_s": 50.0},
    "batching": {"max_batch": 4, "chunked_prefill": True, "token_budget": 64},
    "memory": {"block_tokens": 16, "pages": 40, "preemption": "recompute"},
    "cost": {"kind": "table", "target_us": [1000.0, 1200.0, 1350.0, 1500.0, 1650.0], "draft_step_us": 30.0},
    "acceptance": {"model": "geometric", "alpha": 0.7},
    "policy": {"name": "static", "k": 3},
    "study": {"batches": [1, 2], "workloads": {"a": {"model": "geometric", "alpha": 0.6}}, "policies": [{"name": "static", "k": 2}]},
}
CACHE_VALUES = ["", "0", "0.5", "64", "-1", "nan", "inf", "1e400", "²", "1" * 500, "ten", "1e9", "\x00", "9" * 20]
