"""`moesim best-draft`: the best draft length k*(α) with its speedup, interval over the error box,
staircase and break-even acceptances."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.sim.analysis.scenario import LARGEST_PASS, Scenario, expected_costs, extrapolation_warnings
from moesim.sim.analysis.speculation import (
    best_draft,
    break_even_alpha,
    check_acceptance,
    check_draft_lengths,
    relative_cost,
    speedup_table,
    staircase,
)
from moesim.sim.cost.drafters import draft_us
from moesim.sim.cost.steptime import ERROR_BOX_CORNERS, PassCost


def draft_costs_us(scenario: Scenario, max_draft: int, batch: int = 1) -> np.ndarray:
    """T_draft(k) for k = 0..max_draft."""
    return np.array(
        [draft_us(scenario.drafter, np.full(batch, k), scenario.context_tokens, scenario.dense_us) for k in range(max_draft + 1)]
    )


def corner_costs(cost: PassCost, draft_us_by_k: np.ndarray, drafter_uses_dense: bool, dense_epsilon: float) -> list[np.ndarray]:
    """C(k) at the nominal point and each corner of the error box."""
    out = [relative_cost(draft_us_by_k, cost.total_us())]
    for expert_sign, dense_sign in ERROR_BOX_CORNERS:
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
    if max_draft > LARGEST_PASS - 1:  # a verify pass is k + 1 tokens
        raise InputError(f"the largest draft length (--max-draft) must lie in 0..{LARGEST_PASS - 1}, got {max_draft}")
    longest = int(scenario.trace.seq_lengths().max())
    if max_draft + 1 > longest:
        raise InputError(f"--max-draft {max_draft} needs passes of {max_draft + 1} positions; the longest in the trace has {longest}")
    cost = expected_costs(scenario, np.arange(1, max_draft + 2))
    draft = draft_costs_us(scenario, max_draft)
    uses_dense = scenario.drafter.provenance == "profile"
    nominal, *corners = corner_costs(cost, draft, uses_dense, cost.dense_epsilon)
    k_star, s_star = best_draft(alpha, nominal)
    at_corners = [speedup_table(alpha, c)[np.arange(alpha.size), k_star] for c in corners]
    k_corners = np.stack([best_draft(alpha, c)[0] for c in corners])
    warnings = extrapolation_warnings("verify pass", "n", cost.extrapolation, np.arange(1, max_draft + 2))
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
