"""The FLOP rate an engine reaches, as a floor (`pooled.engine_pool.engine_floors`), judged on the
shared rows: each built-in whose family has one, its fit scaled by datasheet to every other device
of its engine (the unlike and like pairs of bench/validate_engine_transfer.py), once as shipped
before the floor and once with the floor transferred from the pooled fit over the engine's devices
other than both (neither the source's nor the judged device's rows in it). Absolute relative
errors, median / p90 in %. The published table's P40 series is in bench/validate_published_bench.py.

    PYTHONPATH=. python bench/engine_flop_floor.py
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesim.hw_profiles import load_profile
from moesim.hw_profiles.fitting.engine_builtins import RECIPES, fit_recipe
from moesim.hw_profiles.fitting.engine_validation import all_recipes, leave_one_device_out, ratio_errors
from moesim.hw_profiles.fitting.pooled.engine_pool import device_rows, engine_floors
from moesim.hw_profiles.fitting.pooled.pool_validation import engine_parts


def _pct(values: np.ndarray) -> str:
    values = np.abs(values[np.isfinite(values)])
    return "–" if values.size == 0 else f"{100 * np.median(values):.1f} / {100 * np.quantile(values, 0.9):.1f}"


def main() -> None:
    started = time.perf_counter()
    print(
        "| source (floored family) | judged device | source's floor, TFLOP/s at its datasheet | rows "
        "| time per pass: without / with | T(n)/T(n0): without / with |"
    )
    print("|---|---|---|---|---|---|")
    for source in RECIPES:
        floored = [name for name, family in load_profile(source.name).expert_families.items() if family.floor_tflops < math.inf]
        if not floored:
            continue
        fit = fit_recipe(source)
        parts = engine_parts(source.engine, eras="dispatch")
        for target in (t for t in all_recipes() if t.engine == source.engine and t.device != source.device):
            others = [part for part in parts if part.recipe.device != target.device]
            profile = engine_floors(others, device_rows(source, eras="dispatch"), fit.profile)
            judged = [leave_one_device_out(target, source, f) for f in (fit, dataclasses.replace(fit, profile=profile))]
            rates = ", ".join(f"{profile.expert_family(name).floor_tflops:.3g}" for name in floored)
            errors = " → ".join(_pct(j.errors()) for j in judged)
            ratios = " → ".join(_pct(ratio_errors(j)) for j in judged)
            rows = f"{int(np.isfinite(judged[0].errors()).sum())}/{len(judged[0].rows)}"
            print(f"| {source.name} ({', '.join(floored)}) | {target.name} | {rates} | {rows} | {errors} | {ratios} |")
    print(f"\n(all of the above in {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
