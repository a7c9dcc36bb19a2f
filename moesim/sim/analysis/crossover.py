"""`moesim crossover`: where deduplicating expert reads wins. The formulas (byte share u(n),
bandwidth ratio r(n), win window, crossover under uniform routing) and the analysis on a
scenario (from the trace and from uniform routing, with the range over the error box)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.kernels.features import uniform_distinct_experts
from moesim.sim.analysis.scenario import Scenario, expected_costs, extrapolation_warnings, pass_sizes, uniform_twin
from moesim.sim.cost.pass_features import batch_expected_costs, mean_distinct_experts, window_distributions
from moesim.sim.cost.steptime import ERROR_BOX_CORNERS, check_family
from moesim.tracegen.formats.trace import Trace


def byte_share(distinct_experts: np.ndarray, n_tokens: np.ndarray, top_k: int) -> np.ndarray:
    """u(n) = U(n) / (n·K): the dedup engine's expert bytes relative to the per-slot engine's."""
    return np.asarray(distinct_experts, np.float64) / (np.asarray(n_tokens, np.float64) * top_k)


def bandwidth_ratio(per_slot_us: np.ndarray, dedup_us: np.ndarray, share: np.ndarray) -> np.ndarray:
    """r(n) = BW_dedup / BW_per_slot = u(n) · T_per_slot(n) / T_dedup(n) (effective, on requested bytes)."""
    return np.asarray(share) * np.asarray(per_slot_us, np.float64) / np.asarray(dedup_us, np.float64)


@dataclass(frozen=True)
class WinWindow:
    """Pass sizes where dedup is faster than per-slot: the first (crossover) and all of them."""

    crossover_n: int | None
    dedup_wins: list[int]


def win_window(n_tokens: np.ndarray, per_slot_us: np.ndarray, dedup_us: np.ndarray) -> WinWindow:
    """Dedup wins at n iff T_dedup(n) < T_per_slot(n); it may win in a window and lose again."""
    n = np.asarray(n_tokens)
    wins = np.asarray(dedup_us) < np.asarray(per_slot_us)
    winners = [int(x) for x in n[wins]]
    return WinWindow(winners[0] if winners else None, winners)


def uniform_crossover(experts: int, top_k: int, ratio: float, max_pass: int = 1024) -> int | None:
    """First n with u(n) < r under uniform routing and a constant bandwidth ratio r (the seed's rule)."""
    n = np.arange(1, max_pass + 1)
    share = uniform_distinct_experts(n, experts, top_k) / (n * top_k)
    below = np.flatnonzero(share < ratio)
    return int(n[below[0]]) if below.size else None


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


def _expert_times(
    scenario: Scenario,
    family: str,
    distributions: list,
    trace: Trace,
    sizes: np.ndarray,  # type: ignore[type-arg]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One family's expert time per pass size on the scenario's devices (expert parallel: at the slowest rank)."""
    model = dataclasses.replace(scenario.model, family=family)
    if model.parallel.ranks > 1:
        cost = expected_costs(scenario, sizes, model, trace)
    else:
        cost = model.expected_pass_cost(distributions, float(scenario.context_tokens))
    return cost.expert_us, cost.expert_epsilon, cost.extrapolation


def default_dedup_family(scenario: Scenario) -> str:
    """The dedup family a crossover compares with per_slot by default: `dedup` on a lab profile; on an
    engine profile the deduplicating kernel its dispatch runs at the largest pass size (its mat-mat kernel)."""
    profile = scenario.model.profile
    if profile.dispatch is None or "dedup" in profile.dedup_families:
        return "dedup"
    p = scenario.model.preset
    for n in (4096, 512, 64):
        family = str(profile.dispatch.family_for(scenario.model.weight_format, n, p.experts, p.top_k))
        if family in profile.dedup_families:
            return family
    return profile.dedup_families[0] if profile.dedup_families else "dedup"


def _batched_times(
    scenario: Scenario, family: str, trace: Trace, sizes: np.ndarray, batch: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One family's expert time per pass size for passes of `batch` requests of n tokens each (the
    trace's batch windows, `pass_features.batch_expected_costs`), and their mean distinct experts per layer."""
    model = dataclasses.replace(scenario.model, family=family)
    cost, distinct = batch_expected_costs(model, trace, batch, sizes, scenario.context_tokens)
    return cost.expert_us, cost.expert_epsilon, cost.extrapolation, distinct


def crossover_analysis(
    scenario: Scenario, dedup_family: str | None = None, max_pass: int = 32, sizes: list[int] | None = None, batch: int = 1
) -> Crossover:
    """Where the dedup family's expert time drops below per-slot's, from the trace and from uniform
    routing; `batch` B > 1: passes of B requests of n tokens each (u = U / (B·n·K))."""
    profile = scenario.model.profile
    dedup_family = dedup_family or default_dedup_family(scenario)
    if dedup_family not in profile.dedup_families:
        raise InputError(
            f"profile '{profile.name}' has no dedup family '{dedup_family}' (dedup families: {', '.join(profile.dedup_families)})"
        )
    check_family(profile, "per_slot")
    n = pass_sizes(max_pass, sizes)
    g = scenario.trace.meta.geometry
    twin = uniform_twin(scenario.trace, scenario.model.preset, batch=batch)
    result = {}
    if batch < 1:
        raise InputError(f"batch must be >= 1, got {batch}")
    for label, trace in (("trace", scenario.trace), ("uniform", twin)):
        if batch == 1:
            distributions = window_distributions(trace, n)
            ps, eps_ps, x_ps = _expert_times(scenario, "per_slot", distributions, trace, n)
            dd, eps_dd, x_dd = _expert_times(scenario, dedup_family, distributions, trace, n)
            share = mean_distinct_experts(trace, n, distributions) / (n * g.top_k)
        else:
            ps, eps_ps, x_ps, distinct = _batched_times(scenario, "per_slot", trace, n, batch)
            dd, eps_dd, x_dd, _ = _batched_times(scenario, dedup_family, trace, n, batch)
            share = distinct / (batch * n * g.top_k)
        result[label] = (ps, dd, eps_ps, eps_dd, share, np.maximum(x_ps, x_dd))
    ps, dd, eps_ps, eps_dd, share, factor = result["trace"]
    window = win_window(n, ps, dd)
    corner_crossovers = [win_window(n, ps * (1 + a * eps_ps), dd * (1 + b * eps_dd)).crossover_n for a, b in ERROR_BOX_CORNERS]
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
        warnings=extrapolation_warnings("pass", "n", factor, n),
    )
