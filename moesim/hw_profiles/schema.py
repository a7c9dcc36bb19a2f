"""Hardware profile TOML (contract 4, format version 1): read, validate, write.

Layout: top-level `format`, `format_version`, `name`, `description`, `status`; tables `device`,
`roofline`, `pass`, `families.<name>` (with `calibrated_range` and `heldout_error` sub-tables for
expert families) and `sources.<id>`. Every section holding numbers names its `source`; a number
may override it with `<field>_source`. Any problem is one line naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from pathlib import Path
from typing import Any

from moesim.atomic import write_text_atomic
from moesim.errors import ConfigError, InputError
from moesim.hw_profiles.dispatch import dispatch_from_table, dispatch_lines
from moesim.hw_profiles.families import RANGE_FIELDS, CalibratedRange, DenseFamily, ExpertFamily, ExpertStructure, Roofline
from moesim.hw_profiles.heldout import ErrorStats, HeldoutError
from moesim.hw_profiles.ladder.tables import read_grid, read_rung_errors, read_transfer, rung_error_tables, transfer_table
from moesim.hw_profiles.profile import BACKENDS, STATUSES, DeviceFacts, HardwareProfile
from moesim.hw_profiles.provenance import FittedRow, Provenance
from moesim.hw_profiles.speculative import spec_path_from_table
from moesim.models import bytes_per_weight
from moesim.tomlfile import read_toml, toml_section, toml_value

FORMAT = "moesim-hardware-profile"
FORMAT_VERSION = 1
GRID_ITEMS_PER_LINE = 12

_DEVICE_TEXT = ("name", "engine", "engine_version", "driver_version", "runtime_version")
_EXPERT_RATES = ("hbm_bandwidth_gbps", "cache_bandwidth_gbps")
_EXPERT_TIMES = ("fixed_us", "per_expert_us", "per_slot_us", "cache_bytes")
_TILE_KEYS = ("tile_tokens", "tile_step", "tile_tflops", "tile_doubling")
_SPLITS = ("leave_one_shape_out", "leave_one_routing_out", "in_sample", "leave_one_size_out")
_OPTIONAL_TERMS = ("reread_bandwidth_gbps", "variant_bandwidth_gbps", "row_ns", "floor_tflops")
CACHE_MODELS = ("working_set", "reuse_distance")
EXTRA_TABLES = ("grid", "shape_fits", "rung_error", "pass_transfer")  # the lookup ladder (optional)


class _Reader:
    """Checks values of one profile file; every failure names the file and the field path."""

    def __init__(self, origin: str, sources: dict[str, Provenance]) -> None:
        self.origin = origin
        self.sources = sources
        self.field_sources: dict[str, str] = {}
        self.section_sources: dict[str, str] = {}

    def fail(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.origin}: field '{path}' {message}")

    def table(self, parent: dict[str, Any], key: str, path: str) -> dict[str, Any]:
        value = parent.get(key)
        if value is None:
            raise self.fail(path, "is missing")
        if not isinstance(value, dict):
            raise self.fail(path, "must be a table")
        return value

    def text(self, table: dict[str, Any], key: str, path: str, required: bool = True) -> str:
        value = table.get(key)
        if value is None and not required:
            return ""
        if not isinstance(value, str) or (required and not value):
            raise self.fail(f"{path}.{key}", "is missing" if value is None else f"must be a non-empty string, got {value!r}")
        return value

    def number(self, table: dict[str, Any], key: str, path: str, positive: bool = False, allow_inf: bool = False) -> float:
        value = table.get(key)
        where = f"{path}.{key}"
        if value is None:
            raise self.fail(where, "is missing")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(where, f"must be a number, got {value!r}")
        value = float(value)
        if math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
            raise self.fail(where, f"must be a finite number, got {value}")
        if value < 0 or (positive and value == 0):
            raise self.fail(where, f"must be {'> 0' if positive else '>= 0'}, got {value:g}")
        return value

    def numbers(self, table: dict[str, Any], key: str, path: str, count: int, positive: bool, allow_inf: bool) -> tuple[float, ...]:
        value = table.get(key)
        where = f"{path}.{key}"
        if not isinstance(value, list):
            raise self.fail(where, "is missing" if value is None else "must be a list of numbers")
        if len(value) != count:
            raise self.fail(where, f"must hold {count} numbers (one per tile variant), got {len(value)}")
        return tuple(self.number({key: v}, key, path, positive, allow_inf) for v in value)

    def source(self, table: dict[str, Any], path: str, numeric_keys: tuple[str, ...]) -> None:
        source = table.get("source")
        if not isinstance(source, str) or not source:
            raise self.fail(f"{path}.source", "is missing: every section with numbers needs provenance (an id in [sources])")
        if source not in self.sources:
            raise self.fail(f"{path}.source", f"names unknown source '{source}' (known: {', '.join(self.sources) or 'none'})")
        self.section_sources[path] = source
        for key, value in table.items():
            if key.endswith("_source") and key != "source":
                numeric = key.removesuffix("_source")
                if numeric not in numeric_keys:
                    raise self.fail(f"{path}.{key}", f"overrides the source of '{numeric}', which is not a number of this section")
                if not isinstance(value, str) or value not in self.sources:
                    raise self.fail(f"{path}.{key}", f"names unknown source {value!r}")
                self.field_sources[f"{path}.{numeric}"] = value

    def unknown(self, table: dict[str, Any], path: str, allowed: set[str]) -> None:
        for key in table:
            if key not in allowed and not (key.endswith("_source") and key.removesuffix("_source") in allowed):
                raise self.fail(f"{path}.{key}", "is unknown")


def read_sources(data: dict[str, Any], origin: str) -> dict[str, Provenance]:
    """The `[sources]` table: id -> provenance, each checked."""
    sources_table = data.get("sources")
    if not isinstance(sources_table, dict) or not sources_table:
        raise ConfigError(f"{origin}: field 'sources' is missing: a profile lists where its numbers come from")
    sources = {}
    for key, table in sources_table.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{origin}: field 'sources.{key}' must be a table")
        unknown = set(table) - {"kind", "file", "sha256", "citation", "note", "rows"}
        if unknown:
            raise ConfigError(f"{origin}: field 'sources.{key}.{sorted(unknown)[0]}' is unknown")
        rows = _read_rows(table.get("rows", []), f"{origin}: field 'sources.{key}.rows'")
        provenance = Provenance(**{"kind": "", **{k: str(v) for k, v in table.items() if k != "rows"}}, rows=rows)
        problem = provenance.problem()
        if problem:
            raise ConfigError(f"{origin}: field 'sources.{key}.{problem[0]}' {problem[1]}")
        sources[key] = provenance
    return sources


def _notes(value: Any, origin: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{origin}: field 'notes' must be a list of strings, got {value!r}")
    return tuple(str(note) for note in value)


def _read_rows(value: Any, where: str) -> tuple[FittedRow, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list of {{row, source, variant, n_tokens}} tables")
    rows = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or set(entry) != {"row", "source", "variant", "n_tokens"}:
            raise ConfigError(f"{where}[{i}] must be a table of exactly row, source, variant, n_tokens")
        if not all(isinstance(entry[k], int) and not isinstance(entry[k], bool) and entry[k] > 0 for k in ("row", "n_tokens")):
            raise ConfigError(f"{where}[{i}]: row and n_tokens must be positive integers, got {entry['row']!r}, {entry['n_tokens']!r}")
        rows.append(FittedRow(entry["row"], str(entry["source"]), str(entry["variant"]), entry["n_tokens"]))
    return tuple(rows)


def _read_heldout(reader: _Reader, table: dict[str, Any], path: str) -> HeldoutError:
    heldout = reader.table(table, "heldout_error", f"{path}.heldout_error")
    where = f"{path}.heldout_error"
    reader.unknown(heldout, where, {*_SPLITS, "transfer", "transfer_note"})
    stats: dict[str, ErrorStats | None] = {}
    for split in _SPLITS:
        entry = heldout.get(split)
        if entry is None:
            stats[split] = None
            continue
        if not isinstance(entry, dict):
            raise reader.fail(f"{where}.{split}", "must be a table of median, p90, max, rows")
        values = [reader.number(entry, key, f"{where}.{split}") for key in ("median", "p90", "max", "rows")]
        stats[split] = ErrorStats(values[0], values[1], values[2], int(values[3]))
    transfer = reader.number(heldout, "transfer", where) if "transfer" in heldout else 0.0
    result = HeldoutError(transfer=transfer, transfer_note=str(heldout.get("transfer_note", "")), **stats)
    if math.isnan(result.epsilon):
        raise reader.fail(where, "needs a held-out split or a 'transfer' uncertainty: the family's error bound is unknown")
    return result


def _read_range(reader: _Reader, table: dict[str, Any], path: str) -> CalibratedRange:
    ranges = reader.table(table, "calibrated_range", f"{path}.calibrated_range")
    where = f"{path}.calibrated_range"
    reader.unknown(ranges, where, set(RANGE_FIELDS))
    bounds = {}
    for name in RANGE_FIELDS:
        value = ranges.get(name)
        if value is None:
            raise reader.fail(f"{where}.{name}", "is missing")
        if not isinstance(value, list) or len(value) != 2:
            raise reader.fail(f"{where}.{name}", "must be [low, high]")
        low, high = (reader.number({name: v}, name, where, positive=True) for v in value)
        if low > high:
            raise reader.fail(f"{where}.{name}", f"has low {low:g} above high {high:g}")
        bounds[name] = (low, high)
    return CalibratedRange(bounds)


def _read_expert(reader: _Reader, name: str, table: dict[str, Any], roofline: Roofline) -> ExpertFamily:
    path = f"families.{name}"
    allowed = {"tokens_per_read", "variants", "cache_model", *_EXPERT_RATES, *_EXPERT_TIMES, *_OPTIONAL_TERMS}
    allowed |= {"compute_tflops", "serial_ns", "source", "note"}
    reader.unknown(table, path, allowed | {"calibrated_range", "heldout_error", "format_bandwidth_gbps", *_TILE_KEYS, *EXTRA_TABLES})
    reader.source(table, path, (*_EXPERT_RATES, *_EXPERT_TIMES, *_OPTIONAL_TERMS, "compute_tflops", "serial_ns", "tile_tflops"))
    tokens_per_read = table.get("tokens_per_read")
    if isinstance(tokens_per_read, bool) or not isinstance(tokens_per_read, int) or tokens_per_read < 0:
        raise reader.fail(f"{path}.tokens_per_read", f"must be an integer >= 0 (0 = one read per distinct expert), got {tokens_per_read!r}")
    variants = table.get("variants", [])
    if (
        not isinstance(variants, list)
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in variants)
        or variants != sorted(set(variants))
        or (variants and (tokens_per_read < 2 or variants[-1] != tokens_per_read))
    ):
        raise reader.fail(f"{path}.variants", f"must list ascending tile widths ending at tokens_per_read (> 1), got {variants!r}")
    tiles = {key: table.get(key, 0) for key in _TILE_KEYS[:2]}
    for key, value in tiles.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise reader.fail(f"{path}.{key}", f"must be an integer >= 0, got {value!r}")
    if tiles["tile_tokens"] and "tile_tflops" not in table:
        raise reader.fail(f"{path}.tile_tflops", "is missing: a tiled kernel needs its tile compute rate")
    doubling = table.get("tile_doubling", False)
    if not isinstance(doubling, bool) or (doubling and not tiles["tile_step"]):
        raise reader.fail(f"{path}.tile_doubling", f"must be true or false, and true only with a tile_step, got {doubling!r}")
    cache_model = table.get("cache_model", "working_set")
    if cache_model not in CACHE_MODELS:
        raise reader.fail(f"{path}.cache_model", f"must be one of {', '.join(CACHE_MODELS)}, got {cache_model!r}")
    variant_terms = "variant_bandwidth_gbps" in table or "row_ns" in table
    structure = ExpertStructure(
        tokens_per_read,
        tuple(variants),
        tiles["tile_tokens"],
        tiles["tile_step"],
        tile_doubling=doubling,
        reuse_distance=cache_model == "reuse_distance",
        reread_rate="reread_bandwidth_gbps" in table,
        variant_terms=variant_terms,
    )
    if name == "per_slot" and tokens_per_read != 1:
        raise reader.fail(f"{path}.tokens_per_read", f"must be 1 for the per_slot family, got {tokens_per_read}")
    if variant_terms and not variants:
        raise reader.fail(f"{path}.variant_bandwidth_gbps", "needs tile variants (a per-variant term of a kernel without variants)")
    rates = structure.n_rates if variant_terms else 0
    return ExpertFamily(
        name=name,
        structure=structure,
        fixed_us=reader.number(table, "fixed_us", path),
        hbm_bandwidth_gbps=reader.number(table, "hbm_bandwidth_gbps", path, positive=True, allow_inf=True),
        cache_bandwidth_gbps=reader.number(table, "cache_bandwidth_gbps", path, positive=True, allow_inf=True),
        cache_bytes=reader.number(table, "cache_bytes", path),
        compute_tflops=reader.numbers(table, "compute_tflops", path, structure.n_rates, positive=True, allow_inf=True),
        serial_ns=reader.numbers(table, "serial_ns", path, structure.n_rates, positive=False, allow_inf=False),
        per_expert_us=reader.number(table, "per_expert_us", path),
        per_slot_us=reader.number(table, "per_slot_us", path),
        calibrated_range=_read_range(reader, table, path),
        heldout_error=_read_heldout(reader, table, path),
        provenance=reader.sources[reader.section_sources[path]],
        roofline=roofline,
        note=str(table.get("note", "")),
        tile_tflops=reader.number(table, "tile_tflops", path, positive=True, allow_inf=True) if structure.tile_tokens else math.inf,
        format_bandwidth_gbps=_read_format_rates(reader, table.get("format_bandwidth_gbps", {}), f"{path}.format_bandwidth_gbps"),
        reread_bandwidth_gbps=(
            reader.number(table, "reread_bandwidth_gbps", path, positive=True, allow_inf=True) if structure.reread_rate else math.inf
        ),
        variant_bandwidth_gbps=reader.numbers(table, "variant_bandwidth_gbps", path, rates, True, True) if rates else (),
        row_ns=reader.numbers(table, "row_ns", path, rates, False, False) if rates else (),
        floor_tflops=reader.number(table, "floor_tflops", path, positive=True, allow_inf=True) if "floor_tflops" in table else math.inf,
    )


def _read_format_rates(reader: _Reader, table: Any, path: str) -> dict[str, float]:
    """{FORMAT = GB/s}: weight formats with their own effective bandwidth."""
    if not isinstance(table, dict):
        raise reader.fail(path, "must be a table of weight format = GB/s")
    rates = {}
    for fmt in table:
        try:
            bytes_per_weight(fmt)
        except InputError:
            raise reader.fail(f"{path}.{fmt}", "is not a weight format") from None
        rates[fmt.upper()] = reader.number(table, fmt, path, positive=True, allow_inf=True)
    return rates


def _read_ladder(reader: _Reader, family: ExpertFamily, table: dict[str, Any], roofline: Roofline) -> ExpertFamily:
    """The family's optional lookup ladder: knots, fitted rung per shape, rung bounds, pass-level terms."""
    path = f"families.{family.name}"
    grid = None
    if "grid" in table:
        grid, source = read_grid(table["grid"], f"{path}.grid", reader.origin)
        if source not in reader.sources:
            raise reader.fail(f"{path}.grid.source", f"names unknown source '{source}' (known: {', '.join(reader.sources)})")
        reader.section_sources[f"{path}.grid"] = source
    shape_fits = {}
    fits = table.get("shape_fits", {})
    if not isinstance(fits, dict):
        raise reader.fail(f"{path}.shape_fits", "must be a table of shape fits")
    base = {key: value for key, value in table.items() if key not in (*EXTRA_TABLES, "note")}
    for label, fit in fits.items():
        if not isinstance(fit, dict):
            raise reader.fail(f"{path}.shape_fits.{label}", "must be a table")
        weight = reader.number(fit, "weight", f"{path}.shape_fits.{label}", positive=True) if "weight" in fit else 1.0
        parameters = {key: value for key, value in fit.items() if key != "weight"}
        shape_reader = _Reader(f"{reader.origin} (shape fit {label})", reader.sources)
        shape_fits[label] = dataclasses.replace(
            _read_expert(shape_reader, family.name, {**base, **parameters}, roofline), fit_weight=weight
        )
    rung_errors = read_rung_errors(table["rung_error"], f"{path}.rung_error", reader.origin) if "rung_error" in table else None
    for source in (rung_errors.one_layer_source, rung_errors.whole_pass_source) if rung_errors else ():
        if source and source not in reader.sources:
            raise reader.fail(f"{path}.rung_error", f"names unknown source '{source}' (known: {', '.join(reader.sources)})")
    transfer = read_transfer(table["pass_transfer"], f"{path}.pass_transfer", reader.origin) if "pass_transfer" in table else None
    if transfer is not None and transfer.source not in reader.sources:
        raise reader.fail(f"{path}.pass_transfer.source", f"names unknown source '{transfer.source}'")
    return dataclasses.replace(family, grid=grid, shape_fits=shape_fits, rung_errors=rung_errors, pass_transfer=transfer)


def _read_dense(reader: _Reader, table: dict[str, Any]) -> DenseFamily:
    path = "families.dense"
    reader.unknown(table, path, {"bandwidth_gbps", "tflops", "launch_us", "attention_tflops", "source", "note", "heldout_error"})
    reader.source(table, path, ("bandwidth_gbps", "tflops", "launch_us", "attention_tflops"))
    attention = reader.number(table, "attention_tflops", path, positive=True, allow_inf=True) if "attention_tflops" in table else math.inf
    return DenseFamily(
        bandwidth_gbps=reader.number(table, "bandwidth_gbps", path, positive=True),
        tflops=reader.number(table, "tflops", path, positive=True, allow_inf=True),
        launch_us=reader.number(table, "launch_us", path),
        provenance=reader.sources[reader.section_sources[path]],
        heldout_error=_read_heldout(reader, table, path),
        note=str(table.get("note", "")),
        attention_tflops=attention,
    )


def profile_from_dict(data: dict[str, Any], origin: str) -> HardwareProfile:
    """Build and validate a profile from parsed TOML."""
    if data.get("format") != FORMAT:
        raise ConfigError(f"{origin}: field 'format' must be '{FORMAT}', got {data.get('format')!r}")
    if data.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{origin}: field 'format_version' must be {FORMAT_VERSION}, got {data.get('format_version')!r}")
    unknown = set(data) - {
        "format",
        "format_version",
        "name",
        "description",
        "status",
        "derived_from",
        "notes",
        "device",
        "roofline",
        "pass",
        "families",
        "sources",
        "dispatch",
        "partial",
        "speculative",
    }
    if unknown:
        raise ConfigError(f"{origin}: field '{sorted(unknown)[0]}' is unknown")
    reader = _Reader(origin, read_sources(data, origin))
    name = reader.text(data, "name", "profile").strip()
    status = data.get("status")
    if status not in STATUSES:
        raise reader.fail("status", f"must be one of {', '.join(STATUSES)}, got {status!r}")

    device_table = reader.table(data, "device", "device")
    reader.unknown(device_table, "device", {*_DEVICE_TEXT, "backend", "memory_gb", "l2_cache_bytes", "compute_units", "source"})
    reader.source(device_table, "device", ("memory_gb", "l2_cache_bytes", "compute_units"))
    backend = device_table.get("backend")
    if backend not in BACKENDS:
        raise reader.fail("device.backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    device = DeviceFacts(
        name=reader.text(device_table, "name", "device"),
        backend=backend,
        memory_gb=reader.number(device_table, "memory_gb", "device", positive=True),
        l2_cache_bytes=reader.number(device_table, "l2_cache_bytes", "device"),
        compute_units=int(reader.number(device_table, "compute_units", "device")),
        **{key: reader.text(device_table, key, "device", required=False) for key in _DEVICE_TEXT[1:]},
    )

    roofline_table = reader.table(data, "roofline", "roofline")
    reader.unknown(roofline_table, "roofline", {"peak_bandwidth_gbps", "peak_tflops", "source"})
    reader.source(roofline_table, "roofline", ("peak_bandwidth_gbps", "peak_tflops"))
    roofline = Roofline(
        reader.number(roofline_table, "peak_bandwidth_gbps", "roofline", positive=True),
        reader.number(roofline_table, "peak_tflops", "roofline", positive=True),
    )
    pass_table = reader.table(data, "pass", "pass")
    reader.unknown(pass_table, "pass", {"fixed_us", "bench_routed_share", "source", "note"})
    reader.source(pass_table, "pass", ("fixed_us",))
    pass_fixed_us = reader.number(pass_table, "fixed_us", "pass")
    routed_share = reader.number(pass_table, "bench_routed_share", "pass", positive=True) if "bench_routed_share" in pass_table else 1.0
    if routed_share > 1.0:
        raise reader.fail("pass.bench_routed_share", f"is a share of the experts, at most 1, got {routed_share}")

    families_table = reader.table(data, "families", "families")
    experts: dict[str, ExpertFamily] = {}
    for family_name, table in families_table.items():
        if not isinstance(table, dict):
            raise reader.fail(f"families.{family_name}", "must be a table")
        if family_name == "dense":
            continue
        if family_name != "per_slot" and not family_name.startswith("dedup"):
            raise reader.fail(f"families.{family_name}", "is not a family name: per_slot, dense or a name starting with dedup")
        experts[family_name] = _read_ladder(reader, _read_expert(reader, family_name, table, roofline), table, roofline)
    if "dense" not in families_table:
        raise reader.fail("families.dense", "is missing: a profile needs the dense family (non-expert weights, attention, KV)")
    dense = _read_dense(reader, families_table["dense"])
    dispatch = dispatch_from_table(data["dispatch"], origin, reader.sources, tuple(experts)) if "dispatch" in data else None
    partial = data.get("partial", False)
    if not isinstance(partial, bool):
        raise reader.fail("partial", f"must be true or false, got {partial!r}")

    return HardwareProfile(
        name=name,
        description=str(data.get("description", "")),
        status=status,
        device=device,
        roofline=roofline,
        pass_fixed_us=pass_fixed_us,
        bench_routed_share=routed_share,
        expert_families=experts,
        dense=dense,
        sources=reader.sources,
        field_sources=reader.field_sources,
        notes=_notes(data.get("notes", []), origin),
        derived_from=str(data.get("derived_from", "")),
        section_sources=reader.section_sources,
        dispatch=dispatch,
        partial=partial,
        speculative=spec_path_from_table(data["speculative"], "speculative", reader.sources, reader.fail)
        if "speculative" in data
        else None,
    )


def read_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """Read and validate a profile TOML file."""
    path = Path(path)
    return profile_from_dict(read_toml(path, "profile"), str(path))


# ---- writing ---------------------------------------------------------------------------------


def _overrides(profile: HardwareProfile, path: str) -> dict[str, str]:
    prefix = f"{path}."
    return {f"{key.removeprefix(prefix)}_source": source for key, source in profile.field_sources.items() if key.startswith(prefix)}


def _heldout_table(heldout: HeldoutError) -> dict[str, Any]:
    table: dict[str, Any] = {split: stats.to_dict() for split in _SPLITS if (stats := getattr(heldout, split)) is not None}
    if heldout.transfer:
        table["transfer"] = heldout.transfer
        table["transfer_note"] = heldout.transfer_note
    return table


def _ladder_sections(lines: list[str], profile: HardwareProfile, family: ExpertFamily, path: str) -> None:
    """The family's lookup ladder (rung bounds, pass-level terms, fitted rung per shape, knots)."""
    if family.rung_errors is not None:
        for rung, table in rung_error_tables(family.rung_errors).items():
            toml_section(lines, f"{path}.rung_error.{rung}", table)
    if family.pass_transfer is not None:
        toml_section(lines, f"{path}.pass_transfer", transfer_table(family.pass_transfer))
    for label, fit in family.shape_fits.items():
        toml_section(lines, f'{path}.shape_fits."{label}"', {"weight": fit.fit_weight, **fit.parameters(), "note": fit.note or None})
    if family.grid is not None:
        grid = family.grid.to_table(profile.section_sources.get(f"{path}.grid", profile.section_sources[path]))
        lines.extend(["", f"[{path}.grid]"])
        for key, value in grid.items():
            lines.append(
                f"{key} = {_wrapped(value) if isinstance(value, list) and len(value) > GRID_ITEMS_PER_LINE else toml_value(value)}"
            )


def _wrapped(values: list[Any]) -> str:
    """A long array over several lines."""
    rows = [", ".join(toml_value(v) for v in values[i : i + GRID_ITEMS_PER_LINE]) for i in range(0, len(values), GRID_ITEMS_PER_LINE)]
    return "[\n    " + ",\n    ".join(rows) + ",\n]"


def profile_to_toml(profile: HardwareProfile) -> str:
    """The profile as TOML text (floats written exactly: reading it back gives the same numbers)."""
    lines = [
        f"# moesim hardware profile '{profile.name}' (contract 4, format version {FORMAT_VERSION}).",
        "# Times in µs, bandwidths in GB/s (1e9 B/s), compute in TFLOP/s; inf = the term costs nothing.",
    ]
    top: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": profile.name,
        "description": profile.description,
        "status": profile.status,
    }
    if profile.derived_from:
        top["derived_from"] = profile.derived_from
    if profile.partial:
        top["partial"] = True
    if profile.notes:
        top["notes"] = list(profile.notes)
    toml_section(lines, None, top)
    d = profile.device
    toml_section(
        lines,
        "device",
        {
            "name": d.name,
            "backend": d.backend,
            "memory_gb": d.memory_gb,
            "l2_cache_bytes": d.l2_cache_bytes,
            "compute_units": d.compute_units,
            "engine": d.engine,
            "engine_version": d.engine_version,
            "driver_version": d.driver_version,
            "runtime_version": d.runtime_version,
            "source": profile.section_sources["device"],
            **_overrides(profile, "device"),
        },
    )
    toml_section(
        lines,
        "roofline",
        {
            "peak_bandwidth_gbps": profile.roofline.peak_bandwidth_gbps,
            "peak_tflops": profile.roofline.peak_tflops,
            "source": profile.section_sources["roofline"],
            **_overrides(profile, "roofline"),
        },
    )
    toml_section(
        lines,
        "pass",
        {
            "fixed_us": profile.pass_fixed_us,
            "bench_routed_share": profile.bench_routed_share if profile.bench_routed_share < 1.0 else None,
            "source": profile.section_sources["pass"],
            **_overrides(profile, "pass"),
        },
    )
    dense = profile.dense
    toml_section(
        lines,
        "families.dense",
        {
            "bandwidth_gbps": dense.bandwidth_gbps,
            "tflops": dense.tflops,
            "launch_us": dense.launch_us,
            "attention_tflops": dense.attention_tflops if math.isfinite(dense.attention_tflops) else None,
            "note": dense.note or None,
            "source": profile.section_sources["families.dense"],
            **_overrides(profile, "families.dense"),
        },
    )
    toml_section(lines, "families.dense.heldout_error", _heldout_table(dense.heldout_error))
    for name, family in profile.expert_families.items():
        path = f"families.{name}"
        toml_section(
            lines,
            path,
            {
                **family.parameters(),
                "note": family.note or None,
                "source": profile.section_sources[path],
                **_overrides(profile, path),
            },
        )
        toml_section(lines, f"{path}.calibrated_range", {key: list(bounds) for key, bounds in family.calibrated_range.bounds.items()})
        toml_section(lines, f"{path}.heldout_error", _heldout_table(family.heldout_error))
        _ladder_sections(lines, profile, family, path)
    if profile.dispatch is not None:
        lines.extend(dispatch_lines(profile.dispatch))
    if profile.speculative is not None:
        toml_section(lines, "speculative", profile.speculative.table())
        for name, table in profile.speculative.sub_tables().items():
            toml_section(lines, f"speculative.{name}", table)
    sources_lines(lines, profile.sources)
    return "\n".join(lines) + "\n"


def sources_lines(lines: list[str], sources: dict[str, Provenance]) -> None:
    """The `[sources.ID]` tables."""
    for key, source in sources.items():
        fields = {"kind": source.kind, "file": source.file, "sha256": source.sha256, "citation": source.citation, "note": source.note}
        toml_section(lines, f"sources.{key}", {k: v for k, v in fields.items() if v})
        if source.rows:
            lines.append("rows = [")
            lines.extend(f"    {toml_value(row.to_table())}," for row in source.rows)
            lines.append("]")


def check_profile(profile: HardwareProfile, origin: str) -> HardwareProfile:
    """The profile, checked as a file of it would be; a problem is blamed on `origin` (the input it came from)."""
    profile_from_dict(tomllib.loads(profile_to_toml(profile)), origin)
    return profile


def write_profile(path: str | os.PathLike[str], profile: HardwareProfile) -> None:
    """Write a profile atomically (validated by reading the text back first)."""
    text = profile_to_toml(profile)
    profile_from_dict(tomllib.loads(text), str(path))
    write_text_atomic(path, text)
