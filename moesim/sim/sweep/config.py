"""The sweep config: frozen dataclasses parsed from TOML (`moesim sweep CONFIG.toml`).

    [sweep]       executor ("local" | "ray"), workers, ray_address, max_batches
    [grid]        models, profiles, families, drafters, alpha (a list or {start, stop, num}),
                  max_draft (k = 0..max_draft), max_pass (n = 1..max_pass), batch, context, weight_format
    [[routing]]   name, and either generator (+ params, tokens, seqs, seed) or trace (a file; may contain {model})

Paths are relative to the config file. Every error is one line naming the file and the key,
raised before anything runs or is written. Reference: docs/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moesim import __version__
from moesim.atomic import file_digest, protect
from moesim.errors import ConfigError, MoesimError
from moesim.fields import Checked, FieldError, build, checked, dump, renamed_keys, require
from moesim.hw_profiles import HardwareProfile, load_profile
from moesim.hw_profiles.builtin import profile_files
from moesim.kernels.windows import MAX_PASS_LIMIT
from moesim.machine import check_fits
from moesim.models import ModelPreset, check_weight_format, load_preset
from moesim.parsing import load_toml
from moesim.sim.cost.drafters import drafter_tree, make_drafter
from moesim.sim.cost.steptime import check_family
from moesim.sim.serving.config import MODEL_PLACEHOLDER, policy_from_table, resolve_path
from moesim.sim.sweep.executors import EXECUTORS
from moesim.tomlfile import check_run_header, read_toml, run_header
from moesim.tracegen.formats.builtin import config_trace, resolve_trace
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.routing.synth import MAX_SEED, make_generator, synth_sizes

SWEEP_FORMAT = "moesim.sweep/1"
RUN_CONFIG_KEY = "moesim.run_config"  # the results' metadata key of the config resolved (TOML text)
MAX_ALPHA_POINTS = 10_000_000
MAX_BATCH = 1 << 20  # sequences verified together
MAX_CONTEXT = (1 << 31) - 1  # the `context_tokens` column is int32


@dataclass(frozen=True)
class SweepSection(Checked):
    """How the sweep runs (none of it changes the results)."""

    executor: str = "local"
    workers: int = checked(0, ge=0, le=1 << 16)  # 0: all cores
    ray_address: str = ""
    max_batches: int = checked(64, ge=1, le=1 << 20)

    def __post_init__(self) -> None:
        require(self.executor in EXECUTORS, "executor", EXECUTORS.unknown(self.executor))


def _unique(values: tuple[Any, ...], key: str) -> None:
    require(len(values) > 0, key, "must list at least one value")
    seen = [v for i, v in enumerate(values) if v in values[:i]]
    require(not seen, key, f"lists {seen[0]!r} twice" if seen else "")


@dataclass(frozen=True)
class Grid(Checked):
    """The axes of the sweep. k runs over 0..max_draft and n over 1..max_pass (every value: the best
    draft length is an argmax over all k); alpha, batch and context are lists (alpha also
    {start, stop, num}, evenly spaced)."""

    models: tuple[str, ...]
    profiles: tuple[str, ...] = ("nvidia-h200",)
    families: tuple[str, ...] = ("per_slot",)
    drafters: tuple[str, ...] = ("ngram",)
    alpha: tuple[float, ...] | dict = field(default_factory=lambda: {"start": 0.0, "stop": 1.0, "num": 101})
    max_draft: int = checked(16, ge=0, le=MAX_PASS_LIMIT - 1)
    max_pass: int = checked(32, ge=1, le=MAX_PASS_LIMIT)
    batch: tuple[int, ...] = checked((1,), ge=1, le=MAX_BATCH)
    context: tuple[int, ...] = checked((512,), ge=0, le=MAX_CONTEXT)
    weight_format: str = ""
    policies: tuple[dict, ...] = ()

    def __post_init__(self) -> None:
        for key in ("models", "profiles", "families", "drafters", "batch", "context"):
            _unique(getattr(self, key), key)
        if self.weight_format:
            object.__setattr__(self, "weight_format", check_weight_format(self.weight_format, "weight_format"))
        self.alphas  # noqa: B018 (validates)

    @cached_property
    def alphas(self) -> np.ndarray:
        """The acceptance rates, checked to lie in [0, 1]."""
        spec = self.alpha
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - {"start", "stop", "num"})
            require(not unknown, "alpha", f"unknown key '{unknown[0]}' (give start, stop, num)" if unknown else "")
            try:
                start, stop, num = float(spec.get("start", 0.0)), float(spec.get("stop", 1.0)), spec.get("num", 101)
            except (TypeError, ValueError):
                raise FieldError("alpha", f"start and stop must be numbers, got {spec}") from None
            require(isinstance(num, int) and not isinstance(num, bool), "alpha", f"num must be an integer, got {num!r}")
            require(1 <= num <= MAX_ALPHA_POINTS, "alpha", f"num must lie in 1..{MAX_ALPHA_POINTS}, got {num}")
            require(0.0 <= start <= stop <= 1.0, "alpha", f"need 0 <= start <= stop <= 1, got start={start}, stop={stop}")
            return np.linspace(start, stop, num)
        values = np.asarray(spec, np.float64)
        _unique(tuple(spec), "alpha")
        bad = values[~np.isfinite(values) | (values < 0) | (values > 1)]
        require(bad.size == 0, "alpha", f"acceptance rates must lie in [0, 1], got {bad[0] if bad.size else ''}")
        return values

    @property
    def max_tokens(self) -> int:
        """Largest tokens per sequence in any pass the sweep costs: max(max_pass, max_draft + 1, the
        widest drafter tree's verify width at max_draft)."""
        return max(self.max_pass, self.max_draft + 1, *(drafter_tree(d).width(self.max_draft) for d in self.drafters))


@dataclass(frozen=True)
class SimulateSection(Checked):
    """The SimPy cells (one per grid.policies entry): geometric acceptance at each `alpha`, a closed
    loop of B requests (B from grid.batch) or, at each of `rates_per_s`, Poisson arrivals capped at
    a batch of B, `requests` requests of `prompt_tokens` + `output_tokens`."""

    alpha: tuple[float, ...] = checked((0.6, 0.8, 0.9), ge=0.0, le=1.0)
    requests: int = checked(16, ge=1, le=1 << 20)
    prompt_tokens: int = checked(128, ge=0, le=MAX_CONTEXT)
    output_tokens: int = checked(256, ge=1, le=MAX_CONTEXT)
    seed: int = checked(0, ge=0, le=MAX_SEED)
    rates_per_s: tuple[float, ...] = checked((), gt=0.0, finite=True)

    def __post_init__(self) -> None:
        _unique(self.alpha, "alpha")
        if self.rates_per_s:  # else closed loops
            _unique(self.rates_per_s, "rates_per_s")


@dataclass(frozen=True)
class Routing(Checked):
    """Where routing features come from: a synthetic generator (drawn per model: `max(seqs, B)`
    sequences of `tokens` tokens for a batch of B, so batch lanes are different sequences) or a
    recorded trace (a file per model with {model} in its path, or one file applied to the models
    that route like it)."""

    name: str
    generator: str = ""
    params: dict = field(default_factory=dict)
    tokens: int = checked(1024, ge=1, le=(1 << 32) - 1)
    seqs: int = checked(8, ge=1, le=(1 << 32) - 1)
    seed: int = checked(0, ge=0, le=MAX_SEED)
    trace: Path | None = None

    def __post_init__(self) -> None:
        require(bool(self.name), "name", "must be a non-empty string")
        require(bool(self.generator) != (self.trace is not None), "generator", "give exactly one of 'generator' or 'trace'")
        if self.generator:
            try:
                make_generator(self.generator, self.params)
            except FieldError as exc:
                raise FieldError(f"params.{exc.field}" if exc.field else "generator", exc.detail) from None
        else:
            require(not self.params, "params", "generator parameters need a 'generator'")
            object.__setattr__(self, "trace", config_trace(Path(self.trace)))  # type: ignore[arg-type]

    def trace_for(self, model: str) -> Path | None:
        """The trace file for `model` ({model} replaced), or None for a generator."""
        return None if self.trace is None else Path(str(self.trace).replace(MODEL_PLACEHOLDER, model))


def _file_digest(path: Path) -> str:
    path = resolve_trace(path)  # a built-in trace by name: its file
    return file_digest(path) if path.is_file() else "builtin"


@dataclass(frozen=True)
class SweepConfig:
    """A parsed sweep config."""

    source: str
    sweep: SweepSection
    grid: Grid
    routing: tuple[Routing, ...]
    simulate: SimulateSection = SimulateSection()
    notes: tuple[str, ...] = ()  # one line per renamed key the config used

    def key(self, name: str) -> str:
        """'FILE: key NAME' for error messages."""
        return f"{self.source}: key '{name}'"

    @cached_property
    def identity(self) -> dict[str, Any]:
        """Everything the results depend on (not the executor): the grid, the routing, the
        sha256 of every file named, and the moesim version."""
        g = self.grid
        files = [Path(p) for p in (*g.models, *g.profiles, *g.drafters) if Path(p).suffix in (".toml", ".json")]
        files += [r.trace_for(m) for r in self.routing for m in g.models if r.trace is not None]  # type: ignore[misc]
        return {
            "format": SWEEP_FORMAT,
            "moesim": __version__,
            "max_batches": self.sweep.max_batches,
            "grid": {**dataclasses.asdict(g), "alpha": g.alphas.tolist()},
            "routing": [dataclasses.asdict(r) for r in self.routing],
            "simulate": dataclasses.asdict(self.simulate) if g.policies else None,
            "files": {str(p): _file_digest(p) for p in sorted(set(files), key=str)},
        }

    def table(self) -> dict[str, Any]:
        """The config fully resolved, as the TOML document `parse_config` reads back to it: every
        section with its defaults, files as the run named them (from its working folder),
        and `[moesim]` (version, command, the sha256 of every input file, the profiles' among them)."""
        g = self.grid
        files = [resolve_trace(p) for p in self.identity["files"]] + [f for p in g.profiles for f in profile_files(p)]
        doc = {
            "sweep": dump(self.sweep),
            "grid": dump(g),
            "routing": [dump(r) for r in self.routing],
            **({"simulate": dump(self.simulate)} if g.policies else {}),
            "moesim": run_header("sweep", [f for f in files if f.is_file()]),
        }
        return doc

    @cached_property
    def digest(self) -> str:
        """sha256 of the identity: names the partial-results folder of this config."""
        return hashlib.sha256(json.dumps(self.identity, sort_keys=True, default=str).encode()).hexdigest()

    @cached_property
    def presets(self) -> dict[str, ModelPreset]:
        """Model presets by grid name."""
        return {m: load_preset(m) for m in self.grid.models}

    @cached_property
    def profiles(self) -> dict[str, HardwareProfile]:
        """Hardware profiles by grid name."""
        return {p: load_profile(p) for p in self.grid.profiles}


def _check_names(config: SweepConfig) -> None:
    """Presets, profiles, families and drafters resolve (one line naming the grid key otherwise)."""
    for key, loader in (("models", lambda: config.presets), ("profiles", lambda: config.profiles)):
        try:
            loader()
        except MoesimError as exc:
            raise ConfigError(f"{config.key('grid.' + key)}: {exc}") from None
    for name, preset in config.presets.items():
        if preset.kind != "moe":
            raise ConfigError(f"{config.key('grid.models')}: model '{name}' has no experts; the sweep needs MoE targets")
        for drafter in config.grid.drafters:
            try:
                width = make_drafter(drafter, preset).tree.width(config.grid.max_draft)
            except MoesimError as exc:
                raise ConfigError(f"{config.key('grid.drafters')}: {exc}") from None
            if width > MAX_PASS_LIMIT:
                raise ConfigError(
                    f"{config.key('grid.drafters')}: drafter '{drafter}' verifies {width} tokens at max_draft, above {MAX_PASS_LIMIT}"
                )
    for profile in config.profiles.values():
        for family in config.grid.families:
            try:
                check_family(profile, family)
            except MoesimError as exc:
                raise ConfigError(f"{config.key('grid.families')}: {exc}") from None


def _check_routing(config: SweepConfig) -> None:
    names = [r.name for r in config.routing]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"{config.key(f'routing[{i}].name')}: routing '{name}' is named twice")
    for i, routing in enumerate(config.routing):
        if routing.trace is not None and MODEL_PLACEHOLDER not in str(routing.trace) and not resolve_trace(routing.trace).is_file():
            raise ConfigError(f"{config.key(f'routing[{i}].trace')}: no such trace file {routing.trace}")
        if routing.trace is not None and MODEL_PLACEHOLDER in str(routing.trace):
            for model in config.grid.models:
                path = routing.trace_for(model)
                if not resolve_trace(path).is_file():  # type: ignore[arg-type]
                    raise ConfigError(f"{config.key(f'routing[{i}].trace')}: no trace file {path} for model '{model}'")


def synthetic_layout(routing: Routing, batch: int, max_tokens: int) -> tuple[int, int]:
    """(sequences, tokens each) drawn for a batch of B: the routing's seqs × tokens positions in all,
    as max(seqs, B) equal sequences (batch lanes are different sequences) of at least max_tokens."""
    seqs = max(routing.seqs, batch)
    return seqs, max(routing.tokens * routing.seqs // seqs, max_tokens)


def _check_sizes(config: SweepConfig) -> None:
    """Every synthetic trace a unit draws fits this machine's memory (refused with its estimate)."""
    for i, routing in enumerate(config.routing):
        if not routing.generator:
            continue
        for name, preset in config.presets.items():
            geometry = TraceGeometry.from_preset(preset, config.grid.weight_format or None)
            for batch in config.grid.batch:
                seqs, tokens = synthetic_layout(routing, batch, config.grid.max_tokens)
                try:
                    check_fits(f"the routing of {name} at batch {batch}", synth_sizes(geometry, tokens, seqs * tokens, in_memory=True)[0])
                except MoesimError as exc:
                    raise ConfigError(f"{config.key(f'routing[{i}]')} with grid.batch: {exc}") from None


def parse_config(data: dict[str, Any], source: str, base_dir: Path) -> SweepConfig:
    """A sweep config from a parsed TOML document."""
    unknown = sorted(set(data) - {"sweep", "grid", "routing", "simulate"})
    if unknown:
        raise ConfigError(f"{source}: key '{unknown[0]}': unknown section (known: sweep, grid, routing, simulate)")
    if "grid" not in data:
        raise ConfigError(f"{source}: key 'grid' is required (at least grid.models)")
    sweep = build(SweepSection, data.get("sweep", {}), "sweep", source, base_dir)
    grid_table, notes = renamed_grid_keys(data["grid"], source)
    grid = build(Grid, grid_table, "grid", source, base_dir)
    grid = dataclasses.replace(
        grid, **{key: tuple(resolve_path(v, base_dir) for v in getattr(grid, key)) for key in ("models", "profiles", "drafters")}
    )
    for i, table in enumerate(grid.policies):
        policy_from_table(table, f"grid.policies[{i}]", source, base_dir)
    if "simulate" in data and not grid.policies:
        raise ConfigError(f"{source}: key 'simulate': SimPy settings without grid.policies (add policies to simulate)")
    simulate = build(SimulateSection, data.get("simulate", {}), "simulate", source, base_dir)
    tables = data.get("routing", [{"name": "uniform", "generator": "uniform"}])
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{source}: key 'routing' must be a non-empty array of tables ([[routing]])")
    routing = tuple(build(Routing, t, f"routing[{i}]", source, base_dir) for i, t in enumerate(tables))
    config = SweepConfig(source, sweep, grid, routing, simulate, notes)
    _check_names(config)
    _check_routing(config)
    _check_sizes(config)
    return config


# Renamed grid keys: old -> new. The old one still works for one release, with a note.
RENAMED_GRID_KEYS = {"engines": "families"}


def renamed_grid_keys(table: Any, source: str) -> tuple[Any, tuple[str, ...]]:
    """The grid table with renamed keys in their new spelling, and a note for each old one used."""
    return renamed_keys(table, "grid", RENAMED_GRID_KEYS, "kernel families", source)


def load_config(path: str | Path) -> SweepConfig:
    """Read and check a sweep config file, or the config a sweep's results carry (a .parquet)."""
    path = Path(path)
    if path.suffix != ".parquet":
        return parse_config(read_toml(path, "sweep config"), str(path), path.parent)
    protect(path)
    try:
        text = (pq.read_schema(path).metadata or {})[RUN_CONFIG_KEY.encode()].decode()
    except (OSError, KeyError, UnicodeDecodeError, pa.ArrowException):
        raise ConfigError(f"{path}: not the results of a sweep that carry their config (metadata '{RUN_CONFIG_KEY}')") from None
    data = load_toml(text, f"{path} ({RUN_CONFIG_KEY})")
    check_run_header(data.get("moesim"), str(path), "sweep")
    return parse_config({k: v for k, v in data.items() if k != "moesim"}, str(path), Path("."))  # paths as the run named them


def points_per_unit(config: SweepConfig) -> int:
    """Analytic (α, k) points one work unit yields."""
    g = config.grid
    return len(g.profiles) * len(g.context) * len(g.families) * len(g.drafters) * g.alphas.size * (g.max_draft + 1)
