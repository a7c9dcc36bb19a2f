"""What users run on their own machine, read into the rows of the shared engine-overheads tables:
plain decoding at some batch sizes (`DecodeStep`) and speculative runs (`SpecRun`), from which
`moesim profile fit-engine` fits the engine's own terms on that device.

One registered class per output format (`ENGINE_OUTPUTS`); `read_outputs(paths)` detects each
file's format from its content (or takes `fmt`), reads it with what the user says of the run
(`RunContext`: the command's options, and per file `FILE@batch=8,output_len=128`), pairs each
speculative run with the plain decoding of the same setup as its baseline, and checks sizes.

| format | what |
|---|---|
| `vllm-bench-latency` | `vllm bench latency --output-json` (batch, lengths from its `.pytorch.json` or given) |
| `vllm-bench-serve` | `vllm bench serve --save-result` (speculative when the server's counters were scraped) |
| `sglang-bench-serving` | `python -m sglang.bench_serving --output-file` (JSONL; `accept_length` when speculating) |
| `sglang-bench-one-batch` | `python -m sglang.bench_one_batch` console, or its `--result-filename` JSONL |
| `llama-server` | llama-server completion responses with their `timings` (JSON, list or JSONL) |
| `llama-speculative` | `llama-speculative` / `llama-speculative-simple` console |
| `llama-bench` | llama-bench's `tgN` and `ppN` rows (markdown, csv, json, jsonl) |
| `llama-timings` | the `eval time` lines of any llama.cpp tool (llama-cli, llama-server's log; its `draft acceptance rate` lines) |
| `mlx-lm-benchmark` | `python -m mlx_lm.benchmark` (batch sizes) |
| `mlx-lm-generate` | `mlx_lm.generate --verbose` statistics (with --draft-len: a speculative run) |
"""

from __future__ import annotations

import csv
import dataclasses
import io
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moesim.errors import ConfigError, InputError
from moesim.fields import FieldError, option_name
from moesim.hw_profiles.engine_runs import llamacpp, mlx, sglang, vllm
from moesim.hw_profiles.engine_runs.rows import (
    DECODE_COLUMNS,
    MAX_FILE_BYTES,
    MAX_ROWS,
    SPEC_COLUMNS,
    DecodeStep,
    EngineRows,
    RunContext,
    SpecRun,
    pair_baselines,
)
from moesim.registry import Registry

__all__ = ["ENGINE_OUTPUTS", "DecodeStep", "EngineRows", "RunContext", "SpecRun", "read_outputs", "write_rows"]

Parser = Callable[[str, str, RunContext], EngineRows]


class EngineOutput:
    """One output format: `sniff` recognises its text, `read` turns it into rows (its parser in a module beside)."""

    name = ""
    looks_like: Callable[[str], bool]
    parse: Parser

    def sniff(self, text: str) -> bool:
        """Whether the text is this format's output."""
        return self.looks_like(text)

    def read(self, path: Path, text: str, context: RunContext) -> EngineRows:
        """Every row of the file, each naming the file it came from."""
        rows = self.parse(text, str(path), context)
        name = path.name

        def named(row: Any) -> Any:
            return replace(row, raw_file=name, source_url=row.source_url.replace(str(path), name, 1))

        return EngineRows(tuple(named(s) for s in rows.steps), tuple(named(r) for r in rows.runs))


ENGINE_OUTPUTS: Registry[EngineOutput] = Registry("engine output format", InputError)

# Detection tries them in registration order: the more specific layouts first.


@ENGINE_OUTPUTS.register
class VllmBenchLatency(EngineOutput):
    """vllm bench latency --output-json (or its .pytorch.json)."""

    name = "vllm-bench-latency"
    looks_like = staticmethod(vllm.looks_like_latency)
    parse = staticmethod(vllm.parse_latency)


@ENGINE_OUTPUTS.register
class VllmBenchServe(EngineOutput):
    """vllm bench serve --save-result."""

    name = "vllm-bench-serve"
    looks_like = staticmethod(vllm.looks_like_serve)
    parse = staticmethod(vllm.parse_serve)


@ENGINE_OUTPUTS.register
class SglangBenchServing(EngineOutput):
    """python -m sglang.bench_serving --output-file (JSONL)."""

    name = "sglang-bench-serving"
    looks_like = staticmethod(sglang.looks_like_serving)
    parse = staticmethod(sglang.parse_serving)


@ENGINE_OUTPUTS.register
class SglangBenchOneBatch(EngineOutput):
    """python -m sglang.bench_one_batch (console or result JSONL)."""

    name = "sglang-bench-one-batch"
    looks_like = staticmethod(sglang.looks_like_one_batch)
    parse = staticmethod(sglang.parse_one_batch)


@ENGINE_OUTPUTS.register
class LlamaServer(EngineOutput):
    """llama-server completion responses with their timings."""

    name = "llama-server"
    looks_like = staticmethod(llamacpp.looks_like_server_json)
    parse = staticmethod(llamacpp.parse_server_json)


@ENGINE_OUTPUTS.register
class LlamaSpeculative(EngineOutput):
    """llama-speculative's console."""

    name = "llama-speculative"
    looks_like = staticmethod(llamacpp.looks_like_speculative)
    parse = staticmethod(llamacpp.parse_speculative)


@ENGINE_OUTPUTS.register
class LlamaBench(EngineOutput):
    """llama-bench's tg and pp rows."""

    name = "llama-bench"
    looks_like = staticmethod(llamacpp.looks_like_bench)
    parse = staticmethod(llamacpp.parse_bench)


@ENGINE_OUTPUTS.register
class LlamaTimings(EngineOutput):
    """The eval-time lines of a llama.cpp tool or llama-server's log."""

    name = "llama-timings"
    looks_like = staticmethod(llamacpp.looks_like_timings)
    parse = staticmethod(llamacpp.parse_timings)


@ENGINE_OUTPUTS.register
class MlxLmBenchmark(EngineOutput):
    """python -m mlx_lm.benchmark."""

    name = "mlx-lm-benchmark"
    looks_like = staticmethod(mlx.looks_like_benchmark)
    parse = staticmethod(mlx.parse_benchmark)


@ENGINE_OUTPUTS.register
class MlxLmGenerate(EngineOutput):
    """mlx_lm.generate --verbose statistics."""

    name = "mlx-lm-generate"
    looks_like = staticmethod(mlx.looks_like_generate)
    parse = staticmethod(mlx.parse_generate)


_CONTEXT_FIELDS = {f.name: f for f in dataclasses.fields(RunContext)}
_ANNOTATION = re.compile(r"^(\w+=[^,=]+)(,\w+=[^,=]+)*$")


def split_annotation(argument: str) -> tuple[Path, RunContext]:
    """`FILE@key=value,...` → (FILE, what it says of the run); a file whose name holds '@' stays whole."""
    path, at, tail = argument.rpartition("@")
    if not at or Path(argument).exists() or not _ANNOTATION.match(tail):
        return Path(argument), RunContext()
    values: dict[str, object] = {}
    for item in tail.split(","):
        key, _, text = item.partition("=")
        if key not in _CONTEXT_FIELDS:
            raise InputError(f"{argument}: unknown run field '{key}' (known: {', '.join(_CONTEXT_FIELDS)})")
        if "int" in str(_CONTEXT_FIELDS[key].type):
            if not text.isdigit() or int(text) < 1:
                raise InputError(f"{argument}: field '{key}' must be an integer >= 1, got {text!r}")
            values[key] = int(text)
        else:
            values[key] = text
    try:
        return Path(path), RunContext(**values)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise InputError(f"{argument}: {exc}") from None


def context_of_options(options: dict[str, Any], **given: Any) -> RunContext:
    """The command's options as a RunContext; a value out of bounds is one line naming its option."""
    try:
        return RunContext(**options, **given)
    except FieldError as exc:
        raise InputError(f"{option_name(RunContext, exc.field)}: {exc.detail}") from None


def read_text(path: Path) -> str:
    """An output's text, its size checked; one line when it is missing, too large or not text."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise InputError(f"{path}: {size} bytes, more than the {MAX_FILE_BYTES} a benchmark's output may have")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file (a benchmark's output is text)") from None


def detect_format(path: Path, text: str) -> str:
    """The registered format whose `sniff` recognises the text; one line when none does."""
    known = ", ".join(ENGINE_OUTPUTS.names())
    return ENGINE_OUTPUTS.first(lambda fmt: fmt.sniff(text), f"{path}: unknown engine output: not one of {known} (give --run-format)")


def read_outputs(arguments: Sequence[str], context: RunContext | None = None, fmt: str | None = None) -> EngineRows:
    """The rows of every output (`FILE` or `FILE@key=value,...`), speculative runs paired with their baselines."""
    context = context or RunContext()
    rows = EngineRows()
    for argument in arguments:
        path, given = split_annotation(argument)
        text = read_text(path)
        name = fmt or detect_format(path, text)
        read = ENGINE_OUTPUTS.create(name).read(path, text, context.merged(given))
        if not len(read):
            raise InputError(f"{path}: no run in this {name} output")
        rows = rows + read
        if len(rows) > MAX_ROWS:
            raise InputError(f"{path}: more than {MAX_ROWS} rows in all")
    return EngineRows(rows.steps, tuple(pair_baselines(list(rows.runs), list(rows.steps))))


def rows_csv(rows: Sequence[DecodeStep] | Sequence[SpecRun], columns: tuple[str, ...]) -> str:
    """The rows as CSV text in the shared table's columns."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(row.record() for row in rows)
    return buffer.getvalue()


@dataclass(frozen=True)
class RowFiles:
    """Where `write_rows` put the two tables (None: no rows of that kind)."""

    decode_steps: Path | None
    speculative_runs: Path | None


def write_rows(rows: EngineRows, folder: Path) -> RowFiles:
    """decode_steps.csv and speculative_runs.csv into a folder (`atomic.output_dir`'s staging folder)."""
    steps = folder / "decode_steps.csv" if rows.steps else None
    runs = folder / "speculative_runs.csv" if rows.runs else None
    if steps:
        steps.write_text(rows_csv(rows.steps, DECODE_COLUMNS))
    if runs:
        runs.write_text(rows_csv(rows.runs, SPEC_COLUMNS))
    return RowFiles(steps, runs)
