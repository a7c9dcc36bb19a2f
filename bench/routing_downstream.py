"""How far each routing assumption moves the answers (docs/tracing.md): real routing against the
fitted synthetic generators and uniform routing, through `crossover`, `best-draft` and `batch`.

    python bench/routing_downstream.py [--copies 4]

Traces: the built-in real trace `esft-vanilla-lite`; the shipped working-set and mixture fits
(both tasks) and uniform routing, each synthesised on `--copies` repetitions of the real trace's
sequence lengths (fixed seed); on the calibrated H200 profile (engines per_slot and best) and on
engine profiles with their dispatch (`SETUPS`). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from moesim.sim.analysis.batch import batch_analysis
from moesim.sim.analysis.crossover import crossover_analysis
from moesim.sim.analysis.scenario import Scenario, load_scenario
from moesim.sim.analysis.speculation import best_draft_analysis
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.routing.judge import synthetic_like
from moesim.tracegen.routing.params import load_params
from moesim.tracegen.routing.synth import Uniform

TRACE = "esft-vanilla-lite"
ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)
BATCHES = [1, 2, 4, 8, 16, 32, 64]
U_SIZES = (2, 4, 8, 16, 32, 64)


def _traces(scenario: Scenario, copies: int) -> dict[str, Trace]:
    real = scenario.trace
    g = real.meta.geometry
    traces = {"real": real}
    for family in ("working-set", "mixture"):
        traces[f"{family} fit"] = synthetic_like(real, load_params(f"{TRACE}-{family}", g), copies, seed=1)
    traces["uniform"] = synthetic_like(real, Uniform(), copies, seed=1)
    return traces


SETUPS = (  # (profile, weight format, engines): the lab calibration, then engine profiles (extrapolated for this model: flagged)
    ("nvidia-h200", None, ("per_slot", "best")),
    ("nvidia-h200-vllm", "BF16", ("dispatch",)),
    ("nvidia-rtx-3090-llamacpp", "Q4_K", ("dispatch",)),
)


def _crossover(base: Scenario, traces: dict[str, Trace], label: str) -> None:
    print(f"### crossover (per_slot vs the dedup family), {label}\n")
    print("| routing | " + " | ".join(f"u({n})" for n in U_SIZES) + " | dedup family | crossover n (error-box range) |")
    print("|---" * (len(U_SIZES) + 3) + "|")
    for name, trace in traces.items():
        result = crossover_analysis(dataclasses.replace(base, trace=trace), None, 64)
        table = result.table()
        cells = " | ".join(f"{float(table.filter(table['n'] == n)['byte_share'][0]):.3f}" for n in U_SIZES)
        print(f"| {name} | {cells} | {result.dedup_family} | {result.crossover_n} ({result.crossover_range}) |")


def _best_draft(scenario: Scenario, traces: dict[str, Trace], label: str) -> None:
    print(f"\n### best-draft, {label}, drafter ngram: k* (speedup) per α\n")
    print("| routing | " + " | ".join(f"α = {a}" for a in ALPHAS) + " | break-even α for k = 1..4 |")
    print("|---" * (len(ALPHAS) + 2) + "|")
    for name, trace in traces.items():
        result = best_draft_analysis(dataclasses.replace(scenario, trace=trace), list(ALPHAS), 8)
        cells = " | ".join(f"{k} ({s:.3f})" for k, s in zip(result.best_draft.tolist(), result.speedup.tolist(), strict=True))
        print(f"| {name} | {cells} | {', '.join(f'{b:.3f}' for b in result.break_even[1:5])} |")


def _batch(scenario: Scenario, traces: dict[str, Trace], label: str, explain: bool) -> None:
    print(f"\n### batch, α = 0.8, k = 3, {label}: distinct experts of the B·(k+1)-token pass (speedup)\n")
    print("| routing | " + " | ".join(f"B = {b}" for b in BATCHES) + " |\n" + "|---" * (len(BATCHES) + 1) + "|")
    for name, trace in traces.items():
        result = batch_analysis(dataclasses.replace(scenario, trace=trace), 0.8, 3, BATCHES)
        cells = " | ".join(f"{u:.1f} ({s:.3f})" for u, s in zip(result.distinct_experts, result.speedup, strict=True))
        print(f"| {name} | {cells} |")
    if explain:
        result = batch_analysis(scenario, 0.8, 3, BATCHES)
        print(f"\nReal trace, {label}: T(B, 1) and T(B, 4) in µs, their ratio, and the speedup τ(3, 0.8)·T(B, 1)/T(B, 4):\n")
        print("| B | T(B,1) µs | T(B,4) µs | T(B,4)/T(B,1) | speedup | extrapolation |\n|---|---|---|---|---|---|")
        for row in result.table().iter_rows(named=True):
            ratio = row["verify_us"] / row["single_us"]
            print(
                f"| {row['batch']} | {row['single_us']:.0f} | {row['verify_us']:.0f} | {ratio:.2f} | {row['speedup']:.3f} | "
                f"{row['extrapolation']:.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=4)
    args = parser.parse_args()
    traces: dict[str, Trace] = {}
    for profile, weight_format, engines in SETUPS:
        base = load_scenario(TRACE, profile, engines[0], weight_format=weight_format)
        traces = traces or _traces(base, args.copies)
        label = f"profile {profile} ({base.model.weight_format})"
        if "per_slot" in base.model.profile.expert_families:  # vLLM's fused MoE has no per-slot kernel: no crossover
            _crossover(load_scenario(TRACE, profile, "per_slot", weight_format=weight_format), traces, label)
        for engine in engines:
            scenario = load_scenario(TRACE, profile, engine, weight_format=weight_format)
            _best_draft(scenario, traces, f"{label}, engine {engine}")
            _batch(scenario, traces, f"{label}, engine {engine}", engine == "best")
        print()
    print(f"<!-- tokens per pass τ(3, 0.8) = {(1 - 0.8**4) / 0.2:.3f}; numpy {np.__version__} -->")


if __name__ == "__main__":
    main()
