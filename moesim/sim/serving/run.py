"""Running a simulation config: trace and cost model set up, the server run under the policy and
(for comparison) with speculation off, outputs assembled; and study grids of such runs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from moesim.atomic import check_out_dir, output_dir
from moesim.errors import ConfigError, InputError, MoesimError
from moesim.fields import FieldError, dump
from moesim.hw_profiles import load_profile
from moesim.models import load_preset
from moesim.sim.cost.pass_table import BatchCostModel, TablePassCost
from moesim.sim.cost.steptime import StepTimeModel, default_family
from moesim.sim.cost.trace_batch import DenseBatchCost, TraceBatchCost
from moesim.sim.cost.tree import truncated_widths
from moesim.sim.serving.acceptance import AcceptanceModel, Tree
from moesim.sim.serving.config import SimConfig, StudyDevice, placement
from moesim.sim.serving.outputs import config_text, iterations_table, requests_table, summary, write_arrow, write_run
from moesim.sim.serving.policies import Off, Policy
from moesim.sim.serving.scheduler import Scheduling
from moesim.sim.serving.server import Server, ServerRecord
from moesim.sim.serving.workload import TraceWindows
from moesim.tomlfile import RUN_CONFIG
from moesim.tracegen.formats.trace import Trace, read_trace
from moesim.tracegen.routing.synth import make_generator, synthesize

Progress = Callable[[float], None]


def load_trace(config: SimConfig, model: str | None) -> Trace | None:
    """The config's trace for `model`: read from its file or synthesised (None without [trace],
    and for a dense target, which routes nothing)."""
    section = config.trace
    if section is None or (model is not None and load_preset(model).kind != "moe"):
        return None
    if section.synth is not None:
        try:
            generator = make_generator(section.synth, section.synth_params)
            return synthesize(load_preset(model or ""), generator, section.tokens, section.seqs, section.seed, config.target.weight_format)
        except FieldError as exc:
            raise ConfigError(f"{config.source}: key 'trace.synth_params.{exc.field}': {exc.detail}") from None
        except InputError as exc:
            raise ConfigError(f"{config.source}: key 'trace.synth': {exc}") from None
    path = section.path_for(model)
    try:
        return read_trace(path)  # type: ignore[arg-type]
    except InputError as exc:
        raise ConfigError(f"{config.source}: key 'trace.path': {exc}") from None


def build_cost(config: SimConfig, trace: Trace | None, model: str | None = None) -> BatchCostModel:
    """The cost model the config names: the pass-cost table, or the step-time model of the target
    `model` (default: the config's) on its profile and devices, replaying the trace
    (`TraceBatchCost`; a dense target needs none: `DenseBatchCost`)."""
    cost = config.cost
    if cost.kind == "table":
        return TablePassCost(np.asarray(cost.target_us, np.float64), cost.draft_step_us, cost.prefill_us_per_token)
    target = config.target
    name = model or target.model
    parallel, _ = placement(config)
    try:
        preset = load_preset(name or "")
        profile = load_profile(target.profile or "")
        step_time = StepTimeModel(preset, profile, default_family(profile, target.family), target.weight_format or "", parallel=parallel)
        drafter = config.drafter.make(preset, target.weight_format or None)
    except MoesimError as exc:
        raise ConfigError(f"{config.source}: key 'target': {exc}") from None
    if preset.kind != "moe":
        return DenseBatchCost(step_time, drafter, cost.prefill_chunk)
    try:
        return TraceBatchCost(step_time, trace, drafter, cost.prefill_chunk)  # type: ignore[arg-type]
    except MoesimError as exc:
        raise ConfigError(f"{config.source}: key 'trace': {exc}") from None


def tree_widths(config: SimConfig, acceptance: AcceptanceModel, k_cap: int) -> tuple[int, ...]:
    """Verify widths per draft length 0..k_cap of the drafter's tree (its tree at the cap, cut at
    depth k; a pruned beam is pruned for the `tree` acceptance's α); empty for a chain."""
    shape = config.drafter.tree_spec()
    if shape.is_chain:
        return ()
    tree = acceptance.draft_tree(k_cap) if isinstance(acceptance, Tree) else shape.tree(k_cap)
    return truncated_widths(tree, k_cap)


def scheduling(config: SimConfig) -> Scheduling:
    """The config's KV memory, chunked prefill and verify-slot convention, as the server takes them."""
    _, budget = placement(config)
    batching = config.batching
    return Scheduling(budget, batching.chunked_prefill, batching.token_budget, config.cost.moesd_slots)


def trace_windows(config: SimConfig, trace: Trace | None, k_cap: int, widest: int | None = None) -> TraceWindows | None:
    """Where requests decode in the trace; every sequence must hold the largest verify window."""
    if trace is None or config.trace is None:
        return None
    try:
        return TraceWindows.from_trace(trace, config.trace.offset_stride, widest or k_cap + 1, trace.meta.geometry.model)
    except FieldError as exc:
        key = "path" if config.trace.path is not None else "tokens"
        raise ConfigError(f"{config.source}: key 'trace.{key}': {exc.detail}") from None


def run_server(
    config: SimConfig,
    cost: BatchCostModel,
    trace: Trace | None,
    policy: Policy,
    acceptance: AcceptanceModel,
    progress: Progress | None = None,
) -> ServerRecord:
    """One server run of the config's workload under `policy` and `acceptance` (a draft tree
    verifies its width: the trace cost is told the widths)."""
    widths = tree_widths(config, acceptance, policy.k_cap)
    if widths and isinstance(cost, TraceBatchCost | DenseBatchCost):
        cost = dataclasses.replace(cost, widths=widths)
    server = Server(
        cost=cost,
        policy=policy,
        acceptance=acceptance,
        workload=config.workload,
        arrivals=config.arrivals,
        max_batch=config.batching.max_batch,
        requests=config.run.requests,
        duration_us=config.run.duration_s * 1e6,
        seed=config.run.seed,
        windows=trace_windows(config, trace, policy.k_cap, max(widths, default=None)),
        progress=progress,
        scheduling=scheduling(config),
    )
    return server.run()


def _scaled(progress: Progress | None, low: float, high: float) -> Progress | None:
    if progress is None:
        return None
    return lambda fraction: progress(low + (high - low) * fraction)


def describe_entry(entry: Any, selector: str) -> dict[str, Any]:
    """A registry entry (policy, acceptance model) as its config table."""
    return {selector: entry.name, **dump(entry)}


def policy_label(policy: Policy) -> str:
    """The policy's name and the keys that differ from their defaults (required keys always)."""
    parts = []
    for field in dataclasses.fields(policy):  # type: ignore[arg-type]
        value = getattr(policy, field.name)
        if field.default is dataclasses.MISSING or value != field.default:
            parts.append(f"{field.name}={value}")
    return " ".join([policy.name, *parts])


def _alphas(acceptance: AcceptanceModel, record: ServerRecord, seed: int) -> np.ndarray:
    return np.array([acceptance.mean_alpha(r.rid, seed) for r in record.requests], np.float64)


@dataclass
class SimResult:
    """One simulated run, with its speculation-off twin when compared."""

    config: SimConfig
    record: ServerRecord
    off: ServerRecord | None
    summary: dict[str, Any]

    def tables(self) -> dict[str, pa.Table]:
        """requests and iterations tables."""
        alphas = _alphas(self.config.acceptance, self.record, self.config.run.seed)
        return {"requests": requests_table(self.record, alphas, self.off), "iterations": iterations_table(self.record)}

    def write(self, out_dir: Path, force: bool = False) -> None:
        """The per-request and per-iteration Arrow tables and summary.json in `out_dir` (atomically)."""
        write_run(out_dir, self.tables(), self.summary, config_text(self.config), force)


def describe_config(config: SimConfig) -> dict[str, Any]:
    """What a summary says about the run it summarises."""
    described = {
        "policy": describe_entry(config.policy, "name"),
        "policy_label": policy_label(config.policy),
        "acceptance": describe_entry(config.acceptance, "model"),
        "seed": config.run.seed,
        "max_batch": config.batching.max_batch,
        "arrivals": dump(config.arrivals),
        "cost": config.cost.kind,
        "model": config.target.model,
    }
    if config.batching.chunked_prefill:
        described["token_budget"] = config.batching.token_budget
    if config.parallel.tensor_parallel > 1:
        described["parallel"] = placement(config)[0].describe()
    return described


def simulate(config: SimConfig, progress: Progress | None = None) -> SimResult:
    """Run the config (not a study): the policy, and speculation off when `compare_off`."""
    trace = load_trace(config, config.target.model)
    cost = build_cost(config, trace)
    split = 0.5 if config.run.compare_off else 1.0
    record = run_server(config, cost, trace, config.policy, config.acceptance, _scaled(progress, 0.0, split))
    off = None
    if config.run.compare_off:
        off = (
            record
            if config.policy.name == "off"
            else run_server(config, cost, trace, Off(), config.acceptance, _scaled(progress, split, 1.0))
        )
    return SimResult(config, record, off, summary(record, off, describe_config(config)))


STUDY_COLUMNS = (
    "throughput_tok_s",
    "speedup",
    "tpot_speedup",
    "tpot_mean_us",
    "tpot_p99_us",
    "worst_slowdown",
    "mean_draft_len",
    "acceptance_rate",
    "tokens_per_pass",
)


def _decode_passes(record: ServerRecord, batch: int) -> np.ndarray:
    """Verify times of the iterations at `batch` decoding requests that prefilled nothing."""
    keep = record.batch == batch
    if record.prefill_tokens is not None:
        keep &= record.prefill_tokens == 0
    return record.verify_us[keep]


def target_efficiency(record: ServerRecord, off: ServerRecord) -> float:
    """MoESD's target efficiency T(B, 1) / T(B, v): the mean verify pass of the run with
    speculation off over that of the run, both over their iterations at the full batch (and
    without prefill chunks in the pass)."""
    full = max(int(off.batch.max(initial=0)), 1)
    plain, spec = _decode_passes(off, full), _decode_passes(record, full)
    return float(plain.mean() / spec.mean()) if plain.size and spec.size else math.nan


def _cells(config: SimConfig) -> list[tuple[str | None, StudyDevice | None, int | None]]:
    study = config.study
    assert study is not None
    devices = study.devices or (None,)
    batches = study.batches or (None,)
    return [(model, device, batch) for model in config.models() for device in devices for batch in batches]


def run_study(config: SimConfig, progress: Progress | None = None) -> pl.DataFrame:
    """Every model × device × batch × workload × policy of the config's study, each against
    speculation off (one off run per model, device, batch and workload, shared by its policies):
    one row per cell. A study with serving axes (batches or devices) also reports MoESD's
    target efficiency, the mean batch and the preemptions."""
    study = config.study
    if study is None:
        raise ConfigError(f"{config.source}: key 'study' is missing")
    grid = _cells(config)
    cells = len(grid) * len(study.workloads) * (len(study.policies) + 1)
    done = 0
    rows = []
    traces: dict[str | None, Trace | None] = {}
    costs: dict[tuple[str | None, str], BatchCostModel] = {}
    for model, device, batch in grid:
        cell_config = config.with_cell(model, config.acceptance, config.policy, device, batch)
        if model not in traces:
            traces[model] = load_trace(cell_config, model)
        cell_trace = traces[model]
        key = (model, device.name if device is not None else "")
        if key not in costs:
            costs[key] = build_cost(cell_config, cell_trace)
        cost = costs[key]
        axes: dict[str, Any] = {"model": model or "-"}
        if study.devices:
            axes["device"] = key[1]
        if study.batches:
            axes["batch"] = batch
        for workload, acceptance in study.workloads:
            off = run_server(cell_config, cost, cell_trace, Off(), acceptance, _scaled(progress, done / cells, (done + 1) / cells))
            done += 1
            for policy in study.policies:
                if policy.name == "off":
                    record = off
                else:
                    step = _scaled(progress, done / cells, (done + 1) / cells)
                    record = run_server(cell_config.with_cell(model, acceptance, policy), cost, cell_trace, policy, acceptance, step)
                done += 1
                stats = summary(record, off, {})
                row = {**axes, "workload": workload, "policy": policy_label(policy), **{c: float(stats[c]) for c in STUDY_COLUMNS}}
                if study.serving:
                    row["target_efficiency"] = target_efficiency(record, off)
                    row["mean_batch"] = float(stats["mean_batch"])
                    row["preemptions"] = int(record.memory["preemptions"]) if record.memory is not None else 0
                rows.append(row)
    return pl.DataFrame(rows)


def write_study(out_dir: Path, table: pl.DataFrame, config: SimConfig, force: bool = False) -> None:
    """study.arrow, study.csv and config.toml (the config resolved) in `out_dir` (each atomically)."""
    with output_dir(out_dir, force) as staging:
        write_arrow(staging / "study.arrow", table.to_arrow())
        table.write_csv(staging / "study.csv")
        (staging / RUN_CONFIG).write_text(config_text(config))


@dataclass(frozen=True)
class Outcome:
    """What `simulate_to` ran and wrote: a study's table, or one run's result."""

    out_dir: Path
    study: pl.DataFrame | None = None
    result: SimResult | None = None


def default_out_dir(config: SimConfig) -> Path:
    """The output folder when none is given: the config's name + '-sim', in the working folder."""
    return Path(f"{Path(config.source).stem}-sim")


def simulate_to(config: SimConfig, out_dir: Path | None = None, progress: Progress | None = None, force: bool = False) -> Outcome:
    """`moesim simulate`: the config's study or run, written to `out_dir` (checked before running;
    `force`: write into a folder holding files moesim did not write)."""
    out_dir = out_dir if out_dir is not None else default_out_dir(config)
    check_out_dir(out_dir, force)
    if config.study is not None:
        table = run_study(config, progress)
        write_study(out_dir, table, config, force)
        return Outcome(out_dir, study=table)
    result = simulate(config, progress)
    result.write(out_dir, force)
    return Outcome(out_dir, result=result)
