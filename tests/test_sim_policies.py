"""Policies: the oracle against the closed-form best draft, Cascade against its documented schedule."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.fields import FieldError
from moesim.sim.analysis.speculation import best_draft, relative_cost
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.cascade import Cascade
from moesim.sim.serving.policies import Oracle, Static
from moesim.sim.serving.server import Server
from moesim.sim.serving.workload import Arrivals, Workload


def run(policy, cost: TablePassCost, alpha: float, output: int = 3000, requests: int = 1, max_batch: int = 1):  # type: ignore[no-untyped-def]
    engine = Server(
        cost=cost,
        policy=policy,
        acceptance=Geometric(alpha=alpha),
        workload=Workload(prompt_tokens=0, output_tokens=output),
        arrivals=Arrivals(concurrency=max_batch),
        max_batch=max_batch,
        requests=requests,
        duration_us=0.0,
        seed=3,
    )
    return engine.run()


def table(times: list[float], draft_step_us: float = 0.0) -> TablePassCost:
    return TablePassCost(np.array(times, float), draft_step_us=draft_step_us)


@pytest.mark.parametrize("alpha", [0.2, 0.55, 0.8, 0.95])
def test_oracle_at_batch1_is_the_closed_form_best_draft(alpha: float) -> None:
    cost = table([900.0 + 140.0 * n + 6.0 * n * n for n in range(1, 12)], draft_step_us=40.0)
    c = relative_cost(40.0 * np.arange(9), cost.target_us[:9])
    k_star = int(best_draft(alpha, c)[0])
    record = run(Oracle(k_max=8), cost, alpha)
    remaining = 3000 - 1 - np.concatenate([[0], np.cumsum(record.step_accepted + 1)])[:-1]
    assert np.array_equal(record.step_draft_len, np.minimum(k_star, remaining - 1))


def test_oracle_sweep_never_lowers_expected_batch_throughput() -> None:
    """Each iteration's sweep starts from the previous choices and improves Σ τ_i(k_i) / T(k)
    coordinate-wise, so between consecutive iterations of the same batch (no request near its
    end) the expected rate never falls; the sweep also beats every uniform static k."""
    cost = table([1000.0 + 50.0 * n for n in range(1, 80)], draft_step_us=10.0)
    record = run(Oracle(k_max=6), cost, 0.7, output=400, requests=8, max_batch=4)
    tau = np.array([sum(0.7**i for i in range(k + 1)) for k in range(7)])

    def rate(ks: np.ndarray) -> float:
        return tau[ks].sum() / (cost.draft_step_us * ks.max() + cost.pass_us(int((ks + 1).sum())))

    offsets = np.concatenate([[0], np.cumsum(record.batch)])
    done = np.zeros(8, int)
    previous = None
    checked = 0
    for i in range(len(record.batch)):
        rids = record.step_request[offsets[i] : offsets[i + 1]]
        ks = record.step_draft_len[offsets[i] : offsets[i + 1]]
        far_from_end = bool(np.all(399 - done[rids] > 7))
        if previous is not None and far_from_end and np.array_equal(previous[0], rids):
            assert rate(ks) >= rate(previous[1]) * (1 - 1e-9)
            assert rate(ks) >= max(rate(np.full(4, k)) for k in range(7)) * (1 - 1e-9)
            checked += 1
        previous = (rids, ks) if far_from_end and len(rids) == 4 else None
        np.add.at(done, rids, record.step_accepted[offsets[i] : offsets[i + 1]] + 1)
    assert checked > 100


def cascade_pattern(cycles: list[tuple[list[int], int, int]]) -> list[int]:
    """Draft lengths over iterations: for each test phase the tried k (4 iterations each), then the set k for n iterations."""
    out: list[int] = []
    for tried, k_set, n_set in cycles:
        for k in tried:
            out += [k] * 4
        out += [k_set] * n_set
    return out


def test_cascade_turns_speculation_off_and_doubles_the_set_phase() -> None:
    """α = 0: one token per iteration; U(1) = T(1)/T(2) < 1, U(2) lower → k = 0 for 32, then 64, 128 iterations."""
    cost = table([1000.0 + 100.0 * n for n in range(1, 12)])
    record = run(Cascade(), cost, 0.0, output=400)
    expected = cascade_pattern([([1, 2], 0, 32), ([1, 2], 0, 64), ([1, 2], 0, 128), ([1, 2], 0, 256)])
    assert record.step_draft_len.tolist()[: len(expected)] == expected[: len(record.step_draft_len)]


def test_cascade_climbs_to_k_max_when_everything_is_accepted() -> None:
    """α = 1 and nearly flat pass times: utility (k+1)·T(1)/T(k+1) grows with k; four trials per test phase."""
    cost = table([1000.0 + 10.0 * n for n in range(1, 12)])
    record = run(Cascade(), cost, 1.0, output=1500)
    expected = cascade_pattern([([1, 2, 3, 4], 4, 16), ([4, 5, 6, 7], 7, 16), ([7, 8], 8, 16), ([8, 7], 8, 16), ([8, 7], 8, 16)])
    assert record.step_draft_len.tolist()[: len(expected)] == expected


def test_cascade_flat_utilities_stop_the_climb() -> None:
    """U(2)/U(1) = 1.05 (within 10 %): the climb stops and the higher utility (k = 2) is set; from
    k = 2 the step up is worse by more than 10 %, the step down is not better: k = 2 stays."""
    cost = table([1000.0, 1500.0, 1500.0 * 1.5 / 1.05, 4000.0, 5000.0, 6000.0, 7000.0, 8000.0, 9000.0])
    record = run(Cascade(), cost, 1.0, output=800)
    expected = cascade_pattern([([1, 2], 2, 16), ([2, 3, 1], 2, 16), ([2, 3, 1], 2, 16)])
    assert record.step_draft_len.tolist()[: len(expected)] == expected


def test_cascade_hill_climbs_down_from_k_init() -> None:
    """Starting at k = 3: the step up is worse, so it steps down (2, then 1) while each step beats the best by > 10 %."""
    cost = table([1000.0, 1200.0, 2400.0, 3600.0, 5500.0, 7000.0, 8000.0, 9000.0, 10000.0])
    record = run(Cascade(k_init=3), cost, 1.0, output=800)
    expected = cascade_pattern([([3, 4, 2, 1], 1, 16), ([1, 2], 1, 16), ([1, 2], 1, 16)])
    assert record.step_draft_len.tolist()[: len(expected)] == expected


def test_cascade_constants_are_configurable() -> None:
    cost = table([1000.0 + 10.0 * n for n in range(1, 12)])
    policy = Cascade(k_max=3, trial_iterations=2, max_trials=2, set_iterations=5)
    record = run(policy, cost, 1.0, output=200)
    ks = record.step_draft_len.tolist()
    assert ks[:19] == [1, 1, 2, 2] + [2] * 5 + [2, 2, 3, 3] + [3] * 5 + [3]


def test_policy_validation() -> None:
    with pytest.raises(FieldError, match="k_init"):
        Cascade(k_max=2, k_init=3)
    with pytest.raises(FieldError, match="'k'"):
        Static(k=-1)
    with pytest.raises(FieldError, match="k_max"):
        Oracle(k_max=0)
