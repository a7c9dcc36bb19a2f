"""The lookup ladder of a fitted family: its knots, its fitted rung per shape, each rung's bound.

- **Knots** (`ladder.grid`): the family's calibration rows, equal features merged. Interpolation
  features: distinct experts U; for tiled kernels also the busiest expert M (it sets the variant).
- **Fitted rung of a shape the table has**: the family's terms fitted again with that shape's
  rows weighted w, w ∈ `WEIGHTS`, chosen on the calibration alone: the lowest p90 error on the
  shape's rows when each of its routings is held out in turn (the other shapes' rows kept), a
  smaller w within `WEIGHT_TIE` of the best. A shape the table lacks takes the plain fit.
- **Bounds** (`ladder.rungs.RungErrors`, one layer): exact = the repeatability of the measured
  point (half the p10–p90 spread of its repetitions, where the table has them); interpolated =
  each routing of a shape and n held out (the model refitted without that shape's rows of that
  routing) and predicted from the other knots of its shape and n, linear in U where they bracket
  it (1-D even for 2-D families: three knots leave none to hold out of a triangle); fitted =
  the family's leave-one-shape-out error; extrapolated = the same, the factor flagged per row.

**Whole passes** (`profile fit --passes`): a whole-pass table (contract 3; `data/h200/fulldepth/passes.parquet`) holds one row per pass of n
tokens through every MoE layer of a model, with its window of a routing trace (`trace`, `seq`,
`window_start`, `n_tokens`). Each pass is predicted as the sum of its layers through the family's
lookup ladder (the layer model never sees passes). Per family, the pass-level terms
T = a·Σt + b·L (`ladder.transfer.KINDS`: a alone, b alone, both; Huber on relative residuals,
δ = 2 %) are fitted leave-one-model-out: the terms for each model's passes come from the other
models' passes only. The best kind is applied (refitted on every model) only where its
leave-one-model-out loss is more than `SIMPLER_WITHIN` below the plain sum's; otherwise a = 1,
b = 0 and the evidence says so. With passes of fewer than two models nothing is fitted. The
whole-pass errors of each rung (passes grouped by the rung that produced most of their time)
become the rungs' whole-pass bounds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles.families import ExpertFamily, ExpertInputs
from moesim.hw_profiles.fitting.family_fit import (
    HUBER_DELTA,
    SIMPLER_WITHIN,
    FamilyFit,
    family_from_terms,
    huber_irls,
    predict_terms,
    refit_weighted,
)
from moesim.hw_profiles.heldout import ErrorStats, HeldoutError
from moesim.hw_profiles.ladder.grid import CalibrationGrid, merged_knots, shape_label
from moesim.hw_profiles.ladder.interpolate import barycentric
from moesim.hw_profiles.ladder.rungs import RUNGS, RungErrors, Stats
from moesim.hw_profiles.ladder.transfer import KINDS, PassTransfer
from moesim.hw_profiles.measurements.table import load_measurements
from moesim.kernels.reuse import cached_rereads, window_features
from moesim.models import load_preset
from moesim.tracegen.importers import find_trace, open_trace

WEIGHTS = (1.0, 3.0, 10.0, 30.0, 100.0, 1e6)
WEIGHT_TIE = 0.02


def _labels(x: ExpertInputs) -> np.ndarray:
    top_k = np.round(x.slots / x.n_tokens)
    return np.array([shape_label(*row) for row in zip(x.hidden, x.intermediate, x.expert_bytes, top_k, strict=True)], dtype=object)


def interpolation_features(family: ExpertFamily) -> tuple[str, ...]:
    """U, and the busiest expert for a tiled kernel (its variant)."""
    return ("distinct_experts", "max_tokens_per_expert") if family.structure.variants else ("distinct_experts",)


def knot_columns(family: ExpertFamily, x: ExpertInputs, measured_us: np.ndarray) -> dict[str, np.ndarray]:
    """Per calibration row, the grid's columns (tile reads at the family's T, re-reads its cache serves)."""
    t = family.structure.tokens_per_read
    reads = x.chunk_reads.get(t) if (t > 1 and x.chunk_reads) else None
    cached = np.zeros(np.shape(x.n_tokens))
    if family.structure.reuse_distance and x.reread_histogram is not None:
        cached = np.minimum(cached_rereads(x.reread_histogram, x.expert_bytes, family.cache_bytes), x.slots - x.distinct_experts)
    return {
        "n_tokens": x.n_tokens,
        "slots": x.slots,
        "distinct_experts": x.distinct_experts,
        "max_tokens_per_expert": x.max_tokens_per_expert,
        "chunk_reads": x.distinct_experts if reads is None else reads,
        "cached_rereads": cached,
        "time_us": measured_us,
    }


def build_grid(fit: FamilyFit) -> CalibrationGrid:
    """The family's knots."""
    return merged_knots(knot_columns(fit.family, fit.inputs, fit.measured_us), _labels(fit.inputs), interpolation_features(fit.family))


def _p90(errors: list[np.ndarray]) -> float:
    return float(np.quantile(np.abs(np.concatenate(errors)), 0.9)) if errors else np.inf


def choose_weight(fit: FamilyFit, own: np.ndarray) -> tuple[float, dict[float, float]]:
    """The shape weight (module docstring) and each candidate's held-out p90."""
    if fit.routings is None or len(np.unique(fit.routings[own])) < 2:
        return 1.0, {}
    x, y = fit.inputs, fit.measured_us
    scores = {}
    for weight in WEIGHTS:
        errors = []
        for routing in np.unique(fit.routings[own]):
            held = own & (fit.routings == routing)
            terms = refit_weighted(fit.terms, x.select(~held), y[~held], np.where(own, weight, 1.0)[~held])
            errors.append(predict_terms(terms, x.select(held)) / y[held] - 1.0)
        scores[weight] = _p90(errors)
    best = min(scores.values())
    return min(w for w, score in scores.items() if score <= best * (1.0 + WEIGHT_TIE)), scores


def shape_fits(fit: FamilyFit) -> tuple[dict[str, ExpertFamily], dict[str, float]]:
    """The fitted rung of every shape whose chosen weight is above 1, and every shape's weight."""
    labels = _labels(fit.inputs)
    family = fit.family
    fits, weights = {}, {}
    for label in dict.fromkeys(labels.tolist()):
        own = labels == label
        weight, _ = choose_weight(fit, own)
        weights[label] = weight
        if weight > 1.0:
            terms = refit_weighted(fit.terms, fit.inputs, fit.measured_us, np.where(own, weight, 1.0))
            fit_family = family_from_terms(
                family.name, terms, family.calibrated_range, family.heldout_error, family.provenance, family.roofline,
                note=f"{family.name} fitted with the rows of shape {label} weighted {weight:g}",
            )  # fmt: skip
            fits[label] = dataclasses.replace(fit_family, fit_weight=weight)
    return fits, weights


def _stats(errors: np.ndarray) -> Stats | None:
    if errors.size == 0:
        return None
    s = ErrorStats.from_errors(errors)
    return Stats(s.median, s.p90, s.max, s.rows)


def interpolated_errors(fit: FamilyFit) -> np.ndarray:
    """Signed errors of knots predicted by interpolation from the other knots of their shape and n."""
    if fit.routings is None:
        return np.zeros(0)
    x, y = fit.inputs, fit.measured_us
    labels = _labels(x)
    errors = []
    for label in dict.fromkeys(labels.tolist()):
        for routing in np.unique(fit.routings):
            held = (labels == label) & (fit.routings == routing)
            if not held.any() or held.all():  # nothing to hold out, or nothing left to refit on
                continue
            terms = refit_weighted(fit.terms, x.select(~held), y[~held], np.ones(int((~held).sum())))
            fitted = predict_terms(terms, x)
            for n in np.unique(x.n_tokens[held]):
                knots = (labels == label) & (x.n_tokens == n) & ~held
                queries = np.flatnonzero(held & (x.n_tokens == n))
                if knots.sum() < 2:
                    continue
                weights, inside = barycentric(x.distinct_experts[knots][:, None], x.distinct_experts[queries][:, None])
                interior = inside & (weights.max(axis=1) < 1.0 - 1e-9)  # strictly between knots: a real interpolation
                predicted = fitted[queries] + weights @ (y[knots] - fitted[knots])
                errors.append((predicted / y[queries] - 1.0)[interior])
    return np.concatenate(errors) if errors else np.zeros(0)


def rung_errors(fit: FamilyFit, frame: pl.DataFrame) -> RungErrors:
    """Each rung's one-layer held-out error (module docstring)."""
    one_layer: dict[str, Stats] = {}
    notes = {}
    spread_columns = ("time_us_p10", "time_us_p90")
    if all(name in frame.columns and frame[name].null_count() == 0 for name in spread_columns):  # every row has both
        spread = (frame["time_us_p90"].to_numpy() - frame["time_us_p10"].to_numpy()) / 2.0 / fit.measured_us
        exact = _stats(spread)
        if exact is not None:
            one_layer["exact"] = exact
        notes["exact"] = "repeatability of a measured point: half the p10-p90 spread of its repetitions over its median"
    else:
        notes["exact"] = "no repetition spread in the table: the interpolated rung's bound"
    interpolated = _stats(interpolated_errors(fit))
    if interpolated is not None:
        one_layer["interpolated"] = interpolated
        one_layer.setdefault("exact", interpolated)
    notes["interpolated"] = "each routing of a shape and n held out (model refitted without it) and interpolated in U from the other knots"
    heldout: HeldoutError = fit.family.heldout_error
    shape_out = heldout.leave_one_shape_out or heldout.leave_one_routing_out or heldout.in_sample
    if shape_out is not None:
        one_layer["fitted"] = one_layer["extrapolated"] = Stats(shape_out.median, shape_out.p90, shape_out.max, shape_out.rows)
    notes["fitted"] = "the family's leave-one-shape-out error (a shape the fit never saw)"
    notes["extrapolated"] = "the fitted rung's bound; how far outside the calibrated range is flagged per prediction"
    return RungErrors(one_layer, {}, notes)


def with_ladder(fit: FamilyFit, frame: pl.DataFrame) -> tuple[ExpertFamily, dict[str, float]]:
    """The fitted family with its knots, its fitted rung per shape and its rung bounds (and the shape weights)."""
    fits, weights = shape_fits(fit)
    family = dataclasses.replace(fit.family, grid=build_grid(fit), shape_fits=fits, rung_errors=rung_errors(fit, frame))
    return family, weights


# ---- whole passes: pass-level terms and whole-pass bounds -----------------------------------------

NEEDED = ("kernel", "model", "trace", "window_start", "n_tokens", "time_us")


@dataclass(frozen=True)
class WholePasses:
    """Whole passes of one table, predicted as the sum of their layers."""

    frame: pl.DataFrame  # the rows (kernel, model, time_us, ...)
    layers_us: np.ndarray  # Σ over the MoE layers of the ladder's times
    rung_us: np.ndarray  # (rows, 4) of that time per rung
    layers: np.ndarray  # MoE layers per pass


def predict_whole_passes(path: Path, families: dict[str, ExpertFamily]) -> WholePasses:
    """Every row of a whole-pass table whose family the profile has, as the sum of its layers."""
    frame = load_measurements(path)
    missing = [c for c in NEEDED if c not in frame.columns]
    if missing:
        raise InputError(f"{path}: column '{missing[0]}' is missing: a whole-pass table needs {', '.join(NEEDED)}")
    frame = frame.filter(pl.col("kernel").is_in(list(families))).with_row_index("_row")
    layers_us, rung_us, layers = np.zeros(frame.height), np.zeros((frame.height, len(RUNGS))), np.zeros(frame.height)
    for (kernel, name), part in frame.group_by("kernel", "trace", maintain_order=True):
        trace_path = find_trace(str(name), [path.parent / "traces", path.parent]) or path.parent / str(name)
        if not trace_path.is_file():
            raise InputError(f"{path}: field 'trace' is '{name}': no such trace beside the table or in its traces/ folder")
        trace = open_trace(trace_path)
        g = trace.meta.geometry
        seq = part["seq"].fill_null(0).to_numpy() if "seq" in part.columns else np.zeros(part.height, np.int64)
        starts = trace.seq_starts[seq] + part["window_start"].to_numpy()
        lengths = part["n_tokens"].to_numpy()
        if np.any(part["window_start"].to_numpy() + lengths > trace.seq_lengths()[seq]):
            raise InputError(f"{path}: a window of trace '{name}' runs past the trace's end")
        features = window_features(trace.experts, g.experts, starts, lengths)
        shape = load_preset(g.model).expert_shape(g.weight_format)
        summed = families[str(kernel)].sum_layers(ExpertInputs.of(features, shape))
        rows = part["_row"].to_numpy()
        layers_us[rows], rung_us[rows], layers[rows] = summed.time_us, summed.rung_us, len(g.moe_layers)
    return WholePasses(frame, layers_us, rung_us, layers)


def _fit_terms(kind: str, layers_us: np.ndarray, layers: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    """(a, b) minimising the Huber loss of relative residuals (IRLS on least squares; b free in sign)."""
    columns = {"a": [layers_us], "b": [layers], "ab": [layers_us, layers]}[kind]
    offset = np.zeros_like(measured) if "a" in kind else layers_us
    design = np.column_stack(columns) / measured[:, None]
    target = 1.0 - offset / measured
    theta = huber_irls(lambda w: np.linalg.lstsq(design * w[:, None], target * w, rcond=None)[0], design, target, HUBER_DELTA)
    a = float(theta[0]) if "a" in kind else 1.0
    b = float(theta[-1]) if "b" in kind else 0.0
    return a, b


def _huber_loss(errors: np.ndarray) -> float:
    r = np.abs(errors)
    return float(np.mean(np.where(r <= HUBER_DELTA, 0.5 * r**2, HUBER_DELTA * (r - 0.5 * HUBER_DELTA))))


def _summary(errors: np.ndarray) -> dict[str, float | int]:
    return ErrorStats.from_errors(errors).to_dict() if errors.size else {"median": 0.0, "p90": 0.0, "max": 0.0, "rows": 0}


@dataclass(frozen=True)
class TransferFit:
    """The terms of one family and the whole-pass errors behind them (leave-one-model-out)."""

    family: str
    transfer: PassTransfer
    predicted_us: np.ndarray  # each pass predicted without its own model's passes (with the terms if applied)
    measured_us: np.ndarray
    rung_us: np.ndarray


def fit_transfer(passes: WholePasses, family: str, source: str) -> TransferFit:
    """Leave-one-model-out pass-level terms of one family (module docstring)."""
    rows = (passes.frame["kernel"] == family).to_numpy()
    measured = passes.frame["time_us"].to_numpy()[rows]
    summed, layers = passes.layers_us[rows], passes.layers[rows]
    models = passes.frame["model"].to_numpy()[rows].astype(str)
    names = tuple(dict.fromkeys(models.tolist()))
    identity = summed / measured - 1.0
    best_kind, best_loss, best_pred = KINDS[0], np.inf, summed
    if len(names) >= 2:
        for kind in KINDS:
            predicted = np.empty_like(summed)
            for name in names:
                held = models == name
                a, b = _fit_terms(kind, summed[~held], layers[~held], measured[~held])
                predicted[held] = a * summed[held] + b * layers[held]
            loss = _huber_loss(predicted / measured - 1.0)
            if loss < best_loss:
                best_kind, best_loss, best_pred = kind, loss, predicted
    applied = len(names) >= 2 and best_loss < _huber_loss(identity) * (1.0 - SIMPLER_WITHIN)
    a, b = _fit_terms(best_kind, summed, layers, measured) if applied else (1.0, 0.0)
    candidate = best_pred / measured - 1.0
    if len(names) < 2:
        note = f"passes of one model ({names[0] if names else 'none'}): no leave-one-model-out, nothing fitted; the sum of the layers"
    elif applied:
        note = f"T = a·Σt + b·L ({best_kind}) lowers the leave-one-model-out loss by more than {100 * SIMPLER_WITHIN:.0f} %: applied"
    else:
        note = (
            f"no transferable pass term: the best ({best_kind}) leaves the leave-one-model-out loss within {100 * SIMPLER_WITHIN:.0f} % "
            "of the plain sum of the layers (or raises it): a = 1, b = 0"
        )
    transfer = PassTransfer(source, a, b, applied, best_kind, names, note, _summary(identity), _summary(candidate))
    return TransferFit(family, transfer, best_pred if applied else summed, measured, passes.rung_us[rows])


def whole_pass_errors(fit: TransferFit) -> dict[str, Stats]:
    """Per rung, the whole-pass errors of the passes it produced most of the time of."""
    dominant = np.argmax(fit.rung_us, axis=1)
    errors = fit.predicted_us / fit.measured_us - 1.0
    found = {rung: _stats(errors[dominant == i]) for i, rung in enumerate(RUNGS)}
    return {rung: stats for rung, stats in found.items() if stats is not None}


def with_whole_passes(families: dict[str, ExpertFamily], path: Path, source: str) -> tuple[dict[str, ExpertFamily], list[TransferFit]]:
    """Families with their pass-level terms and whole-pass rung bounds from a whole-pass table."""
    passes = predict_whole_passes(path, families)
    out, fits = dict(families), []
    for name in families:
        if not (passes.frame["kernel"] == name).any():
            continue
        fit = fit_transfer(passes, name, source)
        fits.append(fit)
        family = families[name]
        previous = family.rung_errors or RungErrors({}, {}, {})
        rung_errors = RungErrors(previous.one_layer, whole_pass_errors(fit), previous.notes, previous.one_layer_source, source)
        out[name] = dataclasses.replace(family, pass_transfer=fit.transfer, rung_errors=rung_errors)
    return out, fits


def transfer_summary(fits: list[TransferFit]) -> pl.DataFrame:
    """One row per family: passes, models, the plain sum's and the best terms' LOMO errors (%), and what was applied."""
    rows = []
    for fit in fits:
        t = fit.transfer
        rows.append(
            {
                "family": fit.family,
                "models": len(t.models),
                "passes": int(t.identity["rows"]),
                "sum_median_%": 100 * float(t.identity["median"]),
                "sum_p90_%": 100 * float(t.identity["p90"]),
                "best": t.kind,
                "best_median_%": 100 * float(t.candidate["median"]),
                "best_p90_%": 100 * float(t.candidate["p90"]),
                "applied": t.applied,
                "a": t.a,
                "b_us": t.b_us,
            }
        )
    return pl.DataFrame(rows)
