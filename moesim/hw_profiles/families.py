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
the calibrated rates) and the time never drops below the device roofline.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from moesim.hw_profiles.heldout import HeldoutError
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

    def floor_us(self, bytes_read: np.ndarray, flops: np.ndarray) -> np.ndarray:
        """Roofline time = max(bytes / peak bandwidth, flops / peak FLOP/s)."""
        return np.maximum(np.asarray(bytes_read) / (self.peak_bandwidth_gbps * 1e3), np.asarray(flops) / (self.peak_tflops * 1e6))


@dataclass(frozen=True)
class ExpertStructure:
    """How a kernel reads experts: tokens per weight read (1, T, or 0 = unbounded) and tile variants;
    and, for kernels that compute whole tiles of token columns per expert, the tile width J:
    `tile_tokens`, or with `tile_step` the multiple of it that holds the pass's n tokens, at most
    `tile_tokens` (llama.cpp's MMQ picks its column tile from the pass's tokens)."""

    tokens_per_read: int
    variants: tuple[int, ...] = ()
    tile_tokens: int = 0
    tile_step: int = 0
    reuse_distance: bool = False  # cache hits from each re-read's stack distance, when the features carry it
    reread_rate: bool = False  # re-reads at their own rate (no working-set cache split)
    variant_terms: bool = False  # per variant: a bytes rate and a per-row cost

    def tile_width(self, n_tokens: np.ndarray) -> np.ndarray:
        """J: the tile width a pass of n tokens computes in (0: no tiles)."""
        if self.tile_step:
            return np.minimum(self.tile_tokens, self.tile_step * np.ceil(np.asarray(n_tokens) / self.tile_step - 1e-9))
        return np.full(np.shape(n_tokens), float(self.tile_tokens))

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
            tiles = "/".join(str(v) for v in self.variants)
            text = f"one read per {self.tokens_per_read} tokens of an expert, tile variants {tiles}"
        extras = [
            label
            for flag, label in (
                (self.reuse_distance, "cache hits by re-read distance"),
                (self.reread_rate, "re-reads at their own rate"),
                (self.variant_terms, "a bytes rate and a per-row cost per variant"),
            )
            if flag
        ]
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
        cls, *arrays: object, reread_histogram: np.ndarray | None = None, chunk_reads: dict[int, np.ndarray] | None = None
    ) -> ExpertInputs:
        """Broadcast seven arrays in RANGE_FIELDS order (and the optional reuse features to their shape)."""
        values = np.broadcast_arrays(*(np.asarray(a, np.float64) for a in arrays))
        shape = values[0].shape
        hist = None
        if reread_histogram is not None:
            hist = np.asarray(reread_histogram, np.float64)
            hist = np.broadcast_to(hist, shape + hist.shape[-1:])
        reads = None if chunk_reads is None else {t: np.broadcast_to(np.asarray(r, np.float64), shape) for t, r in chunk_reads.items()}
        return cls(*values, reread_histogram=hist, chunk_reads=reads)

    def field(self, name: str) -> np.ndarray:
        """An input by its range name."""
        return getattr(self, name)

    def select(self, index: object) -> ExpertInputs:
        """The inputs at `index` (a mask or indices of the leading axes)."""
        hist = None if self.reread_histogram is None else self.reread_histogram[index]  # type: ignore[index]
        reads = None if self.chunk_reads is None else {t: r[index] for t, r in self.chunk_reads.items()}  # type: ignore[index]
        return ExpertInputs(*(self.field(name)[index] for name in RANGE_FIELDS), reread_histogram=hist, chunk_reads=reads)  # type: ignore[index]


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
    if structure.reuse_distance and x.reread_histogram is not None:
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
        floor = self.roofline.floor_us(x.distinct_experts * x.expert_bytes, x.slots * 6.0 * x.hidden * x.intermediate)
        return np.maximum(self.model_time_us(x), floor)

    def time_us(self, features: RoutingFeatures, shape: ExpertShape) -> np.ndarray:
        """Time in µs of one MoE layer's expert operation, vectorised over the features' shape."""
        family = self.for_format(shape.weight_format) if self.format_bandwidth_gbps else self
        return family.inputs_time_us(ExpertInputs.of(features, shape))

    def extrapolation_factor(self, features: RoutingFeatures, shape: ExpertShape) -> np.ndarray:
        """1.0 inside the calibrated range; else how far outside (max ratio over inputs)."""
        return self.calibrated_range.factor(ExpertInputs.of(features, shape))

    @property
    def is_dedup(self) -> bool:
        """Deduplicating families read each distinct expert once per pass (or per tile)."""
        return self.name.startswith("dedup")


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
        """Time in µs = launch_us·kernels + bytes / bandwidth + flops / FLOP rate."""
        return (
            self.launch_us * np.asarray(kernels, np.float64)
            + np.asarray(bytes_read, np.float64) / (self.bandwidth_gbps * 1e3)
            + np.asarray(flops, np.float64) * _rate_to_coefficient(self.tflops, 1e6)
        )

    def attention_us(self, flops: np.ndarray | float) -> np.ndarray:
        """Time in µs of attention's FLOPs = flops / attention rate (0 when the rate is inf)."""
        return np.asarray(flops, np.float64) * _rate_to_coefficient(self.attention_tflops, 1e6)

    def extrapolation_factor(self, bytes_read: np.ndarray | float) -> np.ndarray:
        """The dense family is not calibrated on a grid: always 1.0 (its ε says how far to trust it)."""
        return np.ones(np.shape(bytes_read))
