"""Benchmark: a whole `moesim sweep` of >= 10^6 analytic (α, k) points, end to end (routing
features, pass costs, the vectorised (α, k) grid, the Parquet file), against a plain-Python loop
of S(k, α) = τ(k, α)·T(1)/(T_draft(k) + T(k+1)) over the pass costs the sweep wrote, on a subsample.

Grid: DeepSeek-V2-Lite and Qwen3-30B-A3B × the H200 and H100 profiles × engines per_slot and best ×
drafter qwen3-0.6b × sticky routing × B = 1, 4, 16, 64 × 1001 α × k = 0..32 (n up to 64):
1,057,056 points in 8 units. Runs in this process (workers = 1), then with the local executor's
processes (workers = 2). Prints each run's time and rate, the reference's rate and the ratio, and
the vectorised closed forms' rate on the same pass costs, the plain-Python rate and their
ratio, and last `sweep_seconds: X` (the in-process run, the goal being under 60 s).

    .venv/bin/python bench/bench_sweep_grid.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from moesim.sim.analysis.speculation import TIE_RTOL, best_draft, speedup_table
from moesim.sim.sweep.config import load_config
from moesim.sim.sweep.run import run_sweep

CONFIG = """
[grid]
models = ["deepseek-v2-lite", "qwen3-30b-a3b"]
profiles = ["nvidia-h200", "nvidia-rtx-4090-llamacpp"]
engines = ["per_slot", "best"]
drafters = ["qwen3-0.6b"]
alpha = { start = 0.0, stop = 1.0, num = 1001 }
max_draft = 32
max_pass = 64
batch = [1, 4, 16, 64]
context = [512]

[[routing]]
name = "sticky-0.3"
generator = "sticky"
params = { keep_prob = 0.3 }
"""
SUBSAMPLE_ALPHAS = 50


def plain_python(alphas: list[float], draft_us: list[float], verify_us: list[float]) -> list[tuple[int, list[float]]]:
    """Per α: every S(k, α) and the best k (ties to the larger), term by term."""
    out = []
    for a in alphas:
        speeds = [sum(a**i for i in range(k + 1)) * verify_us[0] / (draft_us[k] + verify_us[k]) for k in range(len(verify_us))]
        top = max(speeds)
        out.append((max(k for k, s in enumerate(speeds) if s >= top * (1 - TIE_RTOL)), speeds))
    return out


def check_against_reference(rows: pl.DataFrame) -> tuple[float, float]:
    """Recompute a subsample of every unit's points in plain Python, and all of them with the
    vectorised closed forms; returns (plain-Python, vectorised) points per second."""
    points = rows.filter(pl.col("record") == "point")
    alphas = np.unique(points["alpha"].to_numpy())
    sub = alphas[:: max(1, alphas.size // SUBSAMPLE_ALPHAS)]
    elapsed, count, vector_s, vector_count = 0.0, 0, 0.0, 0
    for _, group in points.group_by(["model", "profile", "engine", "drafter", "batch"], maintain_order=True):
        first = group.filter(pl.col("alpha") == alphas[0]).sort("draft_len")
        cost = first["relative_cost"].to_numpy()
        start = time.perf_counter()
        speedup_table(alphas, cost)
        best_draft(alphas, cost)
        vector_s += time.perf_counter() - start
        vector_count += alphas.size * cost.size
        start = time.perf_counter()
        reference = plain_python(sub.tolist(), first["draft_us"].to_list(), first["verify_us"].to_list())
        elapsed += time.perf_counter() - start
        count += sub.size * first.height
        swept = group.filter(pl.col("alpha").is_in(sub)).sort("alpha", "draft_len")
        speeds = swept["speedup"].to_numpy().reshape(sub.size, first.height)
        best = swept.filter(pl.col("best_draft"))["draft_len"].to_list()
        np.testing.assert_allclose(speeds, [s for _, s in reference], rtol=1e-9)
        assert best == [k for k, _ in reference], "sweep and plain-Python best draft lengths differ"
    return count / elapsed, vector_count / vector_s


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.toml"
        path.write_text(CONFIG)
        config = load_config(path)
        runs = {}
        for workers in (1, 2):
            start = time.perf_counter()
            summary = run_sweep(config, Path(tmp) / f"w{workers}.parquet", workers=workers, fresh=True)
            runs[workers] = (time.perf_counter() - start, summary)
        rows = pl.read_parquet(runs[1][1].out)
        assert runs[1][1].out.read_bytes() == runs[2][1].out.read_bytes(), "in-process and process-pool outputs differ"
        size_mb = runs[1][1].out.stat().st_size / 1e6
    reference_rate, vector_rate = check_against_reference(rows)
    points = runs[1][1].points
    print(f"points: {points:,} in {runs[1][1].units} units; {rows.height:,} rows, {size_mb:.1f} MB Parquet")
    for workers, (seconds, _) in runs.items():
        print(f"sweep, workers={workers}: {seconds:.1f} s end to end, {points / seconds:,.0f} points/s")
    print(f"analytic grid alone, vectorised (S(k, α) table and k*(α) from the pass costs): {vector_rate:,.0f} points/s")
    print(f"analytic grid alone, plain python (same formulas, subsample, checked equal): {reference_rate:,.0f} points/s")
    print(f"ratio vectorised / plain python: {vector_rate / reference_rate:.0f}x")
    print(f"sweep_seconds: {runs[1][0]:.1f}")


if __name__ == "__main__":
    main()
