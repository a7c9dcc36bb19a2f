"""Kernel families of a hardware profile: time of one MoE layer's expert operation from routing
features and the expert's shape, and the dense family for everything else a pass reads.

An expert family streams expert weights. Per pass through one MoE layer with n tokens, S = n·K
slots, U distinct experts and c = max tokens per expert (b_e = bytes of one expert, h = hidden,
I = intermediate):

    reads   = S                    tokens_per_read T = 1 (per-slot: every slot reads its expert)
            = Σ_e ceil(c_e / T)    T > 1 (a register-tiled kernel reads an expert once per T tokens;
                                   without per-expert counts: U·ceil((S/U) / T))
            = U                    T = 0 (reads each distinct expert once, whatever the tokens)
    cached  = (reads − U)·min(1, cache_bytes / (U·b_e))      re-reads the cache serves (working set)
            = Σ_d hist[d]·min(1, cache_bytes / (d·b_e))       `reuse_distance`: each re-read by its LRU
                                                              stack distance d (`kernels.reuse`)
    time_us = fixed + per_expert·U + per_slot·S
            + b_e·(U + (reads − U) − cached) / hbm_bandwidth + b_e·cached / cache_bandwidth
            + S·6·h·I / compute_rate[v] + serial[v]·tok·chunks·(h + I)
            + U·ceil((S/U) / J)·J·6·h·I / tile_rate        (kernels that compute whole tiles of J tokens)
    `reread_rate`:   the re-reads b_e·(reads − U) at their own rate instead of the hbm/cache split
    `variant_terms`: + b_e·U / variant_bandwidth[v] + row[v]·S·(2I + h) (the variant's occupancy
                     sets its streaming rate; a per-token cost along every output row), and the
                     serial path of one chunk only (chunks = 1: the re-read term prices the others)

v is the kernel variant (the smallest tile width ≥ min(c, T)); tok·chunks·(h + I) is the serial
path of one warp (the tokens of the busiest expert along one gate/up and one down row). Every
coefficient is ≥ 0; a rate of inf means its term costs nothing. Beyond the calibrated range the
same terms are evaluated (they are linear in bytes, flops and counts: an effective roofline with
the calibrated rates) and the time never drops below the device roofline, whose FLOP ceiling is,
for a family whose rows never separated its FLOP rate, the rate the engine reaches (`floor_tflops`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from moesim.hw_profiles import family_kernel
from moesim.hw_profiles.heldout import HeldoutError
from moesim.hw_profiles.ladder.grid import CalibrationGrid, shape_groups
from moesim.hw_profiles.ladder.rungs import EXTRAPOLATED, FITTED, RUNGS, RungErrors, ladder_times, rung_shares
from moesim.hw_profiles.ladder.transfer import PassTransfer
from moesim.hw_profiles.provenance import Provenance
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.reuse import cached_rereads
from moesim.models import ExpertShape

RANGE_FIELDS = ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert", "expert_bytes", "hidden", "intermediate")


@dataclass(frozen=True)
class Roofline:
    """Device peaks: the lower bound of every time, and the only guide far beyond calibration."""

    peak_bandwidth_gbps: float
    peak_tflops: float

    def ceiling_tflops(self, reached_tflops: float = math.inf) -> float:
        """FLOP ceiling = min(peak FLOP/s, the FLOP rate the engine reaches)."""
        return min(self.peak_tflops, reached_tflops)

    def floor_us(self, bytes_read: np.ndarray, flops: np.ndarray, reached_tflops: float = math.inf) -> np.ndarray:
        """Roofline time = max(bytes / peak bandwidth, flops / min(peak FLOP/s, the FLOP rate the engine reaches))."""
        ceiling = self.ceiling_tflops(reached_tflops) * 1e6
        return np.maximum(np.asarray(bytes_read) / (self.peak_bandwidth_gbps * 1e3), np.asarray(flops) / ceiling)


@dataclass(frozen=True)
class ExpertStructure:
    """How a kernel reads experts: tokens per weight read (1, T, or 0 = unbounded) and tile variants;
    and, for kernels that compute whole tiles of token columns per expert, the tile width J:
    `tile_tokens`, or with `tile_step` the multiple of it that holds the pass's n tokens, at most
    `tile_tokens` (llama.cpp's MMQ picks its column tile from the pass's tokens); with
    `tile_doubling` the power-of-two multiple (llama.cpp Vulkan's matmul_id: 32, 64, else 128)."""

    tokens_per_read: int
    variants: tuple[int, ...] = ()
    tile_tokens: int = 0
    tile_step: int = 0
    tile_doubling: bool = False
    reuse_distance: bool = False  # cache hits from each re-read's stack distance, when the features carry it
    reread_rate: bool = False  # re-reads at their own rate (no working-set cache split)
    variant_terms: bool = False  # per variant: a bytes rate and a per-row cost

    def tile_width(self, n_tokens: np.ndarray) -> np.ndarray:
        """J = min(tile_tokens, step·m), m = ⌈n / step⌉ (`tile_doubling`: 2^⌈log2 m⌉); tile_tokens without a step (0: no tiles)."""
        if not self.tile_step:
            return np.full(np.shape(n_tokens), float(self.tile_tokens))
        steps = np.ceil(np.asarray(n_tokens, np.float64) / self.tile_step - 1e-9)
        if self.tile_doubling:
            steps = np.exp2(np.ceil(np.log2(np.maximum(steps, 1.0)) - 1e-9))
        return np.minimum(self.tile_tokens, self.tile_step * steps)

    @property
    def n_rates(self) -> int:
        """Number of compute / serial coefficients (one per variant, or one)."""
        return max(1, len(self.variants))

    def describe(self) -> str:
        """One-line description."""
        if self.tokens_per_read == 1:
            text = "per-slot reads (each token slot reads its expert)"
        elif self.tokens_per_read == 0:
            text = "one read per distinct expert"
        else:
            text = f"one read per {self.tokens_per_read} tokens of an expert, tile variants {'/'.join(map(str, self.variants))}"
        flags = ((self.reuse_distance, "cache hits by re-read distance"), (self.reread_rate, "re-reads at their own rate"))
        extras = [label for flag, label in (*flags, (self.variant_terms, "a bytes rate and a per-row cost per variant")) if flag]
        return text + "".join(f"; {label}" for label in extras)


@dataclass(frozen=True)
class ExpertInputs:
    """Routing features and expert shape as broadcast float arrays (the model's inputs)."""

    n_tokens: np.ndarray
    slots: np.ndarray
    distinct_experts: np.ndarray
    max_tokens_per_expert: np.ndarray
    expert_bytes: np.ndarray
    hidden: np.ndarray
    intermediate: np.ndarray
    reread_histogram: np.ndarray | None = None  # shape + (E + 1,): re-reads by LRU stack distance
    chunk_reads: dict[int, np.ndarray] | None = None  # tile T -> Σ_e ceil(c_e / T)
    cached_rereads: np.ndarray | None = None  # re-reads the family's cache serves, where known (a grid's knots)

    @classmethod
    def of(cls, features: RoutingFeatures, shape: ExpertShape) -> ExpertInputs:
        """Inputs for one expert shape and an array of passes."""
        return cls.from_arrays(
            features.n_tokens,
            features.slots,
            features.distinct_experts,
            features.max_tokens_per_expert,
            shape.expert_bytes,
            shape.hidden,
            shape.intermediate,
            reread_histogram=features.reread_histogram,
            chunk_reads=features.chunk_reads,
        )

    @classmethod
    def from_arrays(
        cls,
        *arrays: object,
        reread_histogram: np.ndarray | None = None,
        chunk_reads: dict[int, np.ndarray] | None = None,
        cached_rereads: np.ndarray | None = None,
    ) -> ExpertInputs:
        """Broadcast seven arrays in RANGE_FIELDS order (and the optional reuse features to their shape)."""
        values = np.broadcast_arrays(*(np.asarray(a, np.float64) for a in arrays))
        shape = values[0].shape
        hist = None
        if reread_histogram is not None:
            hist = np.asarray(reread_histogram, np.float64)
            hist = np.broadcast_to(hist, shape + hist.shape[-1:])
        reads = None if chunk_reads is None else {t: np.broadcast_to(np.asarray(r, np.float64), shape) for t, r in chunk_reads.items()}
        cached = None if cached_rereads is None else np.broadcast_to(np.asarray(cached_rereads, np.float64), shape)
        return cls(*values, reread_histogram=hist, chunk_reads=reads, cached_rereads=cached)

    def field(self, name: str) -> np.ndarray:
        """An input by its range name."""
        return getattr(self, name)

    def select(self, index: object) -> ExpertInputs:
        """The inputs at `index` (a mask or indices of the leading axes)."""
        hist = None if self.reread_histogram is None else self.reread_histogram[index]  # type: ignore[index]
        reads = None if self.chunk_reads is None else {t: r[index] for t, r in self.chunk_reads.items()}  # type: ignore[index]
        cached = None if self.cached_rereads is None else self.cached_rereads[index]  # type: ignore[index]
        values = (self.field(name)[index] for name in RANGE_FIELDS)  # type: ignore[index]
        return ExpertInputs(*values, reread_histogram=hist, chunk_reads=reads, cached_rereads=cached)


def base_columns(x: ExpertInputs, structure: ExpertStructure, cache_bytes: float) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The model's terms (time = Σ coefficient·column, see the module docstring) and each pass's tile
    variant index; the compute, serial, vbytes and rows columns take the coefficient of that variant."""
    u, s, cmax = x.distinct_experts, x.slots, x.max_tokens_per_expert
    safe_u = np.maximum(u, 1.0)
    t = structure.tokens_per_read
    if t == 1:
        reads, chunks, tokens = s, np.ones_like(u), np.ones_like(u)
    elif t == 0:
        reads, chunks, tokens = u, np.ones_like(u), cmax
    else:
        chunks = np.ceil(s / safe_u / t - 1e-9)
        exact = x.chunk_reads.get(t) if x.chunk_reads else None
        reads, tokens = (u * chunks if exact is None else exact), np.minimum(cmax, t)
    rereads = np.maximum(reads - u, 0.0)
    if structure.reuse_distance and x.cached_rereads is not None:
        cached = np.minimum(x.cached_rereads, rereads)
    elif structure.reuse_distance and x.reread_histogram is not None:
        cached = np.minimum(cached_rereads(x.reread_histogram, x.expert_bytes, cache_bytes), rereads)
    else:
        cached = rereads * np.minimum(1.0, cache_bytes / (safe_u * x.expert_bytes))
    active = np.where(s > 0, 1.0, 0.0)  # a pass that routes no token costs nothing
    separate = structure.reread_rate
    columns = {
        "fixed": active,
        "per_expert": u,
        "per_slot": s,
        "hbm": x.expert_bytes * (u if separate else u + rereads - cached),
        "cache": x.expert_bytes * (0.0 * u if separate else cached),
        "reread": x.expert_bytes * (rereads if separate else 0.0 * u),
        "compute": s * 6.0 * x.hidden * x.intermediate,
        "serial": active * tokens * (1.0 if structure.variant_terms else chunks) * (x.hidden + x.intermediate),
    }
    if structure.tile_tokens:
        width = np.maximum(structure.tile_width(x.n_tokens), 1.0)
        tiles = np.ceil(s / safe_u / width - 1e-9)
        columns["tile"] = active * u * tiles * width * 6.0 * x.hidden * x.intermediate
    if structure.variant_terms:
        columns["vbytes"] = x.expert_bytes * u
        columns["rows"] = s * (2.0 * x.intermediate + x.hidden)
    if not structure.variants:
        return columns, np.zeros(np.shape(u), np.intp)
    widths = np.asarray(structure.variants, np.float64)
    return columns, np.minimum(np.searchsorted(widths, np.minimum(cmax, t) - 1e-9), len(widths) - 1)


VARIANT_COLUMNS = ("compute", "serial", "vbytes", "rows")  # one coefficient per tile variant


def term_columns(x: ExpertInputs, structure: ExpertStructure, cache_bytes: float) -> dict[str, np.ndarray]:
    """Every term as its own column (one compute, serial, vbytes and rows column per tile variant): the fit's design."""
    columns, index = base_columns(x, structure, cache_bytes)
    if structure.variants:
        for name in VARIANT_COLUMNS:
            if name in columns:
                values = columns.pop(name)
                for i, width in enumerate(structure.variants):
                    columns[f"{name}{width}"] = np.where(index == i, values, 0.0)
    return columns


def _rate_to_coefficient(rate: float, unit: float) -> float:
    return 0.0 if math.isinf(rate) else 1.0 / (rate * unit)


EXTRAPOLATION_TOLERANCE = 1e-9  # an extrapolation factor above 1 + this lies beyond the calibrated range


def extrapolated(factor: np.ndarray | float) -> np.ndarray:
    """Whether extrapolation factors lie beyond the calibrated range."""
    return np.asarray(factor) > 1.0 + EXTRAPOLATION_TOLERANCE


@dataclass(frozen=True)
class CalibratedRange:
    """Per input, the [low, high] seen in calibration; None for an input never calibrated."""

    bounds: dict[str, tuple[float, float]]

    def factor(self, x: ExpertInputs) -> np.ndarray:
        """How far inputs lie outside the range: max over inputs of max(x/high, low/x); 1.0 inside."""
        factor = np.ones(np.shape(x.n_tokens))
        for name, (low, high) in self.bounds.items():
            value = np.maximum(x.field(name), 1e-300)
            factor = np.maximum(factor, np.maximum(value / high, low / value))
        return np.where(x.slots > 0, factor, 1.0)  # an empty pass is not an extrapolation


@dataclass(frozen=True)
class ExpertFamily:
    """Fitted time model of one kernel family (per_slot or a dedup* family)."""

    name: str
    structure: ExpertStructure
    fixed_us: float
    hbm_bandwidth_gbps: float
    cache_bandwidth_gbps: float
    cache_bytes: float
    compute_tflops: tuple[float, ...]
    serial_ns: tuple[float, ...]
    per_expert_us: float
    per_slot_us: float
    calibrated_range: CalibratedRange
    heldout_error: HeldoutError
    provenance: Provenance
    roofline: Roofline
    note: str = ""
    tile_tflops: float = math.inf
    format_bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    reread_bandwidth_gbps: float = math.inf  # `reread_rate`: re-read bytes per µs·1e3
    variant_bandwidth_gbps: tuple[float, ...] = ()  # `variant_terms`: bytes rate of first reads, per variant
    row_ns: tuple[float, ...] = ()  # `variant_terms`: ns per slot and output row, per variant
    grid: CalibrationGrid | None = None  # the lookup ladder's knots (a calibrated profile)
    shape_fits: dict[str, ExpertFamily] = field(default_factory=dict)  # fitted rung per grid shape
    rung_errors: RungErrors | None = None
    pass_transfer: PassTransfer | None = None
    fit_weight: float = 1.0  # a shape fit: the weight of its shape's rows
    floor_tflops: float = math.inf  # the engine's FLOP rate for the family on this device, where its rows gave none: the roofline's ceiling

    def for_format(self, weight_format: str) -> ExpertFamily:
        """The family as it runs weights of a format: a format with its own effective bandwidth
        (its dequantisation cost per byte, where calibration resolved it) reads at that rate."""
        rate = self.format_bandwidth_gbps.get(weight_format.upper())
        return (
            self
            if rate is None
            else dataclasses.replace(self, hbm_bandwidth_gbps=rate, cache_bandwidth_gbps=rate, format_bandwidth_gbps={})
        )

    def parameters(self) -> dict[str, object]:
        """The family's structure and rates as plain data (the TOML keys; tile keys only for tiled
        kernels, the optional terms only where used)."""
        tiles = self.structure.tile_tokens
        tiled = {"tile_tokens": tiles, "tile_step": self.structure.tile_step, "tile_tflops": self.tile_tflops} if tiles else {}
        if self.structure.tile_doubling:
            tiled["tile_doubling"] = True
        out: dict[str, object] = {
            "tokens_per_read": self.structure.tokens_per_read,
            "variants": list(self.structure.variants),
            "fixed_us": self.fixed_us,
            "per_expert_us": self.per_expert_us,
            "per_slot_us": self.per_slot_us,
            "hbm_bandwidth_gbps": self.hbm_bandwidth_gbps,
            "cache_bandwidth_gbps": self.cache_bandwidth_gbps,
            "cache_bytes": self.cache_bytes,
            "compute_tflops": list(self.compute_tflops),
            **({"floor_tflops": self.floor_tflops} if math.isfinite(self.floor_tflops) else {}),
            "serial_ns": list(self.serial_ns),
            **tiled,
            **({"format_bandwidth_gbps": dict(self.format_bandwidth_gbps)} if self.format_bandwidth_gbps else {}),
        }
        if self.structure.reuse_distance:
            out["cache_model"] = "reuse_distance"
        if self.structure.reread_rate:
            out["reread_bandwidth_gbps"] = self.reread_bandwidth_gbps
        if self.structure.variant_terms:
            out["variant_bandwidth_gbps"] = list(self.variant_bandwidth_gbps)
            out["row_ns"] = list(self.row_ns)
        return out

    def coefficients(self) -> dict[str, float]:
        """Coefficient of each term column of `term_columns` (µs per unit of the column)."""
        coefficients = {
            "fixed": self.fixed_us,
            "per_expert": self.per_expert_us,
            "per_slot": self.per_slot_us,
            "hbm": _rate_to_coefficient(self.hbm_bandwidth_gbps, 1e3),
            "cache": _rate_to_coefficient(self.cache_bandwidth_gbps, 1e3),
            "reread": _rate_to_coefficient(self.reread_bandwidth_gbps, 1e3),
        }
        if self.structure.tile_tokens:
            coefficients["tile"] = _rate_to_coefficient(self.tile_tflops, 1e6)
        suffixes = [str(v) for v in self.structure.variants] or [""]
        for name, values in self._variant_coefficients().items():
            for suffix, value in zip(suffixes, values, strict=True):
                coefficients[f"{name}{suffix}"] = float(value)
        return coefficients

    def _variant_coefficients(self) -> dict[str, np.ndarray]:
        out = {
            "compute": np.array([_rate_to_coefficient(rate, 1e6) for rate in self.compute_tflops]),
            "serial": np.array(self.serial_ns) * 1e-3,
        }
        if self.structure.variant_terms:
            out["vbytes"] = np.array([_rate_to_coefficient(rate, 1e3) for rate in self.variant_bandwidth_gbps])
            out["rows"] = np.array(self.row_ns) * 1e-3
        return out

    def model_time_us(self, x: ExpertInputs) -> np.ndarray:
        """The fitted terms alone, without the roofline floor."""
        columns, index = base_columns(x, self.structure, self.cache_bytes)
        total = np.zeros(np.shape(x.n_tokens))
        for name, values in self._variant_coefficients().items():
            total = total + columns[name] * values[index]
        for name, coefficient in self.coefficients().items():
            if coefficient and name in ("fixed", "per_expert", "per_slot", "hbm", "cache", "tile", "reread"):
                total = total + coefficient * columns[name]
        return total

    def inputs_time_us(self, x: ExpertInputs) -> np.ndarray:
        """Time of one MoE layer's expert operation for prepared inputs (floored by the roofline)."""
        floor = self.roofline.floor_us(x.distinct_experts * x.expert_bytes, x.slots * 6.0 * x.hidden * x.intermediate, self.floor_tflops)
        return np.maximum(self.model_time_us(x), floor)

    def time_us(self, features: RoutingFeatures, shape: ExpertShape) -> np.ndarray:
        """Time in µs of one MoE layer's expert operation (the lookup ladder's, at the weight format's
        rates), vectorised over the features' shape."""
        return self.lookup(features, shape).time_us

    def lookup(self, features: RoutingFeatures, shape: ExpertShape, whole_pass: bool = False) -> Lookup:
        """Time, rung and relative bound of every layer (`whole_pass`: the rungs' whole-pass bounds, where measured)."""
        return self.for_format(shape.weight_format).inputs_lookup(ExpertInputs.of(features, shape), whole_pass)

    def inputs_lookup(self, x: ExpertInputs, whole_pass: bool = False) -> Lookup:
        """The lookup ladder for prepared inputs (`moesim.hw_profiles.ladder`): per layer the first
        rung that applies among exact, interpolated (knots of the same shape and n), fitted, extrapolated."""
        outside = extrapolated(self.calibrated_range.factor(x))
        time = np.zeros(np.shape(x.n_tokens))
        rung = np.full(time.shape, FITTED, np.int8)
        groups: list[tuple[str | None, np.ndarray]] = [(None, np.ones(time.shape, bool))]
        if self.shape_fits or self.grid is not None:
            groups = shape_groups(x.n_tokens, x.slots, x.hidden, x.intermediate, x.expert_bytes)
        for label, where in groups:
            model = self.shape_fits.get(label, self) if label is not None else self
            part = x if len(groups) == 1 else x.select(where)
            fitted = model.inputs_time_us(part)
            beyond = outside if len(groups) == 1 else outside[where]
            t, r = fitted, np.where(beyond, EXTRAPOLATED, FITTED).astype(np.int8)
            if self.grid is not None:
                t, r = self._ladder(model, label, part, fitted, beyond)
            if len(groups) == 1:
                time, rung = np.asarray(t, np.float64).reshape(time.shape), np.asarray(r, np.int8).reshape(time.shape)
            else:
                time[where], rung[where] = t, r
        fallback = finite_or_nan(self.heldout_error.epsilon)
        epsilon = self.rung_errors.epsilon(whole_pass, fallback) if self.rung_errors else np.full(len(RUNGS), fallback)
        return Lookup(time, rung, epsilon[rung])

    def _ladder(
        self, model: ExpertFamily, label: str | None, x: ExpertInputs, fitted: np.ndarray, outside: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rungs of inputs of one shape, per pass size (`outside`: beyond the calibrated range)."""
        grid = self.grid
        time, rung = np.array(fitted, np.float64), np.array(np.where(outside, EXTRAPOLATED, FITTED), np.int8)
        for n in np.unique(x.n_tokens):
            index = grid.knots(label, n)  # type: ignore[union-attr]
            if not index.size:
                continue
            where = x.n_tokens == n
            knots = self.knot_inputs(index, x)
            features = np.column_stack([x.field(name)[where] for name in grid.interpolate])  # type: ignore[union-attr]
            time[where], rung[where] = ladder_times(
                grid.features(index),
                grid.time_us[index],
                model.inputs_time_us(knots),
                features,
                fitted[where],
                outside[where],
            )
        return time, rung

    def sum_layers(self, x: ExpertInputs, used: np.ndarray | None = None, whole_pass: bool = False) -> LayerSum:
        """Σ over the layers (last axis; `used` masks them) of the ladder's times, with their rungs'
        bounds and the time per rung; a whole pass also takes the family's pass-level transfer."""
        look = self.inputs_lookup(x, whole_pass)
        used = np.ones(look.time_us.shape, bool) if used is None else np.broadcast_to(used, look.time_us.shape)
        time = np.where(used, look.time_us, 0.0)
        epsilon = np.where(np.isfinite(look.epsilon), look.epsilon, 0.0)
        total, spread = time.sum(axis=-1), (time * epsilon).sum(axis=-1)
        factor = np.where(used, self.calibrated_range.factor(x), 1.0).max(axis=-1, initial=1.0)
        summed = LayerSum(total, total - spread, total + spread, rung_shares(time, look.rung), factor)
        return self.transferred(summed, used.sum(axis=-1)) if whole_pass else summed

    def transferred(self, summed: LayerSum, layers: np.ndarray | float) -> LayerSum:
        """Whole passes of `layers` MoE layers with the pass-level transfer where it applies (T = a·Σt + b·L)."""
        transfer = self.pass_transfer
        if transfer is None or not transfer.applied:
            return summed
        total = summed.time_us
        scale = np.divide(transfer.pass_us(total, layers), total, out=np.ones_like(total), where=total > 0)
        return LayerSum(
            total * scale, summed.low_us * scale, summed.high_us * scale, summed.rung_us * scale[..., None], summed.extrapolation
        )

    @property
    def bound_basis(self) -> str:
        """What a whole pass's bound rests on: the rungs' whole-pass held-out errors, or the one-layer fit."""
        if self.rung_errors is not None and self.rung_errors.whole_pass:
            return f"{self.name}: whole-pass leave-one-model-out per rung"
        return f"{self.name}: one-layer fit"

    def knot_inputs(self, index: np.ndarray, like: ExpertInputs) -> ExpertInputs:
        """Model inputs of grid knots (the expert shape of `like`, which shares their shape)."""
        g = self.grid
        t = self.structure.tokens_per_read
        return ExpertInputs.from_arrays(
            g.n_tokens[index], g.slots[index], g.distinct_experts[index], g.max_tokens_per_expert[index],  # type: ignore[union-attr]
            like.expert_bytes.flat[0], like.hidden.flat[0], like.intermediate.flat[0],
            chunk_reads={t: g.chunk_reads[index]} if t > 1 else None,  # type: ignore[union-attr]
            cached_rereads=g.cached_rereads[index] if self.structure.reuse_distance else None,  # type: ignore[union-attr]
        )  # fmt: skip

    @cached_property
    def _compiled(self) -> dict[tuple[ExpertShape, int], tuple[np.ndarray, ...]]:
        return {}

    def compiled_params(self, shape: ExpertShape, top_k: int) -> tuple[np.ndarray, ...]:
        """The compiled kernel's parameters for an expert shape and top-k, kept per pair."""
        params = self._compiled.get((shape, top_k))
        if params is None:
            family = self.for_format(shape.weight_format) if self.format_bandwidth_gbps else self
            params = self._compiled[(shape, top_k)] = family_kernel.parameters(family, shape, top_k)
        return params

    @property
    def compiled(self) -> bool:
        """Whether `fast_time_us` / `fast_layers_us` run compiled (`family_kernel`): fitted terms alone, no
        ladder knots, shape fits, re-read or per-variant terms; others take `time_us`'s path."""
        s = self.structure
        return self.grid is None and not self.shape_fits and not (s.reuse_distance or s.reread_rate or s.variant_terms)

    def fast_time_us(self, slots: np.ndarray, distinct: np.ndarray, most: np.ndarray, shape: ExpertShape, top_k: int) -> np.ndarray:
        """`time_us` of passes of slots / top_k tokens given by slots, distinct experts and max
        tokens per expert (arrays of one shape), in one compiled call where the family allows it
        (`compiled`): the simulator's per-pass path where no table applies (mixed passes,
        expert-parallel ranks). Tested equal to `time_us`."""
        if not self.compiled:
            return self._counts_time_us(slots, distinct, most, shape, top_k)
        flat = [np.ascontiguousarray(a, np.float64).ravel() for a in (slots, distinct, most)]
        out = np.empty(flat[0].size)
        family_kernel.pass_times_us(*flat, *self.compiled_params(shape, top_k), out)
        return out.reshape(np.shape(slots))

    def fast_layers_us(self, slots: np.ndarray, distinct: np.ndarray, most: np.ndarray, shape: ExpertShape, top_k: int) -> float:
        """Σ over MoE layers of the slowest rank's `time_us`, for (ranks, layers) arrays of slots,
        distinct experts and max tokens per expert, in one compiled call where the family allows it
        (a pass over expert-parallel ranks; one rank: the layers' sum)."""
        if not self.compiled:
            return float(self._counts_time_us(slots, distinct, most, shape, top_k).max(axis=0).sum())
        arrays = [np.ascontiguousarray(a, np.float64) for a in (slots, distinct, most)]
        return float(family_kernel.slowest_rank_layers_us(*arrays, *self.compiled_params(shape, top_k)))

    def _counts_time_us(self, slots: np.ndarray, distinct: np.ndarray, most: np.ndarray, shape: ExpertShape, top_k: int) -> np.ndarray:
        """`time_us` from the four counts a server pass has (the ladder's path, in numpy)."""
        slots = np.asarray(slots, np.float64)
        features = RoutingFeatures(slots / top_k, slots, np.asarray(distinct, np.float64), np.asarray(most, np.float64))
        return self.time_us(features, shape)

    def extrapolation_factor(self, features: RoutingFeatures, shape: ExpertShape) -> np.ndarray:
        """1.0 inside the calibrated range; else how far outside (max ratio over inputs)."""
        return self.calibrated_range.factor(ExpertInputs.of(features, shape))

    @property
    def is_dedup(self) -> bool:
        """Deduplicating families read each distinct expert once per pass (or per tile)."""
        return self.name.startswith("dedup")


@dataclass(frozen=True)
class Lookup:
    """Per layer: time (µs), rung index into `ladder.rungs.RUNGS`, and the rung's relative bound ε."""

    time_us: np.ndarray
    rung: np.ndarray
    epsilon: np.ndarray


@dataclass(frozen=True)
class LayerSum:
    """Layer times summed per pass: time, bounds (each layer at its rung's ±ε), µs per rung (..., 4), extrapolation factor."""

    time_us: np.ndarray
    low_us: np.ndarray
    high_us: np.ndarray
    rung_us: np.ndarray
    extrapolation: np.ndarray

    @property
    def epsilon(self) -> np.ndarray:
        """Per pass, the relative bound (high − time) / time (0 for an empty pass)."""
        return np.divide(self.high_us - self.time_us, self.time_us, out=np.zeros_like(self.time_us), where=self.time_us > 0)


def finite_or_nan(value: float) -> float:
    """The value where finite, else NaN."""
    return float(value) if np.isfinite(value) else math.nan


@dataclass(frozen=True)
class DenseFamily:
    """Non-expert weights, attention and KV reads: fixed time per kernel + bytes / bandwidth + flops / rate.

    `attention_tflops`: the rate of attention's own FLOPs (queries against cached tokens); inf, the
    default, leaves them out (profiles fitted on passes at short contexts, where they are noise)."""

    bandwidth_gbps: float
    tflops: float
    launch_us: float
    provenance: Provenance
    heldout_error: HeldoutError = field(default_factory=HeldoutError)
    note: str = ""
    name: str = "dense"
    attention_tflops: float = math.inf

    def time_us(self, bytes_read: np.ndarray | float, flops: np.ndarray | float = 0.0, kernels: np.ndarray | float = 1.0) -> np.ndarray:
        """Time in µs = launch_us·kernels + bytes / bandwidth + flops / FLOP rate, vectorised (plain
        numbers stay numbers, as the simulator's per-pass call passes them; the same arithmetic)."""
        if not (isinstance(bytes_read, float | int) and isinstance(flops, float | int) and isinstance(kernels, float | int)):
            bytes_read, flops, kernels = (np.asarray(v, np.float64) for v in (bytes_read, flops, kernels))
        return self.launch_us * kernels + bytes_read / (self.bandwidth_gbps * 1e3) + flops * self._flop_coefficient  # type: ignore[return-value]

    @cached_property
    def _flop_coefficient(self) -> float:
        return _rate_to_coefficient(self.tflops, 1e6)

    def attention_us(self, flops: np.ndarray | float) -> np.ndarray:
        """Time in µs of attention's FLOPs = flops / attention rate (0 when the rate is inf)."""
        return np.asarray(flops, np.float64) * _rate_to_coefficient(self.attention_tflops, 1e6)

    def extrapolation_factor(self, bytes_read: np.ndarray | float) -> np.ndarray:
        """The dense family is not calibrated on a grid: always 1.0 (its ε says how far to trust it)."""
        return np.ones(np.shape(bytes_read))
