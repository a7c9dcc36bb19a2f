"""How far the shared rows let the engine profiles be judged (issue 25, `fitting/pooled/data_limits`):
the floors the table sets by itself (llama-bench's spread over repetitions, two builds timing the
same test, two builds' shapes T(n)/T(n0)), leave one pass size out on every device, and how many
rows leave one model out keeps their build and format in the fit. Absolute relative errors,
median / p90 in %.

    PYTHONPATH=. python bench/engine_transfer_floor.py
"""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesim.hw_profiles.fitting.engine_builtins import PUBLIC_TABLE, recipe_rows
from moesim.hw_profiles.fitting.engine_validation import Judged, all_recipes, ratio_errors
from moesim.hw_profiles.fitting.pooled.data_limits import (
    build_shape_spread,
    build_spread,
    interior,
    leave_one_size_out,
    model_out_seen,
    repeat_spread,
    represented,
)
from moesim.hw_profiles.heldout import ErrorStats


def _line(name: str, errors: np.ndarray) -> str:
    errors = errors[np.isfinite(errors)]
    if errors.size == 0:
        return f"| {name} | 0 | – |"
    stats = ErrorStats.from_errors(errors)
    return f"| {name} | {stats.rows} | {100 * stats.median:.1f} / {100 * stats.p90:.1f} |"


def _cells(judged: Judged) -> str:
    errors = np.abs(judged.errors())
    errors = errors[np.isfinite(errors)]
    return f"{100 * np.median(errors):.1f} %" if errors.size else "–"


def main() -> None:
    started = time.perf_counter()
    with PUBLIC_TABLE.open(newline="") as handle:
        records = list(csv.DictReader(handle))
    print("#### Floors of the shared table (no fit)\n")
    print("| what | pairs or rows | median / p90 % |")
    print("|---|---|---|")
    print(_line("llama-bench's spread over its repetitions (± s / value)", repeat_spread(records)))
    print(_line("another build, same test, model, format, microbatch, device", build_spread(records)))
    print(_line("another build's T(n)/T(n0), same series", build_shape_spread(records)))

    print("\n#### What leave one model out keeps in the fit\n")
    print("| device | rows | rows whose build and format another model of the device ran |")
    print("|---|---|---|")
    kept_all = total_all = 0
    for item in all_recipes():
        rows = recipe_rows(item)
        if len({r.model for r in rows}) < 2:
            continue
        kept, total = represented((r.model, r.era, r.shape.weight_format) for r in rows)
        kept_all, total_all = kept_all + kept, total_all + total
        print(f"| {item.name} | {total} | {kept} |")
    print(f"| all | {total_all} | {kept_all} |")

    print("\n#### Leave one model out by what the fit saw of each held-out row\n")
    print("(oracle: a row of a build no other model ran, priced at that build's own fixed times, fitted on all rows: not held-out)\n")
    print("| held-out rows | rows | as shipped: median / p90 % | oracle: median / p90 % |")
    print("|---|---|---|---|")
    splits = [found for item in all_recipes() if (found := model_out_seen(item)) is not None]
    plain = np.concatenate([s.judged.errors() for s in splits])
    oracle = np.concatenate([s.oracle.errors() for s in splits])
    build = np.concatenate([s.build_seen for s in splits])
    weight = np.concatenate([s.format_seen for s in splits])
    for name, keep in (
        ("build seen, format seen", build & weight),
        ("build seen, format unseen", build & ~weight),
        ("build unseen, format seen", ~build & weight),
        ("build unseen, format unseen", ~build & ~weight),
        ("all", np.ones_like(build)),
    ):
        cells = [_line("", e[keep]).split(" | ", 2)[2].rstrip(" |") for e in (plain, oracle)]
        print(f"| {name} | {int((keep & np.isfinite(plain)).sum())} | {' | '.join(cells)} |")
    shapes = [np.concatenate([ratio_errors(getattr(s, kind)) for s in splits]) for kind in ("judged", "oracle")]
    print(_line("T(n)/T(n0), as shipped", shapes[0]))
    print(_line("T(n)/T(n0), oracle", shapes[1]))
    print("\nPer device (as shipped · oracle): " + "; ".join(f"{s.judged.target} {_cells(s.judged)} · {_cells(s.oracle)}" for s in splits))

    print("\n#### Leave one pass size out on every device with three or more sizes\n")
    print("| device | rows | time per pass: median / p90 % | interior sizes: median / p90 % | T(n)/T(n0): median / p90 % |")
    print("|---|---|---|---|---|")
    every, inside, shapes = [], [], []
    for item in all_recipes():
        judged = leave_one_size_out(item)
        if judged is None:
            continue
        errors, ratios = judged.errors(), ratio_errors(judged)
        within = errors[interior(judged)]
        every.append(errors)
        inside.append(within)
        shapes.append(ratios)
        cells = [_line("", e).split(" | ", 2)[2].rstrip(" |") for e in (errors, within, ratios)]
        print(f"| {item.name} | {int(np.isfinite(errors).sum())}/{len(errors)} | {' | '.join(cells)} |")
    print(_line("all devices: time per pass", np.concatenate(every)))
    print(_line("all devices: interior sizes", np.concatenate(inside)))
    print(_line("all devices: T(n)/T(n0)", np.concatenate(shapes)))
    print(f"\n(all of the above in {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
