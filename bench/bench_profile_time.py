"""Profile time model: vectorised `ExpertFamily.time_us` against a plain-Python per-pass loop.

The step-time model evaluates every pass of a trace; this prints passes/s of both paths on the
calibrated H200 `dedup` family (the most complex structure) and their ratio.

    .venv/bin/python bench/bench_profile_time.py
"""

from __future__ import annotations

import math
import time

import numpy as np

from moesim.hw_profiles import ExpertFamily, load_profile
from moesim.kernels.features import RoutingFeatures
from moesim.models import ExpertShape


def reference_time_us(family: ExpertFamily, n: float, s: float, u: float, c: float, shape: ExpertShape) -> float:
    """One pass with the documented formula, in plain Python."""
    t = family.structure.tokens_per_read
    b = shape.expert_bytes
    chunks = math.ceil(s / u / t - 1e-9)
    reads, tokens = u * chunks, min(c, t)
    hit = min(1.0, family.cache_bytes / (u * b))
    variant = next(i for i, w in enumerate(family.structure.variants) if w >= min(c, t))
    time_us = family.fixed_us + b * (u + (reads - u) * (1 - hit)) / (family.hbm_bandwidth_gbps * 1e3)
    time_us += b * (reads - u) * hit / (family.cache_bandwidth_gbps * 1e3)
    time_us += s * 6 * shape.hidden * shape.intermediate / (family.compute_tflops[variant] * 1e6)
    time_us += family.serial_ns[variant] * 1e-3 * tokens * chunks * (shape.hidden + shape.intermediate)
    return time_us


def main() -> None:
    family = load_profile("nvidia-h200").expert_family("dedup")
    shape = ExpertShape(2048, 1408)
    rng = np.random.default_rng(0)
    passes = 1_000_000
    n = rng.integers(1, 17, passes).astype(float)
    s = n * 6
    u = np.ceil(rng.uniform(s / n, np.minimum(s, 64)))
    c = np.minimum(n, np.ceil(s / u) + rng.integers(0, 3, passes))
    features = RoutingFeatures(n, s, u, c)
    start = time.perf_counter()
    fast = family.time_us(features, shape)
    fast_s = time.perf_counter() - start
    sample = 20_000
    start = time.perf_counter()
    slow = [reference_time_us(family, n[i], s[i], u[i], c[i], shape) for i in range(sample)]
    slow_s = (time.perf_counter() - start) * passes / sample
    np.testing.assert_allclose(fast[:sample], slow, rtol=1e-9)
    print(
        f"vectorised time_us: {passes / fast_s:,.0f} passes/s; plain-Python loop: {passes / slow_s:,.0f} passes/s; "
        f"ratio {slow_s / fast_s:.0f}x (agree to 1e-9)"
    )


if __name__ == "__main__":
    main()
