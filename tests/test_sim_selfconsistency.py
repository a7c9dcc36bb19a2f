"""Self-consistency: on a per-pass cost table, the simulated speedup of static speculation agrees
with the closed form S(k, α) = τ(k, α)·T(1) / (T_draft(k) + T(k + 1)) within the simulation's
99 % confidence interval.

The interval: decode iterations are independent, each commits X_i = min(k, A_i) + 1 tokens in the
same time C = T_draft(k) + T(k + 1) (batch 1), so the simulated speedup is mean(X)·T(1)/C and its
99 % interval is ± z_0.995 · sd(X)/√n · T(1)/C (normal approximation, n > 10^4 iterations).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from moesim.sim.analysis.speculation import relative_cost, speedup, tokens_per_pass
from moesim.sim.serving.config import config_from_dict
from moesim.sim.serving.run import simulate

Z99 = 2.5758293035489004
TARGET_US = [900.0 + 150.0 * n + 4.0 * n * n for n in range(1, 40)]
DRAFT_STEP_US = 30.0


def _config(alpha: float, k: int, max_batch: int, output: int, duration_s: float = 0.0, seed: int = 1):  # type: ignore[no-untyped-def]
    data = {
        "run": {"seed": seed, "requests": max_batch if not duration_s else 0, "duration_s": duration_s},
        "workload": {"prompt_tokens": 0, "output_tokens": output},
        "arrivals": {"kind": "closed", "concurrency": max_batch},
        "batching": {"max_batch": max_batch},
        "cost": {"kind": "table", "target_us": TARGET_US, "draft_step_us": DRAFT_STEP_US},
        "acceptance": {"model": "geometric", "alpha": alpha},
        "policy": {"name": "static", "k": k},
    }
    return config_from_dict(data, "test", Path("."))


@pytest.mark.parametrize(("alpha", "k"), [(0.3, 1), (0.5, 2), (0.7, 3), (0.8, 5), (0.92, 7)])
def test_batch1_speedup_matches_closed_form(alpha: float, k: int) -> None:
    result = simulate(_config(alpha, k, 1, output=200_001))
    x = result.record.step_accepted + 1
    cost = relative_cost(DRAFT_STEP_US * np.arange(k + 1), np.array(TARGET_US[: k + 1]))
    closed = float(speedup(k, alpha, cost))
    half_width = Z99 * x.std(ddof=1) / math.sqrt(x.size) / cost[k]
    simulated = result.summary["speedup"]
    assert abs(simulated - closed) <= half_width, (simulated, closed, half_width)
    assert half_width < 0.01 * closed  # the test has teeth: the interval is under 1 %


@pytest.mark.parametrize(("alpha", "k"), [(0.6, 2), (0.85, 4)])
def test_full_batch_speedup_matches_closed_form(alpha: float, k: int) -> None:
    """Batch B kept full: S_B = τ(k, α)·T(B) / (T_draft(k) + T(B(k + 1))), same interval."""
    batch = 4
    result = simulate(_config(alpha, k, batch, output=10**8, duration_s=30.0, seed=4))
    x = result.record.step_accepted + 1
    iteration_us = DRAFT_STEP_US * k + TARGET_US[batch * (k + 1) - 1]
    closed = float(tokens_per_pass(k, alpha)) * TARGET_US[batch - 1] / iteration_us
    # tokens per iteration = sum of B independent X_i
    per_iteration = x.reshape(-1, batch).sum(axis=1)
    half_width = Z99 * per_iteration.std(ddof=1) / math.sqrt(per_iteration.size) * TARGET_US[batch - 1] / iteration_us / batch
    # a duration-bound run cuts one iteration at the end of each run: at most B tokens of ~10^5
    assert abs(result.summary["speedup"] - closed) <= half_width + 2 * batch / x.size * closed
