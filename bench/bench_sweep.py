"""Benchmark: best draft length and speedup over >= 10^6 (α, k) points from precomputed pass costs.

The pass costs T(n), n = 1..33, come from the step-time model (DeepSeek-V2-Lite on the calibrated
H200 profile, a sticky synthetic trace); the sweep evaluates S(k, α) = τ(k, α)·T(1)/(T_draft(k) + T(k+1))
for every (α, k) and the best k per α, vectorised, against a plain-Python loop of the same
formulas on a subsample. Prints the rate of each, their ratio, and last `points_per_s: X`.

    .venv/bin/python bench/bench_sweep.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from moesim.models import load_preset
from moesim.sim.analysis.predict import predict
from moesim.sim.analysis.scenario import load_scenario
from moesim.sim.analysis.speculation import TIE_RTOL, best_draft, relative_cost, speedup_table
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Sticky, synthesize

MAX_DRAFT = 32
ALPHAS = 31_250  # x 33 draft lengths = 1,031,250 points
SUBSAMPLE = 500


def pass_costs() -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.arrow"
        write_trace(path, synthesize(load_preset("deepseek-v2-lite"), Sticky(keep_prob=0.3), 1024, 4, 0))
        scenario = load_scenario(path, "nvidia-h200", "best", drafter="qwen3-0.6b")
        target = predict(scenario, MAX_DRAFT + 1).cost.total_us()
    step = 40.0  # µs per draft step (a fixed drafter keeps the benchmark about the sweep)
    return relative_cost(step * np.arange(MAX_DRAFT + 1), target)


def plain_python(alphas: list[float], cost: list[float]) -> list[tuple[int, float]]:
    out = []
    for a in alphas:
        speeds = []
        for k, c in enumerate(cost):
            tau = sum(a**i for i in range(k + 1))
            speeds.append(tau / c)
        top = max(speeds)
        best = max(k for k, s in enumerate(speeds) if s >= top * (1 - TIE_RTOL))
        out.append((best, speeds[best]))
    return out


def main() -> None:
    cost = pass_costs()
    alphas = np.linspace(0.0, 1.0, ALPHAS)
    points = alphas.size * cost.size
    start = time.perf_counter()
    k_star, s_star = best_draft(alphas, cost)
    vector_s = time.perf_counter() - start
    table = speedup_table(alphas, cost)
    sub = alphas[:: alphas.size // SUBSAMPLE][:SUBSAMPLE]
    start = time.perf_counter()
    reference = plain_python(sub.tolist(), cost.tolist())
    plain_s = time.perf_counter() - start
    index = np.searchsorted(alphas, sub)
    assert [k for k, _ in reference] == k_star[index].tolist(), "vectorised and plain best draft differ"
    np.testing.assert_allclose([s for _, s in reference], s_star[index], rtol=1e-9)
    assert table.shape == (alphas.size, cost.size)
    vector_rate = points / vector_s
    plain_rate = sub.size * cost.size / plain_s
    print(f"points: {points:,} ({alphas.size:,} alphas x {cost.size} draft lengths)")
    print(f"vectorised: {vector_s * 1e3:.1f} ms, {vector_rate:,.0f} points/s")
    print(f"plain python on {sub.size * cost.size:,} points: {plain_s * 1e3:.1f} ms, {plain_rate:,.0f} points/s")
    print(f"ratio vectorised / plain: {vector_rate / plain_rate:.0f}x")
    print(f"points_per_s: {vector_rate:.0f}")


if __name__ == "__main__":
    main()
