"""Kernel families of a hardware profile: time of one MoE layer's expert operation from routing
features and the expert's shape, and the dense family for everything else a pass reads.

An expert family streams expert weights. Per pass through one MoE layer with n tokens, S = n·K
slots, U distinct experts and c = max tokens per expert (b_e = bytes of one expert, h = hidden,
I = intermediate):

    reads   = S                    tokens_per_read T = 1 (per-slot: every slot reads its expert)
            = U·ceil((S/U) / T)    T > 1 (a register-tiled kernel reads an expert once per T tokens)
            = U                    T = 0 (reads each distinct expert once, whatever the tokens)
    hit     = min(1, cache_bytes / (U·b_e))     share of re-reads served by the cache
    time_us = fixed + per_expert·U + per_slot·S
            + b_e·(U + (reads − U)·(1 − hit)) / hbm_bandwidth + b_e·(reads − U)·hit / cache_bandwidth
            + S·6·h·I / compute_rate[v] + serial[v]·tok·chunks·(h + I)
            + U·ceil((S/U) / J)·J·6·h·I / tile_rate        (kernels that compute whole tiles of J tokens)

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
from functools import cached_property

import numba
import numpy as np

from moesim.hw_profiles.heldout import HeldoutError
from moesim.hw_profiles.provenance import Provenance
from moesim.kernels.features import RoutingFeatures
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
            return "per-slot reads (each token slot reads its expert)"
        if self.tokens_per_read == 0:
            return "one read per distinct expert"
        tiles = "/".join(str(v) for v in self.variants)
        return f"one read per {self.tokens_per_read} tokens of an expert, tile variants {tiles}"


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
        )

    @classmethod
    def from_arrays(cls, *arrays: object) -> ExpertInputs:
        """Broadcast seven arrays in RANGE_FIELDS order."""
        values = np.broadcast_arrays(*(np.asarray(a, np.float64) for a in arrays))
        return cls(*values)

    def field(self, name: str) -> np.ndarray:
        """An input by its range name."""
        return getattr(self, name)


def base_columns(x: ExpertInputs, structure: ExpertStructure, cache_bytes: float) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The model's terms (time = Σ coefficient·column, see the module docstring) and each pass's tile
    variant index; the compute and serial columns take the coefficient of that variant."""
    u, s, cmax = x.distinct_experts, x.slots, x.max_tokens_per_expert
    safe_u = np.maximum(u, 1.0)
    t = structure.tokens_per_read
    if t == 1:
        reads, chunks, tokens = s, np.ones_like(u), np.ones_like(u)
    elif t == 0:
        reads, chunks, tokens = u, np.ones_like(u), cmax
    else:
        chunks = np.ceil(s / safe_u / t - 1e-9)
        reads, tokens = u * chunks, np.minimum(cmax, t)
    rereads = np.maximum(reads - u, 0.0)
    hit = np.minimum(1.0, cache_bytes / (safe_u * x.expert_bytes))
    active = np.where(s > 0, 1.0, 0.0)  # a pass that routes no token costs nothing
    columns = {
        "fixed": active,
        "per_expert": u,
        "per_slot": s,
        "hbm": x.expert_bytes * (u + rereads * (1.0 - hit)),
        "cache": x.expert_bytes * rereads * hit,
        "compute": s * 6.0 * x.hidden * x.intermediate,
        "serial": active * tokens * chunks * (x.hidden + x.intermediate),
    }
    if structure.tile_tokens:
        width = np.maximum(structure.tile_width(x.n_tokens), 1.0)
        tiles = np.ceil(s / safe_u / width - 1e-9)
        columns["tile"] = active * u * tiles * width * 6.0 * x.hidden * x.intermediate
    if not structure.variants:
        return columns, np.zeros(np.shape(u), np.intp)
    widths = np.asarray(structure.variants, np.float64)
    return columns, np.minimum(np.searchsorted(widths, np.minimum(cmax, t) - 1e-9), len(widths) - 1)


def term_columns(x: ExpertInputs, structure: ExpertStructure, cache_bytes: float) -> dict[str, np.ndarray]:
    """Every term as its own column (one compute and one serial column per tile variant): the fit's design."""
    columns, index = base_columns(x, structure, cache_bytes)
    if structure.variants:
        compute, serial = columns.pop("compute"), columns.pop("serial")
        for i, width in enumerate(structure.variants):
            columns[f"compute{width}"] = np.where(index == i, compute, 0.0)
            columns[f"serial{width}"] = np.where(index == i, serial, 0.0)
    return columns


@numba.njit(cache=True)
def _element_time_us(u, s, cmax, params, widths, compute, serial):  # noqa: ANN001, ANN202
    """`ExpertFamily.inputs_time_us` of one pass, compiled: the same terms in the same order
    (`base_columns`, `model_time_us`, the roofline floor); `params` = tokens_per_read, cache_bytes,
    expert_bytes, hidden, intermediate, the fixed, per_expert, per_slot, hbm and cache
    coefficients, peak bandwidth and peak TFLOP/s, the tile coefficient, tile_tokens, tile_step and
    top-k (a pass of s slots has s / top-k tokens)."""
    t_read = params[0]
    cache_bytes, b, h, inter = params[1], params[2], params[3], params[4]
    fixed, per_expert, per_slot, hbm, cache = params[5], params[6], params[7], params[8], params[9]
    safe_u = max(u, 1.0)
    if t_read == 1.0:
        reads, chunks, tokens = s, 1.0, 1.0
    elif t_read == 0.0:
        reads, chunks, tokens = u, 1.0, cmax
    else:
        chunks = math.ceil(s / safe_u / t_read - 1e-9)
        reads, tokens = u * chunks, min(cmax, t_read)
    rereads = max(reads - u, 0.0)
    hit = min(1.0, cache_bytes / (safe_u * b))
    active = 1.0 if s > 0 else 0.0
    v = 0
    if widths.shape[0]:
        v = min(np.searchsorted(widths, min(cmax, t_read) - 1e-9), widths.shape[0] - 1)
    flops = s * 6.0 * h * inter
    total = flops * compute[v] + active * tokens * chunks * (h + inter) * serial[v]
    if fixed:
        total = total + fixed * active
    if per_expert:
        total = total + per_expert * u
    if per_slot:
        total = total + per_slot * s
    if hbm:
        total = total + hbm * (b * (u + rereads * (1.0 - hit)))
    if cache:
        total = total + cache * (b * rereads * hit)
    tile, tile_tokens, tile_step = params[12], params[13], params[14]
    if tile_tokens and tile:
        width = tile_tokens
        if tile_step:
            width = min(tile_tokens, tile_step * math.ceil(s / params[15] / tile_step - 1e-9))
        width = max(width, 1.0)
        total = total + tile * (active * u * math.ceil(s / safe_u / width - 1e-9) * width * 6.0 * h * inter)
    return max(total, max(u * b / (params[10] * 1e3), flops / (params[11] * 1e6)))


@numba.njit(cache=True)
def _compiled_time_us(slots, distinct, most, params, widths, compute, serial, out):  # noqa: ANN001, ANN202
    """`_element_time_us` of every pass of flat arrays."""
    for i in range(slots.shape[0]):
        out[i] = _element_time_us(distinct[i], slots[i], most[i], params, widths, compute, serial)


@numba.njit(cache=True)
def _compiled_layers_us(slots, distinct, most, params, widths, compute, serial):  # noqa: ANN001, ANN202
    """Σ over layers of the slowest rank's time, for (ranks, layers) arrays."""
    total = 0.0
    for layer in range(slots.shape[1]):
        slowest = 0.0
        for r in range(slots.shape[0]):
            slowest = max(slowest, _element_time_us(distinct[r, layer], slots[r, layer], most[r, layer], params, widths, compute, serial))
        total += slowest
    return total


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
        """The family's structure and rates as plain data (the TOML keys; tile keys only for tiled kernels)."""
        tiles = self.structure.tile_tokens
        tiled = {"tile_tokens": tiles, "tile_step": self.structure.tile_step, "tile_tflops": self.tile_tflops} if tiles else {}
        return {
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

    def coefficients(self) -> dict[str, float]:
        """Coefficient of each term column of `term_columns` (µs per unit of the column)."""
        coefficients = {
            "fixed": self.fixed_us,
            "per_expert": self.per_expert_us,
            "per_slot": self.per_slot_us,
            "hbm": _rate_to_coefficient(self.hbm_bandwidth_gbps, 1e3),
            "cache": _rate_to_coefficient(self.cache_bandwidth_gbps, 1e3),
        }
        if self.structure.tile_tokens:
            coefficients["tile"] = _rate_to_coefficient(self.tile_tflops, 1e6)
        suffixes = [str(v) for v in self.structure.variants] or [""]
        for suffix, compute, serial in zip(suffixes, *self._variant_coefficients(), strict=True):
            coefficients[f"compute{suffix}"] = compute
            coefficients[f"serial{suffix}"] = serial
        return coefficients

    def _variant_coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        compute = np.array([_rate_to_coefficient(rate, 1e6) for rate in self.compute_tflops])
        return compute, np.array(self.serial_ns) * 1e-3

    def model_time_us(self, x: ExpertInputs) -> np.ndarray:
        """The fitted terms alone, without the roofline floor."""
        columns, index = base_columns(x, self.structure, self.cache_bytes)
        compute, serial = self._variant_coefficients()
        total = columns["compute"] * compute[index] + columns["serial"] * serial[index]
        for name, coefficient in self.coefficients().items():
            if coefficient and name in ("fixed", "per_expert", "per_slot", "hbm", "cache", "tile"):
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

    @cached_property
    def _compiled(self) -> dict[tuple[ExpertShape, int], tuple[np.ndarray, ...]]:
        return {}

    def compiled_params(self, shape: ExpertShape, top_k: int) -> tuple[np.ndarray, ...]:
        """The kernel's parameters for an expert shape and top-k (kept per pair; the format's own bandwidth where it has one)."""
        params = self._compiled.get((shape, top_k))
        if params is None:
            family = self.for_format(shape.weight_format) if self.format_bandwidth_gbps else self
            c = family.coefficients()
            compute, serial = family._variant_coefficients()
            structure = family.structure
            scalars = [
                float(structure.tokens_per_read), family.cache_bytes, shape.expert_bytes, float(shape.hidden),
                float(shape.intermediate), c["fixed"], c["per_expert"], c["per_slot"], c["hbm"], c["cache"],
                family.roofline.peak_bandwidth_gbps, family.roofline.peak_tflops, c.get("tile", 0.0),
                float(structure.tile_tokens), float(structure.tile_step), float(top_k),
            ]  # fmt: skip
            widths = np.asarray(structure.variants, np.float64)
            params = self._compiled[(shape, top_k)] = (
                np.array(scalars),
                widths,
                np.ascontiguousarray(compute, np.float64),
                np.ascontiguousarray(serial, np.float64),
            )
        return params

    def fast_time_us(self, slots: np.ndarray, distinct: np.ndarray, most: np.ndarray, shape: ExpertShape, top_k: int) -> np.ndarray:
        """`time_us` of passes of slots / top_k tokens given by slots, distinct experts and max
        tokens per expert (arrays of one shape), in one compiled call: the simulator's per-pass
        path where no table applies (mixed passes, expert-parallel ranks). Tested equal to `time_us`."""
        flat = [np.ascontiguousarray(a, np.float64).ravel() for a in (slots, distinct, most)]
        out = np.empty(flat[0].size)
        _compiled_time_us(*flat, *self.compiled_params(shape, top_k), out)
        return out.reshape(np.shape(slots))

    def fast_layers_us(self, slots: np.ndarray, distinct: np.ndarray, most: np.ndarray, shape: ExpertShape, top_k: int) -> float:
        """Σ over MoE layers of the slowest rank's `time_us`, for (ranks, layers) arrays of slots,
        distinct experts and max tokens per expert, in one compiled call (a pass over expert-parallel
        ranks; one rank: the layers' sum)."""
        arrays = [np.ascontiguousarray(a, np.float64) for a in (slots, distinct, most)]
        return float(_compiled_layers_us(*arrays, *self.compiled_params(shape, top_k)))

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
        """Time in µs = launch_us·kernels + bytes / bandwidth + flops / FLOP rate, vectorised (plain
        numbers stay numbers, as the simulator's per-pass call passes them; the same arithmetic)."""
        if not (isinstance(bytes_read, float | int) and isinstance(flops, float | int) and isinstance(kernels, float | int)):
            bytes_read, flops, kernels = (np.asarray(v, np.float64) for v in (bytes_read, flops, kernels))
        return self.launch_us * kernels + bytes_read / (self.bandwidth_gbps * 1e3) + flops * self.flop_coefficient  # type: ignore[return-value]

    @cached_property
    def flop_coefficient(self) -> float:
        """µs per FLOP (0 at an infinite rate)."""
        return _rate_to_coefficient(self.tflops, 1e6)

    @property
    def attention_coefficient(self) -> float:
        """µs per attention FLOP (0 at an infinite rate)."""
        return _rate_to_coefficient(self.attention_tflops, 1e6)

    def attention_us(self, flops: np.ndarray | float) -> np.ndarray:
        """Time in µs of attention's FLOPs = flops / attention rate (0 when the rate is inf)."""
        return np.asarray(flops, np.float64) * self.attention_coefficient

    def extrapolation_factor(self, bytes_read: np.ndarray | float) -> np.ndarray:
        """The dense family is not calibrated on a grid: always 1.0 (its ε says how far to trust it)."""
        return np.ones(np.shape(bytes_read))
