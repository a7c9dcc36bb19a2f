"""Profile time model: the vectorised fitted model (`ExpertFamily.model_time_us`) against a
plain-Python per-pass loop, and the lookup ladder (`time_us`) beside them.

The step-time model evaluates every pass of a trace; this prints passes/s of the paths on the
calibrated H200 `dedup` family (the most complex structure) and their ratios.

    .venv/bin/python bench/bench_profile_time.py
"""

from __future__ import annotations

import math
import time

import numpy as np

from moesim.hw_profiles import ExpertFamily, load_profile
from moesim.hw_profiles.families import ExpertInputs
from moesim.kernels.features import RoutingFeatures
from moesim.models import ExpertShape


def _per(rate: float, unit: float) -> float:
    return 0.0 if math.isinf(rate) else 1.0 / (rate * unit)


def reference_time_us(family: ExpertFamily, n: float, s: float, u: float, c: float, shape: ExpertShape) -> float:
    """One pass with the documented formula (re-reads at their own rate, per-variant terms), in plain Python."""
    t = family.structure.tokens_per_read
    b, h, i = shape.expert_bytes, shape.hidden, shape.intermediate
    chunks = math.ceil(s / u / t - 1e-9)
    reads, tokens = u * chunks, min(c, t)
    variant = next(k for k, w in enumerate(family.structure.variants) if w >= min(c, t))
    time_us = family.fixed_us + b * u * _per(family.hbm_bandwidth_gbps, 1e3) + b * (reads - u) * _per(family.reread_bandwidth_gbps, 1e3)
    time_us += b * u * _per(family.variant_bandwidth_gbps[variant], 1e3) + family.row_ns[variant] * 1e-3 * s * (2 * i + h)
    time_us += s * 6 * h * i * _per(family.compute_tflops[variant], 1e6)
    time_us += family.serial_ns[variant] * 1e-3 * tokens * (h + i)
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
    inputs = ExpertInputs.of(features, shape)
    start = time.perf_counter()
    fast = family.model_time_us(inputs)
    fast_s = time.perf_counter() - start
    start = time.perf_counter()
    ladder = family.time_us(features, shape)
    ladder_s = time.perf_counter() - start
    sample = 20_000
    start = time.perf_counter()
    slow = [reference_time_us(family, n[i], s[i], u[i], c[i], shape) for i in range(sample)]
    slow_s = (time.perf_counter() - start) * passes / sample
    np.testing.assert_allclose(fast[:sample], slow, rtol=1e-9)
    print(
        f"vectorised fitted model: {passes / fast_s:,.0f} passes/s; plain-Python loop: {passes / slow_s:,.0f} passes/s; "
        f"ratio {slow_s / fast_s:.0f}x (agree to 1e-9); the lookup ladder (time_us, knots per shape and n): "
        f"{passes / ladder_s:,.0f} passes/s ({ladder_s / fast_s:.1f}x the fitted model's time, "
        f"{np.mean(ladder != fast):.0%} of passes moved by knots)"
    )


if __name__ == "__main__":
    main()
