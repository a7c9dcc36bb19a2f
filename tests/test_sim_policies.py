"""Policies: the oracle against the closed-form best draft (Cascade: tests/test_sim_cascade.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_server

from moesim.fields import FieldError
from moesim.sim.analysis.speculation import best_draft, relative_cost
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.policies import Oracle, Static
from moesim.sim.serving.workload import Arrivals, Workload


def run(policy, cost: TablePassCost, alpha: float, output: int = 3000, requests: int = 1, max_batch: int = 1):  # type: ignore[no-untyped-def]
    server = make_server(
        cost=cost,
        policy=policy,
        acceptance=Geometric(alpha=alpha),
        workload=Workload(prompt_tokens=0, output_tokens=output),
        arrivals=Arrivals(concurrency=max_batch),
        max_batch=max_batch,
        requests=requests,
        seed=3,
    )
    return server.run()


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


def test_policy_validation() -> None:
    with pytest.raises(FieldError, match="'k'"):
        Static(k=-1)
    with pytest.raises(FieldError, match="k_max"):
        Oracle(k_max=0)
