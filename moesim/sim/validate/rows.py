"""Measurement-table rows (contract 3) predicted the way each was measured (see `moesim.sim.validate`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles.families import ExpertFamily, ExpertInputs
from moesim.hw_profiles.measurements.routing_reuse import calibration_reuse
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.reuse import window_features
from moesim.models import bytes_per_weight
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.validate.predictions import (
    FEATURE_COLUMNS,
    FEATURE_FIELDS,
    SCOPES,
    SPEC_COLUMNS,
    Context,
    Predicted,
    is_preset_reference,
    pass_prediction,
    target_preset,
)
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.importers import TRACE_SUFFIXES, find_trace

# ---- table rows ---------------------------------------------------------------------------------


@dataclass
class Table:
    """A checked measurement table and where it came from."""

    frame: pl.DataFrame
    source: Path

    def value(self, column: str, row: int) -> Any:
        """A cell, or None where the column is absent."""
        return self.frame[column][row] if column in self.frame.columns else None

    def where(self, row: int) -> str:
        """'FILE: row N' for messages."""
        return f"{self.source}: row {row}"

    def kind(self, row: int) -> str:
        """'features' (routing features given) or 'window' (a window of a trace)."""
        if all(self.value(c, row) is not None for c in FEATURE_COLUMNS):
            return "features"
        if self.value("window_start", row) is not None:
            return "window"
        raise InputError(
            f"{self.where(row)}: neither routing features ({', '.join(FEATURE_COLUMNS)}) nor a window (window_start) to predict from"
        )

    def scope(self, row: int) -> str:
        """'expert' (the family's operation) or 'pass' (a whole forward pass)."""
        scope = self.value("scope", row)
        if scope is not None:
            if scope not in SCOPES:
                raise InputError(f"{self.where(row)}: field 'scope' is {scope!r}; expected one of {', '.join(SCOPES)}")
            return str(scope)
        return "pass" if all(self.value(c, row) is not None for c in SPEC_COLUMNS) else "expert"

    def trace_path(self, row: int, default: Path | None) -> Path:
        """The trace of a window row: its `trace` column (relative to the table) or the default
        (--trace: a file, or a folder where bare names are looked up). A bare name (no suffix)
        is looked up as NAME.arrow or NAME.parquet (NAME may hold dots: `model_p0.50`) in that folder, the table's `traces/` folder
        and the table's own folder, in that order."""
        text = self.value("trace", row)
        folder = default if default is not None and default.is_dir() else None
        if text is None:
            if default is None or folder is not None:
                raise InputError(f"{self.where(row)}: a window row needs a trace (column 'trace' or --trace FILE)")
            if not default.is_file():
                raise InputError(f"{self.where(row)}: trace {default} does not exist")
            return default
        path = Path(text) if Path(text).is_absolute() else self.source.parent / text
        if path.is_file():
            return path
        if Path(text).suffix.lower() not in TRACE_SUFFIXES:
            folders = [f for f in (folder, self.source.parent / "traces", self.source.parent) if f is not None]
            found = find_trace(text, folders)
            if found is not None:
                return found
            looked = ", ".join(str(f) for f in folders)
            raise InputError(f"{self.where(row)}: field 'trace' is '{text}': no {'/'.join(TRACE_SUFFIXES)} file of that name in {looked}")
        raise InputError(f"{self.where(row)}: trace {path} does not exist")

    def check_model(self, row: int, geometry: TraceGeometry) -> None:
        """The row's model and shape columns, where given, must describe the trace's model."""
        model = self.value("model", row)
        if model is not None and model != geometry.model:
            raise InputError(f"{self.where(row)}: field 'model' is '{model}', but the trace records model '{geometry.model}'")
        for column in ("experts", "top_k", "hidden", "expert_intermediate"):
            given, actual = self.value(column, row), getattr(geometry, column)
            if given is not None and given != actual:
                raise InputError(f"{self.where(row)}: field '{column}' is {given}, but the trace's model '{geometry.model}' has {actual}")

    def given_features(self, rows: list[int]) -> RoutingFeatures:
        """Routing features of feature rows, shape (rows, 1), checked for consistency, with the reuse
        features their `routing` implies (`hw_profiles.measurements.routing_reuse`, as the fit derives them)."""
        for row in rows:
            n, s, u, m = (self.frame[c][row] for c in FEATURE_FIELDS)
            top_k = self.value("top_k", row)
            if u > s or m > n or m * u < n or (top_k is not None and s != n * top_k):
                raise InputError(
                    f"{self.where(row)}: routing features are inconsistent (n_tokens {n}, slots {s}, distinct_experts {u}, "
                    f"max_tokens_per_expert {m}{'' if top_k is None else f', top_k {top_k}'})"
                )
        counts = [self.frame[c].to_numpy()[rows].astype(np.float64)[:, None] for c in FEATURE_FIELDS]
        reuse = calibration_reuse(self.frame[rows])  # what the row's `routing` implies, as the fit derives it
        reads = {t: r[:, None] for t, r in reuse.chunk_reads.items()}
        return RoutingFeatures(*counts, reuse.reread_histogram[:, None, :], reads)

    def window_features(self, rows: list[int], trace: Trace) -> RoutingFeatures:
        """Per row and MoE layer, the features of the row's window of the trace: shape (rows, L)."""
        seq_starts, lengths = trace.seq_starts, trace.seq_lengths()
        starts = []
        for row in rows:
            seq = self.value("seq", row) or 0
            start, n = int(self.frame["window_start"][row]), int(self.frame["n_tokens"][row])
            if seq >= trace.n_seqs:
                raise InputError(f"{self.where(row)}: field 'seq' is {seq}, but the trace has {trace.n_seqs} sequences")
            if start + n > lengths[seq]:
                raise InputError(
                    f"{self.where(row)}: window [{start}, {start + n}) of sequence {seq} runs past the trace's end "
                    f"({lengths[seq]} positions)"
                )
            starts.append(seq_starts[seq] + start)
        sizes = self.frame["n_tokens"].to_numpy()[rows]
        return window_features(trace.experts, trace.meta.geometry.experts, np.asarray(starts), sizes)

    def expert_shapes(self, rows: list[int], ctx: Context) -> np.ndarray:
        """(rows, 3): hidden, intermediate and bytes of one expert, from the shape columns, else the
        row's preset (`model` or --model; its own weight format unless `dtype` says otherwise)."""
        out = np.empty((len(rows), 3))
        for i, row in enumerate(rows):
            hidden, inter = self.value("hidden", row), self.value("expert_intermediate", row)
            expert_bytes, dtype = self.value("expert_bytes", row), self.value("dtype", row)
            name = self.value("model", row) or ctx.options.model
            preset = ctx.preset(str(name)) if name is not None and is_preset_reference(str(name)) else None
            if hidden is None or inter is None:
                if preset is None:
                    raise InputError(
                        f"{self.where(row)}: fields 'hidden' and 'expert_intermediate' are empty and no preset gives the expert shape "
                        "(column 'model' naming a built-in preset, or --model)"
                    )
                hidden, inter = preset.hidden, preset.expert_intermediate
            if expert_bytes is None:
                if dtype is None and preset is None:
                    raise InputError(f"{self.where(row)}: fields 'expert_bytes' and 'dtype' are empty; one of them gives an expert's bytes")
                fmt = str(dtype) if dtype is not None else preset.default_format  # type: ignore[union-attr]
                expert_bytes = float(3 * hidden * inter * bytes_per_weight(fmt))
            out[i] = (hidden, inter, expert_bytes)
        return out

    def layers(self, row: int, default: int, maximum: int | None) -> int:
        """MoE layers the row measured (`layers`, else the default), at most `maximum`."""
        layers = self.value("layers", row)
        if layers is None:
            return default
        if maximum is not None and layers > maximum:
            raise InputError(f"{self.where(row)}: field 'layers' is {layers}, but the trace's model has {maximum} MoE layers")
        return int(layers)

    def context_tokens(self, row: int, default: int) -> float:
        """KV positions the pass reads: `context_tokens`, else the window's end, else the default."""
        given = self.value("context_tokens", row)
        if given is not None:
            if isinstance(given, bool) or not isinstance(given, int | float) or not given >= 0:
                raise InputError(f"{self.where(row)}: field 'context_tokens' must be a number >= 0, got {given!r}")
            return float(given)
        start = self.value("window_start", row)
        return float(start + self.frame["n_tokens"][row]) if start is not None else float(default)


def _expert_time(family: ExpertFamily, features: RoutingFeatures, shape: np.ndarray, used_layers: np.ndarray, layers: int) -> Predicted:
    """Σ over the first `used_layers` of `layers` MoE layers (last axis) of the family's ladder, each
    layer at its rung's ε; a row over every MoE layer is a whole pass (whole-pass bounds and transfer)."""
    x = ExpertInputs.from_arrays(  # RANGE_FIELDS order: features, then bytes, hidden, intermediate
        features.n_tokens, features.slots, features.distinct_experts, features.max_tokens_per_expert,
        shape[:, 2:3], shape[:, :1], shape[:, 1:2],
        reread_histogram=features.reread_histogram, chunk_reads=features.chunk_reads,
    )  # fmt: skip
    used = np.arange(x.n_tokens.shape[-1])[None, :] < used_layers[:, None]
    out = Predicted.empty(len(used_layers))
    for whole in (False, True):
        rows = np.flatnonzero((used_layers == layers) == whole)
        if rows.size:
            part = family.sum_layers(x.select(rows), used[rows], whole_pass=whole)
            out.put(rows, Predicted(part.time_us, part.low_us, part.high_us, part.extrapolation, part.rung_us))
    return out


def _predict_passes(table: Table, rows: list[int], kernel: str, features: RoutingFeatures, trace: Trace | None, ctx: Context) -> Predicted:
    """Whole passes of table rows, grouped by target preset."""
    out = Predicted.empty(len(rows))
    geometry = trace.meta.geometry if trace is not None else None
    groups: dict[tuple[str, str], list[int]] = {}
    presets = {}
    for i, row in enumerate(rows):
        name = ctx.options.model or table.value("model", row) or (geometry.model if geometry else None)
        preset = target_preset(name, table.where(row), ctx, geometry)
        layers = table.value("layers", row)
        if layers is not None and layers != len(preset.moe_layers):
            raise InputError(f"{table.where(row)}: field 'layers' is {layers}; a whole pass covers all {len(preset.moe_layers)} MoE layers")
        dtype = table.value("dtype", row)
        fmt = str(dtype).upper() if dtype is not None else (geometry.weight_format if geometry else preset.default_format)
        presets[preset.name] = preset
        groups.setdefault((preset.name, fmt), []).append(i)
    for (name, fmt), index in groups.items():
        preset = presets[name]
        model = StepTimeModel(preset, ctx.profile, kernel, fmt)
        shape = (len(index), len(preset.moe_layers))
        chosen = features.select(index, shape)
        context = np.array([table.context_tokens(rows[i], ctx.options.context_tokens) for i in index], np.float64)
        out.put(index, pass_prediction(model, chosen, context))
    return out


def predict_table(table: Table, ctx: Context) -> Predicted:
    """Predict every row of a checked measurement table, group by group."""
    frame = table.frame
    groups: dict[tuple[str, str, str, Path | None], list[int]] = {}
    for row in range(frame.height):
        kind, scope, kernel = table.kind(row), table.scope(row), str(frame["kernel"][row])
        ctx.family(kernel, table.where(row))
        path = table.trace_path(row, ctx.options.trace) if kind == "window" else None
        if path is not None:
            table.check_model(row, ctx.trace(path).meta.geometry)
        groups.setdefault((kind, scope, kernel, path), []).append(row)
    out = Predicted.empty(frame.height)
    for (_kind, scope, kernel, path), rows in groups.items():
        family = ctx.profile.expert_families[kernel]
        trace = ctx.trace(path) if path is not None else None
        features = table.window_features(rows, trace) if trace is not None else table.given_features(rows)
        if scope == "pass":
            out.put(rows, _predict_passes(table, rows, kernel, features, trace, ctx))
        elif trace is not None:
            g = trace.meta.geometry
            shape = np.tile([g.hidden, g.expert_intermediate, g.expert_bytes], (len(rows), 1))
            used = np.array([table.layers(r, len(g.moe_layers), len(g.moe_layers)) for r in rows])
            out.put(rows, _expert_time(family, features, shape, used, len(g.moe_layers)))
        else:
            repeat = np.array([table.layers(r, 1, None) for r in rows], np.float64)
            one = np.ones(len(rows), np.int64)
            out.put(rows, _expert_time(family, features, table.expert_shapes(rows, ctx), one, 0).scaled(repeat))
    return out


def spec_rows(frame: pl.DataFrame, source: Path) -> pl.DataFrame:
    """Measured draft time per step implied by a speculative row: (1 + accepted)·1e6 / tokens_per_s − time_us."""
    present = [c for c in SPEC_COLUMNS if c in frame.columns]
    if len(present) < len(SPEC_COLUMNS):
        return frame.clear()
    rows = frame.filter(pl.all_horizontal(pl.col(c).is_not_null() for c in SPEC_COLUMNS) & (pl.col("_scope") == "pass"))
    step_us = (1.0 + rows["accepted_mean"]) * 1e6 / rows["tokens_per_s"]
    draft = step_us - rows["time_us"]
    bad = (draft < -1e-6 * step_us).arg_true()
    if bad.len():
        i = int(bad[0])
        raise InputError(
            f"{source}: row {int(rows['_row'][i])}: tokens_per_s {rows['tokens_per_s'][i]} with accepted_mean {rows['accepted_mean'][i]} "
            f"implies a step of {step_us[i]:.1f} us, shorter than its verify pass time_us {rows['time_us'][i]}"
        )
    return rows.with_columns(draft.clip(lower_bound=0.0).alias("draft_us"), pl.col("accepted_mean").alias("accepted"))
