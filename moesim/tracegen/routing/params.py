"""Routing-generator parameter files: written by `moesim trace fit`, read by `trace synth --params`.

TOML: `format = "moesim-routing-params"`, version 1, `generator` and its parameters under
`[params]` (one value per MoE layer of the source, or one for all), the source trace under
`[source]` and the matched moments under `[fit]`. Parameters of a trace with L MoE layers are
mapped onto a preset with another number of MoE layers by relative depth (linear
interpolation), so a fitted trace can drive studies of models no one has traced. Built-in
parameter files (`BUILTIN_PARAMS`, fitted to the built-in real trace) are named like files.
`generator_from_options` is `trace synth`'s choice among the generators and parameter files
(here, above `synth`, so the generators never import their parameter files).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moesim.atomic import write_text_atomic
from moesim.errors import InputError
from moesim.fields import Checked, FieldError, build, checked
from moesim.models import ModelPreset
from moesim.tomlfile import read_toml
from moesim.tracegen.formats.builtin import builtin_data_dir, resolve_trace
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.routing.fit import FitResult
from moesim.tracegen.routing.synth import GENERATORS, RoutingGenerator, Sticky, Uniform, Zipf, make_generator

PARAMS_FORMAT = "moesim-routing-params"
PARAMS_FORMAT_VERSION = 1
BUILTIN_PARAMS = {
    "esft-vanilla-lite-working-set": "esft-vanilla-lite/working-set.params.toml",
    "esft-vanilla-lite-mixture": "esft-vanilla-lite/mixture.params.toml",
}


def resolve_params(name_or_path: str | Path) -> Path:
    """A built-in parameter file by name, else the path."""
    text = str(name_or_path)
    if text in BUILTIN_PARAMS and not Path(text).exists():
        return builtin_data_dir() / BUILTIN_PARAMS[text]
    return Path(name_or_path)


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(float(value)) if math.isfinite(value) else '"nan"'
    return str(value)


def params_toml(generator: RoutingGenerator, source: dict[str, Any], fit: dict[str, Any]) -> str:
    """A parameter file's text."""
    lines = [
        "# Routing-generator parameters for `moesim trace synth --params` (written by `moesim trace fit`).",
        f"format = {_toml_value(PARAMS_FORMAT)}",
        f"format_version = {PARAMS_FORMAT_VERSION}",
        f"generator = {_toml_value(generator.name)}",
        "",
        "[params]  # one value per MoE layer of the source, or one for all",
    ]
    lines += [f"{name} = {_toml_value(value)}" for name, value in dataclasses.asdict(generator).items()]  # type: ignore[call-overload]
    for title, table in (("source", source), ("fit", fit)):
        if table:
            lines += ["", f"[{title}]"] + [f"{name} = {_toml_value(value)}" for name, value in table.items()]
    return "\n".join(lines) + "\n"


def _rounded(values: np.ndarray) -> tuple[float, ...]:
    return tuple(float(f"{v:.6g}") for v in values)


def write_fit(path: str | Path, result: FitResult, trace_path: str | Path, geometry: TraceGeometry, selection: str = "") -> None:
    """Save a fit as a parameter file (atomically); `selection` says which sequences of the trace were fitted."""
    file = resolve_trace(trace_path)
    source = {
        "trace": Path(trace_path).name,
        "sha256": hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else "",
        "sequences_fitted": selection or "all",
        "model": geometry.model,
        "experts": geometry.experts,
        "top_k": geometry.top_k,
        "moe_layers": list(geometry.moe_layers),
        "positions": result.positions,
        "sequences": result.sequences,
    }
    fit: dict[str, Any] = {"method": result.method()}
    for j, pair in enumerate(result.pairs):
        fit[f"{pair.moment}_source"] = _rounded(result.source[:, j])
        fit[f"{pair.moment}_fitted"] = _rounded(result.fitted[:, j])
    write_text_atomic(path, params_toml(result.generator, source, fit))


def _interpolate(value: Any, n_layers: int) -> Any:
    """Per-layer values onto n_layers by relative depth (linear); scalars stay scalars."""
    if not isinstance(value, (list, tuple)):
        return value
    values = np.asarray(value, np.float64)
    if values.shape[0] == n_layers:
        return tuple(values.tolist())
    if values.shape[0] == 1:
        return float(values[0])
    depth_from = np.linspace(0.0, 1.0, values.shape[0])
    depth_to = np.linspace(0.0, 1.0, n_layers) if n_layers > 1 else np.array([0.5])
    return tuple(np.interp(depth_to, depth_from, values).tolist())


@dataclass(frozen=True)
class ParamsFile(Checked):
    """A parameter file as `write_fit` writes it (`source` and `fit` are informational)."""

    format: str = checked(choices=(PARAMS_FORMAT,))
    format_version: int = checked(choices=(PARAMS_FORMAT_VERSION,))
    generator: str = checked(choices=tuple(GENERATORS))
    params: dict[str, Any]
    source: dict[str, Any] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)


def load_params(path: str | Path, geometry: TraceGeometry) -> RoutingGenerator:
    """A generator from a parameter file (or a built-in one by name), its per-layer values mapped onto the geometry's MoE layers."""
    path = resolve_params(path)
    if not path.is_file():
        raise InputError(f"{path}: no such parameter file (built-in: {', '.join(BUILTIN_PARAMS)})")
    data = build(ParamsFile, read_toml(path, "parameter"), "", str(path), path.parent)
    n_layers = len(geometry.moe_layers)
    for key, value in data.params.items():
        if isinstance(value, list) and not value:
            raise InputError(f"{path}: key 'params.{key}': must be a number or a non-empty list of numbers, got []")
    try:
        generator = make_generator(data.generator, {k: _interpolate(v, n_layers) if _numbers(v) else v for k, v in data.params.items()})
    except FieldError as exc:
        raise InputError(f"{path}: key 'params.{exc.field}': {exc.detail}") from None
    try:
        generator.generate(geometry, 2, 1, 0)  # checks every parameter against the geometry
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
    return generator


def _numbers(value: Any) -> bool:
    items = value if isinstance(value, list) else [value]
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in items)


DEFAULT_PARAMS = "esft-vanilla-lite-working-set"  # the working set fitted to the built-in real trace


def is_default_routing(uniform: bool, sticky: float | None, zipf: float, params: Path | None) -> bool:
    """Whether `trace synth` was given no routing option (it then draws from `DEFAULT_PARAMS`)."""
    return not uniform and sticky is None and not zipf and params is None


def generator_from_options(
    preset: ModelPreset,
    uniform: bool = False,
    sticky: float | None = None,
    zipf: float = 0.0,
    params: Path | None = None,
    weight_format: str | None = None,
) -> RoutingGenerator:
    """`trace synth`'s choice: uniform, sticky (keep probability, optional Zipf skew), Zipf alone,
    or a fitted parameter file mapped onto the preset's layers; default (none of them) the
    generator fitted to the built-in real trace (`DEFAULT_PARAMS`)."""
    if uniform and sticky is not None:
        raise InputError("--uniform and --sticky exclude each other")
    if uniform and zipf:
        raise InputError("--uniform and --zipf exclude each other")
    if is_default_routing(uniform, sticky, zipf, params):
        params = Path(DEFAULT_PARAMS)
    if params is not None:
        if uniform or sticky is not None or zipf:
            raise InputError("--params excludes --uniform, --sticky and --zipf")
        return load_params(params, TraceGeometry.from_preset(preset, weight_format, "synthetic routing"))
    if sticky is not None:
        return Sticky(keep_prob=sticky, zipf_exponent=zipf)
    return Zipf(exponent=zipf) if zipf else Uniform()
