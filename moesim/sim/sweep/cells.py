"""The SimPy cells of a sweep: speculation policies (static, oracle, Cascade, ...) simulated on the
trace-driven step-time model, for every profile × engine × drafter × acceptance × policy of a
work unit (one model, routing and batch size).

A cell is a `moesim simulate` run built from the sweep's axes: a closed loop of B concurrent
requests (B = the unit's batch size, also the engine's max batch) or, at each of the
`[simulate]` request rates, Poisson arrivals (the rows' `rate_per_s`), the `[simulate]` workload,
geometric acceptance at the cell's α (a drafter with a draft tree: the `tree` acceptance at that
top-candidate α, `moesim.sim.serving.acceptance.Tree`), the unit's routing trace replayed by the step-time model
of the model on the profile with the engine. Each (profile, engine, drafter, α) runs once with
speculation off, shared by its policies, as `moesim simulate`'s studies do. Rows carry the
study's figures; the cells' wall time and simulated iterations give the sweep's SimPy rate.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from moesim.fields import dump
from moesim.sim.cost.drafters import parse_drafter
from moesim.sim.serving.config import SimConfig, config_from_dict
from moesim.sim.serving.outputs import summary
from moesim.sim.serving.policies import Off
from moesim.sim.serving.run import STUDY_COLUMNS, build_cost, policy_label, run_server
from moesim.sim.sweep.config import SweepConfig
from moesim.tracegen.formats.trace import Trace


@dataclass(frozen=True)
class SimulationTally:
    """Cells simulated, engine iterations simulated and the wall time they took."""

    cells: int = 0
    iterations: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Cell:
    """The axes of one SimPy cell (its policy aside)."""

    model: str
    profile: str
    engine: str
    drafter: str
    alpha: float
    batch: int
    weight_format: str
    rate_per_s: float | None = None  # Poisson arrivals at this rate (None: a closed loop of `batch`)


def cell_config(config: SweepConfig, cell: Cell, policy: dict) -> SimConfig:
    """The simulation config of one cell (its trace section only names the routing: the unit's trace is passed as is)."""
    sim = config.simulate
    drafter = parse_drafter(cell.drafter)
    target = {"model": cell.model, "profile": cell.profile, "family": cell.engine, "weight_format": cell.weight_format}
    return config_from_dict(
        {
            "run": {"seed": sim.seed, "requests": sim.requests},
            "workload": {"prompt_tokens": sim.prompt_tokens, "output_tokens": sim.output_tokens},
            "arrivals": {"kind": "poisson", "rate_per_s": cell.rate_per_s}
            if cell.rate_per_s
            else {"kind": "closed", "concurrency": cell.batch},
            "batching": {"max_batch": cell.batch},
            "trace": {"synth": "uniform"},
            "cost": {"kind": "steptime"},
            "target": target,
            "drafter": dump(drafter),
            "acceptance": {"model": "geometric" if drafter.tree_spec().is_chain else "tree", "alpha": cell.alpha},
            "policy": policy,
        },
        f"{config.source}: simulation cell",
        Path("."),
    )


def simulation_rows(config: SweepConfig, model: str, batch: int, trace: Trace, weight_format: str) -> tuple[pl.DataFrame, SimulationTally]:
    """One row per profile × engine × drafter × α × policy of the unit (weights in `weight_format`, as its analytic rows)."""
    grid, sim = config.grid, config.simulate
    rows, iterations, start = [], 0, time.perf_counter()
    for profile in grid.profiles:
        for engine in grid.families:
            for drafter in grid.drafters:
                for alpha, rate in itertools.product(sim.alpha, sim.rates_per_s or (None,)):
                    axes = Cell(model, profile, engine, drafter, alpha, batch, weight_format, rate)
                    base = cell_config(config, axes, {"name": "off"})
                    cost = build_cost(base, trace)
                    off = run_server(base, cost, trace, Off(), base.acceptance)
                    iterations += off.prefill_us.size
                    for table in grid.policies:
                        cell = cell_config(config, axes, table)
                        record = off if cell.policy.name == "off" else run_server(cell, cost, trace, cell.policy, cell.acceptance)
                        iterations += 0 if record is off else record.prefill_us.size
                        stats = summary(record, off, {})
                        rows.append(
                            {
                                "profile": profile,
                                "engine": engine,
                                "drafter": drafter,
                                "alpha": alpha,
                                "rate_per_s": rate,
                                "policy": policy_label(cell.policy),
                                "iterations": int(record.prefill_us.size),
                                **{column: float(stats[column]) for column in STUDY_COLUMNS},
                            }
                        )
    tally = SimulationTally(len(rows), iterations, time.perf_counter() - start)
    return pl.DataFrame(rows).with_columns(record=pl.lit("simulation")), tally
