"""Engine profiles that transfer (issue 25): the per-device fits against the pooled engine fit,
in the splits of docs/validation.md (it prints the tables of its section "Engine profiles that
transfer").

    .venv/bin/python bench/validate_engine_transfer.py        # ≈ 2 min on a loaded 2-core machine

Leave one model out on every device with two or more models; leave one device out within each
engine between like devices (same vendor, same generation or one apart): the fit of one
device scaled by datasheet, and the pooled fit of the engine over the like devices (and over all
other devices); unlike pairs with their error and the transfer uncertainty a profile scaled
between them states (`pool_validation.pair_bounds`). Errors: absolute relative errors of the
time per pass and of T(n)/T(n0) within a series, median / p90 in %. The shipped profiles route
llama-bench's tokens over every expert (`BENCH_ROUTED_SHARE`, empty); each split is also judged with
a routed share chosen nested (`Nested`): by `choose_share`'s criterion without the rows it judges.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesim.hw_profiles.fitting.bench_fit import fit_bench_output, predicted_rows
from moesim.hw_profiles.fitting.engine_builtins import BENCH_ROUTED_SHARE, PUBLIC_TABLE, Recipe, fit_recipe, recipe_rows
from moesim.hw_profiles.fitting.engine_validation import Judged, all_recipes, ratio_errors, series_of
from moesim.hw_profiles.fitting.engine_validation import leave_one_device_out as scaled_out
from moesim.hw_profiles.fitting.engine_validation import leave_one_model_out as own_lomo
from moesim.hw_profiles.fitting.pooled.data_limits import with_fixed_times
from moesim.hw_profiles.fitting.pooled.pool_validation import (
    engine_parts,
    leave_one_device_out,
    leave_one_model_out,
    like,
    pair_bounds,
    pair_kind,
    stated_transfer,
)
from moesim.hw_profiles.fitting.pooled.routing_share import ROUTED_SHARES, fit_errors, least_error, median_error, share_fit
from moesim.hw_profiles.fitting.whole_pass import PassRow
from moesim.hw_profiles.importers import ImportOptions, import_table
from moesim.hw_profiles.profile import HardwareProfile

SERIES = {
    "RTX 3090 CUDA, DeepSeek-V2-Lite pp512, 2025-08 build (32-48)": tuple(range(32, 49, 2)),
    "RTX 3090 CUDA, Granite F16 pp512, MMF build (51-65)": tuple(range(51, 66, 2)),
    "P40 CUDA, DeepSeek-V2-Lite pp512, 2025-08 build (17-29)": tuple(range(17, 30, 2)),
    "RTX 3090 CUDA, Gemma-4 pp2048, 2026-04 build (106-120)": tuple(range(106, 121, 2)),
    "RX 7900 XTX Vulkan, batched decode B = 1..64 (331-340)": tuple(range(331, 341)),
    "W7800 Vulkan, Qwen3.5 pp1024..32768 (429-459)": tuple(range(429, 460, 2)),
}
ERAS = "dispatch"  # the pooled fit's fixed times per dispatch era of the engine's source


def _pct(values: np.ndarray) -> str:
    values = np.abs(values[np.isfinite(values)])
    return "–" if values.size == 0 else f"{100 * np.median(values):.1f} / {100 * np.quantile(values, 0.9):.1f}"


def _cells(judged: Judged | None) -> str:
    if judged is None:
        return "– | – | –"
    errors = judged.errors()
    return f"{int(np.isfinite(errors).sum())}/{len(errors)} | {_pct(errors)} | {_pct(ratio_errors(judged))}"


def _medians(found: list[Judged]) -> str:
    errors = np.concatenate([j.errors() for j in found]) if found else np.array([])
    ratios = np.concatenate([ratio_errors(j) for j in found]) if found else np.array([])
    return f"time per pass {_pct(errors)}, T(n)/T(n0) {_pct(ratios)}"


class Nested:
    """The routed share chosen as `choose_share` does, on an engine's rows without the ones a split
    judges, then those rows predicted at it (the held-out figure of a chosen share)."""

    def __init__(self, items: list[Recipe]) -> None:
        self.items = items
        self.rows = {item.name: recipe_rows(item) for item in items}
        self.fits = {(item.name, share): share_fit(item, share, self.rows[item.name]) for item in items for share in ROUTED_SHARES}
        self.errors = {key: fit_errors(fit) for key, fit in self.fits.items()}

    def criterion(self, skip: str = "", kept: dict[str, list[PassRow]] | None = None) -> dict[float, float]:
        """`choose_share`'s held-out error per share over the engine's recipes but `skip`, those of `kept` fitted on the rows given."""
        kept = kept or {}
        errors = {}
        for share in ROUTED_SHARES:
            found = [
                fit_errors(share_fit(item, share, kept[item.name])) if item.name in kept else self.errors[item.name, share]
                for item in self.items
                if item.name != skip
            ]
            errors[share] = median_error(found)
        return errors

    def leave_one_model_out(self, item: Recipe) -> tuple[Judged, dict[str, float]]:
        """The device's rows, each model's predicted by the fit without it at the share chosen without it."""
        rows = self.rows[item.name]
        predicted, chosen = np.full(len(rows), np.nan), {}
        for model in dict.fromkeys(r.model for r in rows):
            chosen[model] = least_error(self.criterion(kept={item.name: [r for r in rows if r.model != model]}))
            held = np.array([r.model == model for r in rows])
            predicted[held] = self.fits[item.name, chosen[model]].heldout_us[held]
        routed = [r.routed_over(chosen[r.model]) for r in rows]
        return Judged(item.name, "leave one model out", "same device, other models", routed, predicted), chosen

    def leave_one_device_out(self, target: Recipe, source: Recipe) -> tuple[Judged, float]:
        """The target predicted by the source scaled, at the share chosen without the target's rows."""
        share = least_error(self.criterion(skip=target.name))
        rows = [r.routed_over(share) for r in self.rows[target.name]]
        return scaled_out(target, source, self.fits[source.name, share], rows), share

    def without_rows(self, numbers: set[int]) -> float:
        """The share chosen on the engine's rows but those of the public table's numbers."""
        kept = {name: [r for r in rows if r.source_row not in numbers] for name, rows in self.rows.items()}
        return least_error(self.criterion(kept={name: rows for name, rows in kept.items() if len(rows) < len(self.rows[name])}))


def main() -> None:
    started = time.perf_counter()
    recipes = all_recipes()
    fits = {item.name: fit_recipe(item) for item in recipes}
    engines = list(dict.fromkeys(item.engine for item in recipes))
    parts = {engine: engine_parts(engine, eras=ERAS) for engine in engines}
    by_name = {p.recipe.name: p for ps in parts.values() for p in ps}

    print("#### The routed share of llama-bench's tokens per engine (`routing_share.choose_share`'s criterion)\n")
    print("| engine | held-out error per share: median % | chosen on all rows | shipped |")
    print("|---|---|---|---|")
    nested = {}
    for engine in engines:
        items = [item for item in recipes if item.engine == engine]
        if not any(r.takes_share for item in items for r in fits[item.name].rows):
            continue
        nested[engine] = Nested(items)
        errors = nested[engine].criterion()
        chosen = least_error(errors)
        cells = ", ".join(f"{share:g}: {100 * error:.1f}" for share, error in errors.items())
        print(f"| {engine} | {cells} | {chosen:g} | {BENCH_ROUTED_SHARE.get(engine, 1.0):g} |")

    print("\n#### Leave one model out: the per-device fit against the pooled engine fit\n")
    print(
        "| device | per device: rows | per device: time per pass % | per device: T(n)/T(n0) % | pooled: rows | pooled: time per pass % "
        "| pooled: T(n)/T(n0) % |"
    )
    print("|---|---|---|---|---|---|---|")
    today_all, pooled_all, nested_all, chosen_lomo = [], [], [], []
    for item in recipes:
        today = own_lomo(fits[item.name], item.name)
        if today is None:
            continue
        pooled = leave_one_model_out(parts[item.engine], by_name[item.name])
        today_all.append(today)
        if pooled is not None:
            pooled_all.append(pooled)
        print(f"| {item.name} | {_cells(today)} | {_cells(pooled)} |")
        if item.engine in nested:
            judged, chosen = nested[item.engine].leave_one_model_out(item)
            chosen_lomo.append(f"{item.name} {_cells(judged)} ({', '.join(f'{m} {c:g}' for m, c in chosen.items())})")
            nested_all.append(judged)
        else:
            nested_all.append(today)
    print(f"\nAll devices: per device {_medians(today_all)}; pooled {_medians(pooled_all)}.")
    print("\nNested (the share chosen without the held-out model's rows; rows | time | T, the share per held-out model):")
    for line in chosen_lomo:
        print(f"- {line}")
    print(f"\nAll devices, per device, nested share: {_medians(nested_all)} (shipped: {_medians(today_all)}).")

    print("\n#### Leave one device out between like devices\n")
    print("| target | from | rows | time per pass: median / p90 % | T(n)/T(n0): median / p90 % |")
    print("|---|---|---|---|---|")
    today_like, pooled_like, nested_like = [], [], []
    for engine in engines:
        for target in parts[engine]:
            alike = [p for p in parts[engine] if p is not target and like(p.spec, target.spec)]
            if not alike:
                continue
            for source in alike:
                judged = scaled_out(target.recipe, source.recipe, fits[source.recipe.name])
                today_like.append(judged)
                print(f"| {target.recipe.name} | per device: {source.recipe.name} scaled | {_cells(judged)} |")
                if engine in nested:
                    honest, share = nested[engine].leave_one_device_out(target.recipe, source.recipe)
                    nested_like.append(honest)
                    print(f"| {target.recipe.name} | per device: {source.recipe.name} scaled, nested share {share:g} | {_cells(honest)} |")
                else:
                    nested_like.append(judged)
            pooled = leave_one_device_out(alike, target, "like")
            if pooled is not None:
                pooled_like.append(pooled)
                print(f"| {target.recipe.name} | pooled: {', '.join(p.recipe.name for p in alike)} | {_cells(pooled)} |")
            others = [p for p in parts[engine] if p is not target]
            if len(others) > len(alike):
                every = leave_one_device_out(others, target, "all")
                print(f"| {target.recipe.name} | pooled: all {len(others)} other devices | {_cells(every)} |")
    print(f"\nLike pairs: per device {_medians(today_like)}; pooled {_medians(pooled_like)}.")
    print(f"Like pairs, per device, nested share: {_medians(nested_like)}.")
    engine_of = {item.name: item.engine for item in recipes}
    print(
        "Like pairs, per device, by engine: "
        + "; ".join(
            f"{engine} {_medians([j for j in today_like if engine_of[j.target] == engine])}"
            for engine in engines
            if any(engine_of[j.target] == engine for j in today_like)
        )
        + "."
    )
    ran = {name: ({r.model for r in fit.rows}, {r.era for r in fit.rows}) for name, fit in fits.items()}
    seen = np.array([(r.model in ran[j.source][0], r.era in ran[j.source][1]) for j in today_like for r in j.rows])
    print(f"Like pairs' target rows of a model the source ran: {seen[:, 0].sum()} of {len(seen)}; of a build it ran: {seen[:, 1].sum()}.")
    oracle = [
        scaled_out(t, s, dataclasses.replace(fits[s.name], profile=with_fixed_times(fits[s.name].profile, fits[t.name].profile)))
        for t, s in ((by_name[j.target].recipe, by_name[j.source].recipe) for j in today_like)
    ]
    print(f"Like pairs with the target's own fitted fixed times (an oracle on the judged rows, not held-out): {_medians(oracle)}.")
    print("\nThe worst like pair per engine (largest median T(n)/T(n0) error), per series: n, T(n)/T(n0) measured, predicted:")
    for engine in engines:
        found = [j for j in today_like if engine_of[j.target] == engine and ratio_errors(j).size]
        if found:
            worst = max(found, key=lambda j: np.median(np.abs(ratio_errors(j))))
            for (model, build, _), indices in series_of(worst.rows).items():
                measured, predicted = np.array([worst.rows[i].time_us for i in indices]), worst.predicted_us[indices]
                cells = ", ".join(
                    f"{worst.rows[i].n_tokens}: {m / measured[0]:.2f}, {p / predicted[0]:.2f}"
                    for i, m, p in zip(indices, measured, predicted, strict=True)
                )
                print(f"- {worst.source} -> {worst.target}, {model} ({build}): {cells}")

    bounds = pair_bounds(fits)
    print("\n#### Unlike pairs: error and the stated transfer uncertainty\n")
    print(
        "(stated: the bound of the engine's other held-out pairs of the same kind, `stated_transfer`, the target's own rows "
        "left out of it too)\n"
    )
    print(
        "| target | source | kind | rows | time per pass: median / p90 % | T(n)/T(n0): median / p90 % | stated uncertainty % "
        "| covers median / p90 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for engine in engines:
        for target in parts[engine]:
            held = pair_bounds({name: fit for name, fit in fits.items() if name != target.recipe.name})
            for source in parts[engine]:
                if source is target or like(source.spec, target.spec):
                    continue
                judged = scaled_out(target.recipe, source.recipe, fits[source.recipe.name])
                stats = judged.stats()
                kind = pair_kind(source.spec, target.spec)
                stated = stated_transfer(held, engine, kind)
                covered = (
                    "–"
                    if stats is None or stated is None
                    else " / ".join("yes" if value <= stated.bound else "no" for value in (stats.median, stats.p90))
                )
                stated_text = "–" if stated is None else f"{100 * stated.bound:.0f}"
                print(f"| {target.recipe.name} | {source.recipe.name} | {kind} | {_cells(judged)} | {stated_text} | {covered} |")
    print("\n#### Stated transfer uncertainty per engine (what a datasheet-scaled profile states)\n")
    print("| engine | between | held-out pairs | uncertainty % |")
    print("|---|---|---|---|")
    for (engine, kind), bound in sorted(bounds.items()):
        print(f"| {engine} | {kind} devices | {bound.pairs} | {100 * bound.bound:.0f} |")
    halves: list[tuple[float, float, float]] = []
    print("\n#### A user's run: half the sizes of a shared series fitted, the other half predicted\n")
    print(
        "(`profile fit` as shipped chooses the routed share on the fitted half's own held-out error; beside it every expert, "
        "and the engine's share chosen nested, without the predicted half's rows)\n"
    )
    print(
        "| series (rows) | fitted sizes | predicted sizes | per-slot limit (source's) | chosen share: share, median / max |error| % "
        "| every expert: median / max % | engine's nested share: share, median / max % |"
    )
    print("|---|---|---|---|---|---|---|")

    def held_errors(fitted: HardwareProfile, held: pl.DataFrame) -> np.ndarray:
        return np.abs(predicted_rows(held, fitted)["error_%"].drop_nulls().to_numpy())

    for label, series in SERIES.items():
        for first in (0, 1):
            options = ImportOptions(rows=series[first::2])
            result = fit_bench_output(PUBLIC_TABLE, "mine", options)
            _, held = import_table(PUBLIC_TABLE, "public-bench", ImportOptions(rows=series[1 - first :: 2]))
            errors = held_errors(result.fit.profile, held)
            every = held_errors(fit_bench_output(PUBLIC_TABLE, "mine", options, share=1.0).fit.profile, held)
            fitted = ",".join(str(r.n_tokens) for r in result.fit.rows)
            sizes = ",".join(str(n) for n in held["n_tokens"].to_list())
            limits = f"{result.learned_limit} ({result.source_limit})"
            engine = result.fit.profile.device.engine
            share = nested[engine].without_rows(set(series[1 - first :: 2])) if engine in nested else 1.0
            honest = held_errors(fit_bench_output(PUBLIC_TABLE, "mine", options, share=share).fit.profile, held)
            halves.append((np.median(errors), np.median(every), np.median(honest)))
            print(
                f"| {label} | {fitted} | {sizes} | {limits} | {result.share.share:g}, {np.median(errors):.1f} / {np.max(errors):.1f} "
                f"| {np.median(every):.1f} / {np.max(every):.1f} | {share:g}, {np.median(honest):.1f} / {np.max(honest):.1f} |"
            )
    within = [sum(1 for h in halves if h[i] <= 5.0) for i in range(3)]
    medians = [np.median([h[i] for h in halves]) for i in range(3)]
    print(
        f"\nHalves within 5 %: chosen share {within[0]} of {len(halves)}, every expert {within[1]}, engine's nested share "
        f"{within[2]}; median over the halves {medians[0]:.1f} / {medians[1]:.1f} / {medians[2]:.1f} %."
    )
    print(f"\n(all of the above in {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
