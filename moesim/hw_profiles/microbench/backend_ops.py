"""Import llama.cpp's own `test-backend-ops perf -o MUL_MAT_ID` output as a measurement table.

A source build of llama.cpp prints, per backend, one console line per perf case:

    Backend 1/2: CUDA0
      Device description: NVIDIA GeForce RTX 4090
      MUL_MAT_ID(type_a=q4_0,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=32,k=2048):   1234 runs -   81.05 us/run - ...

A case is ONE expert matrix (m×k per expert, E = n_mats, top-k = n_used) multiplied for n tokens;
`us/run` is a mean over runs. Each token's experts are a random permutation prefix drawn by the
tool (independent uniform top-k sets, not printed), so the routing features are expectations:
distinct experts E·(1 − (1 − k/E)^n), the largest expert load averaged over seeded draws of the
same routing (`features` = "expected"). A SwiGLU expert of hidden k and intermediate m is three
such matrices of equal bytes (gate, up: m×k; down: k×m), so a row's `time_us` is 3 × the measured
time, as one layer's expert operation (SwiGLU and the combine excluded); `time_us_matrix` keeps
the measurement. Types without a byte size in moesim (i-quants) are skipped and counted.

Also read: the `--output sql` form (`INSERT INTO test_backend_ops (...) VALUES (...);` lines,
which name the device in every row), and fused cases (`o=N`: N chained MUL_MAT_IDs in one timed
graph, `time_us_matrix` = time / N, the parameters kept in `op_params`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import InputError
from moesim.hw_profiles.microbench.llamacpp_kernels import LLAMACPP_BACKENDS, llamacpp_family
from moesim.hw_profiles.microbench.routing import pass_features, routing_ids
from moesim.hw_profiles.microbench.table import MoeShape, TimingSummary, measurement_row
from moesim.kernels.features import RoutingFeatures, uniform_distinct_experts
from moesim.models import WEIGHT_FORMATS
from moesim.parsing import parse_float, parse_int

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BACKEND = re.compile(r"^Backend \d+/\d+: (?P<name>\S+)")
_DESCRIPTION = re.compile(r"^\s*Device description: (?P<description>.+?)\s*$")
_CASE = re.compile(r"^\s*MUL_MAT_ID\((?P<params>[^)]*)\):\s*(?P<runs>\d+) runs -\s*(?P<us>[0-9.]+) us/run")
_SQL_VALUE = re.compile(r"\s*(?:'((?:[^']|'')*)'|([^,]*))\s*(,|$)")
_SQL = re.compile(r"^\s*INSERT INTO test_backend_ops \((?P<columns>[^)]*)\) VALUES \((?P<values>.*)\);\s*$")
_PARAMS = ("type_a", "type_b", "n_mats", "n_used", "b", "m", "n", "k")
MAX_DIM = 1 << 20  # a matrix dimension (m, k) of a case
MAX_CASE_TOKENS = 1 << 16  # tokens (n) of one case: its expected routing is drawn EXPECTATION_DRAWS times
_BOUNDS = {"b": (0, 1), "n_mats": (1, 1 << 16), "n_used": (1, 1 << 16), "n": (1, None)}
EXPECTATION_DRAWS = 400


@dataclass(frozen=True)
class MulMatIdCase:
    """One timed MUL_MAT_ID perf case."""

    backend_name: str
    device: str
    type_a: str
    n_mats: int
    n_used: int
    broadcast_input: bool
    m: int
    n: int
    k: int
    runs: int
    time_us: float
    params: str


def mul_mat_id_case(params: str, backend_name: str, device: str, runs: int, time_us: float, where: str) -> MulMatIdCase:
    """One case from its printed parameters; a fused case of o chained products counts once per product."""
    values = dict(item.partition("=")[::2] for item in params.split(","))
    missing = [p for p in _PARAMS if p not in values]
    if missing:
        raise InputError(f"{where}: MUL_MAT_ID case lacks '{missing[0]}' ({params})")
    numbers = {
        p: parse_int(values[p], f"{where}: column '{p}'", *_BOUNDS.get(p, (1, MAX_DIM))) for p in ("n_mats", "n_used", "b", "m", "n", "k")
    }
    chained = parse_int(values.get("o", 1), f"{where}: column 'o'", 1, 64)
    if numbers["n"] > MAX_CASE_TOKENS:
        ids = float(numbers["n"]) * numbers["n_used"] * EXPECTATION_DRAWS
        raise InputError(
            f"{where}: column 'n': {numbers['n']} tokens in one case, more than {MAX_CASE_TOKENS} (its expected routing would "
            f"draw {ids:.3g} expert ids, {ids * 8 / 1e9:.3g} GB)"
        )
    if numbers["n_used"] > numbers["n_mats"]:
        raise InputError(f"{where}: column 'n_used': {numbers['n_used']} experts used of {numbers['n_mats']}")
    return MulMatIdCase(
        backend_name=backend_name,
        device=device,
        type_a=values["type_a"],
        n_mats=numbers["n_mats"],
        n_used=numbers["n_used"],
        broadcast_input=bool(numbers["b"]),
        m=numbers["m"],
        n=numbers["n"],
        k=numbers["k"],
        runs=runs,
        time_us=time_us / max(chained, 1),
        params=params,
    )


def _sql_values(text: str) -> list[str]:
    """The values of one SQL VALUES list: 'quoted' strings (with '' escapes) and bare numbers."""
    values, position = [], 0
    while True:
        match = _SQL_VALUE.match(text, position)
        quoted, bare, separator = match.groups()  # type: ignore[union-attr]
        values.append(quoted.replace("''", "'") if quoted is not None else bare.strip())
        if not separator:
            return values
        position = match.end()  # type: ignore[union-attr]


def parse_backend_ops_perf(text: str, source: str = "log") -> list[MulMatIdCase]:
    """Every timed MUL_MAT_ID case (console lines, or SQL rows of `--output sql`; not
    MUL_MAT_ID_FUSION, not 'not supported'), with its backend and device."""
    cases = []
    backend_name = device = ""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _ANSI.sub("", raw)
        where = f"{source}: line {number}"
        if match := _BACKEND.match(line):
            backend_name = device = match["name"]
        elif match := _DESCRIPTION.match(line):
            device = match["description"]
        elif match := _CASE.match(line):
            runs = parse_int(match["runs"], f"{where}: column 'runs'", 0, 1 << 40)
            time_us = parse_float(match["us"], f"{where}: column 'us/run'", 0.0, 1e12)
            cases.append(mul_mat_id_case(match["params"], backend_name, device, runs, time_us, where))
        elif match := _SQL.match(line):
            columns = [c.strip() for c in match["columns"].split(",")]
            row = dict(zip(columns, _sql_values(match["values"]), strict=False))
            if row.get("op_name") != "MUL_MAT_ID" or row.get("supported") in ("0", "false") or not row.get("time_us"):
                continue
            runs = parse_int(row.get("n_runs", "0"), f"{where}: column 'n_runs'", 0, 1 << 40)
            time_us = parse_float(row["time_us"], f"{where}: column 'time_us'", 0.0, 1e12)
            name = row.get("backend_name", "")
            cases.append(mul_mat_id_case(row.get("op_params", ""), name, row.get("device_description") or name, runs, time_us, where))
    return cases


def backend_of(backend_name: str, where: str = "test-backend-ops") -> str:
    """moesim's backend for a ggml backend name (CUDA0 -> cuda, Metal/MTL0 -> metal, CPU -> cpu)."""
    name = backend_name.lower()
    for prefix, backend in (("cuda", "cuda"), ("metal", "metal"), ("mtl", "metal"), ("cpu", "cpu"), ("vulkan", "vulkan")):
        if name.startswith(prefix):
            return backend
    raise InputError(f"{where}: cannot tell the backend of '{backend_name}' (pass --backend {'|'.join(LLAMACPP_BACKENDS)})")


@cache
def expected_uniform_features(n_tokens: int, experts: int, top_k: int, seed: int) -> tuple[RoutingFeatures, float]:
    """Rounded expected features of independent uniform top-k routing, and the exact E[U]."""
    expected_distinct = float(uniform_distinct_experts(n_tokens, experts, top_k))
    loads = [
        int(pass_features(routing_ids("uniform", n_tokens, experts, top_k, seed + i), experts).max_tokens_per_expert)
        for i in range(EXPECTATION_DRAWS)
    ]
    features = RoutingFeatures(
        n_tokens=np.asarray(n_tokens),
        slots=np.asarray(n_tokens * top_k),
        distinct_experts=np.asarray(max(1, round(expected_distinct))),
        max_tokens_per_expert=np.asarray(max(1, round(float(np.mean(loads))))),
    )
    return features, expected_distinct


@dataclass
class BackendOpsImport:
    """Rows and provenance of one imported log."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)


def import_backend_ops(path: Path, backend: str | None = None, per_slot_max_tokens: int | None = None, seed: int = 0) -> BackendOpsImport:
    """Rows (contract 3) for every MUL_MAT_ID case of a `test-backend-ops perf` console log."""
    if backend is not None and backend not in LLAMACPP_BACKENDS:
        raise InputError(f"--backend '{backend}': must be one of {', '.join(LLAMACPP_BACKENDS)}")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text log of test-backend-ops") from None
    cases = parse_backend_ops_perf(text, str(path))
    if not cases:
        raise InputError(f"{path}: no timed MUL_MAT_ID lines (run: test-backend-ops perf -o MUL_MAT_ID -b <backend>)")
    result = BackendOpsImport()
    skipped: dict[str, int] = {}
    for case in cases:
        weight_format = case.type_a.upper()
        if weight_format not in WEIGHT_FORMATS:
            skipped[case.type_a] = skipped.get(case.type_a, 0) + 1
            continue
        case_backend = backend or backend_of(case.backend_name, str(path))
        name = f"mul_mat_id E{case.n_mats} k{case.n_used} {case.m}x{case.k}"
        shape = MoeShape(name, case.k, case.m, case.n_mats, case.n_used, weight_format)
        features, expected_distinct = expected_uniform_features(case.n, case.n_mats, case.n_used, seed)
        row = measurement_row(
            kernel=llamacpp_family(case_backend, case.n, per_slot_max_tokens),
            engine=f"llama.cpp test-backend-ops ({case.backend_name})",
            device=case.device,
            shape=shape,
            routing="uniform",
            features=features,
            timing=TimingSummary(3 * case.time_us, None, None, None, case.runs),
            extra={
                "features": "expected",
                "distinct_experts_expected": expected_distinct,
                "time_us_matrix": case.time_us,
                "broadcast_input": case.broadcast_input,
                "op_params": case.params,
                "timing": "test-backend-ops mean over runs, x3 matrices",
            },
        )
        result.rows.append(row)
    result.provenance = {
        "runner": "moesim.hw_profiles.microbench.backend_ops",
        "method": __doc__,
        "source": path.name,
        "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "cases": len(cases),
        "skipped_types": skipped,
        "per_slot_max_tokens": per_slot_max_tokens,
    }
    return result
