"""Closed-form analyses on a trace, a profile and a model (issue 6): pass times per n with their
intervals, the best draft length per acceptance, the dedup win window, and batch effects.

Everything starts from a `Scenario`: a step-time model (target preset on a profile with an
engine), the trace whose routing it replays, the drafter and the context length. Results are
plain frozen dataclasses with `table()` (a polars frame) and `to_dict()` (for `--json`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles import load_profile
from moesim.kernels.unions import batch_lanes, batch_windows, union_features_many
from moesim.kernels.windows import MAX_PASS_LIMIT, summarize_windows
from moesim.models import ModelPreset, builtin_names, load_preset
from moesim.sim.crossover import bandwidth_ratio, win_window
from moesim.sim.drafters import Drafter, draft_us, make_drafter
from moesim.sim.moesd import target_efficiency
from moesim.sim.speculation import (
    best_draft,
    break_even_alpha,
    check_acceptance,
    check_draft_lengths,
    relative_cost,
    speedup_table,
    staircase,
    tokens_per_pass,
)
from moesim.sim.steptime import PassCost, StepTimeModel, check_engine
from moesim.tracegen.synth import Uniform, synthesize
from moesim.tracegen.trace import Trace, read_trace

CORNERS = ((-1.0, -1.0), (-1.0, 1.0), (1.0, -1.0), (1.0, 1.0))


@dataclass(frozen=True)
class Scenario:
    """A target on a device replaying a trace's routing, with a drafter and a context length."""

    model: StepTimeModel
    trace: Trace
    drafter: Drafter
    context_len: int = 512

    @property
    def top_k(self) -> int:
        """Experts per token."""
        return self.model.preset.top_k

    def dense_us(self, bytes_read: float, flops: float) -> float:
        """The profile's dense family (drafters use it)."""
        return self.model.dense_family_us(bytes_read, flops)


def preset_for_trace(trace: Trace, model: str | None) -> ModelPreset:
    """The trace's own preset (its metadata names a built-in one), or `model`; checked against the routing."""
    g = trace.meta.geometry
    if model is None and g.model not in builtin_names("moe"):
        raise InputError(f"trace model '{g.model}' is not a built-in preset; give --model PRESET (a name, .toml or config.json)")
    preset = load_preset(model or g.model)
    if (preset.top_k, preset.experts, preset.moe_layers) != (g.top_k, g.experts, g.moe_layers):
        raise InputError(
            f"trace of '{g.model}' routes top-{g.top_k} of {g.experts} experts in MoE layers {list(g.moe_layers)[:3]}..., "
            f"but preset '{preset.name}' has top-{preset.top_k} of {preset.experts} in {list(preset.moe_layers)[:3]}..."
        )
    return preset


def load_scenario(
    trace_path: str | Path,
    profile: str,
    engine: str = "per_slot",
    model: str | None = None,
    drafter: str = "ngram",
    weight_format: str | None = None,
    context_len: int = 512,
) -> Scenario:
    """Read the trace, resolve preset, profile, engine and drafter (each a one-line error when wrong)."""
    if context_len < 0:
        raise InputError(f"context length must be >= 0, got {context_len}")
    trace = read_trace(trace_path)
    preset = preset_for_trace(trace, model)
    hw = load_profile(profile)
    check_engine(hw, engine)
    fmt = weight_format or trace.meta.geometry.weight_format
    step = StepTimeModel(preset, hw, engine, fmt)
    return Scenario(step, trace, make_drafter(drafter, preset), context_len)


def _check_pass_sizes(scenario: Scenario, max_pass: int) -> None:
    if not 1 <= max_pass <= MAX_PASS_LIMIT:
        raise InputError(f"pass size must lie in 1..{MAX_PASS_LIMIT}, got {max_pass}")
    longest = int(scenario.trace.seq_lengths().max())
    if max_pass > longest:
        raise InputError(f"pass size {max_pass} exceeds the trace's longest sequence ({longest} positions)")


def expected_costs(scenario: Scenario, max_pass: int, model: StepTimeModel | None = None, trace: Trace | None = None) -> PassCost:
    """Expected pass times over the trace's windows for n = 1..max_pass (shape (max_pass,))."""
    _check_pass_sizes(scenario, max_pass)
    trace = trace or scenario.trace
    summary = summarize_windows(trace.experts, trace.seq_starts, trace.meta.geometry.experts, max_pass)
    distributions = [summary.feature_distribution(n) for n in range(1, max_pass + 1)]
    return (model or scenario.model).expected_pass_cost(distributions, float(scenario.context_len))


def uniform_twin(trace: Trace, preset: ModelPreset, seed: int = 0) -> Trace:
    """A uniform-routing trace of the same geometry and sequence lengths (for comparison)."""
    lengths = trace.seq_lengths()
    tokens = int(min(lengths.max(), 4096))
    seqs = max(1, min(int(lengths.sum()) // tokens, 16))
    return synthesize(preset, Uniform(), tokens, seqs, seed, trace.meta.geometry.weight_format)


def extrapolation_warnings(label: str, factor: np.ndarray, sizes: np.ndarray) -> list[str]:
    """One warning per prediction beyond the calibrated range, with its extrapolation factor."""
    out = []
    for size, f in zip(np.asarray(sizes).ravel(), np.asarray(factor).ravel(), strict=True):
        if f > 1.0 + 1e-9:
            out.append(
                f"{label} {int(size)} lies beyond the calibrated range (extrapolation factor {f:.2f}); the roofline bounds it from below"
            )
    return out


# ---- predict -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """Expected pass time T(n) per n with its interval and where it rests."""

    engine: str
    n: np.ndarray
    cost: PassCost
    warnings: list[str] = field(default_factory=list)

    def table(self) -> pl.DataFrame:
        """One row per n."""
        c = self.cost
        return pl.DataFrame(
            {
                "n": self.n,
                "family": c.family,
                "time_us": c.total_us(),
                "low_us": c.low_us,
                "high_us": c.high_us,
                "expert_us": c.expert_us,
                "dense_us": c.dense_us,
                "fixed_us": np.full(self.n.shape, c.fixed_us),
                "extrapolation": c.extrapolation,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "engine": self.engine,
            "passes": self.table().to_dicts(),
            "epsilon": {"expert": self.cost.expert_epsilon, "dense": self.cost.dense_epsilon},
            "provenance_share": self.cost.provenance_share(),
            "warnings": self.warnings,
        }


def predict(scenario: Scenario, max_pass: int = 16) -> Prediction:
    """T(n) for n = 1..max_pass, expected over the trace's windows."""
    cost = expected_costs(scenario, max_pass)
    n = np.arange(1, max_pass + 1)
    return Prediction(scenario.model.engine, n, cost, extrapolation_warnings("pass of n =", cost.extrapolation, n))


# ---- best draft ------------------------------------------------------------------------------------


def draft_costs_us(scenario: Scenario, max_draft: int, batch: int = 1) -> np.ndarray:
    """T_draft(k) for k = 0..max_draft."""
    return np.array([draft_us(scenario.drafter, np.full(batch, k), scenario.context_len, scenario.dense_us) for k in range(max_draft + 1)])


def corner_costs(cost: PassCost, draft_us_by_k: np.ndarray, drafter_uses_dense: bool, dense_epsilon: float) -> list[np.ndarray]:
    """C(k) at the nominal point and each corner of the error box."""
    out = [relative_cost(draft_us_by_k, cost.total_us())]
    for expert_sign, dense_sign in CORNERS:
        draft = draft_us_by_k * (1.0 + dense_sign * dense_epsilon) if drafter_uses_dense else draft_us_by_k
        out.append(relative_cost(draft, cost.total_us(expert_sign, dense_sign)))
    return out


@dataclass(frozen=True)
class BestDraft:
    """k*(α) with speedups, their intervals, ambiguity, the staircase and break-even acceptances."""

    alpha: np.ndarray
    best_draft: np.ndarray
    speedup: np.ndarray
    speedup_low: np.ndarray
    speedup_high: np.ndarray
    best_draft_low: np.ndarray
    best_draft_high: np.ndarray
    relative_cost: np.ndarray
    break_even: np.ndarray
    steps: list[tuple[float, int]]
    warnings: list[str] = field(default_factory=list)

    def table(self) -> pl.DataFrame:
        """One row per α."""
        return pl.DataFrame(
            {
                "alpha": self.alpha,
                "best_draft": self.best_draft,
                "speedup": self.speedup,
                "speedup_low": self.speedup_low,
                "speedup_high": self.speedup_high,
                "best_draft_range": [
                    f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in zip(self.best_draft_low, self.best_draft_high, strict=True)
                ],
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form: `points` as the issue specifies, plus staircase and break-even."""
        points = [
            {
                "alpha": float(a),
                "best_draft": int(k),
                "speedup": float(s),
                "speedup_low": float(lo),
                "speedup_high": float(hi),
                "best_draft_low": int(klo),
                "best_draft_high": int(khi),
                "ambiguous": bool(klo != khi),
            }
            for a, k, s, lo, hi, klo, khi in zip(
                self.alpha,
                self.best_draft,
                self.speedup,
                self.speedup_low,
                self.speedup_high,
                self.best_draft_low,
                self.best_draft_high,
                strict=True,
            )
        ]
        return {
            "points": points,
            "relative_cost": self.relative_cost.tolist(),
            "break_even_alpha": [None if not np.isfinite(a) else float(a) for a in self.break_even],
            "staircase": [{"from_alpha": a, "best_draft": k} for a, k in self.steps],
            "warnings": self.warnings,
        }


def best_draft_analysis(scenario: Scenario, alphas: list[float] | np.ndarray, max_draft: int = 8) -> BestDraft:
    """Best draft length k = 0..max_draft per α, with intervals from the families' ε."""
    alpha = check_acceptance(np.asarray(alphas, np.float64))
    check_draft_lengths(max_draft, "max draft length")
    cost = expected_costs(scenario, max_draft + 1)
    draft = draft_costs_us(scenario, max_draft)
    uses_dense = scenario.drafter.provenance == "profile"
    nominal, *corners = corner_costs(cost, draft, uses_dense, cost.dense_epsilon)
    k_star, s_star = best_draft(alpha, nominal)
    at_corners = [speedup_table(alpha, c)[np.arange(alpha.size), k_star] for c in corners]
    k_corners = np.stack([best_draft(alpha, c)[0] for c in corners])
    warnings = extrapolation_warnings("verify pass of n =", cost.extrapolation, np.arange(1, max_draft + 2))
    return BestDraft(
        alpha=alpha,
        best_draft=k_star,
        speedup=s_star,
        speedup_low=np.min(at_corners, axis=0),
        speedup_high=np.max(at_corners, axis=0),
        best_draft_low=k_corners.min(axis=0),
        best_draft_high=k_corners.max(axis=0),
        relative_cost=nominal,
        break_even=break_even_alpha(np.arange(max_draft + 1), nominal),
        steps=staircase(nominal),
        warnings=warnings,
    )


# ---- dedup win window -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Crossover:
    """Per n: byte share u(n), bandwidth ratio r(n), expert times; crossover and win set, from the
    trace and from uniform routing, with the crossover's range over the error box."""

    dedup_family: str
    n: np.ndarray
    byte_share: np.ndarray
    bandwidth_ratio: np.ndarray
    per_slot_us: np.ndarray
    dedup_us: np.ndarray
    crossover_n: int | None
    dedup_wins: list[int]
    crossover_range: tuple[int | None, int | None]
    uniform_byte_share: np.ndarray
    uniform_crossover_n: int | None
    uniform_dedup_wins: list[int]
    warnings: list[str] = field(default_factory=list)

    def table(self) -> pl.DataFrame:
        """One row per n."""
        return pl.DataFrame(
            {
                "n": self.n,
                "byte_share": self.byte_share,
                "bandwidth_ratio": self.bandwidth_ratio,
                "per_slot_us": self.per_slot_us,
                "dedup_us": self.dedup_us,
                "dedup_wins": np.isin(self.n, self.dedup_wins),
                "uniform_byte_share": self.uniform_byte_share,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "dedup_family": self.dedup_family,
            "crossover_n": self.crossover_n,
            "dedup_wins": self.dedup_wins,
            "crossover_range": list(self.crossover_range),
            "byte_share": self.byte_share.tolist(),
            "bandwidth_ratio": self.bandwidth_ratio.tolist(),
            "per_slot_us": self.per_slot_us.tolist(),
            "dedup_us": self.dedup_us.tolist(),
            "uniform": {
                "byte_share": self.uniform_byte_share.tolist(),
                "crossover_n": self.uniform_crossover_n,
                "dedup_wins": self.uniform_dedup_wins,
            },
            "warnings": self.warnings,
        }


def _expert_times(scenario: Scenario, family: str, max_pass: int, trace: Trace) -> tuple[np.ndarray, float, np.ndarray]:
    model = StepTimeModel(scenario.model.preset, scenario.model.profile, family, scenario.model.weight_format)
    cost = expected_costs(scenario, max_pass, model, trace)
    return cost.expert_us, cost.expert_epsilon, cost.extrapolation


def crossover_analysis(scenario: Scenario, dedup_family: str = "dedup", max_pass: int = 32) -> Crossover:
    """Where the dedup family's expert time drops below per-slot's, from the trace and from uniform routing."""
    profile = scenario.model.profile
    if dedup_family not in profile.dedup_families:
        raise InputError(
            f"profile '{profile.name}' has no dedup family '{dedup_family}' (dedup families: {', '.join(profile.dedup_families)})"
        )
    check_engine(profile, "per_slot")
    n = np.arange(1, max_pass + 1)
    g = scenario.trace.meta.geometry
    twin = uniform_twin(scenario.trace, scenario.model.preset)
    result = {}
    for label, trace in (("trace", scenario.trace), ("uniform", twin)):
        ps, eps_ps, x_ps = _expert_times(scenario, "per_slot", max_pass, trace)
        dd, eps_dd, x_dd = _expert_times(scenario, dedup_family, max_pass, trace)
        summary = summarize_windows(trace.experts, trace.seq_starts, g.experts, max_pass)
        share = summary.mean_distinct_experts() / (n * g.top_k)
        result[label] = (ps, dd, eps_ps, eps_dd, share, np.maximum(x_ps, x_dd))
    ps, dd, eps_ps, eps_dd, share, factor = result["trace"]
    window = win_window(n, ps, dd)
    corner_crossovers = [win_window(n, ps * (1 + a * eps_ps), dd * (1 + b * eps_dd)).crossover_n for a, b in CORNERS]
    known = [c for c in corner_crossovers if c is not None]
    low = min(known) if known else None
    high = None if None in corner_crossovers else max(known)
    uniform_window = win_window(n, result["uniform"][0], result["uniform"][1])
    return Crossover(
        dedup_family=dedup_family,
        n=n,
        byte_share=share,
        bandwidth_ratio=bandwidth_ratio(ps, dd, share),
        per_slot_us=ps,
        dedup_us=dd,
        crossover_n=window.crossover_n,
        dedup_wins=window.dedup_wins,
        crossover_range=(low, high),
        uniform_byte_share=result["uniform"][4],
        uniform_crossover_n=uniform_window.crossover_n,
        uniform_dedup_wins=uniform_window.dedup_wins,
        warnings=extrapolation_warnings("pass of n =", factor, n),
    )


# ---- batch -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchEffect:
    """Per batch size B: target pass times for 1 and v tokens per sequence, MoESD's target
    efficiency T(B, 1) / T(B, v), and the speedup of speculation at α and k."""

    alpha: float
    draft_len: int
    verify_tokens: int
    batch: np.ndarray
    single_us: np.ndarray
    verify_us: np.ndarray
    draft_us: np.ndarray
    distinct_experts: np.ndarray
    extrapolation: np.ndarray
    source: list[str]
    warnings: list[str] = field(default_factory=list)

    @property
    def efficiency(self) -> np.ndarray:
        """T_T(B, 1) / T_T(B, v)."""
        return target_efficiency(self.single_us, self.verify_us)

    @property
    def speedup(self) -> np.ndarray:
        """S(B) = τ(k, α)·T(B, 1) / (T_draft(B, k) + T(B, k + 1))."""
        return tokens_per_pass(self.draft_len, self.alpha) * self.single_us / (self.draft_us + self.verify_us)

    def table(self) -> pl.DataFrame:
        """One row per B."""
        return pl.DataFrame(
            {
                "batch": self.batch,
                "single_us": self.single_us,
                "verify_us": self.verify_us,
                "draft_us": self.draft_us,
                "distinct_experts": self.distinct_experts,
                "target_efficiency": self.efficiency,
                "speedup": self.speedup,
                "extrapolation": self.extrapolation,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "alpha": self.alpha,
            "draft_len": self.draft_len,
            "verify_tokens": self.verify_tokens,
            "batches": self.table().to_dicts(),
            "lanes": self.source,
            "warnings": self.warnings,
        }


def _batch_pass_us(scenario: Scenario, trace: Trace, batch: int, n: int, max_batches: int) -> tuple[float, float, float, str]:
    lanes = batch_lanes(trace.seq_starts, batch)
    if int(lanes.length.max(initial=0)) < n:
        raise InputError(f"the trace is too short for a batch of {batch} sequences of {n} tokens each")
    offsets, starts, lengths = batch_windows(lanes, n, max_batches)
    union = union_features_many(trace.experts, offsets, starts, lengths, trace.meta.geometry.experts)
    cost = scenario.model.pass_cost(union.routing_features(), float(batch * scenario.context_len))
    return float(cost.total_us().mean()), float(union.distinct_experts.mean()), float(cost.extrapolation.max()), lanes.describe()


def batch_analysis(
    scenario: Scenario,
    alpha: float,
    draft_len: int,
    batches: list[int],
    moesd_slots: bool = False,
    routing: str = "trace",
    max_batches: int = 256,
) -> BatchEffect:
    """Speedup and target efficiency vs batch size. MoESD's convention verifies γ = k slots per
    sequence (`moesd_slots`); moesim's verifies k + 1."""
    check_acceptance(alpha)
    k = int(check_draft_lengths(draft_len))
    if k < 1:
        raise InputError(f"batch analysis needs a draft length >= 1, got {k}")
    if not batches or min(batches) < 1:
        raise InputError(f"batch sizes must be >= 1, got {batches}")
    if routing not in ("trace", "uniform"):
        raise InputError(f"routing must be 'trace' or 'uniform', got '{routing}'")
    trace = scenario.trace if routing == "trace" else uniform_twin(scenario.trace, scenario.model.preset)
    verify = k if moesd_slots else k + 1
    rows = []
    for b in batches:
        single, _, x1, source = _batch_pass_us(scenario, trace, b, 1, max_batches)
        multi, distinct, xv, _ = _batch_pass_us(scenario, trace, b, verify, max_batches)
        drafted = draft_us(scenario.drafter, np.full(b, k), scenario.context_len, scenario.dense_us)
        rows.append((single, multi, drafted, distinct, max(x1, xv), f"B={b}: {source}"))
    single, multi, drafted, distinct, factor, source = zip(*rows, strict=True)
    sizes = np.asarray(batches)
    return BatchEffect(
        alpha=float(alpha),
        draft_len=k,
        verify_tokens=verify,
        batch=sizes,
        single_us=np.asarray(single),
        verify_us=np.asarray(multi),
        draft_us=np.asarray(drafted),
        distinct_experts=np.asarray(distinct),
        extrapolation=np.asarray(factor),
        source=list(source),
        warnings=extrapolation_warnings("batch of B =", np.asarray(factor), sizes),
    )
