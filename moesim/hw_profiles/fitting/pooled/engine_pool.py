"""An engine's kernels fitted once over every device that ran it, each device through its datasheet.

The per-device fit (`engine_fit`) learns each device's overheads and rates from that device's few
rows alone. Here every row of the engine (all devices, models, formats and builds) enters one
design, with each row's columns in units of its own device's datasheet:

    T(row on device d) = f_d · [ Σ_bytes θ_b · bytes / BW_d  +  Σ_flops θ_c · FLOPs / F_d  +  Σ_time θ_t · count ]

θ_b ≥ 1 is a family's inverse bandwidth efficiency (1 = the datasheet peak; per weight format its
dequantisation excess `bytes[<format>]`), θ_c its inverse FLOP efficiency (the efficiency curve in
tokens per expert is the family's bytes, tile and compute terms together: `whole_pass`), θ_t the
fixed times (per layer, per expert, per slot, per pass) of each build era, shared by every
device. f_d is the device's factor, fitted (geometric mean of measured / predicted over its rows,
alternating with θ) only where the device has rows; the factors of the devices with rows have
geometric mean 1, and a device without rows takes f = 1: the engine's curves at its datasheet.

Whole passes are split as `whole_pass` splits them (the preset's bytes and FLOPs of attention, the
dense and shared weights, the routed experts and the LM head); what a pass costs beyond them is the
fixed time per pass of its build era (`pass.fixed@<era>`), a stand-in for the engine's time per
forward, so that it is not fitted into the expert terms.

Build eras: `build` keeps every build's fixed times apart (a build measured on several devices
shares them); `dispatch` pools the builds of one dispatch era of the engine's source.

A FLOP rate the engine reaches (`engine_floors`): where a device's own rows never separated a
family's FLOP rate (its fit left `compute_tflops` at inf: up to the sizes it ran, the reads hide the
FLOPs), the pooled fit over the engine's other devices (fixed times per dispatch era) prices them
on this device's datasheet with factor 1, at full tiles: rate = F_d / (θ_compute + θ_tile). It is
the family's FLOP ceiling in the roofline floor (`ExpertFamily.floor_tflops`), not an added term:
time = max(fitted time, bytes / peak bandwidth, FLOPs / rate), so it binds only where the FLOPs at
that rate exceed what the device's own terms price.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from moesim.errors import InputError
from moesim.hw_profiles.catalog import DeviceSpec, catalog
from moesim.hw_profiles.engines import ENGINES, Engine
from moesim.hw_profiles.fitting.engine_builtins import PUBLIC_TABLE, Recipe, profile_frame, recipe_rows
from moesim.hw_profiles.fitting.engine_fit import Coefficients, ProfileFrame, fit_coefficients, profile_of, term_kind
from moesim.hw_profiles.fitting.whole_pass import PassRow, predicted_by_era
from moesim.hw_profiles.heldout import HeldoutError
from moesim.hw_profiles.profile import HardwareProfile

ROUNDS = 6  # alternations of θ and the device factors (the factors settle within 1e-3 by then on the shared rows)
ERAS = ("build", "dispatch")


@dataclass(frozen=True)
class DeviceRows:
    """One device's rows of an engine, with its datasheet and the frame of its profile."""

    recipe: Recipe
    spec: DeviceSpec
    frame: ProfileFrame
    rows: tuple[PassRow, ...]


@cache
def device_rows(item: Recipe, table: Path = PUBLIC_TABLE, eras: str = "build") -> DeviceRows:
    """A recipe's rows, each labelled with its build (`eras="build"`) or its dispatch era."""
    if eras not in ERAS:
        raise InputError(f"build eras are one of {', '.join(ERAS)}, got '{eras}'")
    rows = recipe_rows(item, table)
    if eras == "dispatch":
        era_of = {g.build: g.era for g in item.groups}
        rows = [dataclasses.replace(r, era=era_of[r.era]) for r in rows]
    return DeviceRows(item, catalog()[item.device], profile_frame(item, table), tuple(rows))


def unit_scales(specs: list[DeviceSpec], factors: np.ndarray) -> dict[str, np.ndarray]:
    """Column scales per row: bytes in µs at the row's peak bandwidth, FLOPs in µs at its tensor peak, × its factor."""
    bandwidth = np.array([s.peak_bandwidth_gbps * 1e3 for s in specs])
    flops = np.array([s.tensor_tflops * 1e6 for s in specs])
    return {"bytes": factors / bandwidth, "compute": factors / flops, "time": factors}


def device_coefficients(unit: Coefficients, spec: DeviceSpec, factor: float) -> Coefficients:
    """The engine's coefficients on one device: θ over its peaks (µs per byte, per FLOP), times its factor."""
    per_kind = {"bytes": 1.0 / (spec.peak_bandwidth_gbps * 1e3), "compute": 1.0 / (spec.tensor_tflops * 1e6), "time": 1.0}
    return Coefficients(unit.design, {name: value * factor * per_kind[term_kind(name)] for name, value in unit.values.items()})


@dataclass(frozen=True)
class PooledFit:
    """The engine's shared coefficients (θ, in units of each device's peaks) and its devices' factors."""

    engine: Engine
    unit: Coefficients
    factors: dict[str, float]
    rows: tuple[PassRow, ...]

    def factor(self, device: str) -> float:
        """A device's factor: fitted where it has rows, else 1 (the engine's curves at its datasheet)."""
        return self.factors.get(device, 1.0)

    def profile(self, part: DeviceRows, era: str = "", errors: dict[str, HeldoutError] | None = None) -> HardwareProfile:
        """The device's engine profile at an era (default: its frame's)."""
        frame = dataclasses.replace(part.frame, era=era or part.frame.era)
        coefficients = device_coefficients(self.unit, part.spec, self.factor(part.spec.key))
        return profile_of(list(self.rows), self.engine, coefficients, frame, errors or {})

    def predict(self, part: DeviceRows, rows: list[PassRow] | tuple[PassRow, ...]) -> np.ndarray:
        """Each row on the device predicted by its era's profile (NaN where its family never ran in the pool)."""
        return predicted_by_era(rows, lambda era: self.profile(part, era))


def reached_tflops(theta_compute: float, theta_tile: float, tensor_tflops: float) -> float:
    """FLOP rate the engine reaches at full tiles = tensor peak / (θ_compute + θ_tile) (inf where both are 0)."""
    theta = theta_compute + theta_tile
    return tensor_tflops / theta if theta > 0 else math.inf


def engine_floors(parts: list[DeviceRows], target: DeviceRows, profile: HardwareProfile) -> HardwareProfile:
    """The target's profile with, on each family without a rate of useful FLOPs of its own (all compute
    rates inf, a rate of its whole tiles may stand; not a mat-vec kernel, whose FLOPs ride on its
    reads), the rate the pooled fit over the engine's
    other devices reaches on the target's datasheet (`reached_tflops`) as its FLOP ceiling, where it
    is below the peak (else it never binds); a note says where each comes from."""
    wanted = [
        name
        for name, family in profile.expert_families.items()
        if family.structure.tokens_per_read != 1 and all(math.isinf(rate) for rate in family.compute_tflops)
    ]
    others = [(part, list(part.rows)) for part in parts if part.spec.key != target.spec.key and part.rows]
    if not wanted or not others:
        return profile
    pool = fit_pool(others)
    families, notes = dict(profile.expert_families), list(profile.notes)
    devices = ", ".join(f"{part.spec.key} ({len(rows)})" for part, rows in others)
    for name in wanted:
        family = families[name]
        theta = (pool.unit.get(f"{name}.compute"), pool.unit.get(f"{name}.tile"))
        rate = reached_tflops(*theta, target.spec.tensor_tflops)
        if rate >= family.roofline.peak_tflops:
            continue
        families[name] = dataclasses.replace(family, floor_tflops=rate)
        notes.append(
            f"{name}'s rows do not give its rate of useful FLOPs: its time is floored at {rate:.3g} TFLOP/s, transferred: the pooled "
            f"{pool.engine.name} fit over the rows of {devices} in {PUBLIC_TABLE.as_posix()} (fixed times per dispatch era), "
            f"at this device's datasheet ({target.spec.tensor_tflops:g} TFLOP/s / (θ_compute {theta[0]:.3f} + θ_tile {theta[1]:.3f}))"
        )
    return dataclasses.replace(profile, expert_families=families, notes=tuple(notes))


def fit_pool(parts: list[tuple[DeviceRows, list[PassRow]]], rounds: int = ROUNDS) -> PooledFit:
    """θ and the factors of the devices with rows, alternating: θ by the relative NNLS of
    `engine_fit` at fixed factors, each factor the geometric mean of measured / predicted over its
    device's rows at fixed θ, the factors renormalised to geometric mean 1."""
    parts = [(part, rows) for part, rows in parts if rows]
    if not parts:
        raise InputError("no rows to fit an engine on")
    engines = {part.recipe.engine for part, _ in parts}
    if len(engines) != 1:
        raise InputError(f"one engine per pooled fit, got {sorted(engines)}")
    engine = ENGINES.create(engines.pop())
    rows = [row for _, part_rows in parts for row in part_rows]
    specs = [part.spec for part, part_rows in parts for _ in part_rows]
    keys = np.array([spec.key for spec in specs])
    measured = np.array([r.time_us for r in rows])
    factors = {part.spec.key: 1.0 for part, _ in parts}
    roofline = parts[0][0].frame.roofline  # unused by the floor once the columns are in units of each device's peaks
    for round_ in range(rounds):
        per_row = np.array([factors[k] for k in keys])
        unit = fit_coefficients(rows, engine, roofline, unit_scales(specs, per_row))
        if len(factors) < 2 or round_ == rounds - 1:
            break
        theta = np.array([unit.values[name] for name in unit.design.names])
        at_unit = unit.design.matrix @ theta / per_row
        logs = {k: float(np.mean(np.log(measured[keys == k] / at_unit[keys == k]))) for k in factors}
        centre = float(np.mean(list(logs.values())))
        factors = {k: math.exp(v - centre) for k, v in logs.items()}
    return PooledFit(engine, unit, factors, tuple(rows))
