"""The `table` importer: Parquet or CSV, one row per (token, layer, slot); see the package docstring."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import polars as pl

from moesim.errors import InputError, first_line
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.importers.common import Sequence, assemble
from moesim.tracegen.importers.registry import IMPORTERS


def _read_table(path: Path) -> pl.DataFrame:
    try:
        if path.suffix.lower() == ".csv":
            return pl.read_csv(path)
        return pl.read_parquet(path)
    except (pl.exceptions.PolarsError, OSError, ValueError) as exc:
        first = first_line(exc)
        raise InputError(f"{path}: not a readable {path.suffix.lstrip('.') or 'table'} file ({first})") from None


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


@IMPORTERS.register
@dataclass(frozen=True)
class TableImporter:
    """A Parquet/CSV table of (seq, token, layer, slot, expert[, weight]) rows."""

    name: ClassVar[str] = "table"

    def read(self, path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
        """The table's routing as a trace (`normalize` does not apply: the table gives the weights)."""
        return import_table(path, geometry)


def import_table(path: Path, geometry: TraceGeometry) -> Trace:
    """A Parquet/CSV table of (seq, token, layer, slot, expert[, weight]) rows."""
    frame = _read_table(path)
    for name in ("token", "layer", "slot", "expert"):
        if name not in frame.columns:
            raise InputError(f"{path}: column '{name}' is missing (need token, layer, slot, expert; optional seq, weight)")
    token, layer, slot, expert = (_int_column(frame, n, path) for n in ("token", "layer", "slot", "expert"))
    seq = _int_column(frame, "seq", path) if "seq" in frame.columns else np.zeros_like(token)
    moe = np.asarray(geometry.moe_layers, np.int64)
    n_layers, k = moe.shape[0], geometry.top_k
    layer_index = np.searchsorted(moe, layer)
    bad = np.flatnonzero((layer_index >= n_layers) | (moe[np.minimum(layer_index, n_layers - 1)] != layer))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{path}: row {i}: field 'layer' is {layer[i]}, not a MoE layer of {geometry.model} ({list(geometry.moe_layers)})")
    bad = np.flatnonzero(slot >= k)
    if bad.size:
        raise InputError(f"{path}: row {int(bad[0])}: field 'slot' is {slot[bad[0]]}, expected 0..{k - 1} (top-k = {k})")
    bad = np.flatnonzero(expert >= geometry.experts)
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{path}: row {i}: field 'expert' is {expert[i]}, but {geometry.model} has {geometry.experts} experts")
    order = np.lexsort((slot, layer_index, token, seq))
    key = np.stack([seq[order], token[order], layer_index[order], slot[order]], axis=1)
    repeated = np.flatnonzero((key[1:] == key[:-1]).all(axis=1))
    if repeated.size:
        i = int(order[repeated[0] + 1])
        raise InputError(f"{path}: row {i}: (seq {seq[i]}, token {token[i]}, layer {layer[i]}, slot {slot[i]}) appears twice")
    position_start = np.flatnonzero(np.r_[True, (key[1:, :2] != key[:-1, :2]).any(axis=1)])
    counts = np.diff(np.r_[position_start, key.shape[0]])
    bad = np.flatnonzero(counts != n_layers * k)
    if bad.size:
        i = int(order[position_start[bad[0]]])
        raise InputError(
            f"{path}: seq {seq[i]} token {token[i]} has {counts[bad[0]]} rows, expected {n_layers * k} (every MoE layer × every slot)"
        )
    pos_seq, pos_token = key[position_start, 0], key[position_start, 1]
    experts = expert[order].reshape(-1, n_layers, k)
    weights = None
    if "weight" in frame.columns:
        weights = _cast(frame, "weight", pl.Float32, path)[order].reshape(-1, n_layers, k)
        if not np.isfinite(weights).all():
            raise InputError(f"{path}: column 'weight' holds an empty or non-finite value")
    prompt = _cast(frame, "is_prompt", pl.Boolean, path)[order][:: n_layers * k] if "is_prompt" in frame.columns else None
    token_id = _cast(frame, "token_id", pl.Int32, path)[order][:: n_layers * k] if "token_id" in frame.columns else None
    sequences = []
    starts = np.flatnonzero(np.r_[True, pos_seq[1:] != pos_seq[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], pos_seq.shape[0]], strict=True):
        gaps = np.flatnonzero(np.diff(pos_token[a:b]) != 1)
        if gaps.size:
            missing = pos_token[a + gaps[0]] + 1
            raise InputError(f"{path}: seq {pos_seq[a]} has no rows for token {missing} (positions must be contiguous)")
        sequences.append(
            Sequence(
                experts[a:b],
                None if weights is None else weights[a:b],
                np.zeros(b - a, bool) if prompt is None else prompt[a:b],
                None if token_id is None else token_id[a:b],
            )
        )
    return assemble(geometry, sequences, "table", path)
