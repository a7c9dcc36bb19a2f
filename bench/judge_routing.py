"""Synthetic routing judged against the built-in real trace `esft-vanilla-lite` (docs/tracing.md).

    python bench/judge_routing.py [--out DIR] [--copies 16] [--families working-set,mixture]

Fits each generator family per MoE layer on one task (intent, law), on each half of a task
(even / odd sequences) and on both tasks (the shipped parameters), then judges each fit on a
synthetic trace of the judged sequences' exact lengths (`--copies` times, fixed seed) against the
real judged sequences: mean distinct experts U(n), n = 1..64, per layer and per layer group, and
reuse at lag 1. The two real tasks judged against each other (and a task's halves against each
other) are the floors no generator can beat. Prints markdown tables; fitted parameter files are
kept in DIR (reused when present, so the tables can be reprinted without refitting). About
70-95 s per fit per family on one core and 15 s per judged case.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from moesim.tracegen.formats.select import select
from moesim.tracegen.formats.trace import read_trace
from moesim.tracegen.routing.fit import fit_generator
from moesim.tracegen.routing.judge import UNION_BATCHES, UNION_WINDOWS, RoutingStats, Verdict, judge, routing_stats, synthetic_like
from moesim.tracegen.routing.params import load_params, resolve_params, write_fit
from moesim.tracegen.routing.synth import Uniform, make_generator

TRACE = "esft-vanilla-lite"
FITS = ("intent", "law", "intent:even", "intent:odd", "law:even", "law:odd", "all")
CASES = (
    ("all", "all", "in-sample (shipped)"),
    ("intent", "intent", "in-sample"),
    ("law", "law", "in-sample"),
    ("intent:even", "intent:odd", "within task, held out"),
    ("intent:odd", "intent:even", "within task, held out"),
    ("law:even", "law:odd", "within task, held out"),
    ("law:odd", "law:even", "within task, held out"),
    ("intent", "law", "cross-task"),
    ("law", "intent", "cross-task"),
    ("all", "intent", "shipped on one task"),
    ("all", "law", "shipped on one task"),
)
FLOORS = (("intent", "law"), ("law", "intent"), ("intent:even", "intent:odd"), ("law:even", "law:odd"))
GROUPS = ("1, 2-3, 4-26", "thirds", "all layers")


def _row(generator: str, fitted: str, judged: str, kind: str, v: Verdict) -> str:
    groups = " | ".join(f"{100 * v.grouped_u[g]:.1f}" for g in GROUPS)
    return (
        f"| {generator} | {fitted} | {judged} | {kind} | {100 * v.worst_layer_u:.1f} | {v.layers_within_u}/{v.layers} | {groups} | "
        f"{v.worst_layer_reuse_1:.3f} | {v.layers_within_reuse_1}/{v.layers} | {v.pooled_reuse_1:+.3f} |"
    )


def _fitted(trace_name: str, family: str, selection: str, out: Path) -> object:
    path = out / f"{family}-{selection.replace(':', '-')}.params.toml"
    trace = read_trace(trace_name)
    if not path.exists():
        start = time.perf_counter()
        result = fit_generator(select(trace, selection), family)
        write_fit(path, result, trace_name, trace.meta.geometry, selection)
        print(f"<!-- fitted {family} on {selection} in {time.perf_counter() - start:.0f} s -->", flush=True)
    return load_params(path, trace.meta.geometry)


def _pooled(stats: RoutingStats, name: str) -> str:
    sizes = (1, 2, 4, 8, 16, 32, 64)
    cells = [
        f"{np.nanmean(stats.distinct_mean[:, n - 1]):.2f} ({np.nanmean(stats.distinct_p10[:, n - 1]):.1f}/"
        f"{np.nanmean(stats.distinct_p90[:, n - 1]):.1f})"
        for n in sizes
    ]
    return f"| {name} | " + " | ".join(cells) + " |"


def _details(named: dict[str, RoutingStats]) -> None:
    print("\nMean distinct experts U(n) per layer, mean over layers (p10/p90 over windows, mean over layers):\n")
    print("| trace | n = 1 | 2 | 4 | 8 | 16 | 32 | 64 |\n|---|---|---|---|---|---|---|---|")
    for name, stats in named.items():
        print(_pooled(stats, name))
    print("\nReuse at lags 1..8 (mean over layers), and the busiest expert's share of a layer's slots × E (range over layers):\n")
    print("| trace | " + " | ".join(f"d = {d}" for d in range(1, 9)) + " | busiest × uniform |\n|---" * 1 + "|---" * 9 + "|")
    for name, stats in named.items():
        share = stats.busiest_share * 64
        lags = " | ".join(f"{v:.3f}" for v in np.nanmean(stats.reuse, axis=0))
        print(f"| {name} | {lags} | {share.min():.1f}-{share.max():.1f} |")
    for i, n in enumerate(UNION_WINDOWS):
        print(f"\nDistinct experts of the union of B sequences' windows of n = {n} (staggered random lanes, mean over layers):\n")
        print("| trace | " + " | ".join(f"B = {b}" for b in UNION_BATCHES) + " |\n|---" + "|---" * len(UNION_BATCHES) + "|")
        for name, stats in named.items():
            print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in stats.union[i].mean(axis=1)) + " |")


def _per_layer(rows: dict[str, tuple[RoutingStats, RoutingStats]]) -> None:
    print("\nPer layer, worst |U_pred/U_judged − 1| over n = 1..64 (%), and reuse@1 gap:\n")
    names = list(rows)
    print("| layer | " + " | ".join(f"{n} U % | reuse@1" for n in names) + " |\n|---" + "|---|---" * len(names) + "|")
    first = next(iter(rows.values()))[1]
    for layer in range(first.distinct_mean.shape[0]):
        cells = []
        for predicted, judged in rows.values():
            with np.errstate(invalid="ignore", divide="ignore"):
                rel = np.nan_to_num(np.abs(predicted.distinct_mean[layer] / judged.distinct_mean[layer] - 1))
            cells.append(f"{100 * rel.max():.1f} | {predicted.reuse[layer, 0] - judged.reuse[layer, 0]:+.3f}")
        print(f"| {layer + 1} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the fitted parameter files (default: a temporary one)")
    parser.add_argument("--copies", type=int, default=16, help="synthetic copies of the judged layout")
    parser.add_argument("--families", default="working-set,mixture")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="judge-routing-"))
    out.mkdir(parents=True, exist_ok=True)
    trace = read_trace(TRACE)
    real = {s: routing_stats(select(trace, s)) for s in {*FITS, *(j for _, j, _ in CASES)}}
    groups = " | ".join(f"{g} U %" for g in GROUPS)
    print(f"| generator | fitted on | judged on | kind | worst layer U % | layers within 3 % | {groups} | ", end="")
    print("worst layer reuse@1 gap | layers within 0.02 | pooled reuse@1 gap |")
    print("|---|---|---|---|---|---|" + "---|" * len(GROUPS) + "---|---|---|")
    for fitted, judged in FLOORS:
        print(_row("real (floor)", fitted, judged, "real vs real", judge(real[fitted], real[judged])), flush=True)
    synthetic: dict[tuple[str, str, str], RoutingStats] = {}
    for family in args.families.split(","):
        for fitted, judged, kind in CASES:
            generator = _fitted(TRACE, family, fitted, out)
            stats = routing_stats(synthetic_like(select(trace, judged), generator, args.copies, seed=1))  # type: ignore[arg-type]
            synthetic[(family, fitted, judged)] = stats
            print(_row(family, fitted, judged, kind, judge(stats, real[judged])), flush=True)
        shipped = load_params(resolve_params(f"{TRACE}-{family}"), trace.meta.geometry)
        same = shipped == _fitted(TRACE, family, "all", out)
        print(f"<!-- {family}: the fit on all sequences equals the shipped parameter file: {same} -->")
        default = make_generator(family)
        stats = routing_stats(synthetic_like(trace, default, args.copies, seed=1))
        synthetic[(family, "defaults", "all")] = stats
        print(_row(f"{family} defaults", "(scalars)", "all", "in-sample", judge(stats, real["all"])), flush=True)
    uniform = routing_stats(synthetic_like(trace, Uniform(), args.copies, seed=1))
    print(_row("uniform", "-", "all", "-", judge(uniform, real["all"])))
    named = {"real (both tasks)": real["all"]}
    named |= {f"{f} (both-task fit)": s for (f, fitted, judged), s in synthetic.items() if (fitted, judged) == ("all", "all")}
    named |= {f"{f} defaults": s for (f, fitted, _), s in synthetic.items() if fitted == "defaults"}
    named["uniform"] = uniform
    _details(named)
    family = args.families.split(",")[0]
    _per_layer(
        {
            "real intent→law": (real["intent"], real["law"]),
            f"{family} intent→law": (synthetic[(family, "intent", "law")], real["law"]),
            f"{family} law→intent": (synthetic[(family, "law", "intent")], real["intent"]),
            f"{family} law-even→odd": (synthetic[(family, "law:even", "law:odd")], real["law:odd"]),
        }
    )


if __name__ == "__main__":
    main()
