"""llama-bench output (llama.cpp `tools/llama-bench`): the markdown table (default `-o md`, also
as pasted in GitHub threads and the `compare-llama-bench.py` layout with one `t/s <variant>`
column per build), `-o csv`, `-o json` and `-o jsonl`.

Time per pass = test time / passes: from `avg_ns` where the output has it (csv, json, jsonl),
else n_tokens / (t/s) (markdown: `t/s` is the mean over repetitions of tokens / test time).
Markdown omits the GPU's name (`--device` names it; compare-llama-bench's `GPU` column does) and
the microbatch unless it was set
(llama.cpp's default 512 is taken then, and n_batch 2048).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from typing import Any

from moesim.errors import InputError, first_line
from moesim.hw_profiles.importers.names import format_in_description, resolve_formats, resolve_model
from moesim.hw_profiles.importers.rows import (
    LLAMA_DEFAULT_BATCH,
    LLAMA_DEFAULT_UBATCH,
    MAX_TEST_NS,
    MAX_TOKENS,
    Measured,
    decode_scope,
    prompt_scope,
)
from moesim.parsing import load_json, parse_float, parse_int

_TEST = re.compile(r"^(?:(?P<kind>pp|tg)(?P<tokens>[0-9]+))(?:\s*@\s*d(?P<depth>[0-9]+))?(?:\s*\(.*\))?$")
_MARKDOWN_NAMES = {
    "model": "model",
    "backend": "backend",
    "n_ubatch": "n_ubatch",
    "microbatch size": "n_ubatch",
    "n_batch": "n_batch",
    "batch size": "n_batch",
    "test": "test",
    "gpu": "device",
}


@dataclass(frozen=True)
class BenchTest:
    """One llama-bench test: model description, test name, batch sizes, throughput or time."""

    model: str
    test: str
    n_ubatch: int
    n_batch: int
    tokens_per_s: float
    total_ns: float | None
    backend: str
    device: str
    build: str
    variant: str
    line: int


def measured_of(test: BenchTest, where: str, model: str | None = None, expert_format: str | None = None) -> Measured | None:
    """The measurement of one test (None for a combined `ppN+tgM` test, which is not one pass kind)."""
    match = _TEST.match(test.test.strip())
    if match is None:
        if "+" in test.test:
            return None
        raise InputError(f"{where}: line {test.line}: field 'test' is {test.test!r}, expected ppN, tgN or ppN @ dD")
    tokens = parse_int(match["tokens"], f"{where}: line {test.line}: column 'test' ({test.test.strip()[:20]})", 1, MAX_TOKENS)
    depth = parse_int(match["depth"] or 0, f"{where}: line {test.line}: column 'test' (depth)", 0, MAX_TOKENS)
    scope = prompt_scope(tokens, test.n_ubatch, depth, test.n_batch) if match["kind"] == "pp" else decode_scope(tokens, depth)
    if test.total_ns is not None:
        time_us, how = test.total_ns / 1e3 / scope.passes, "avg_ns / passes"
    else:
        if not test.tokens_per_s > 0:
            raise InputError(f"{where}: line {test.line}: field 't/s' is {test.tokens_per_s!r}, expected a positive rate")
        time_us, how = tokens / test.tokens_per_s / scope.passes * 1e6, "tokens / (t/s) / passes"
    quant = expert_format or format_in_description(test.model)
    if quant is None:
        raise InputError(f"{where}: line {test.line}: the model {test.model!r} names no weight format (give --format)")
    experts, dense = resolve_formats(quant, f"{where}: line {test.line}")
    return Measured(
        time_us=time_us,
        scope="pass",
        passes=scope,
        model=resolve_model(model or test.model, f"{where}: line {test.line}"),
        expert_format=experts,
        dense_format=dense,
        device=test.device,
        engine=f"llama.cpp {test.backend}".strip(),
        engine_version=test.build,
        variant=test.variant or test.build,
        source=where,
        source_row=test.line,
        time_source=how,
        test=test.test.strip(),
    )


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _number(text: str, where: str, field: str) -> float:
    return parse_float(text.split("±")[0], f"{where}: column '{field}'", 0.0)


def _count(text: str, where: str, field: str) -> int:
    return parse_int(text, f"{where}: column '{field}'", 1, MAX_TOKENS)


def is_markdown_header(line: str) -> bool:
    """Whether a line is the header of a llama-bench table: model and test columns (any order, after
    others such as compare-llama-bench's `GPU`; the reader then asks for its t/s)."""
    header = [h.lower() for h in _cells(line)] if line.lstrip().startswith("|") else []
    return "model" in header and "test" in header


def parse_markdown(text: str, where: str, device: str = "") -> list[BenchTest]:
    """Every row of every llama-bench (or compare-llama-bench: `GPU` names the device, one `t/s
    <variant>` column per build) markdown table in the text."""
    tests: list[BenchTest] = []
    build = re.search(r"^build: (\S+) \((\d+)\)", text, re.MULTILINE)
    build_text = f"{build[1]} (b{build[2]})" if build else ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("|") or i + 1 >= len(lines) or not re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            i += 1
            continue
        printed = _cells(lines[i])
        header = [h.lower() for h in printed]
        columns = {_MARKDOWN_NAMES[h]: j for j, h in enumerate(header) if h in _MARKDOWN_NAMES}
        rates = {j: printed[j][3:].strip() for j, h in enumerate(header) if h.startswith("t/s")}
        if "model" not in columns or "test" not in columns or not rates:
            raise InputError(
                f"{where}: line {i + 1}: unknown column layout {'|'.join(header)!r}: a llama-bench table has model, test and t/s"
            )
        i += 2
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            cells = _cells(lines[i])
            if len(cells) != len(header):
                raise InputError(f"{where}: line {i + 1}: {len(cells)} cells under a header of {len(header)}")
            for j, variant in rates.items():
                tests.append(
                    BenchTest(
                        model=cells[columns["model"]],
                        test=cells[columns["test"]],
                        n_ubatch=_count(cells[columns["n_ubatch"]], f"{where}: line {i + 1}", "n_ubatch")
                        if "n_ubatch" in columns
                        else LLAMA_DEFAULT_UBATCH,
                        n_batch=_count(cells[columns["n_batch"]], f"{where}: line {i + 1}", "n_batch")
                        if "n_batch" in columns
                        else LLAMA_DEFAULT_BATCH,
                        tokens_per_s=_number(cells[j], f"{where}: line {i + 1}", header[j]),
                        total_ns=None,
                        backend=cells[columns["backend"]] if "backend" in columns else "",
                        device=device or (cells[columns["device"]] if "device" in columns else ""),
                        build=build_text,
                        variant=variant,
                        line=i + 1,
                    )
                )
            i += 1
    return tests


def _field(record: dict[str, Any], key: str, where: str) -> Any:
    if key not in record:
        raise InputError(f"{where}: field '{key}' is missing (not llama-bench -o csv/json output?)")
    return record[key]


def _from_record(record: dict[str, Any], where: str, line: int, device: str) -> BenchTest:
    if not isinstance(record, dict):
        raise InputError(f"{where}: a llama-bench test is an object of fields, got {type(record).__name__}")
    n_prompt = parse_int(_field(record, "n_prompt", where), f"{where}: column 'n_prompt'", 0, MAX_TOKENS)
    n_gen = parse_int(_field(record, "n_gen", where), f"{where}: column 'n_gen'", 0, MAX_TOKENS)
    depth = parse_int(record.get("n_depth", 0) or 0, f"{where}: column 'n_depth'", 0, MAX_TOKENS)
    if not n_prompt and not n_gen:
        raise InputError(f"{where}: columns 'n_prompt' and 'n_gen' are both 0: no test")
    if n_prompt and n_gen:
        test = f"pp{n_prompt}+tg{n_gen}"
    else:
        test = (f"pp{n_prompt}" if n_prompt else f"tg{n_gen}") + (f" @ d{depth}" if depth else "")
    build = f"{record.get('build_commit', '')} (b{record.get('build_number', '?')})"
    return BenchTest(
        model=str(_field(record, "model_type", where)),
        test=test,
        n_ubatch=parse_int(_field(record, "n_ubatch", where), f"{where}: column 'n_ubatch'", 1, MAX_TOKENS),
        n_batch=parse_int(record.get("n_batch", LLAMA_DEFAULT_BATCH), f"{where}: column 'n_batch'", 1, MAX_TOKENS),
        tokens_per_s=parse_float(record.get("avg_ts", 0.0), f"{where}: column 'avg_ts'", 0.0),
        total_ns=parse_float(_field(record, "avg_ns", where), f"{where}: column 'avg_ns'", 0.0, MAX_TEST_NS),
        backend=str(record.get("backends", "")),
        device=device or str(record.get("gpu_info", "")),
        build=build,
        variant=build,
        line=line,
    )


def parse_records(text: str, where: str, kind: str, device: str = "") -> list[BenchTest]:
    """The tests of `-o csv`, `-o json` or `-o jsonl` output."""
    try:
        if kind == "csv":
            records = list(csv.DictReader(io.StringIO(text)))
            return [_from_record(r, f"{where}: line {i + 2}", i + 2, device) for i, r in enumerate(records)]
        if kind == "json":
            records = load_json(text, where)
            if not isinstance(records, list):
                raise InputError(f"{where}: llama-bench -o json is a list of tests")
            return [_from_record(r, f"{where}: test {i + 1}", i + 1, device) for i, r in enumerate(records)]
        lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
        return [_from_record(load_json(line, f"{where}: line {i}"), f"{where}: line {i}", i, device) for i, line in lines]
    except (ValueError, TypeError, AttributeError) as exc:  # a CSV the reader cannot split
        raise InputError(f"{where}: not llama-bench -o {kind} output ({first_line(exc)[:80]})") from None
