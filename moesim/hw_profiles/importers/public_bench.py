"""The shared public table (`data/public-bench/moe_pass_times.csv`): numbers copied from GitHub
pull requests and issues, one per row, with `source_url, repo, pr_or_issue, comment_author, date,
backend, device, model, model_arch, quant, test, ubatch, value, unit, variant, notes`.

Each row becomes a measurement of its scope: a llama-bench `ppN[@dD]` or `tgN` row (t/s) a whole
pass of `ubatch` tokens (time = ubatch / value); a llama-batched-bench row a decode pass of B
sequences (B / aggregate S_TG); a `benchmark_moe.py` row one MoE layer's fused operation (µs or
ms); a `test-backend-ops` MUL_MAT_ID row one expert matrix (TFLOPS → 2·m·k·n·n_used / rate, ×3
for a SwiGLU layer); an MLX `gather_qmm up+gate+down` row one MoE layer (ms per call or per
layer). Rows of other kinds (dense ops, rates without a time, tables that give no token count)
are refused: the table mixes 25 devices, many variants and kinds, so it is read through filters
(`--filter device=... --filter variant=...`, or row numbers), and what survives them must be
readable. Row numbers count from 1 after the header, as in the table's README.
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from moesim.errors import InputError, first_line
from moesim.filters import apply_filters, parse_filters
from moesim.hw_profiles.importers.names import ExpertGeometry, expert_geometry, resolve_formats, resolve_model
from moesim.hw_profiles.importers.rows import Measured, PassScope, decode_scope, prompt_scope
from moesim.hw_profiles.microbench.backend_ops import mul_mat_id_case
from moesim.models import load_preset

COLUMNS = ("source_url", "repo", "pr_or_issue", "comment_author", "date", "backend", "device", "model", "model_arch", "quant",
           "test", "ubatch", "value", "unit", "variant", "notes")  # fmt: skip
_LLAMA_TEST = re.compile(r"^(?P<kind>pp|tg)(?P<tokens>\d+)(?:\s*@\s*d(?P<depth>\d+))?(?:\s*\(.*\))?$")
_BATCHED = re.compile(r"llama-batched-bench.*-npp (?P<pp>\d+) -ntg (?P<tg>\d+)")
_MUL_MAT_ID = re.compile(r"MUL_MAT_ID\((?P<params>[^)]*)\)")
_PR = re.compile(r"^(?P<kind>PR|issue) (?P<number>#\d+)")
_TIME_UNITS = {"us": 1.0, "us/iter": 1.0, "us/run": 1.0, "ms": 1e3, "ms per call": 1e3, "ms per moe layer": 1e3, "ms/token": 1e3}


def engine_of(row: dict[str, str]) -> str:
    """The engine a row measured (its `backend` column mixes engines and their backends)."""
    backend, repo, variant = row["backend"], row["repo"], row["variant"]
    if backend.startswith("CUDA (Triton"):
        return "vLLM fused_moe (Triton)"
    if "MLX" in backend:
        inner = backend[backend.index("(") + 1 : -1]
        return f"{inner.split(',')[-1].strip().split()[0]} {backend.split()[0]}"
    if "aiter" in backend:
        return "aiter (ROCm)"
    fork = "ik_llama.cpp" if repo == "ikawrakow/ik_llama.cpp" and not variant.startswith("mainline llama.cpp") else "llama.cpp"
    return f"{fork} {backend}"


def _geometry(row: dict[str, str], where: str) -> ExpertGeometry:
    shape = expert_geometry(row["model"])
    if shape is not None:
        return shape
    preset = load_preset(resolve_model(row["model"], where))
    return ExpertGeometry(preset.hidden, preset.expert_intermediate, preset.experts, preset.top_k)


def _value(row: dict[str, str], where: str) -> float:
    try:
        value = float(row["value"])
    except ValueError:
        raise InputError(f"{where}: field 'value' is {row['value']!r}, expected a number") from None
    if not value > 0:
        raise InputError(f"{where}: field 'value' is {value:g}, expected a positive number")
    return value


def measured_of_row(row: dict[str, str], number: int, origin: str) -> Measured:
    """The measurement one row holds; one line naming the row and field when it holds none moesim reads."""
    where = f"{origin}: row {number}"
    unit, test = row["unit"].strip(), row["test"].strip()
    if not unit:
        raise InputError(f"{where}: field 'unit' is empty: a number without a unit is not a time")
    value = _value(row, where)
    try:
        ubatch = int(row["ubatch"])
    except ValueError:
        raise InputError(f"{where}: field 'ubatch' is {row['ubatch']!r}: no tokens per pass") from None
    common = {
        "device": row["device"],
        "engine": engine_of(row),
        "engine_version": f"{pr['kind']} {pr['number']} {row['variant']}" if (pr := _PR.match(row["pr_or_issue"])) else row["variant"],
        "variant": row["variant"],
        "source": row["source_url"],
        "source_row": number,
        "test": test,
    }
    llama, batched, mmid = _LLAMA_TEST.match(test), _BATCHED.search(test), _MUL_MAT_ID.search(test)
    if llama and unit == "t/s":
        tokens, depth = int(llama["tokens"]), int(llama["depth"] or 0)
        scope = prompt_scope(tokens, ubatch, depth) if llama["kind"] == "pp" else decode_scope(tokens, depth)
        if scope.n_tokens != ubatch:
            raise InputError(f"{where}: field 'ubatch' is {ubatch}, but test {test!r} runs passes of {scope.n_tokens} tokens")
        return _pass(row, where, ubatch / value * 1e6, scope, "ubatch / (t/s)", common)
    if batched and unit.startswith("t/s (aggregate"):
        scope = decode_scope(int(batched["tg"]), sequences=ubatch, prompt_tokens=int(batched["pp"]))
        return _pass(row, where, ubatch / value * 1e6, scope, "B / aggregate S_TG", common)
    if test.startswith("single-stream decode at depth") and unit in ("t/s", "ms/token"):
        depth = int(re.search(r"depth (\d+)", test)[1])  # type: ignore[index]
        time_us = value * 1e3 if unit == "ms/token" else 1e6 / value
        return _pass(row, where, time_us, PassScope(1, 1, depth + 1.0), unit, common)
    experts, _ = resolve_formats(row["quant"], where)
    if mmid and unit == "TFLOPS":
        case = mul_mat_id_case(mmid["params"], row["backend"], row["device"], 0, 0.0, where)
        if case.n != ubatch or re.search(r"\bo=(?!1\b)", mmid["params"]):
            raise InputError(f"{where}: field 'test' ({mmid['params']}) is not one product of n = ubatch ({ubatch}) tokens")
        matrix_us = 2.0 * case.m * case.k * case.n * case.n_used / (value * 1e6)
        geometry = ExpertGeometry(case.k, case.m, case.n_mats, case.n_used)
        return Measured(3 * matrix_us, "op", PassScope(ubatch), "", experts, experts, geometry,
                        time_source="2·m·k·n·n_used / TFLOPS, x3 matrices", **common)  # fmt: skip
    is_layer_op = test.startswith("fused MoE kernel time") or test.startswith("gather_qmm up+gate+down one MoE layer")
    if is_layer_op and unit.lower() in _TIME_UNITS:
        time_us = value * _TIME_UNITS[unit.lower()]
        return Measured(time_us, "op", PassScope(ubatch), "", experts, experts, _geometry(row, where), time_source=unit, **common)
    raise InputError(f"{where}: field 'test' is {test[:60]!r} with unit {unit!r}: not a pass or MoE-layer time moesim reads")


def _pass(row: dict[str, str], where: str, time_us: float, scope: PassScope, how: str, common: dict[str, object]) -> Measured:
    experts, dense = resolve_formats(row["quant"], where)
    return Measured(time_us, "pass", scope, resolve_model(row["model"], where), experts, dense, time_source=how, **common)  # type: ignore[arg-type]


def read_public_table(path: Path, filters: list[str], rows: list[int] | None = None) -> list[Measured]:
    """The measurements of the rows that survive the filters (COLUMN=VALUE on the table's own
    columns) and, when given, the row numbers."""
    try:
        frame = pl.read_csv(path, infer_schema_length=0)
    except (pl.exceptions.PolarsError, OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: unreadable public table ({first_line(exc)})") from None
    if tuple(frame.columns) != COLUMNS:
        raise InputError(f"{path}: unknown column layout ({', '.join(frame.columns[:6])}, …): expected {', '.join(COLUMNS)}")
    frame = frame.with_row_index("row", offset=1).with_columns(pl.col("row").cast(pl.Int64)).fill_null("")
    if rows is not None:
        unknown = sorted(set(rows) - set(frame["row"].to_list()))
        if unknown:
            raise InputError(f"{path}: no row {unknown[0]} (rows 1..{frame.height})")
        frame = frame.filter(pl.col("row").is_in(rows))
    frame = apply_filters(frame, parse_filters(filters), str(path))
    return [measured_of_row(record, int(record["row"]), str(path)) for record in frame.iter_rows(named=True)]
