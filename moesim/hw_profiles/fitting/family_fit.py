"""Fitting expert families to a measurement table, and judging them on held-out rows.

Every term of the model (`families.term_columns`) is linear in its coefficient, so a fit is a
non-negative least-squares problem on relative residuals (time_pred / time_meas − 1), solved by
iteratively re-weighted NNLS with a Huber weight (δ = 2 %): the acceptance criterion is the
median error, and a few rows the physics does not explain (e.g. a spilling kernel variant on one
shape) should not drag every other row. For a dedup* family the read structure (tokens per
weight read 0, 8, 16 or 32 with power-of-two tile variants; for tiles, with or without re-reads
at their own rate and a bytes rate and per-row cost per variant) is chosen by grouped
cross-validation (`fit_terms`); held-out errors repeat the whole selection on each training
split, so they judge the procedure, not one lucky structure.

Per-slot reads take their cache hits from each re-read's stack distance (`kernels.reuse`; the
calibration rows' histograms from `routing_reuse`). The cache-hit cost is identified only by rows
the cache serves a large share of (`same`-like routing): when some training row has at least
`IDENTIFIES_CACHE` of its slots served by a cache of the whole L2, the capacity is the L2 and the
hit cost is fitted; otherwise hits are free at half the L2 (`CACHE_SHARE`, the working-set
assumption of the shipped profile), since nothing pins their cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
from scipy.optimize import nnls

from moesim.errors import InputError
from moesim.hw_profiles.families import (
    RANGE_FIELDS,
    VARIANT_COLUMNS,
    CalibratedRange,
    ExpertFamily,
    ExpertInputs,
    ExpertStructure,
    Roofline,
    term_columns,
)
from moesim.hw_profiles.heldout import ErrorStats, HeldoutError, relative_errors
from moesim.hw_profiles.measurements.routing_reuse import calibration_reuse
from moesim.hw_profiles.provenance import Provenance
from moesim.kernels.reuse import cached_rereads
from moesim.models import bytes_per_weight

HUBER_DELTA = 0.02
TILE_CANDIDATES = (0, 8, 16, 32)
SIMPLER_WITHIN = 0.2
TERMS_WITHIN = 0.05
CACHE_SHARE = 0.5
IDENTIFIES_CACHE = 0.25
_FEATURE_COLUMNS = ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert", "hidden", "expert_intermediate")


@dataclass(frozen=True)
class FittedTerms:
    """A chosen read structure, the terms it uses, and their coefficients (µs per column unit)."""

    structure: ExpertStructure
    terms: tuple[str, ...]
    coefficients: dict[str, float]
    criterion: float
    cache_bytes: float
    cache_fitted: bool = True


def power_of_two_variants(tokens_per_read: int) -> tuple[int, ...]:
    """Tile widths 1, 2, 4, … up to tokens_per_read (a power of two)."""
    return tuple(2**i for i in range(int(math.log2(tokens_per_read)) + 1))


def structure_for(tokens_per_read: int) -> ExpertStructure:
    """Read structure for a number of tokens per weight read (tiles are powers of two up to it)."""
    if tokens_per_read < 0 or (tokens_per_read > 1 and tokens_per_read & (tokens_per_read - 1)):
        raise InputError(f"tokens per read must be 0, 1 or a power of two, got {tokens_per_read}")
    return ExpertStructure(tokens_per_read, power_of_two_variants(tokens_per_read) if tokens_per_read > 1 else ())


def candidate_structures(family: str) -> list[ExpertStructure]:
    """Read structures tried for a family: per-slot reads (hits by re-read distance) for per_slot;
    one read per expert, or tiles with the shipped terms or with re-reads at their own rate and
    per-variant bytes and row terms, otherwise."""
    if family == "per_slot":
        return [ExpertStructure(1, (), reuse_distance=True)]
    out = []
    for t in TILE_CANDIDATES:
        plain = structure_for(t)
        out.append(plain)
        if plain.variants:
            out.append(ExpertStructure(t, plain.variants, reread_rate=True, variant_terms=True))
    return out


def _columns_for(terms: tuple[str, ...], all_columns: dict[str, np.ndarray], structure: ExpertStructure, fit_cache: bool) -> list[str]:
    """The fitted columns. Per-slot reads by re-read distance are memory-bound: their S·6·h·I is
    b_e·S in other units, the bytes column's own shape, so no compute rate is fitted beside it."""
    names = ["fixed", "hbm"]
    if structure.reread_rate:
        names.append("reread")
    elif structure.tokens_per_read != 0 and fit_cache:
        names.append("cache")
    if not structure.reuse_distance:
        names += [n for n in all_columns if n.startswith("compute")]
    for term in terms:
        names += [n for n in all_columns if n.startswith(term)] if term in VARIANT_COLUMNS else [term]
    return names


def cache_choice(structure: ExpertStructure, x: ExpertInputs, cache_bytes: float, l2_bytes: float | None) -> tuple[float, bool]:
    """(capacity, whether the hit cost is fitted) for a structure on these rows (module docstring)."""
    if not structure.reuse_distance or l2_bytes is None or x.reread_histogram is None:
        return cache_bytes, cache_bytes > 0
    share = cached_rereads(x.reread_histogram, x.expert_bytes, l2_bytes) / np.maximum(x.slots, 1.0)
    if l2_bytes > 0 and float(share.max(initial=0.0)) >= IDENTIFIES_CACHE:
        return l2_bytes, True
    return CACHE_SHARE * l2_bytes, False


def solve_relative(
    design: np.ndarray,
    measured_us: np.ndarray,
    delta: float = HUBER_DELTA,
    offset_us: np.ndarray | None = None,
    row_weights: np.ndarray | None = None,
) -> np.ndarray:
    """Non-negative θ minimising Σ w·Huber((design·θ + offset) / measured − 1) (IRLS on NNLS);
    `offset_us` is a known part of each prediction (e.g. terms held at their lower bounds), w a
    weight per row (1 by default)."""
    relative = design / measured_us[:, None]
    scale = np.abs(relative).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = relative / scale
    target = 1.0 - (np.zeros(len(measured_us)) if offset_us is None else offset_us / measured_us)
    base = np.ones(len(measured_us)) if row_weights is None else np.sqrt(np.asarray(row_weights, np.float64))

    def weighted(weights: np.ndarray) -> np.ndarray:
        return nnls(scaled * (base * weights)[:, None], target * base * weights, maxiter=50 * design.shape[1])[0]

    return huber_irls(weighted, scaled, target, delta) / scale


def huber_irls(solve: Callable[[np.ndarray], np.ndarray], design: np.ndarray, target: np.ndarray, delta: float) -> np.ndarray:
    """θ minimising Σ Huber_δ(design·θ − target) by IRLS: θ = `solve(w)` (the fit weighted by w per row),
    w = √min(1, δ/|r|) of its residuals r, until w moves by under 1e-9 (100 rounds at most)."""
    weights = np.ones(len(target))
    for _ in range(100):
        theta = solve(weights)
        residual = design @ theta - target
        new_weights = np.sqrt(np.minimum(1.0, delta / np.maximum(np.abs(residual), 1e-12)))
        if np.max(np.abs(new_weights - weights)) < 1e-9:
            break
        weights = new_weights
    return theta


def _huber(residual: np.ndarray, delta: float) -> np.ndarray:
    r = np.abs(residual)
    return np.where(r <= delta, 0.5 * r**2, delta * (r - 0.5 * delta))


def _fit_one(
    x: ExpertInputs,
    measured_us: np.ndarray,
    structure: ExpertStructure,
    terms: tuple[str, ...],
    cache: tuple[float, bool],
    delta: float,
    row_weights: np.ndarray | None = None,
) -> tuple[FittedTerms, np.ndarray]:
    columns = term_columns(x, structure, cache[0])
    names = _columns_for(terms, columns, structure, cache[1])
    coefficients, residual = _fit_columns(columns, names, measured_us, delta, row_weights)
    return FittedTerms(structure, terms, coefficients, 0.0, cache[0], cache[1]), residual


def refit_weighted(fitted: FittedTerms, x: ExpertInputs, measured_us: np.ndarray, row_weights: np.ndarray) -> FittedTerms:
    """The same structure, terms and cache choice fitted again with a weight per row."""
    cache = (fitted.cache_bytes, fitted.cache_fitted)
    refitted, _ = _fit_one(x, measured_us, fitted.structure, fitted.terms, cache, HUBER_DELTA, row_weights)
    return FittedTerms(fitted.structure, fitted.terms, refitted.coefficients, fitted.criterion, *cache)


def predict_terms(fitted: FittedTerms, x: ExpertInputs) -> np.ndarray:
    """Σ coefficient·column of fitted terms (no roofline floor)."""
    columns = term_columns(x, fitted.structure, fitted.cache_bytes)
    return sum((value * columns[name] for name, value in fitted.coefficients.items()), np.zeros(np.shape(x.n_tokens)))


def terms_for(structure: ExpertStructure) -> tuple[str, ...]:
    """Terms beyond fixed, bytes and compute: the serial path always; a per-expert cost when each
    distinct expert is one unit of work (launch or group overhead of one-read-per-expert kernels);
    a bytes rate and a per-row cost per tile variant for the structures that have them."""
    if structure.tokens_per_read == 0:
        return ("serial", "per_expert")
    if structure.reuse_distance:
        return ()
    return ("serial", "vbytes", "rows") if structure.variant_terms else ("serial",)


def _group_sets(groups: list[np.ndarray | None]) -> list[np.ndarray]:
    return [g for g in groups if g is not None and len(np.unique(g)) >= 2]


def fit_terms(
    x: ExpertInputs,
    measured_us: np.ndarray,
    structures: list[ExpertStructure],
    cache_bytes: float,
    groups: list[np.ndarray | None],
    delta: float = HUBER_DELTA,
    l2_bytes: float | None = None,
) -> FittedTerms:
    """Choose a read structure and optional terms, then fit them to all rows.

    The choice minimises the mean Huber loss of grouped cross-validation residuals (leave out one
    shape, then one routing, of the rows given): the model that generalises, not the one that
    fits. In two steps: the tokens per read among the structures with the shipped terms (the one
    with fewer rates unless another is more than `SIMPLER_WITHIN` better), then at that T the
    term set (the extra per-variant and re-read terms only if more than `TERMS_WITHIN` better).
    Without two groups of either kind, a BIC on the in-sample fit decides.
    """
    group_sets = _group_sets(groups) if len(structures) > 1 else []  # one candidate: nothing to choose
    scored = _scores(
        [st for st in structures if not _has_extra_terms(st)] or structures, x, measured_us, cache_bytes, group_sets, delta, l2_bytes
    )
    reads = _simplest_within(scored, SIMPLER_WITHIN if group_sets else 0.0)
    richer = [st for st in structures if _has_extra_terms(st) and st.tokens_per_read == reads[2].tokens_per_read and st != reads[2]]
    same_reads = [reads, *_scores(richer, x, measured_us, cache_bytes, group_sets, delta, l2_bytes)]
    best = _simplest_within(same_reads, TERMS_WITHIN if group_sets else 0.0, key=lambda score: (_has_extra_terms(score[2]), score[0]))
    cache = cache_choice(best[2], x, cache_bytes, l2_bytes)
    fitted, _ = _fit_one(x, measured_us, best[2], terms_for(best[2]), cache, delta)
    return FittedTerms(best[2], terms_for(best[2]), fitted.coefficients, best[0], *cache)


def _scores(
    structures: list[ExpertStructure],
    x: ExpertInputs,
    measured_us: np.ndarray,
    cache_bytes: float,
    group_sets: list[np.ndarray],
    delta: float,
    l2_bytes: float | None,
) -> list[tuple[float, int, ExpertStructure]]:
    """(criterion, rates, structure) of each structure: grouped-CV Huber loss, or a BIC without groups."""
    n = len(measured_us)
    scored: list[tuple[float, int, ExpertStructure]] = []
    for structure in structures:
        terms = terms_for(structure)
        if group_sets:
            residuals = []
            for labels in group_sets:
                for group in np.unique(labels):
                    train = labels != group
                    part = x.select(train)
                    cache = cache_choice(structure, part, cache_bytes, l2_bytes)
                    fitted, _ = _fit_one(part, measured_us[train], structure, terms, cache, delta)
                    residuals.append(predict_terms(fitted, x.select(~train)) / measured_us[~train] - 1.0)
            criterion = float(np.mean(_huber(np.concatenate(residuals), delta)))
        else:
            fitted, residual = _fit_one(x, measured_us, structure, terms, cache_choice(structure, x, cache_bytes, l2_bytes), delta)
            used = sum(1 for value in fitted.coefficients.values() if value > 0)
            criterion = n * math.log(max(float(np.mean(_huber(residual, delta))), 1e-300)) + used * math.log(n)
        scored.append((criterion, structure.n_rates, structure))
    return scored


def _terms_line(coefficients: dict[str, float]) -> str:
    """'fixed, hbm, compute ×5, ...': the fitted columns, per-variant ones counted."""
    groups: dict[str, int] = {}
    for name in coefficients:
        base = name.rstrip("0123456789")
        groups[base] = groups.get(base, 0) + 1
    return ", ".join(f"{name} ×{count}" if count > 1 else name for name, count in groups.items())


def _has_extra_terms(structure: ExpertStructure) -> bool:
    return structure.reread_rate or structure.variant_terms


def _simplest_within(
    scored: list[tuple[float, int, ExpertStructure]], margin: float, key: Callable[[tuple[float, int, ExpertStructure]], Any] | None = None
) -> tuple[float, int, ExpertStructure]:
    """The simplest candidate (fewest rates, or `key`) whose criterion is within `margin` of the lowest."""
    lowest = min(score[0] for score in scored)
    return min((score for score in scored if score[0] <= lowest + abs(lowest) * margin), key=key or (lambda score: (score[1], score[0])))


def _fit_columns(
    columns: dict[str, np.ndarray], names: list[str], measured_us: np.ndarray, delta: float, row_weights: np.ndarray | None = None
) -> tuple[dict[str, float], np.ndarray]:
    """Coefficients of the named columns, with a cache hit never slower than an HBM read.

    If the free fit prices a cache byte above an HBM byte, the constrained optimum (a convex
    problem with one more linear constraint) has them equal: refit with the two columns merged.
    """
    design = np.column_stack([columns[name] for name in names])
    theta = solve_relative(design, measured_us, delta, row_weights=row_weights)
    coefficients = dict(zip(names, (float(t) for t in theta), strict=True))
    if coefficients.get("cache", 0.0) > coefficients["hbm"]:
        merged = {**columns, "hbm": columns["hbm"] + columns["cache"]}
        names = [name for name in names if name != "cache"]
        design = np.column_stack([merged[name] for name in names])
        theta = solve_relative(design, measured_us, delta, row_weights=row_weights)
        coefficients = dict(zip(names, (float(t) for t in theta), strict=True))
        coefficients["cache"] = coefficients["hbm"]
    return coefficients, design @ np.array([coefficients[name] for name in names]) / measured_us - 1.0


def _rate(coefficient: float, unit: float) -> float:
    """Rate from a coefficient (µs per unit): 1 / (coefficient · unit); inf for a zero coefficient."""
    return math.inf if coefficient <= 0 else 1.0 / (coefficient * unit)


def family_from_terms(
    name: str,
    fitted: FittedTerms,
    calibrated_range: CalibratedRange,
    heldout_error: HeldoutError,
    provenance: Provenance,
    roofline: Roofline,
    note: str = "",
) -> ExpertFamily:
    """An ExpertFamily whose rates come from fitted coefficients."""
    c = fitted.coefficients
    suffixes = [str(v) for v in fitted.structure.variants] or [""]
    variant_terms = fitted.structure.variant_terms
    return ExpertFamily(
        name=name,
        structure=fitted.structure,
        fixed_us=c.get("fixed", 0.0),
        hbm_bandwidth_gbps=_rate(c.get("hbm", 0.0), 1e3),
        cache_bandwidth_gbps=_rate(c.get("cache", 0.0), 1e3),
        cache_bytes=fitted.cache_bytes,
        compute_tflops=tuple(_rate(c.get(f"compute{s}", 0.0), 1e6) for s in suffixes),
        serial_ns=tuple(c.get(f"serial{s}", 0.0) * 1e3 for s in suffixes),
        per_expert_us=c.get("per_expert", 0.0),
        per_slot_us=c.get("per_slot", 0.0),
        calibrated_range=calibrated_range,
        heldout_error=heldout_error,
        provenance=provenance,
        roofline=roofline,
        note=note,
        reread_bandwidth_gbps=_rate(c.get("reread", 0.0), 1e3),
        variant_bandwidth_gbps=tuple(_rate(c.get(f"vbytes{s}", 0.0), 1e3) for s in suffixes) if variant_terms else (),
        row_ns=tuple(c.get(f"rows{s}", 0.0) * 1e3 for s in suffixes) if variant_terms else (),
    )


# ---- measurement rows -> model inputs --------------------------------------------------------


def expert_inputs(frame: pl.DataFrame, source: str, family: str) -> ExpertInputs:
    """Model inputs of a family's rows; every routing-feature and shape column must be present."""
    for column in _FEATURE_COLUMNS:
        if column not in frame.columns:
            raise InputError(f"{source}: column '{column}' is missing; fitting family '{family}' needs routing features and expert shape")
        nulls = frame[column].is_null().arg_true()
        if nulls.len():
            raise InputError(f"{source}: family '{family}' row {int(nulls[0])}: field '{column}' is empty")
    hidden = frame["hidden"].to_numpy().astype(np.float64)
    intermediate = frame["expert_intermediate"].to_numpy().astype(np.float64)
    if "expert_bytes" in frame.columns and frame["expert_bytes"].null_count() == 0:
        expert_bytes = frame["expert_bytes"].to_numpy().astype(np.float64)
    elif "dtype" in frame.columns and frame["dtype"].null_count() == 0:
        per_weight = np.array([float(bytes_per_weight(d)) for d in frame["dtype"].to_list()])
        expert_bytes = 3.0 * hidden * intermediate * per_weight
    else:
        raise InputError(f"{source}: family '{family}' needs column 'expert_bytes' (or 'dtype') for every row")
    u, s = frame["distinct_experts"].to_numpy(), frame["slots"].to_numpy()
    bad = np.flatnonzero((u > s) | (frame["max_tokens_per_expert"].to_numpy() > frame["n_tokens"].to_numpy()))
    if bad.size:
        raise InputError(f"{source}: family '{family}' row {int(bad[0])}: distinct_experts > slots or max_tokens_per_expert > n_tokens")
    return ExpertInputs.from_arrays(
        frame["n_tokens"].to_numpy(), s, u, frame["max_tokens_per_expert"].to_numpy(), expert_bytes, hidden, intermediate
    )


def calibrated_range_of(x: ExpertInputs) -> CalibratedRange:
    """[min, max] of every input over the calibration rows."""
    return CalibratedRange({name: (float(x.field(name).min()), float(x.field(name).max())) for name in RANGE_FIELDS})


def shape_groups(frame: pl.DataFrame) -> np.ndarray | None:
    """Group label per row for leave-one-shape-out: the `model` column, else hidden×intermediate."""
    if "model" in frame.columns and frame["model"].null_count() == 0:
        return frame["model"].to_numpy().astype(str)
    return (frame["hidden"].cast(pl.String) + "x" + frame["expert_intermediate"].cast(pl.String)).to_numpy().astype(str)


def routing_groups(frame: pl.DataFrame) -> np.ndarray | None:
    """Group label per row for leave-one-routing-out: the `routing` column, when present."""
    if "routing" in frame.columns and frame["routing"].null_count() == 0:
        return frame["routing"].to_numpy().astype(str)
    return None


@dataclass(frozen=True)
class GroupError:
    """Held-out errors of one left-out group."""

    split: str
    group: str
    stats: ErrorStats


def leave_one_group_out(
    x: ExpertInputs, measured_us: np.ndarray, groups: np.ndarray | None, fit_and_predict: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> tuple[ErrorStats | None, list[tuple[str, ErrorStats]]]:
    """Pooled relative errors over every left-out group (None with fewer than two groups)."""
    if groups is None or len(np.unique(groups)) < 2:
        return None, []
    pooled, per_group = [], []
    for group in dict.fromkeys(groups.tolist()):
        held = groups == group
        errors = relative_errors(fit_and_predict(~held, held), measured_us[held])
        pooled.append(errors)
        per_group.append((group, ErrorStats.from_errors(errors)))
    return ErrorStats.from_errors(np.concatenate(pooled)), per_group


@dataclass(frozen=True)
class FamilyFit:
    """One fitted family with the evidence behind it, and the rows it was fitted on."""

    family: ExpertFamily
    terms: FittedTerms
    group_errors: tuple[GroupError, ...]
    max_requested_bandwidth_gbps: float
    inputs: ExpertInputs
    measured_us: np.ndarray
    shapes: np.ndarray | None
    routings: np.ndarray | None


def family_inputs(frame: pl.DataFrame, source: str, family: str) -> ExpertInputs:
    """Model inputs of a family's rows with the reuse features their routing implies (`routing_reuse`)."""
    x = expert_inputs(frame, source, family)
    reuse = calibration_reuse(frame)
    return dataclasses.replace(x, reread_histogram=reuse.reread_histogram, chunk_reads=reuse.chunk_reads)


def fit_family(
    name: str,
    frame: pl.DataFrame,
    source: str,
    cache_bytes: float,
    roofline: Roofline,
    provenance: Provenance,
    tokens_per_read: int | None = None,
    l2_bytes: float | None = None,
) -> FamilyFit:
    """Fit one expert family to its rows (structure given or chosen); held-out errors by shape and routing.
    `cache_bytes` is the capacity of working-set structures, `l2_bytes` the device's L2 (per-slot reads)."""
    x = family_inputs(frame, source, name)
    measured = frame["time_us"].to_numpy().astype(np.float64)
    structures = candidate_structures(name)
    if tokens_per_read is not None:
        if name == "per_slot" and tokens_per_read != 1:
            raise InputError(f"family 'per_slot' reads per slot: tokens per read must be 1, got {tokens_per_read}")
        structures = [st for st in structures if st.tokens_per_read == tokens_per_read] or [structure_for(tokens_per_read)]
    shapes, routings = shape_groups(frame), routing_groups(frame)
    fitted = fit_terms(x, measured, structures, cache_bytes, [shapes, routings], l2_bytes=l2_bytes)
    calibrated_range = calibrated_range_of(x)

    def predict(terms: FittedTerms, rows: np.ndarray) -> np.ndarray:
        model = family_from_terms(name, terms, calibrated_range, HeldoutError(), provenance, roofline)
        return model.inputs_time_us(x.select(rows))

    def fit_and_predict(train: np.ndarray, test: np.ndarray) -> np.ndarray:
        groups = [None if labels is None else labels[train] for labels in (shapes, routings)]
        return predict(fit_terms(x.select(train), measured[train], structures, cache_bytes, groups, l2_bytes=l2_bytes), test)

    in_sample = ErrorStats.from_errors(relative_errors(predict(fitted, np.ones(len(measured), bool)), measured))
    shape_stats, shape_groups_stats = leave_one_group_out(x, measured, shapes, fit_and_predict)
    routing_stats, routing_groups_stats = leave_one_group_out(x, measured, routings, fit_and_predict)
    heldout = HeldoutError(leave_one_shape_out=shape_stats, leave_one_routing_out=routing_stats, in_sample=in_sample)
    requested = np.where(name == "per_slot", x.slots, x.distinct_experts) * x.expert_bytes
    family = family_from_terms(
        name,
        fitted,
        calibrated_range,
        heldout,
        provenance,
        roofline,
        note=f"{fitted.structure.describe()}; fitted terms: {_terms_line(fitted.coefficients)}",
    )
    group_errors = tuple(GroupError("leave_one_shape_out", g, s) for g, s in shape_groups_stats) + tuple(
        GroupError("leave_one_routing_out", g, s) for g, s in routing_groups_stats
    )
    return FamilyFit(family, fitted, group_errors, float(np.max(requested / measured) / 1e3), x, measured, shapes, routings)
