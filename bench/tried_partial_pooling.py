"""Partial pooling, tried and not shipped (issue 25, fourth pass; docs/validation.md): each held-out
model's rows predicted by a blend of the device's own fit and the pooled engine fit,
exp((1 − w)·ln own + w·ln pooled), judged by leave one model out on every device with two or more
models.

    .venv/bin/python bench/tried_partial_pooling.py     # ≈ 40 s

It prints the blend at each fixed weight w (optimistic: a w picked from these figures is picked on
the rows it is judged on), then w chosen nested: for each held-out (device, model), the w of the
least median error over every other (device, model) of the table, each of those predicted by fits
without it and without the judged one. Errors: time per pass, and T(n)/T(n0) within a series.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesim.hw_profiles.engines import ENGINES
from moesim.hw_profiles.fitting.engine_builtins import profile_frame, recipe_rows
from moesim.hw_profiles.fitting.engine_fit import fit_coefficients, predict_rows
from moesim.hw_profiles.fitting.engine_validation import Judged, all_recipes, ratio_errors
from moesim.hw_profiles.fitting.pooled.engine_pool import fit_pool
from moesim.hw_profiles.fitting.pooled.pool_validation import engine_parts

WEIGHTS = (0.0, 0.25, 0.5, 0.75)
Group = tuple[str, str]  # (recipe name, model)


class Devices:
    """Every device with two or more models, its rows, and its engine's pooled parts."""

    def __init__(self) -> None:
        self.parts = {e: engine_parts(e, eras="dispatch") for e in {item.engine for item in all_recipes()}}
        self.items = {}
        for item in all_recipes():
            rows = recipe_rows(item)
            if len({r.model for r in rows}) >= 2:
                self.items[item.name] = (item, rows, next(p for p in self.parts[item.engine] if p.recipe.name == item.name))
        self.groups: list[Group] = [(name, m) for name, (_, rows, _) in self.items.items() for m in dict.fromkeys(r.model for r in rows)]
        self.cache: dict[tuple[Group, frozenset[Group]], tuple[list, np.ndarray, np.ndarray]] = {}

    def predictions(self, group: Group, without: frozenset[Group] = frozenset()) -> tuple[list, np.ndarray, np.ndarray]:
        """The group's rows, predicted by its device's fit and by the pooled fit, neither fitted on it or on `without`."""
        key = (group, without)
        if key not in self.cache:
            item, rows, part = self.items[group[0]]
            out = without | {group}
            held = np.array([r.model == group[1] for r in rows])
            train = [r for r in rows if (item.name, r.model) not in out]
            test = [r for r, h in zip(rows, held, strict=True) if h]
            engine, frame = ENGINES.create(item.engine), profile_frame(item)
            fitted = fit_coefficients(train, engine, frame.roofline) if train else None  # a device of two models, both left out
            own = predict_rows(test, train, engine, fitted, frame) if fitted is not None else np.full(len(test), np.nan)
            pool = fit_pool([(p, [r for r in p.rows if (p.recipe.name, r.model) not in out]) for p in self.parts[item.engine]])
            pooled = pool.predict(part, [r for r, h in zip(part.rows, held, strict=True) if h])
            self.cache[key] = (test, own, pooled)
        return self.cache[key]


def blend(own: np.ndarray, pooled: np.ndarray, weight: float) -> np.ndarray:
    """exp((1 − w)·ln own + w·ln pooled); the own fit alone where the pool has no prediction."""
    pooled = np.where(np.isfinite(pooled), pooled, own)
    return np.exp((1.0 - weight) * np.log(own) + weight * np.log(pooled))


def judged(rows: list, predicted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Errors of the time per pass and of T(n)/T(n0)."""
    j = Judged("", "leave one model out", "blend", rows, predicted)
    return j.errors(), ratio_errors(j)


def median(values: list[np.ndarray]) -> float:
    """Median |value| over the finite values, in %."""
    joined = np.abs(np.concatenate(values)) if values else np.array([])
    joined = joined[np.isfinite(joined)]
    return 100 * float(np.median(joined)) if joined.size else float("nan")


def main() -> None:
    devices = Devices()
    print("| w | time per pass % | T(n)/T(n0) % |\n|---|---|---|")
    for weight in WEIGHTS:
        found = [judged(rows, blend(own, pooled, weight)) for rows, own, pooled in map(devices.predictions, devices.groups)]
        print(f"| {weight:g} (fixed) | {median([f[0] for f in found]):.1f} | {median([f[1] for f in found]):.1f} |")
    found, chosen = [], []
    for group in devices.groups:
        others = [g for g in devices.groups if g != group]

        def criterion(weight: float, others: list[Group] = others, group: Group = group) -> float:
            held = (devices.predictions(g, frozenset({group})) for g in others)
            return median([np.concatenate(judged(rows, blend(own, pooled, weight))) for rows, own, pooled in held])

        errors = {weight: criterion(weight) for weight in WEIGHTS}
        weight = min(WEIGHTS, key=lambda w: (errors[w], w))
        rows, own, pooled = devices.predictions(group)
        found.append(judged(rows, blend(own, pooled, weight)))
        chosen.append(f"{group[0]} {group[1]}: w = {weight:g}")
    print(f"| nested | {median([f[0] for f in found]):.1f} | {median([f[1] for f in found]):.1f} |")
    print("\nNested choices: " + "; ".join(chosen))


if __name__ == "__main__":
    main()
