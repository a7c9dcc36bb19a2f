"""One work unit (in a worker): routing features of every pass size once, pass costs of every
profile × context × engine, the vectorised (α, k) grid of every engine × drafter, and the SimPy
cells when the grid names policies."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import polars as pl
import pyarrow as pa

from moesim.sim.analysis.crossover import bandwidth_ratio, byte_share, win_window
from moesim.sim.analysis.scenario import Scenario
from moesim.sim.analysis.speculation import (
    SpecCosts,
    best_in_table,
    costs_on,
    draft_costs_us,
    pick,
    speedup_table,
    tokens_per_pass,
    tokens_per_pass_table,
)
from moesim.sim.cost.drafters import make_drafter
from moesim.sim.cost.pass_features import pass_distributions
from moesim.sim.cost.steptime import BEST, PassCost, StepTimeModel
from moesim.sim.cost.tree import TreeSpec
from moesim.sim.sweep.cells import SimulationTally, simulation_rows
from moesim.sim.sweep.config import Routing, SweepConfig, synthetic_layout
from moesim.sim.sweep.plan import WorkUnit
from moesim.sim.sweep.schema import POLARS_SCHEMA, SCHEMA, TALLY_KEY
from moesim.tracegen.formats.trace import Trace, read_trace
from moesim.tracegen.routing.synth import make_generator, synthesize

_TRACES: dict[str, Trace] = {}  # per process: the last traces drawn or read


def unit_trace(config: SweepConfig, model: str, routing: Routing, batch: int) -> Trace:
    """The unit's trace: read, or synthesised for the model and batch size; cached per process."""
    path = routing.trace_for(model)
    seqs, tokens = synthetic_layout(routing, batch, config.grid.max_tokens)
    key = str(path) if path is not None else repr((model, routing, seqs, tokens, config.grid.weight_format))
    if key not in _TRACES:
        if len(_TRACES) >= 4:
            _TRACES.pop(next(iter(_TRACES)))
        if path is not None:
            _TRACES[key] = read_trace(path)
        else:
            generator = make_generator(routing.generator, routing.params)
            _TRACES[key] = synthesize(config.presets[model], generator, tokens, seqs, routing.seed, config.grid.weight_format or None)
    return _TRACES[key]


def _pass_rows(
    costs: dict[str, PassCost], profile_dedup: tuple[str, ...], share: np.ndarray, distinct: np.ndarray, size: int
) -> pl.DataFrame:
    """One row per engine (every kernel family and `best`) and n = 1..size: T(n) with its interval,
    u(n), and for dedup families r(n) against per_slot and whether dedup wins at n (where the profile
    has a per_slot family: an engine profile of vLLM's fused MoE has none)."""
    n = np.arange(1, size + 1)
    heads = {engine: pick(cost, np.arange(size)) for engine, cost in costs.items()}
    per_slot = heads["per_slot"].expert_us if "per_slot" in heads else None
    share, distinct = share[:size], distinct[:size]
    frames = []
    for engine, cost in heads.items():
        columns: dict[str, object] = {
            "engine": engine,
            "family": cost.family,
            "n": n,
            "time_us": cost.total_us(),
            "low_us": cost.low_us,
            "high_us": cost.high_us,
            "expert_us": cost.expert_us,
            "dense_us": cost.dense_us,
            "fixed_us": np.full(size, cost.fixed_us),
            "distinct_experts": distinct,
            "byte_share": share,
            "extrapolation": cost.extrapolation,
        }
        if engine in profile_dedup and per_slot is not None:
            columns["bandwidth_ratio"] = bandwidth_ratio(per_slot, cost.expert_us, share)
            columns["dedup_wins"] = np.isin(n, win_window(n, per_slot, cost.expert_us).dedup_wins)
        frames.append(pl.DataFrame(columns))
    return pl.concat(frames, how="diagonal_relaxed").with_columns(record=pl.lit("pass"))


def _point_rows(alphas: np.ndarray, costs: SpecCosts, tree: TreeSpec) -> pl.DataFrame:
    """One row per (α, k): τ (of the drafter's tree), C, S at the nominal point and its min..max over
    the error box's corners, and whether k is the best draft length at α (ties to the larger k)."""
    nominal, *corners = costs.corners()
    k_count = nominal.size
    if tree.is_chain:
        table, at_corners = speedup_table(alphas, nominal), np.stack([speedup_table(alphas, c) for c in corners])
        taus = tokens_per_pass(np.arange(k_count)[None, :], alphas[:, None])
    else:
        taus = tokens_per_pass_table(alphas, k_count - 1, tree)
        table, at_corners = taus / nominal, np.stack([taus / c for c in corners])
    k_star, _ = best_in_table(table)
    k = np.arange(k_count)
    cost = costs.verify
    return pl.DataFrame(
        {
            "record": "point",
            "family": np.tile(cost.family, alphas.size),
            "draft_len": np.tile(k, alphas.size),
            "alpha": np.repeat(alphas, k_count),
            "tokens_per_pass": taus.ravel(),
            "draft_us": np.tile(costs.draft_us, alphas.size),
            "verify_us": np.tile(costs.target_us(), alphas.size),
            "relative_cost": np.tile(nominal, alphas.size),
            "speedup": table.ravel(),
            "speedup_low": at_corners.min(axis=0).ravel(),
            "speedup_high": at_corners.max(axis=0).ravel(),
            "best_draft": (k[None, :] == k_star[:, None]).ravel(),
            "extrapolation": np.tile(np.maximum(cost.extrapolation, cost.extrapolation[0]), alphas.size),
        }
    )


def _conform(frame: pl.DataFrame, constants: dict[str, object]) -> pl.DataFrame:
    """The frame with the key constants added and every column of the schema, in order."""
    frame = frame.with_columns(**{k: pl.lit(v) for k, v in constants.items()})
    return frame.select([pl.col(c).cast(t) if c in frame.columns else pl.lit(None, dtype=t).alias(c) for c, t in POLARS_SCHEMA.items()])


def compute_unit(config: SweepConfig, unit: WorkUnit) -> pa.Table:
    """Every pass row and (α, k) point of one unit, as an Arrow table of the sweep schema."""
    grid = config.grid
    routing = config.routing[unit.routing]
    preset = config.presets[unit.model]
    trace = unit_trace(config, unit.model, routing, unit.batch)
    weight_format = grid.weight_format or trace.meta.geometry.weight_format
    n = np.arange(1, grid.max_tokens + 1)
    distributions, distinct = pass_distributions(trace, unit.batch, n, config.sweep.max_batches)
    share = byte_share(distinct, n * unit.batch, preset.top_k)
    k_count = grid.max_draft + 1
    frames = []
    for profile_name, profile in config.profiles.items():
        engines = [*profile.expert_families, BEST, *(e for e in grid.families if e not in profile.expert_families and e != BEST)]
        models = {e: StepTimeModel(preset, profile, e, weight_format) for e in engines}
        for context in grid.context:
            keys = {"model": unit.model, "profile": profile_name, "routing": routing.name, "batch": unit.batch, "context_tokens": context}
            costs = {e: m.expected_pass_cost(distributions, float(unit.batch * context), float(unit.batch)) for e, m in models.items()}
            frames.append(_conform(_pass_rows(costs, profile.dedup_families, share, distinct, grid.max_pass), keys))
            for spec in grid.drafters:
                drafter = make_drafter(spec, preset, weight_format)
                scenario = Scenario(models[BEST], trace, drafter, context)
                draft = draft_costs_us(scenario, grid.max_draft, unit.batch)  # the drafter runs on the dense family: any engine
                widths = np.array([drafter.tree.width(k) for k in range(k_count)])
                for engine in grid.families:
                    spec_cost = costs_on(profile, drafter, widths, draft, pick(costs[engine], widths - 1), unit.batch)
                    frames.append(_conform(_point_rows(grid.alphas, spec_cost, drafter.tree), {**keys, "engine": engine, "drafter": spec}))
    tally = SimulationTally()
    if grid.policies:
        cells, tally = simulation_rows(config, unit.model, unit.batch, trace, weight_format)
        frames.append(_conform(cells, {"model": unit.model, "routing": routing.name, "batch": unit.batch}))
    table = pl.concat(frames).to_arrow().cast(SCHEMA)
    return table.replace_schema_metadata({TALLY_KEY: json.dumps(dataclasses.asdict(tally))})
