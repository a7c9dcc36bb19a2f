"""The pooled engine fit judged on what it never saw, in the splits of `engine_validation`.

Leave one model out: on a device with two or more models, each model's rows predicted by the
engine's fit over every other row (every other device's, and this device's other models', which
also give the device its factor). Leave one device out: a device's rows predicted by the fit over
the other devices of its engine, at the device's datasheet with factor 1, from its like devices
(same vendor, same generation or one apart: `like`), from all of them, and from each unlike
device alone (`bench/validate_engine_transfer.py` prints them). A scaled profile's transfer
uncertainty is what held-out devices show: the largest p90 error, over the held-out pairs of its
kind (`pair_kind`: like, one vendor further apart, different vendors), of the datasheet scaling of
one device's fit that the scaled built-ins use (`pair_bounds`, `stated_transfer`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moesim.hw_profiles.catalog import DeviceSpec, catalog
from moesim.hw_profiles.fitting.engine_builtins import PUBLIC_TABLE
from moesim.hw_profiles.fitting.engine_fit import EngineFit
from moesim.hw_profiles.fitting.engine_validation import Judged, all_recipes
from moesim.hw_profiles.fitting.engine_validation import leave_one_device_out as pairwise_out
from moesim.hw_profiles.fitting.pooled.engine_pool import DeviceRows, device_rows, fit_pool

# Generations per vendor (an index: one apart = neighbours). NVIDIA: Pascal 2016, Volta 2017, Turing
# 2018, Ampere 2020, Ada and Hopper 2022, Blackwell 2025; AMD: GCN 5 (Vega 20) 2018, CDNA 2020,
# RDNA 3 2022; Apple: the M generation in the device's name.
GENERATION = {"pascal": 0, "volta": 1, "turing": 2, "ampere": 3, "ada": 4, "hopper": 4, "blackwell": 5, "gcn": 0, "cdna": 1, "rdna3": 2}


def vendor(spec: DeviceSpec) -> str:
    """The vendor of a catalog device (its key's first word)."""
    return spec.key.split("-", 1)[0]


def generation(spec: DeviceSpec) -> int:
    """The device's generation index within its vendor."""
    apple = re.match(r"apple-m(\d+)", spec.key)
    return int(apple[1]) if apple else GENERATION.get(spec.architecture, -10)


def like(a: DeviceSpec, b: DeviceSpec) -> bool:
    """Same vendor, same generation or one apart."""
    return vendor(a) == vendor(b) and abs(generation(a) - generation(b)) <= 1


# How far a datasheet scaling reaches, nearest first: like devices; one vendor's generations further
# apart; another vendor's devices (other caches, schedulers, and the engine's code paths per vendor).
KINDS = ("like", "unlike", "other vendor")
_KIND_WORDS = {
    "like": "like devices (same vendor, same generation or one apart)",
    "unlike": "devices of one vendor further apart",
    "other vendor": "devices of different vendors",
}


def pair_kind(a: DeviceSpec, b: DeviceSpec) -> str:
    """The kind of a pair of devices (`KINDS`)."""
    return "like" if like(a, b) else "unlike" if vendor(a) == vendor(b) else "other vendor"


def engine_parts(engine: str, table: Path = PUBLIC_TABLE, eras: str = "build") -> list[DeviceRows]:
    """Every device (built-in and judging-only recipes) of one engine, with its rows."""
    return [device_rows(item, table, eras) for item in all_recipes() if item.engine == engine]


def leave_one_model_out(parts: list[DeviceRows], target: DeviceRows) -> Judged | None:
    """Each model of the target's rows predicted by the pooled fit without that model on that device."""
    models = list(dict.fromkeys(r.model for r in target.rows))
    if len(models) < 2:
        return None
    predicted = np.full(len(target.rows), np.nan)
    for model in models:
        held = np.array([r.model == model for r in target.rows])
        train = [(p, [r for r in p.rows if p is not target or r.model != model]) for p in parts]
        pool = fit_pool(train)
        predicted[held] = pool.predict(target, [r for r, h in zip(target.rows, held, strict=True) if h])
    return Judged(target.recipe.name, "leave one model out", "pooled, other models", list(target.rows), predicted)


def leave_one_device_out(sources: list[DeviceRows], target: DeviceRows, label: str) -> Judged | None:
    """The target's rows predicted by the pooled fit over the sources, at its datasheet (factor 1)."""
    sources = [p for p in sources if p is not target]
    if not sources:
        return None
    pool = fit_pool([(p, list(p.rows)) for p in sources])
    return Judged(target.recipe.name, "leave one device out", label, list(target.rows), pool.predict(target, target.rows))


@dataclass(frozen=True)
class PairBound:
    """The transfer uncertainty of an engine between like or unlike devices: the largest p90 error
    over the held-out pairs (a device's rows predicted by another's fit scaled by datasheet)."""

    engine: str
    kind: str
    bound: float
    pairs: int

    def note(self) -> str:
        """Where the number comes from, in words."""
        return (
            f"relative transfer uncertainty {self.bound:.2f}: the largest p90 error of {self.pairs} held-out pairs of "
            f"{_KIND_WORDS[self.kind]} of {self.engine} in the shared public table (one device's rows predicted by another's "
            "fit scaled by datasheet)"
        )


def pair_bounds(fits: dict[str, EngineFit]) -> dict[tuple[str, str], PairBound]:
    """Per engine and kind of pair (`KINDS`), the bound of today's datasheet scaling (pairwise)."""
    recipes = [item for item in all_recipes() if item.name in fits]
    specs = catalog()
    errors: dict[tuple[str, str], list[float]] = {}
    for target in recipes:
        for source in recipes:
            if source.name == target.name or source.engine != target.engine:
                continue
            stats = pairwise_out(target, source, fits[source.name]).stats()
            if stats is not None:
                kind = pair_kind(specs[target.device], specs[source.device])
                errors.setdefault((target.engine, kind), []).append(stats.p90)
    return {key: PairBound(key[0], key[1], max(values), len(values)) for key, values in errors.items()}


def stated_transfer(bounds: dict[tuple[str, str], PairBound], engine: str, kind: str) -> PairBound | None:
    """The bound a profile scaled within an engine states: the largest of its engine's bound for its
    kind of pair (where the engine has no held-out pair of that kind, the largest of that kind over
    the engines: a vendor's gap is the devices', whichever engine ran on them) and its engine's
    bounds for nearer kinds (a pair further apart is no better known); where none is, the engine's
    for the nearest farther kind. None for an engine without held-out pairs."""
    if not any(e == engine for e, _ in bounds):
        return None
    at = KINDS.index(kind)
    same = [bounds[(engine, kind)]] if (engine, kind) in bounds else [b for (_, k), b in bounds.items() if k == kind]
    nearer = [bounds[(engine, k)] for k in KINDS[:at] if (engine, k) in bounds]
    if same or nearer:
        return max([*same, *nearer], key=lambda bound: bound.bound)
    return next((bounds[(engine, k)] for k in KINDS[at + 1 :] if (engine, k) in bounds), None)
