"""The `table` importer: Parquet or CSV, one row per (token, layer, slot); see the package docstring."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import polars as pl

from moesim.errors import InputError, first_line
from moesim.tracegen.formats.schema import TraceGeometry, groups_of
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.importers.common import Sequence, assemble
from moesim.tracegen.importers.registry import ROUTING_SOURCES

TABLE_SUFFIXES = (".csv", ".csv.gz", ".parquet")


def table_suffix(path: Path) -> str:
    """The table suffix of a path (`.csv.gz` counts as one), or '' when it is none of TABLE_SUFFIXES."""
    name = path.name.lower()
    return next((suffix for suffix in sorted(TABLE_SUFFIXES, key=len, reverse=True) if name.endswith(suffix)), "")


def read_table(path: Path) -> pl.DataFrame:
    """A Parquet, CSV or gzipped CSV file as a frame (one line when it does not read)."""
    suffix = table_suffix(path)
    try:
        if suffix.startswith(".csv"):
            return pl.read_csv(path)
        return pl.read_parquet(path)
    except (pl.exceptions.PolarsError, OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable {suffix.lstrip('.') or 'table'} file ({first_line(exc)})") from None


def _int_column(frame: pl.DataFrame, name: str, path: Path) -> np.ndarray:
    column = frame[name]
    if column.null_count():
        row = int(np.flatnonzero(column.is_null().to_numpy())[0])
        raise InputError(f"{path}: row {row}: field '{name}' is empty")
    if not column.dtype.is_integer():
        raise InputError(f"{path}: column '{name}' must hold integers, got {column.dtype}")
    values = column.to_numpy().astype(np.int64)
    bad = np.flatnonzero(values < 0)
    if bad.size:
        raise InputError(f"{path}: row {int(bad[0])}: field '{name}' is {values[bad[0]]}, expected >= 0")
    return values


def _cast(frame: pl.DataFrame, name: str, dtype: pl.DataType, path: Path) -> np.ndarray:
    """An optional column as numpy of a given type (one line naming it when it does not convert)."""
    try:
        column = frame[name].cast(dtype)
    except pl.exceptions.PolarsError:
        raise InputError(f"{path}: column '{name}' does not convert to {dtype}") from None
    if column.null_count():
        row = int(np.flatnonzero(column.is_null().to_numpy())[0])
        raise InputError(f"{path}: row {row}: field '{name}' is empty")
    return column.to_numpy()


@ROUTING_SOURCES.register
@dataclass(frozen=True)
class TableImporter:
    """A Parquet/CSV table of routing rows, long (one id per row) or wide (a token's k ids per row)."""

    name: ClassVar[str] = "table"

    def read(self, path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
        """The table's routing as a trace (`normalize` does not apply: the table gives the weights)."""
        return import_table(path, geometry)


def _id_columns(frame: pl.DataFrame, path: Path, k: int) -> list[str]:
    """['expert'] for the long layout (with `slot`), e0..e{k-1} for the wide one."""
    if "e0" in frame.columns:
        wide = [f"e{j}" for j in range(k)]
        missing = [c for c in wide if c not in frame.columns]
        if missing:
            raise InputError(f"{path}: column '{missing[0]}' is missing (a wide table holds e0..e{k - 1}: the model's top-k is {k})")
        if f"e{k}" in frame.columns:
            raise InputError(f"{path}: column 'e{k}' is one id more than the model's top-k ({k})")
        for name in ("slot", "expert", "weight"):
            if name in frame.columns:
                raise InputError(f"{path}: column '{name}' belongs to the long layout (one row per slot), the table is wide (e0..e{k - 1})")
        return wide
    for name in ("slot", "expert"):
        if name not in frame.columns:
            raise InputError(f"{path}: column '{name}' is missing (need token, layer, slot, expert, or token, layer, e0..e{k - 1})")
    return ["expert"]


def _sequence_keys(frame: pl.DataFrame, path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Per row: its sequence id, a sort key (task in order of first appearance, then seq) and the task names."""
    seq = _int_column(frame, "seq", path) if "seq" in frame.columns else np.zeros(frame.height, np.int64)
    if "task" not in frame.columns:
        return seq, seq, []
    task = frame["task"]
    if task.null_count():
        raise InputError(f"{path}: row {int(np.flatnonzero(task.is_null().to_numpy())[0])}: field 'task' is empty")
    names = task.cast(pl.String).unique(maintain_order=True).to_list()
    rank = task.cast(pl.String).replace_strict(names, list(range(len(names))), return_dtype=pl.Int64).to_numpy()
    return seq, rank * (int(seq.max(initial=0)) + 1) + seq, names


def import_table(path: Path, geometry: TraceGeometry) -> Trace:
    """A Parquet/CSV table of routing rows (see the package docstring for both layouts)."""
    return routing_from_frame(read_table(path), geometry, path, "table")


def routing_from_frame(frame: pl.DataFrame, geometry: TraceGeometry, path: Path, engine: str) -> Trace:
    """Routing rows (either layout) as a checked trace; `layer` is the model's own layer index
    (a MoE layer of the geometry), `engine` what the trace records as its source."""
    moe = np.asarray(geometry.moe_layers, np.int64)
    n_layers, k = moe.shape[0], geometry.top_k
    position = "token" if "token" in frame.columns else "pos"
    for name in (position, "layer"):
        if name not in frame.columns:
            raise InputError(f"{path}: column '{name}' is missing (need token or pos, layer, and slot, expert or e0..e{k - 1})")
    ids = _id_columns(frame, path, k)
    wide = ids != ["expert"]
    token, layer = _int_column(frame, position, path), _int_column(frame, "layer", path)
    slot = np.zeros_like(token) if wide else _int_column(frame, "slot", path)
    expert = np.column_stack([_int_column(frame, name, path) for name in ids])
    seq, seq_key, tasks = _sequence_keys(frame, path)

    def where(i: int) -> str:
        return (f"task {frame['task'][i]} " if tasks else "") + f"seq {seq[i]} {position} {token[i]}"

    layer_index = np.searchsorted(moe, layer)
    bad = np.flatnonzero((layer_index >= n_layers) | (moe[np.minimum(layer_index, n_layers - 1)] != layer))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{path}: row {i}: field 'layer' is {layer[i]}, not a MoE layer of {geometry.model} ({list(geometry.moe_layers)})")
    bad = np.flatnonzero(slot >= k)
    if bad.size:
        raise InputError(f"{path}: row {int(bad[0])}: field 'slot' is {slot[bad[0]]}, expected 0..{k - 1} (top-k = {k})")
    bad_row, bad_col = np.nonzero(expert >= geometry.experts)
    if bad_row.size:
        i, j = int(bad_row[0]), int(bad_col[0])
        raise InputError(f"{path}: row {i}: field '{ids[j]}' is {expert[i, j]}, but {geometry.model} has {geometry.experts} experts")
    order = np.lexsort((slot, layer_index, token, seq_key))
    key = np.stack([seq_key[order], token[order], layer_index[order], slot[order]], axis=1)
    repeated = np.flatnonzero((key[1:] == key[:-1]).all(axis=1))
    if repeated.size:
        i = int(order[repeated[0] + 1])
        cell = f"layer {layer[i]}" + ("" if wide else f", slot {slot[i]}")
        raise InputError(f"{path}: row {i}: ({where(i)}, {cell}) appears twice")
    rows_per_position = n_layers * (1 if wide else k)
    position_start = np.flatnonzero(np.r_[True, (key[1:, :2] != key[:-1, :2]).any(axis=1)])
    counts = np.diff(np.r_[position_start, key.shape[0]])
    bad = np.flatnonzero(counts != rows_per_position)
    if bad.size:
        i = int(order[position_start[bad[0]]])
        cells = "every MoE layer" + ("" if wide else " × every slot")
        raise InputError(f"{path}: {where(i)} has {counts[bad[0]]} rows, expected {rows_per_position} ({cells})")
    pos_seq, pos_token = key[position_start, 0], key[position_start, 1]
    experts = expert[order].reshape(-1, n_layers, k)
    weights = None
    if "weight" in frame.columns:
        weights = _cast(frame, "weight", pl.Float32, path)[order].reshape(-1, n_layers, k)
        if not np.isfinite(weights).all():
            raise InputError(f"{path}: column 'weight' holds an empty or non-finite value")
    first_rows = order[position_start]
    prompt = _cast(frame, "is_prompt", pl.Boolean, path)[first_rows] if "is_prompt" in frame.columns else None
    token_id = _cast(frame, "token_id", pl.Int32, path)[first_rows] if "token_id" in frame.columns else None
    sequences, names = [], []
    starts = np.flatnonzero(np.r_[True, pos_seq[1:] != pos_seq[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], pos_seq.shape[0]], strict=True):
        gaps = np.flatnonzero(np.diff(pos_token[a:b]) != 1)
        if gaps.size:
            missing = pos_token[a + gaps[0]] + 1
            raise InputError(f"{path}: {where(int(first_rows[a]))}: no rows for {position} {missing} (positions must be contiguous)")
        sequences.append(
            Sequence(
                experts[a:b],
                None if weights is None else weights[a:b],
                np.zeros(b - a, bool) if prompt is None else prompt[a:b],
                None if token_id is None else token_id[a:b],
            )
        )
        names.append(tasks[pos_seq[a] // (int(seq.max(initial=0)) + 1)] if tasks else "")
    return assemble(geometry, sequences, engine, path, groups_of(names))
