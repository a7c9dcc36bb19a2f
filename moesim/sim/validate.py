"""`moesim validate`: predict every measured row with a hardware profile and compare (issue 8).

Inputs are measurement tables (contract 3, Parquet or CSV) and measured speculative runs
(contract 2, Arrow IPC), several at once. Each row is predicted the way it was measured:

- **expert rows** (the default scope): one kernel family's expert operation. A row with routing
  features (`distinct_experts`, `slots`, `max_tokens_per_expert`; expert shape from `hidden`,
  `expert_intermediate` and `expert_bytes` or `dtype`, else from the `model` preset or
  `--model`) is predicted from them, times `layers` (default 1: one MoE layer). A row with
  `window_start` and `n_tokens` is the pass over positions [window_start, window_start +
  n_tokens) of sequence `seq` (default 0) of its trace (`trace`, relative to the table, or
  `--trace`) through the first `layers` MoE layers (default all), features from the counter.
- **pass rows** (`scope` = `pass`; implied by `draft_len` + `accepted_mean` + `tokens_per_s`;
  every verify step of a speculative run): a whole forward pass through the step-time model
  (the row's family in every MoE layer, the dense part at the pass's KV length, the fixed time),
  the target preset from `--model`, the row's `model` or the trace's.

A row's `kernel` names its family. Every prediction carries the family's held-out bound ε
(`predicted_low_us`, `predicted_high_us`) and `extrapolated` (an input outside the family's
calibrated range: pass size, routing features, or an expert shape the profile was not fitted on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.atomic import atomic_path
from moesim.errors import InputError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.calibrate import apply_filters, parse_filters
from moesim.hw_profiles.families import ExpertFamily, ExpertInputs
from moesim.hw_profiles.measurements import load_measurements
from moesim.hw_profiles.profile import HardwareProfile
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.unions import union_features_many
from moesim.models import ModelPreset, builtin_names, bytes_per_weight, load_preset
from moesim.sim.spec_passes import plain_decode_us, verify_passes
from moesim.sim.steptime import StepTimeModel
from moesim.sim.validate_metrics import (
    DedupValidation,
    curve_key,
    curve_label,
    dedup_families,
    dedup_validation,
    errors_by,
    speculative_curves,
    time_errors,
)
from moesim.tracegen.schema import TraceGeometry
from moesim.tracegen.specrun import SpecRun, read_spec_run
from moesim.tracegen.trace import Trace, read_trace

FEATURE_COLUMNS = ("distinct_experts", "slots", "max_tokens_per_expert")
FEATURE_FIELDS = ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert")  # RoutingFeatures order
SPEC_COLUMNS = ("draft_len", "accepted_mean", "tokens_per_s")
SCOPES = ("expert", "pass")
RUN_SUFFIXES = (".arrow", ".ipc", ".feather")
PREDICTED_COLUMNS = ("predicted_us", "predicted_low_us", "predicted_high_us", "extrapolated")
EXTRAPOLATION_TOLERANCE = 1e-9


@dataclass(frozen=True)
class ValidateOptions:
    """How to predict: the profile, a default trace, the target preset and engine family of pass
    rows, the KV length of pass rows that carry no position, and row filters (COL=VALUE)."""

    profile: str
    trace: Path | None = None
    model: str | None = None
    engine: str | None = None
    context_tokens: int = 512
    filters: tuple[str, ...] = ()


@dataclass(frozen=True)
class Predicted:
    """Predictions of some rows, in the rows' order: time with its bound, extrapolation factor."""

    time_us: np.ndarray
    low_us: np.ndarray
    high_us: np.ndarray
    extrapolation: np.ndarray

    def scaled(self, factor: np.ndarray) -> Predicted:
        """Times multiplied by a per-row factor (e.g. identical MoE layers)."""
        return Predicted(self.time_us * factor, self.low_us * factor, self.high_us * factor, self.extrapolation)

    @classmethod
    def empty(cls, rows: int) -> Predicted:
        """Zero predictions (filled group by group)."""
        return cls(np.zeros(rows), np.zeros(rows), np.zeros(rows), np.ones(rows))

    def put(self, index: np.ndarray | list[int], part: Predicted) -> None:
        """Write a group's predictions at its rows."""
        for name in ("time_us", "low_us", "high_us", "extrapolation"):
            getattr(self, name)[index] = getattr(part, name)

    def columns(self) -> list[pl.Series]:
        """The four prediction columns of predictions.parquet."""
        return [
            pl.Series("predicted_us", self.time_us),
            pl.Series("predicted_low_us", self.low_us),
            pl.Series("predicted_high_us", self.high_us),
            pl.Series("extrapolated", self.extrapolation > 1.0 + EXTRAPOLATION_TOLERANCE),
            pl.Series("_extrapolation", self.extrapolation),
        ]


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else 0.0


class _Context:
    """The profile, and the traces and presets read once per validation."""

    def __init__(self, options: ValidateOptions) -> None:
        self.options = options
        self.profile: HardwareProfile = load_profile(options.profile)
        self.warnings: list[str] = []
        self._traces: dict[Path, Trace] = {}
        self._presets: dict[str, ModelPreset] = {}

    def trace(self, path: Path) -> Trace:
        key = path.resolve()
        if key not in self._traces:
            self._traces[key] = read_trace(path)
        return self._traces[key]

    def preset(self, name: str) -> ModelPreset:
        if name not in self._presets:
            self._presets[name] = load_preset(name)
        return self._presets[name]

    def family(self, kernel: str, where: str) -> ExpertFamily:
        if kernel == "dense":
            raise InputError(f"{where}: field 'kernel' is 'dense'; validate predicts expert families and whole passes, not dense rows")
        if kernel not in self.profile.expert_families:
            known = ", ".join(self.profile.expert_families)
            raise InputError(
                f"{where}: field 'kernel' is '{kernel}', but profile '{self.profile.name}' has no such expert family ({known})"
            )
        family = self.profile.expert_families[kernel]
        if not math.isfinite(family.heldout_error.epsilon):
            note = f"family '{kernel}' of profile '{self.profile.name}' has no held-out error: its bounds have zero width"
            if note not in self.warnings:
                self.warnings.append(note)
        return family


def _is_preset_reference(name: str) -> bool:
    return name in builtin_names("moe") or Path(name).suffix in (".toml", ".json")


# ---- table rows ---------------------------------------------------------------------------------


@dataclass
class _Table:
    """A checked measurement table and where it came from."""

    frame: pl.DataFrame
    source: Path

    def value(self, column: str, row: int) -> Any:
        return self.frame[column][row] if column in self.frame.columns else None

    def where(self, row: int) -> str:
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
        text = self.value("trace", row)
        if text is None and default is None:
            raise InputError(f"{self.where(row)}: a window row needs a trace (column 'trace' or --trace)")
        path = default if text is None else (Path(text) if Path(text).is_absolute() else self.source.parent / text)
        if not path.is_file():  # type: ignore[union-attr]
            raise InputError(f"{self.where(row)}: trace {path} does not exist")
        return path  # type: ignore[return-value]

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
        """Routing features of feature rows, shape (rows, 1), checked for consistency."""
        for row in rows:
            n, s, u, m = (self.frame[c][row] for c in FEATURE_FIELDS)
            top_k = self.value("top_k", row)
            if u > s or m > n or m * u < n or (top_k is not None and s != n * top_k):
                raise InputError(
                    f"{self.where(row)}: routing features are inconsistent (n_tokens {n}, slots {s}, distinct_experts {u}, "
                    f"max_tokens_per_expert {m}{'' if top_k is None else f', top_k {top_k}'})"
                )
        return RoutingFeatures(*(self.frame[c].to_numpy()[rows].astype(np.float64)[:, None] for c in FEATURE_FIELDS))

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
        union = union_features_many(trace.experts, np.arange(len(rows) + 1), np.asarray(starts), sizes, trace.meta.geometry.experts)
        return union.routing_features()

    def expert_shapes(self, rows: list[int], ctx: _Context) -> np.ndarray:
        """(rows, 3): hidden, intermediate and bytes of one expert, from the shape columns, else the
        row's preset (`model` or --model; its own weight format unless `dtype` says otherwise)."""
        out = np.empty((len(rows), 3))
        for i, row in enumerate(rows):
            hidden, inter = self.value("hidden", row), self.value("expert_intermediate", row)
            expert_bytes, dtype = self.value("expert_bytes", row), self.value("dtype", row)
            name = self.value("model", row) or ctx.options.model
            preset = ctx.preset(str(name)) if name is not None and _is_preset_reference(str(name)) else None
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


def _expert_time(family: ExpertFamily, features: RoutingFeatures, shape: np.ndarray, used_layers: np.ndarray) -> Predicted:
    """Σ over the first `used_layers` MoE layers (last axis) of the family's time, with its ε bound."""
    x = ExpertInputs.from_arrays(  # RANGE_FIELDS order: features, then bytes, hidden, intermediate
        features.n_tokens, features.slots, features.distinct_experts, features.max_tokens_per_expert,
        shape[:, 2:3], shape[:, :1], shape[:, 1:2],
    )  # fmt: skip
    used = np.arange(x.n_tokens.shape[-1])[None, :] < used_layers[:, None]
    time_us = np.where(used, family.inputs_time_us(x), 0.0).sum(axis=-1)
    factor = np.where(used, family.calibrated_range.factor(x), 1.0).max(axis=-1)
    epsilon = _finite(family.heldout_error.epsilon)
    return Predicted(time_us, time_us * (1.0 - epsilon), time_us * (1.0 + epsilon), factor)


def pass_prediction(model: StepTimeModel, features: RoutingFeatures, context_tokens: np.ndarray) -> Predicted:
    """Whole passes (features shaped (passes, MoE layers)) through the step-time model."""
    cost = model.pass_cost(features, context_tokens)
    return Predicted(cost.total_us(), cost.low_us, cost.high_us, cost.extrapolation)


def _target_preset(name: str | None, where: str, ctx: _Context, geometry: TraceGeometry | None) -> ModelPreset:
    """The target preset of whole passes, checked against the routing it replays."""
    if name is None or not _is_preset_reference(str(name)):
        raise InputError(f"{where}: a whole pass needs the target's preset: column 'model' naming a built-in preset, or --model")
    preset = ctx.preset(str(name))
    if preset.kind != "moe":
        raise InputError(f"{where}: model preset '{preset.name}' has no experts")
    if geometry is not None and (preset.top_k, preset.experts, preset.moe_layers) != (
        geometry.top_k,
        geometry.experts,
        geometry.moe_layers,
    ):
        raise InputError(
            f"{where}: preset '{preset.name}' (top-{preset.top_k} of {preset.experts}, {len(preset.moe_layers)} MoE layers) does not "
            f"route like model '{geometry.model}' (top-{geometry.top_k} of {geometry.experts}, {len(geometry.moe_layers)} MoE layers)"
        )
    return preset


def _predict_passes(
    table: _Table, rows: list[int], kernel: str, features: RoutingFeatures, trace: Trace | None, ctx: _Context
) -> Predicted:
    """Whole passes of table rows, grouped by target preset."""
    out = Predicted.empty(len(rows))
    geometry = trace.meta.geometry if trace is not None else None
    groups: dict[tuple[str, str], list[int]] = {}
    presets = {}
    for i, row in enumerate(rows):
        name = ctx.options.model or table.value("model", row) or (geometry.model if geometry else None)
        preset = _target_preset(name, table.where(row), ctx, geometry)
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
        chosen = RoutingFeatures(*(np.broadcast_to(getattr(features, f)[index], shape) for f in FEATURE_FIELDS))
        context = np.array([table.context_tokens(rows[i], ctx.options.context_tokens) for i in index], np.float64)
        out.put(index, pass_prediction(model, chosen, context))
    return out


def _predict_table(table: _Table, ctx: _Context) -> Predicted:
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
            out.put(rows, _expert_time(family, features, shape, used))
        else:
            repeat = np.array([table.layers(r, 1, None) for r in rows], np.float64)
            out.put(rows, _expert_time(family, features, table.expert_shapes(rows, ctx), np.ones(len(rows), np.int64)).scaled(repeat))
    return out


def _spec_rows(frame: pl.DataFrame, source: Path) -> pl.DataFrame:
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


# ---- speculative runs (contract 2) --------------------------------------------------------------


def _run_engine(ctx: _Context, source: Path) -> str:
    engine = ctx.options.engine
    families = list(ctx.profile.expert_families)
    if engine is None:
        if len(families) != 1:
            raise InputError(f"{source}: profile '{ctx.profile.name}' has several expert families ({', '.join(families)}): give --engine")
        engine = families[0]
    ctx.family(engine, f"{source}: --engine")
    return engine


def _predict_run(run: SpecRun, source: Path, ctx: _Context) -> tuple[pl.DataFrame, StepTimeModel]:
    """One row per verify step: the measured pass and its prediction through the step-time model."""
    g = run.meta.geometry
    engine = _run_engine(ctx, source)
    preset = _target_preset(ctx.options.model or g.model, f"{source}", ctx, g)
    model = StepTimeModel(preset, ctx.profile, engine, g.weight_format)
    steps = run.steps
    n_tokens = (steps["drafted"].cast(pl.Int64) + 1).to_numpy()
    predicted = pass_prediction(model, *verify_passes(run))
    plain = [s.plain_decode_us for s in run.meta.sequences]
    frame = pl.DataFrame(
        {
            "kernel": engine,
            "model": g.model,
            "draft_model": run.meta.draft_model,
            "_scope": "pass",
            "seq": steps["seq"].cast(pl.Int64),
            "step": steps["step"].cast(pl.Int64),
            "window_start": steps["pos0"].cast(pl.Int64),
            "n_tokens": n_tokens,
            "draft_len": steps["drafted"].cast(pl.Int64),
            "accepted": steps["accepted"].cast(pl.Float64),
            "draft_us": steps["draft_us"],
            "time_us": steps["verify_us"],
            "plain_decode_us": [plain[s] for s in steps["seq"].to_list()],
        }
    )
    return frame.with_columns(predicted.columns()), model


# ---- the result -----------------------------------------------------------------------------------


@dataclass
class Validation:
    """Predictions of every measured row and what they say about the profile's decisions."""

    profile: str
    predictions: pl.DataFrame
    dedup: list[DedupValidation]
    speculative: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The `--json` object."""
        frame = self.predictions
        out: dict[str, Any] = {"profile": self.profile, **time_errors(frame).to_dict()}
        out["extrapolated_rows"] = int(frame["extrapolated"].sum())
        out["per_family"] = errors_by(frame, "kernel")
        pairs = [d.pairs for d in self.dedup if d.pairs.height]
        pooled = pl.concat(pairs, how="diagonal_relaxed") if pairs else None
        out["saving_inside_bound_fraction"] = float(pooled["inside"].mean()) if pooled is not None else None  # type: ignore[arg-type]
        out["mean_bound_width_pct"] = float(pooled["bound_width_pct"].mean()) if pooled is not None else None  # type: ignore[arg-type]
        if len(self.dedup) == 1:
            one = self.dedup[0].to_dict()
            out["dedup_family"] = self.dedup[0].family
            for key in ("crossover_measured", "crossover_predicted", "dedup_wins_measured", "dedup_wins_predicted", "curves"):
                out[key] = one[key]
        out["families"] = {d.family: d.to_dict() for d in self.dedup}
        out["speculative"] = self.speculative
        if len(self.speculative) == 1:
            out["best_draft_measured"] = self.speculative[0]["best_draft_measured"]
            out["best_draft_predicted"] = self.speculative[0]["best_draft_predicted"]
        out["warnings"] = self.warnings
        return out

    def family_table(self) -> pl.DataFrame:
        """Time errors per family (%)."""
        rows = []
        for family, stats in errors_by(self.predictions, "kernel").items():
            part = self.predictions.filter(pl.col("kernel") == family)
            rows.append(
                {
                    "family": family,
                    "rows": stats["rows"],
                    "median_abs_%": stats["median_abs_pct_error"],
                    "p90_abs_%": stats["p90_abs_pct_error"],
                    "mean_signed_%": stats["mean_signed_pct_error"],
                    "pearson_r": stats["pearson_r"],
                    "inside_bound": stats["time_inside_bound_fraction"],
                    "extrapolated": int(part["extrapolated"].sum()),
                }
            )
        return pl.DataFrame(rows)

    def dedup_table(self) -> pl.DataFrame:
        """Per dedup family and curve: crossover and win set, measured and predicted; savings inside the bound."""
        rows = [
            {
                "family": d.family,
                "curve": curve_label(c["curve"]),
                "crossover_measured": c["crossover_measured"],
                "crossover_predicted": c["crossover_predicted"],
                "wins_measured": _ranges(c["dedup_wins_measured"]),
                "wins_predicted": _ranges(c["dedup_wins_predicted"]),
                "saving_inside_bound": c["saving_inside_bound_fraction"],
                "bound_width_pp": c["mean_bound_width_pct"],
            }
            for d in self.dedup
            for c in d.curves
        ]
        return pl.DataFrame(rows)

    def speculative_table(self) -> pl.DataFrame:
        """Per speculative curve and draft length: tokens per pass and tokens/s, measured and predicted."""
        rows = [
            {
                "curve": curve_label(c["curve"]),
                "draft_len": k,
                "tokens_per_pass": tau,
                "tokens_per_s_measured": measured,
                "tokens_per_s_predicted": predicted,
                "error_%": error,
            }
            for c in self.speculative
            for k, tau, measured, predicted, error in zip(
                c["draft_lens"],
                c["tokens_per_pass"],
                c["tokens_per_s_measured"],
                c["tokens_per_s_predicted"],
                c["tokens_per_s_pct_error"],
                strict=True,
            )
        ]
        return pl.DataFrame(rows)

    def write(self, out_dir: Path) -> Path:
        """Write `out_dir`/predictions.parquet (created atomically; the folder is made if missing)."""
        check_out_dir(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "predictions.parquet"
        with atomic_path(path) as tmp:
            self.predictions.write_parquet(tmp)
        return path


def check_out_dir(out_dir: Path) -> None:
    """Fail before any work when `out_dir` cannot hold the output."""
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir}: --out must be a folder, but a file of that name exists")
    if (out_dir / "predictions.parquet").is_dir():
        raise InputError(f"{out_dir / 'predictions.parquet'}: output path is a directory")


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    parts: list[list[int]] = []
    for v in values:
        if parts and v == parts[-1][-1] + 1:
            parts[-1].append(v)
        else:
            parts.append([v])
    return ", ".join(f"{p[0]}-{p[-1]}" if len(p) > 1 else str(p[0]) for p in parts) or "-"


def _speculative(tables: list[pl.DataFrame], runs: list[tuple[pl.DataFrame, StepTimeModel]]) -> list[dict[str, Any]]:
    """Tokens per second per draft length, measured and predicted with the measured acceptance
    and drafting time; k = 0 from plain decoding where the runs timed it."""
    per_draft = []
    for rows in tables:
        if rows.height == 0:
            continue
        columns = [c for c in curve_key(rows) if c not in ("_scope", "layers", "window_start", "seq", "_source", "_row")]
        tokens = 1.0 + pl.col("accepted")
        grouped = rows.group_by(*columns, "draft_len").agg(
            pl.col("tokens_per_s").mean().alias("tokens_per_s_measured"),
            (tokens * 1e6 / (pl.col("draft_us") + pl.col("predicted_us"))).mean().alias("tokens_per_s_predicted"),
            tokens.mean().alias("tokens_per_pass"),
        )
        per_draft.append((grouped, columns))
    run_rows = []
    for steps, model in runs:
        tokens = float((steps["accepted"] + 1.0).sum())
        row = {
            "model": steps["model"][0],
            "draft_model": steps["draft_model"][0],
            "draft_len": int(steps["draft_len"].max()),  # type: ignore[arg-type]
            "tokens_per_s_measured": tokens * 1e6 / float((steps["draft_us"] + steps["time_us"]).sum()),
            "tokens_per_s_predicted": tokens * 1e6 / float((steps["draft_us"] + steps["predicted_us"]).sum()),
            "tokens_per_pass": tokens / steps.height,
        }
        run_rows.append(row)
        plain = steps["plain_decode_us"].drop_nans().drop_nulls()
        if plain.len() == steps.height:
            context = steps["window_start"].to_numpy().astype(np.float64) + 1.0
            one_token = plain_decode_us(model, context)
            run_rows.append({**row, "draft_len": 0, "tokens_per_pass": 1.0, "tokens_per_s_measured": 1e6 / float(plain.mean()),
                             "tokens_per_s_predicted": 1e6 / float(one_token.mean())})  # fmt: skip
    if run_rows:
        frame = pl.DataFrame(run_rows).group_by("model", "draft_model", "draft_len", maintain_order=True).agg(pl.all().mean())
        per_draft.append((frame, ["model", "draft_model"]))
    return [curve for grouped, columns in per_draft for curve in speculative_curves(grouped, columns)]


def validate(measured: list[Path], options: ValidateOptions) -> Validation:
    """Predict every row of the measured inputs with the profile and compare."""
    if not measured:
        raise InputError("give at least one measurement table or speculative run")
    if options.context_tokens < 0:
        raise InputError(f"--context must be >= 0, got {options.context_tokens}")
    ctx = _Context(options)
    filters = parse_filters(list(options.filters))
    frames: list[pl.DataFrame] = []
    spec_tables: list[pl.DataFrame] = []
    runs: list[tuple[pl.DataFrame, StepTimeModel]] = []
    for path in measured:
        if path.suffix.lower() in RUN_SUFFIXES:
            steps, model = _predict_run(read_spec_run(path), path, ctx)
            steps = apply_filters(steps, filters, str(path)) if filters else steps
            runs.append((steps, model))
            frames.append(steps.with_columns(pl.lit(path.name).alias("_source")))
            continue
        frame = load_measurements(path)
        frame = apply_filters(frame, filters, str(path)) if filters else frame
        table = _Table(frame, path)
        predicted = _predict_table(table, ctx)
        scopes = [table.scope(r) for r in range(frame.height)]
        frame = frame.with_columns(predicted.columns()).with_columns(pl.Series("_scope", scopes), pl.lit(path.name).alias("_source"))
        spec_tables.append(_spec_rows(frame.with_row_index("_row"), path))
        frames.append(frame)
    predictions = pl.concat(frames, how="diagonal_relaxed")
    dedup = [dedup_validation(predictions, family) for family in dedup_families(predictions)]
    speculative = _speculative(spec_tables, runs)
    factor = predictions["_extrapolation"]
    if predictions["extrapolated"].any():
        ctx.warnings.append(
            f"{int(predictions['extrapolated'].sum())} of {predictions.height} rows lie beyond their family's calibrated range "
            f"(extrapolation factor up to {float(factor.max()):.2f}; column 'extrapolated'); the roofline bounds them from below"  # type: ignore[arg-type]
        )
    predictions = predictions.drop("_scope", "_extrapolation")
    predictions = predictions.drop("_source") if len(measured) == 1 else predictions.rename({"_source": "source"})
    return Validation(ctx.profile.name, predictions, dedup, speculative, ctx.warnings)
