"""Sweeps (`moesim sweep CONFIG.toml`): grids of models × profiles × engines × drafters × routing ×
batch × context × n × k × α, far beyond a measured grid, written as one Parquet file.

Work is split into units, one per (model, routing, batch). A unit does the expensive part once:
the routing features of every pass size n = 1..N (the exact distribution over the trace's
windows at B = 1, the unions of B lockstep lanes at B > 1), then the pass costs of every
profile × context × engine through the step-time model. The analytic (α, k) grid of each
engine × drafter is then one vectorised evaluation of S(k, α) = τ(k, α)/C(k) at the nominal
point and the four corners of the error box.

Resumable: each finished unit is written (atomically) to a partial-results folder named by the
config's digest beside the output; a rerun of the same config skips the units found there.
The output is assembled from the unit files in plan order and renamed into place, so it is
either complete or absent, and the same config gives the same bytes however often it was
interrupted. The rows and columns are documented in docs/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from moesim.atomic import atomic_path, check_writable
from moesim.errors import ConfigError, MoesimError
from moesim.kernels.features import RoutingFeatures
from moesim.kernels.unions import batch_lanes, batch_windows, union_features_many
from moesim.kernels.windows import summarize_windows
from moesim.models import ModelPreset
from moesim.sim.analysis import Scenario, corner_costs, draft_costs_us
from moesim.sim.crossover import bandwidth_ratio, byte_share, win_window
from moesim.sim.drafters import make_drafter
from moesim.sim.executors import make_executor
from moesim.sim.speculation import best_draft, speedup_table, tokens_per_pass
from moesim.sim.steptime import BEST, PassCost, StepTimeModel
from moesim.sim.sweepconfig import MODEL_PLACEHOLDER, SWEEP_FORMAT, Routing, SweepConfig, points_per_unit
from moesim.sim.sweepsim import SimulationTally, simulation_rows
from moesim.tracegen.schema import TraceGeometry
from moesim.tracegen.synth import make_generator, synthesize
from moesim.tracegen.trace import Trace, read_trace

KEYS = {
    "record": pa.string(),  # "pass" (one per n and kernel family or engine) or "point" (one per α and k)
    "model": pa.string(),
    "profile": pa.string(),
    "routing": pa.string(),
    "batch": pa.int32(),
    "context_tokens": pa.int32(),
    "engine": pa.string(),
    "family": pa.string(),
    "drafter": pa.string(),
    "policy": pa.string(),
    "n": pa.int32(),
    "draft_len": pa.int32(),
    "alpha": pa.float64(),
}
PASS_COLUMNS = {
    "time_us": pa.float64(),
    "low_us": pa.float64(),
    "high_us": pa.float64(),
    "expert_us": pa.float64(),
    "dense_us": pa.float64(),
    "fixed_us": pa.float64(),
    "distinct_experts": pa.float64(),
    "byte_share": pa.float64(),
    "bandwidth_ratio": pa.float64(),
    "dedup_wins": pa.bool_(),
    "extrapolation": pa.float64(),
}
POINT_COLUMNS = {
    "tokens_per_pass": pa.float64(),
    "draft_us": pa.float64(),
    "verify_us": pa.float64(),
    "relative_cost": pa.float64(),
    "speedup": pa.float64(),
    "speedup_low": pa.float64(),
    "speedup_high": pa.float64(),
    "best_draft": pa.bool_(),
}
SIMULATION_COLUMNS = {  # besides speedup and tokens_per_pass (as in point rows, but simulated)
    "throughput_tok_s": pa.float64(),
    "tpot_speedup": pa.float64(),
    "tpot_mean_us": pa.float64(),
    "tpot_p99_us": pa.float64(),
    "worst_slowdown": pa.float64(),
    "mean_draft_len": pa.float64(),
    "acceptance_rate": pa.float64(),
    "iterations": pa.int64(),
}
SCHEMA = pa.schema([pa.field(name, kind) for name, kind in {**KEYS, **PASS_COLUMNS, **POINT_COLUMNS, **SIMULATION_COLUMNS}.items()])
TALLY_KEY = b"moesim.simulation"
POLARS_SCHEMA = pl.from_arrow(SCHEMA.empty_table()).schema  # type: ignore[union-attr]


@dataclass(frozen=True)
class WorkUnit:
    """One model with one routing at one batch size: routing features computed once."""

    model: str
    routing: int  # index into the config's routing list
    batch: int

    @staticmethod
    def file_name(index: int) -> str:
        """The file of the plan's unit `index` in the partial-results folder (the folder names the config)."""
        return f"unit-{index:05d}.parquet"


# ---- planning (in the driver: every check before anything runs) -----------------------------------


def routes_like(geometry: TraceGeometry, preset: ModelPreset) -> bool:
    """A trace can stand for a model when top-k, experts and MoE layers agree."""
    return (geometry.top_k, geometry.experts, geometry.moe_layers) == (preset.top_k, preset.experts, preset.moe_layers)


def _check_trace(config: SweepConfig, index: int, trace: Trace, batches: tuple[int, ...]) -> None:
    """Every batch size finds lanes of at least N positions in the trace."""
    need = config.grid.max_tokens
    for batch in batches:
        lanes = batch_lanes(trace.seq_starts, batch)
        longest = int(lanes.length.max(initial=0))
        if longest < need:
            raise ConfigError(
                f"{config.key(f'routing[{index}].trace')}: at batch {batch} the longest lane of the trace has {longest} positions, "
                f"passes up to {need} tokens per sequence need at least {need} (max_pass / max_draft + 1)"
            )


def plan_units(config: SweepConfig) -> list[WorkUnit]:
    """The units in a fixed order (model, routing, batch); trace routings apply to the models
    that route like them."""
    units = []
    for i, routing in enumerate(config.routing):
        matched = []
        for model, preset in config.presets.items():
            path = routing.trace_for(model)
            if path is not None:
                try:
                    trace = read_trace(path)
                except MoesimError as exc:
                    raise ConfigError(f"{config.key(f'routing[{i}].trace')}: {exc}") from None
                if not routes_like(trace.meta.geometry, preset):
                    if MODEL_PLACEHOLDER in str(routing.trace):
                        raise ConfigError(f"{config.key(f'routing[{i}].trace')}: {path} does not route like model '{model}'")
                    continue
                _check_trace(config, i, trace, config.grid.batch)
            matched.append(model)
        if not matched:
            raise ConfigError(f"{config.key(f'routing[{i}].trace')}: {routing.trace} routes like none of the grid's models")
        units += [WorkUnit(model, i, batch) for model in matched for batch in config.grid.batch]
    for model in config.grid.models:
        if not any(u.model == model for u in units):
            raise ConfigError(f"{config.key('routing')}: no routing applies to model '{model}'")
    return sorted(units, key=lambda u: (config.grid.models.index(u.model), u.routing, config.grid.batch.index(u.batch)))


# ---- one unit (in a worker) --------------------------------------------------------------------------


_TRACES: dict[str, Trace] = {}  # per process: the last traces drawn or read


def synthetic_layout(routing: Routing, batch: int, max_tokens: int) -> tuple[int, int]:
    """(sequences, tokens each) drawn for a batch of B: the routing's seqs × tokens positions in all,
    as max(seqs, B) equal sequences (batch lanes are different sequences) of at least max_tokens."""
    seqs = max(routing.seqs, batch)
    return seqs, max(routing.tokens * routing.seqs // seqs, max_tokens)


def _unit_trace(config: SweepConfig, model: str, routing: Routing, batch: int) -> Trace:
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
            generator = make_generator(routing.generator, **routing.params)
            _TRACES[key] = synthesize(config.presets[model], generator, tokens, seqs, routing.seed, config.grid.weight_format or None)
    return _TRACES[key]


def pass_distributions(
    trace: Trace, batch: int, max_tokens: int, max_batches: int
) -> tuple[list[tuple[RoutingFeatures, np.ndarray]], np.ndarray]:
    """Per-layer feature distributions of passes of B·n tokens, n = 1..max_tokens (B sequences, n
    each), and the mean distinct experts per layer. B = 1: every window of the trace, exactly;
    B > 1: the unions of up to `max_batches` lockstep batches of B lanes, each (batch, layer) equally likely."""
    experts, starts, n_experts = trace.experts, trace.seq_starts, trace.meta.geometry.experts
    if batch == 1:
        summary = summarize_windows(experts, starts, n_experts, max_tokens)
        return [summary.feature_distribution(n) for n in range(1, max_tokens + 1)], summary.mean_distinct_experts()
    lanes = batch_lanes(starts, batch)
    distributions, distinct = [], []
    for n in range(1, max_tokens + 1):
        union = union_features_many(experts, *batch_windows(lanes, n, max_batches), n_experts)
        f = union.routing_features()
        flat = RoutingFeatures(f.n_tokens.ravel(), f.slots.ravel(), f.distinct_experts.ravel(), f.max_tokens_per_expert.ravel())
        distributions.append((flat, np.full(flat.shape, 1.0 / flat.shape[0])))
        distinct.append(float(union.distinct_experts.mean()))
    return distributions, np.asarray(distinct)


def _head(cost: PassCost, size: int) -> PassCost:
    """The first `size` pass sizes of a PassCost."""
    cut = {f.name: getattr(cost, f.name)[:size] for f in dataclasses.fields(cost) if isinstance(getattr(cost, f.name), np.ndarray)}
    return dataclasses.replace(
        cost,
        **cut,
        provenance_us={k: np.asarray(v)[:size] for k, v in cost.provenance_us.items()},
        expert_by_family_us={k: v[:size] for k, v in cost.expert_by_family_us.items()},
    )


def _pass_rows(
    costs: dict[str, PassCost], profile_dedup: tuple[str, ...], share: np.ndarray, distinct: np.ndarray, size: int
) -> pl.DataFrame:
    """One row per engine (every kernel family and `best`) and n = 1..size: T(n) with its interval,
    u(n), and for dedup families r(n) against per_slot and whether dedup wins at n."""
    n = np.arange(1, size + 1)
    heads = {engine: _head(cost, size) for engine, cost in costs.items()}
    per_slot, share, distinct = heads["per_slot"].expert_us, share[:size], distinct[:size]
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
        if engine in profile_dedup:
            columns["bandwidth_ratio"] = bandwidth_ratio(per_slot, cost.expert_us, share)
            columns["dedup_wins"] = np.isin(n, win_window(n, per_slot, cost.expert_us).dedup_wins)
        frames.append(pl.DataFrame(columns))
    return pl.concat(frames, how="diagonal_relaxed").with_columns(record=pl.lit("pass"))


def _point_rows(alphas: np.ndarray, nominal: np.ndarray, corners: list[np.ndarray], draft: np.ndarray, cost: PassCost) -> pl.DataFrame:
    """One row per (α, k): τ, C, S at the nominal point and its min..max over the error box's corners,
    and whether k is the best draft length at α (ties to the larger k)."""
    k_count = nominal.size
    table = speedup_table(alphas, nominal)
    at_corners = np.stack([speedup_table(alphas, c) for c in corners])
    k_star, _ = best_draft(alphas, nominal)
    k = np.arange(k_count)
    verify = cost.total_us()
    return pl.DataFrame(
        {
            "record": "point",
            "family": np.tile(cost.family, alphas.size),
            "draft_len": np.tile(k, alphas.size),
            "alpha": np.repeat(alphas, k_count),
            "tokens_per_pass": tokens_per_pass(k[None, :], alphas[:, None]).ravel(),
            "draft_us": np.tile(draft, alphas.size),
            "verify_us": np.tile(verify, alphas.size),
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
    trace = _unit_trace(config, unit.model, routing, unit.batch)
    weight_format = grid.weight_format or trace.meta.geometry.weight_format
    distributions, distinct = pass_distributions(trace, unit.batch, grid.max_tokens, config.sweep.max_batches)
    n = np.arange(1, grid.max_tokens + 1)
    share = byte_share(distinct, n * unit.batch, preset.top_k)
    k_count = grid.max_draft + 1
    frames = []
    for profile_name, profile in config.profiles.items():
        engines = [*profile.expert_families, BEST, *(e for e in grid.engines if e not in profile.expert_families and e != BEST)]
        models = {e: StepTimeModel(preset, profile, e, weight_format) for e in engines}
        for context in grid.context:
            keys = {"model": unit.model, "profile": profile_name, "routing": routing.name, "batch": unit.batch, "context_tokens": context}
            costs = {e: m.expected_pass_cost(distributions, float(unit.batch * context)) for e, m in models.items()}
            frames.append(_conform(_pass_rows(costs, profile.dedup_families, share, distinct, grid.max_pass), keys))
            for spec in grid.drafters:
                scenario = Scenario(models[BEST], trace, make_drafter(spec, preset), context)
                draft = draft_costs_us(scenario, grid.max_draft, unit.batch)  # the drafter runs on the dense family: any engine
                uses_dense = scenario.drafter.provenance == "profile"
                for engine in grid.engines:
                    cost = _head(costs[engine], k_count)
                    nominal, *corners = corner_costs(cost, draft, uses_dense, cost.dense_epsilon)
                    points = _point_rows(grid.alphas, nominal, corners, draft, cost)
                    frames.append(_conform(points, {**keys, "engine": engine, "drafter": spec}))
    tally = SimulationTally()
    if grid.policies:
        cells, tally = simulation_rows(config, unit.model, unit.batch, trace, weight_format)
        frames.append(_conform(cells, {"model": unit.model, "routing": routing.name, "batch": unit.batch}))
    table = pl.concat(frames).to_arrow().cast(SCHEMA)
    return table.replace_schema_metadata({TALLY_KEY: json.dumps(dataclasses.asdict(tally))})


# ---- the driver ---------------------------------------------------------------------------------------

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class SweepSummary:
    """What a sweep did."""

    out: Path
    units: int
    resumed: int
    rows: int
    points: int
    elapsed_s: float
    digest: str
    simulation: SimulationTally = field(default_factory=SimulationTally)

    @property
    def points_per_s(self) -> float:
        """Analytic points of the units computed in this run, per second of this run."""
        computed = self.points * (self.units - self.resumed) / self.units if self.units else 0
        return computed / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    @property
    def simulated_iterations_per_s(self) -> float:
        """The SimPy cells' own rate: engine iterations simulated per second of their wall time (all units, resumed ones too)."""
        return self.simulation.iterations / self.simulation.seconds if self.simulation.seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, object]:
        """JSON form."""
        return {
            **dataclasses.asdict(self),
            "out": str(self.out),
            "points_per_s": self.points_per_s,
            "simulated_iterations_per_s": self.simulated_iterations_per_s,
        }


def partial_dir(config: SweepConfig, out: Path) -> Path:
    """The partial-results folder of this config and output: `.OUT.DIGEST16.partial` beside it."""
    return out.parent / f".{out.name}.{config.digest[:16]}.partial"


def _write_unit(path: Path, table: pa.Table) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _compute_to_file(config: SweepConfig, task: tuple[WorkUnit, Path]) -> None:
    """A worker that sees the driver's filesystem writes its unit file itself (no table through a pipe)."""
    unit, path = task
    _write_unit(path, compute_unit(config, unit))


def _assemble(config: SweepConfig, out: Path, files: list[Path]) -> tuple[int, SimulationTally]:
    """Stream the unit files, in plan order, into the output (atomically); returns its rows and
    the SimPy cells' tally summed over the units."""
    metadata = {"moesim.format": SWEEP_FORMAT, "moesim.config": json.dumps(config.identity, sort_keys=True, default=str)}
    schema = SCHEMA.with_metadata(metadata)
    rows, tallies = 0, []
    with atomic_path(out) as tmp, pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for path in files:
            table = pq.read_table(path, schema=SCHEMA)
            tallies.append(json.loads((pq.read_schema(path).metadata or {}).get(TALLY_KEY, b"{}")))
            writer.write_table(table.replace_schema_metadata(metadata))
            rows += table.num_rows
    total = SimulationTally(*(sum(t.get(f.name, 0) for t in tallies) for f in dataclasses.fields(SimulationTally)))
    return rows, total


def run_sweep(
    config: SweepConfig,
    out: Path,
    executor: str | None = None,
    workers: int | None = None,
    fresh: bool = False,
    progress: Progress | None = None,
) -> SweepSummary:
    """Run (or resume) the sweep and write `out`; `executor` and `workers` override the config's."""
    out = Path(out)
    check_writable(out)
    units = plan_units(config)
    runner = make_executor(
        executor or config.sweep.executor, config.sweep.workers if workers is None else workers, config.sweep.ray_address
    )
    folder = partial_dir(config, out)
    if fresh and folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(exist_ok=True)
    files = [folder / WorkUnit.file_name(i) for i in range(len(units))]
    todo = [i for i, path in enumerate(files) if not path.is_file()]
    resumed = len(units) - len(todo)
    start = time.perf_counter()
    done = resumed
    if progress:
        progress(done, len(units))
    if runner.shares_filesystem:
        finished = runner.map_unordered(functools.partial(_compute_to_file, config), [(units[i], files[i]) for i in todo])
    else:
        finished = runner.map_unordered(functools.partial(compute_unit, config), [units[i] for i in todo])
    for j, table in finished:
        if table is not None:
            _write_unit(files[todo[j]], table)
        done += 1
        if progress:
            progress(done, len(units))
    rows, tally = _assemble(config, out, files)
    elapsed = time.perf_counter() - start
    shutil.rmtree(folder)
    return SweepSummary(out, len(units), resumed, rows, points_per_unit(config) * len(units), elapsed, config.digest, tally)
