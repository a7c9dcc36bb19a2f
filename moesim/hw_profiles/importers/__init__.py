"""Importers of the benchmark tables people publish and run, into measurement tables (contract 3).

One registered class per output format (`TABLE_FORMATS`); `import_table(path)` detects the format
from the file's content (or takes `fmt`), reads every timed test with its scope (one MoE op, or a
whole pass with its context, passes and output head) and returns the checked table. A table that
mixes devices, or variants of the same test, is refused: select with filters (`choose_variant`
gives the default variant of a table of several, and says so).

| format | what |
|---|---|
| `llama-bench` | llama-bench's markdown (also as pasted, and compare-llama-bench's `t/s <variant>` columns) |
| `llama-bench-csv`, `llama-bench-json`, `llama-bench-jsonl` | `llama-bench -o csv / json / jsonl` |
| `llama-batched-bench` | llama-batched-bench's table or jsonl (decode passes of B sequences) |
| `test-backend-ops` | `test-backend-ops perf -o MUL_MAT_ID` console or `--output sql` |
| `benchmark-moe` | vLLM's `benchmark_moe.py` / SGLang's `tuning_fused_moe_triton.py`, benchmark mode |
| `public-bench` | `data/public-bench/moe_pass_times.csv` (filters on its own columns, row numbers) |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from moesim.atomic import atomic_path
from moesim.errors import InputError
from moesim.filters import parse_filters
from moesim.hw_profiles.importers.batched_bench import looks_like_batched_bench, parse_batched_bench
from moesim.hw_profiles.importers.benchmark_moe import parse_benchmark_moe
from moesim.hw_profiles.importers.llama_bench import is_markdown_header, measured_of, parse_markdown, parse_records
from moesim.hw_profiles.importers.names import resolve_formats, resolve_model
from moesim.hw_profiles.importers.public_bench import COLUMNS, read_public_table
from moesim.hw_profiles.importers.rows import Measured, checked_frame, measurements_frame
from moesim.hw_profiles.microbench.backend_ops import import_backend_ops
from moesim.parsing import parse_int_ranges
from moesim.registry import Registry


@dataclass(frozen=True)
class ImportOptions:
    """What an output may not say itself: the model preset, the device, the weight format; and the
    row selection (filters COLUMN=VALUE; row numbers of the public table)."""

    model: str | None = None
    device: str | None = None
    weight_format: str | None = None
    filters: tuple[str, ...] = ()
    rows: tuple[int, ...] | None = None


class Importer:
    """One output format: `sniff` recognises its text, `read` turns it into measurements."""

    name = ""

    def sniff(self, text: str) -> bool:
        """Whether the text is this format's output."""
        raise NotImplementedError

    def read(self, path: Path, text: str, options: ImportOptions) -> list[Measured]:
        """Every timed test of the file."""
        raise NotImplementedError

    def frame(self, path: Path, text: str, options: ImportOptions) -> pl.DataFrame:
        """The checked contract-3 table (filters on its columns)."""
        measured = self.read(path, text, options)
        if options.device:
            measured = [m.with_context(device=options.device) for m in measured]
        return measurements_frame(measured, str(path), options.filters)


TABLE_FORMATS: Registry[Importer] = Registry("table format", InputError)


def _needs_device(measured: list[Measured], options: ImportOptions, path: Path, what: str) -> None:
    if not options.device and any(not m.device for m in measured):
        raise InputError(f"{path}: {what} does not name the device: give --device NAME")


@TABLE_FORMATS.register
class PublicBench(Importer):
    """The shared public table (filters on its own columns; row numbers)."""

    name = "public-bench"

    def sniff(self, text: str) -> bool:
        """Whether the text is this format."""
        return text.split("\n", 1)[0].strip() == ",".join(COLUMNS)

    def read(self, path: Path, text: str, options: ImportOptions) -> list[Measured]:
        """Every timed test of the file."""
        return read_public_table(path, list(options.filters), list(options.rows) if options.rows is not None else None)

    def frame(self, path: Path, text: str, options: ImportOptions) -> pl.DataFrame:
        """The checked contract-3 table."""
        return measurements_frame(self.read(path, text, options), str(path))


@TABLE_FORMATS.register
class LlamaBenchCsv(Importer):
    """llama-bench -o csv."""

    name = "llama-bench-csv"
    kind = "csv"

    def sniff(self, text: str) -> bool:
        """Whether the text is this format."""
        return text.lstrip().startswith("build_commit,")

    def read(self, path: Path, text: str, options: ImportOptions) -> list[Measured]:
        """Every timed test of the file."""
        tests = parse_records(text, str(path), self.kind, options.device or "")
        return [m for t in tests if (m := measured_of(t, str(path), options.model, options.weight_format)) is not None]


_JSON_OPENERS = {"json": "[", "jsonl": "{"}  # an array of records; one record a line


@TABLE_FORMATS.register
class LlamaBenchJson(LlamaBenchCsv):
    """llama-bench -o json."""

    name = "llama-bench-json"
    kind = "json"

    def sniff(self, text: str) -> bool:
        """Whether the text is this format: its kind's opener, and records with a build commit."""
        return text.lstrip().startswith(_JSON_OPENERS[self.kind]) and '"build_commit"' in text


@TABLE_FORMATS.register
class LlamaBenchJsonl(LlamaBenchJson):
    """llama-bench -o jsonl."""

    name = "llama-bench-jsonl"
    kind = "jsonl"


@TABLE_FORMATS.register
class LlamaBatchedBench(Importer):
    """llama-batched-bench (needs --model, --format and --device)."""

    name = "llama-batched-bench"

    def sniff(self, text: str) -> bool:
        """Whether the text is this format."""
        return looks_like_batched_bench(text)

    def read(self, path: Path, text: str, options: ImportOptions) -> list[Measured]:
        """Every timed test of the file."""
        if not options.model or not options.weight_format:
            raise InputError(f"{path}: llama-batched-bench prints neither the model nor its format: give --model PRESET and --format")
        experts, dense = resolve_formats(options.weight_format, str(path))
        model = resolve_model(options.model, str(path))
        parsed = parse_batched_bench(text, str(path))
        measured = [m.with_context(model=model, expert_format=experts, dense_format=dense, engine="llama.cpp") for m in parsed]
        _needs_device(measured, options, path, "llama-batched-bench")
        return measured


@TABLE_FORMATS.register
class BenchmarkMoe(Importer):
    """vLLM / SGLang benchmark_moe.py in benchmark mode (needs --device)."""

    name = "benchmark-moe"

    def sniff(self, text: str) -> bool:
        """Whether the text is this format."""
        return "Kernel time:" in text and "Batch size:" in text

    def read(self, path: Path, text: str, options: ImportOptions) -> list[Measured]:
        """Every timed test of the file."""
        measured = parse_benchmark_moe(text, str(path), options.model)
        _needs_device(measured, options, path, "benchmark_moe.py")
        return measured


@TABLE_FORMATS.register
class BackendOps(Importer):
    """test-backend-ops perf -o MUL_MAT_ID (console or SQL)."""

    name = "test-backend-ops"

    def sniff(self, text: str) -> bool:
        """Whether the text is this format."""
        return "MUL_MAT_ID(" in text or "INSERT INTO test_backend_ops" in text

    def frame(self, path: Path, text: str, options: ImportOptions) -> pl.DataFrame:
        """The checked contract-3 table."""
        rows = import_backend_ops(path).rows
        frame = pl.DataFrame(rows, infer_schema_length=None).with_columns(
            scope=pl.lit("op"), test=pl.col("op_params"), context_tokens=pl.lit(0.0), variant=pl.lit(""), passes=pl.lit(1)
        )
        if options.device:
            frame = frame.with_columns(device=pl.lit(options.device))
        return checked_frame(frame, str(path), options.filters)


@TABLE_FORMATS.register
class LlamaBenchMarkdown(Importer):
    """llama-bench's markdown (needs --device unless a `GPU` column names it)."""

    name = "llama-bench"

    def sniff(self, text: str) -> bool:
        """Whether the text is this format."""
        return any(is_markdown_header(line) for line in text.splitlines())

    def read(self, path: Path, text: str, options: ImportOptions) -> list[Measured]:
        """Every timed test of the file."""
        tests = parse_markdown(text, str(path), options.device or "")
        measured = [m for t in tests if (m := measured_of(t, str(path), options.model, options.weight_format)) is not None]
        _needs_device(measured, options, path, "llama-bench's markdown")
        return measured


def write_table(frame: pl.DataFrame, path: Path) -> None:
    """Write a measurement table atomically: Parquet for a .parquet path, else CSV."""
    if path.suffix.lower() not in (".csv", ".parquet"):
        raise InputError(f"{path}: a measurement table is .csv or .parquet")
    with atomic_path(path) as tmp:
        if path.suffix.lower() == ".parquet":
            frame.write_parquet(tmp)
        else:
            frame.write_csv(tmp)


MAX_ROWS = 1 << 20  # row numbers one --rows names


def parse_rows(text: str) -> tuple[int, ...]:
    """'31-35,40' -> (31, 32, 33, 34, 35, 40): row numbers of the public table."""
    return parse_int_ranges(text, "--rows", 1, 1 << 40, MAX_ROWS)


def detect_format(path: Path, text: str) -> str:
    """The registered format whose `sniff` recognises the text; one line when none does."""
    known = ", ".join(TABLE_FORMATS.names())
    return TABLE_FORMATS.first(lambda fmt: fmt.sniff(text), f"{path}: unknown table layout: not one of {known} (give --table-format)")


def read_text(path: Path) -> str:
    """A benchmark output's text; one line when it is missing or not text."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file (a benchmark's output is text)") from None


def import_table(path: str | Path, fmt: str | None = None, options: ImportOptions | None = None) -> tuple[str, pl.DataFrame]:
    """(format, contract-3 table) of a benchmark output."""
    path = Path(path)
    text = read_text(path)
    name = fmt or detect_format(path, text)
    return name, TABLE_FORMATS.create(name).frame(path, text, options or ImportOptions())


def choose_variant(path: str | Path, fmt: str | None, options: ImportOptions) -> tuple[ImportOptions, str]:
    """Where an output times the same tests in several variants (compare-llama-bench's `t/s
    <variant>` columns) and no filter names one: the options keeping the table's last variant (the
    build compared against the first), and the line that says so; else the options as given."""
    if any(column == "variant" for column, _ in parse_filters(list(options.filters))):
        return options, ""
    path = Path(path)
    text = read_text(path)
    name = fmt or detect_format(path, text)
    if name == "public-bench":
        return options, ""
    try:
        measured = TABLE_FORMATS.create(name).read(path, text, dataclasses.replace(options, filters=()))
    except NotImplementedError:  # an importer that builds its table without `Measured` rows: one variant
        return options, ""
    seen: dict[tuple[object, ...], set[str]] = {}
    for m in measured:
        seen.setdefault((m.device, m.model, m.expert_format, m.scope, m.test, m.passes.n_tokens), set()).add(m.variant)
    if all(len(variants) < 2 for variants in seen.values()):
        return options, ""
    variants = list(dict.fromkeys(m.variant for m in measured))
    chosen = variants[-1]
    note = (
        f"{path.name}: the table times the same tests in {len(variants)} variants ({', '.join(variants)}): "
        f"using '{chosen}', the last (choose one with --filter variant=NAME)"
    )
    return dataclasses.replace(options, filters=(*options.filters, f"variant={chosen}")), note
