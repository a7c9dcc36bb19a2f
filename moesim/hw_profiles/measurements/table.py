"""Measurement tables, contract 3 (docs/architecture.md): the input of `profile fit` and `validate`.

Parquet or CSV, one row per measured operation, units in column names. Required: `kernel`
(family: `per_slot`, `dense`, or any name starting with `dedup`; `dispatch` where the engine chose
its kernels itself, as in a whole forward pass), `n_tokens`, `time_us`. Optional columns are
type-checked when present; unknown columns are kept and ignored.

A row's scope (`scope`): `op`, one MoE layer's expert operation (or one expert matrix, as
`time_us_matrix` says), or `pass`, a whole forward pass of the model as a benchmark timed it:
`time_us` per pass, averaged over the test's `passes`, with the keys a query token attends over
(`context_tokens`: through the causal mask, mean over the passes' tokens, summed over the pass's
`sequences`), the share of passes
that ran the output head (`head_share`) and the rows it ran on (`logit_rows`), the weight
formats of the experts (`dtype`) and of the other weights (`dense_format`). Importers of
published and user benchmark outputs (`moesim.hw_profiles.importers`) write these.

A measurement folder (what the microbenchmarks write) holds the table, `provenance.json` (how it
was measured; the llama.cpp runner's dense-twin specs) and, where known, `device.json`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.atomic import protect
from moesim.errors import InputError, first_line

TABLE_NAME = "measurements.parquet"
# the per-model statistic a microbenchmark differences, named in its provenance
STATISTICS: dict[str, Callable[[Any], float]] = {"median": lambda a: float(np.median(a)), "min": lambda a: float(np.min(a))}
PROVENANCE_NAME = "provenance.json"
DEVICE_NAME = "device.json"

REQUIRED_COLUMNS: dict[str, type[pl.DataType]] = {"kernel": pl.String, "n_tokens": pl.Int64, "time_us": pl.Float64}

OPTIONAL_COLUMNS: dict[str, type[pl.DataType]] = {
    "layers": pl.Int64,
    "distinct_experts": pl.Int64,
    "slots": pl.Int64,
    "max_tokens_per_expert": pl.Int64,
    "routing": pl.String,
    "hidden": pl.Int64,
    "expert_intermediate": pl.Int64,
    "experts": pl.Int64,
    "top_k": pl.Int64,
    "expert_bytes": pl.Float64,
    "dtype": pl.String,
    "bytes_requested": pl.Float64,
    "model": pl.String,
    "engine": pl.String,
    "device": pl.String,
    "trace": pl.String,
    "seq": pl.Int64,
    "window_start": pl.Int64,
    "draft_len": pl.Int64,
    "accepted_mean": pl.Float64,
    "tokens_per_s": pl.Float64,
    "scope": pl.String,
    "passes": pl.Int64,
    "context_tokens": pl.Float64,
    "head_share": pl.Float64,
    "logit_rows": pl.Int64,
    "sequences": pl.Int64,
    "dense_format": pl.String,
    "engine_version": pl.String,
    "variant": pl.String,
    "source": pl.String,
    "source_row": pl.Int64,
    "time_us_p10": pl.Float64,
    "time_us_p90": pl.Float64,
    "time_us_min": pl.Float64,
    "reps": pl.Int64,
}
SCOPES = ("op", "pass")
DISPATCH_KERNEL = "dispatch"

# Columns that must be > 0 where given, and those that must be >= 0.
_POSITIVE = ("n_tokens", "time_us", "layers", "distinct_experts", "slots", "max_tokens_per_expert", "hidden",
             "expert_intermediate", "experts", "top_k", "expert_bytes", "tokens_per_s", "passes", "logit_rows",
             "sequences", "source_row", "time_us_p10", "time_us_p90", "time_us_min", "reps")  # fmt: skip
_NON_NEGATIVE = ("bytes_requested", "seq", "window_start", "draft_len", "accepted_mean", "context_tokens", "head_share")


def is_family(kernel: str) -> bool:
    """A kernel family name: per_slot, dense, or any name starting with dedup."""
    return kernel in ("per_slot", "dense") or kernel.startswith("dedup")


def is_dedup_family(kernel: str) -> bool:
    """Deduplicating families read each distinct expert once per pass."""
    return kernel.startswith("dedup")


def _read_raw(path: Path) -> pl.DataFrame:
    if not path.is_file():
        raise InputError(f"{path}: no such measurement table")
    protect(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return pl.read_parquet(path)
        if suffix == ".csv":
            return pl.read_csv(path, infer_schema_length=None)
    except (pl.exceptions.PolarsError, OSError, UnicodeDecodeError) as exc:
        message = first_line(exc)
        raise InputError(f"{path}: unreadable measurement table ({message})") from None
    raise InputError(f"{path}: a measurement table must be .parquet or .csv, got '{suffix}'")


def load_measurements(path: str | os.PathLike[str]) -> pl.DataFrame:
    """Read and check a measurement table; known columns are cast to their contract types."""
    path = Path(path)
    return check_measurements(_read_raw(path), str(path))


def check_measurements(frame: pl.DataFrame, path: str) -> pl.DataFrame:
    """Check a measurement table read or built elsewhere; known columns are cast to their contract types."""
    for name in REQUIRED_COLUMNS:
        if name not in frame.columns:
            raise InputError(f"{path}: column '{name}' is missing (required: {', '.join(REQUIRED_COLUMNS)})")
    if frame.height == 0:
        raise InputError(f"{path}: the measurement table has no rows")
    casts = []
    for name, dtype in {**REQUIRED_COLUMNS, **OPTIONAL_COLUMNS}.items():
        if name not in frame.columns:
            continue
        column = frame[name]
        if dtype is pl.Int64 and column.dtype.is_float():
            fractional = (column.is_not_null() & (column != column.round(0))).arg_true()
            if fractional.len():
                row = int(fractional[0])
                raise InputError(f"{path}: row {row}: field '{name}' must be an integer, got {column[row]}")
        cast = column.cast(dtype, strict=False)
        failed = (cast.is_null() & column.is_not_null()).arg_true()
        if failed.len():
            row = int(failed[0])
            raise InputError(f"{path}: row {row}: field '{name}' has value {column[row]!r}, expected {dtype.__name__}")
        casts.append(cast)
    frame = frame.with_columns(casts)
    for name in REQUIRED_COLUMNS:
        nulls = frame[name].is_null().arg_true()
        if nulls.len():
            raise InputError(f"{path}: row {int(nulls[0])}: field '{name}' is empty")
    kernel = frame["kernel"]
    bad_family = (~(kernel.is_in(["per_slot", "dense", DISPATCH_KERNEL]) | kernel.str.starts_with("dedup"))).arg_true()
    if bad_family.len():
        row = int(bad_family[0])
        raise InputError(
            f"{path}: row {row}: field 'kernel' is {frame['kernel'][row]!r}; a family is per_slot, dense or a name starting with dedup "
            f"(or {DISPATCH_KERNEL}: the engine's own choice)"
        )
    if "scope" in frame.columns:
        bad_scope = (frame["scope"].is_not_null() & ~frame["scope"].is_in(SCOPES)).arg_true()
        if bad_scope.len():
            row = int(bad_scope[0])
            raise InputError(f"{path}: row {row}: field 'scope' is {frame['scope'][row]!r}, expected one of {', '.join(SCOPES)}")
    for name in _POSITIVE + _NON_NEGATIVE:
        if name not in frame.columns:
            continue
        column = frame[name]
        bad = column.is_not_null() & ((column <= 0) if name in _POSITIVE else (column < 0))
        if column.dtype.is_float():
            bad = bad | column.is_nan() | column.is_infinite()
        rows = bad.arg_true()
        if rows.len():
            row = int(rows[0])
            sign = "> 0" if name in _POSITIVE else ">= 0"
            raise InputError(f"{path}: row {row}: field '{name}' must be {sign}, got {column[row]}")
    return frame
