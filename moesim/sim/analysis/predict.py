"""`moesim predict`: the expected pass time T(n) per pass size with its interval and where it rests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.sim.analysis.scenario import Scenario, expected_costs, extrapolation_warnings, pass_sizes
from moesim.sim.cost.pass_features import batch_expected_costs
from moesim.sim.cost.steptime import PassCost


@dataclass(frozen=True)
class Prediction:
    """Expected pass time T(n) per n with its interval and where it rests (the kernel family's name: `family`)."""

    family: str
    n: np.ndarray
    cost: PassCost
    warnings: list[str] = field(default_factory=list)
    batch: int = 1  # requests per pass, n tokens each

    def table(self) -> pl.DataFrame:
        """One row per n."""
        c = self.cost
        comm = {"comm_us": np.broadcast_to(c.comm_us, self.n.shape)} if np.any(c.comm_us) else {}
        return pl.DataFrame(
            {
                "n": self.n,
                "family": c.family,
                "time_us": c.total_us(),
                "low_us": c.low_us,
                "high_us": c.high_us,
                "expert_us": c.expert_us,
                "dense_us": c.dense_us,
                **comm,
                "fixed_us": np.full(self.n.shape, c.fixed_us),
                **({"engine_us": np.asarray(c.engine_us(), np.float64)} if c.engine_parts_us else {}),
                "rung": c.rung,
                "extrapolation": c.extrapolation,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "family": self.family,
            "passes": self.table().to_dicts(),
            "epsilon": {
                "expert": float(np.max(self.cost.expert_epsilon, initial=0.0)),
                "dense": self.cost.dense_epsilon,
                "comm": float(np.max(self.cost.comm_epsilon)),
            },
            "bound_basis": self.cost.bound_basis,
            "provenance_share": self.cost.provenance_share(),
            "rung_share": self.cost.rung_share(),
            "warnings": self.warnings,
            **({"batch": self.batch} if self.batch != 1 else {}),
        }


def predict(scenario: Scenario, max_pass: int = 16, sizes: list[int] | None = None, batch: int = 1) -> Prediction:
    """T(n) for n = 1..max_pass (above 64 on a grid, `pass_sizes`) or the given sizes, expected over
    the trace's windows; `batch` B > 1: passes of B requests of n tokens each, over the trace's batch
    windows (`moesim.sim.cost.pass_features.batch_expected_costs`, as `best-draft --batch`)."""
    if batch < 1:
        raise InputError(f"batch must be >= 1, got {batch}")
    n = pass_sizes(max_pass, sizes)
    if batch == 1:
        cost = expected_costs(scenario, n)
    else:
        cost = batch_expected_costs(scenario.model, scenario.trace, batch, n, scenario.context_tokens)[0]
    return Prediction(scenario.model.family, n, cost, extrapolation_warnings("pass", "n", cost.extrapolation, n), batch)
