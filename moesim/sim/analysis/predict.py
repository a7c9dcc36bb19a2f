"""`moesim predict`: the expected pass time T(n) per pass size with its interval and where it rests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.sim.analysis.scenario import Scenario, expected_costs, extrapolation_warnings, pass_sizes
from moesim.sim.cost.steptime import PassCost


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
                **({"engine_us": np.asarray(c.engine_us(), np.float64)} if c.engine_parts_us else {}),
                "rung": c.rung,
                "extrapolation": c.extrapolation,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "engine": self.engine,
            "passes": self.table().to_dicts(),
            "epsilon": {"expert": float(np.max(self.cost.expert_epsilon, initial=0.0)), "dense": self.cost.dense_epsilon},
            "bound_basis": self.cost.bound_basis,
            "provenance_share": self.cost.provenance_share(),
            "rung_share": self.cost.rung_share(),
            "warnings": self.warnings,
        }


def predict(scenario: Scenario, max_pass: int = 16, sizes: list[int] | None = None) -> Prediction:
    """T(n) for n = 1..max_pass (above 64 on a grid, `pass_sizes`) or the given sizes, expected over the trace's windows."""
    n = pass_sizes(max_pass, sizes)
    cost = expected_costs(scenario, n)
    return Prediction(scenario.model.engine, n, cost, extrapolation_warnings("pass", "n", cost.extrapolation, n))
