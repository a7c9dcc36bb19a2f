"""Cascade's controller against a plain-Python state machine of the paper's rules, on scripted
utilities; and in the server: the measured base time, the drafter kept running at k = 0."""

from __future__ import annotations

import math
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import make_server

from moesim.fields import FieldError
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.cascade import Cascade
from moesim.sim.serving.workload import Arrivals, Workload

BASE_US = 1000.0


class _Done(Exception):
    pass


def reference_schedule(utility, iterations: int, cfg: Cascade) -> list[int]:  # type: ignore[no-untyped-def]
    """The draft length of each iteration, by the rules of docs/simulator.md, when an iteration at
    k > 0 takes BASE_US / utility(k, t) and one at k = 0 takes BASE_US, one token each."""
    ks: list[int] = []
    base: deque[float] = deque(maxlen=cfg.baseline_iterations)
    history: dict[int, float] = {}
    since_base = [0]

    def run(k: int, n: int) -> float:
        tokens, rel = 0, 0.0
        for _ in range(n):
            t = len(ks)
            if t >= iterations:
                raise _Done
            time = BASE_US if k == 0 else BASE_US / utility(k, t)
            ks.append(k)
            if k == 0:
                base.append(time)
                since_base[0] = 0
            else:
                since_base[0] += 1
            tokens += 1
            rel += time / (sum(base) / len(base))
        return tokens / rel

    def decide(trials: list[tuple[int, float]]) -> int:
        if trials[-1][0] == 1 and trials[-1][1] < 1:
            return 0
        best = max(trials, key=lambda kv: (kv[1], -kv[0]))
        return best[0] if best[1] >= 1 else 0

    def peak(trials: list[tuple[int, float]]) -> bool:
        u = dict(trials)
        return any(k - 1 in u and k + 1 in u and u[k] > u[k - 1] and u[k] > u[k + 1] for k in u)

    zero_len = cfg.set_iterations
    try:
        run(0, cfg.baseline_iterations)
        while True:
            trials: list[tuple[int, float]] = []
            k = max(history.items(), key=lambda kv: (kv[1], -kv[0]))[0] if history else cfg.k_init
            while True:
                u = run(k, cfg.trial_iterations)
                trials.append((k, u))
                history[k] = u
                if (k == 1 and u < 1) or len(trials) == cfg.max_trials:
                    break
                if len(trials) == 1:
                    direction = 1 if u >= 1 else -1
                else:
                    k_prev, u_prev = trials[-2]
                    if abs(u - u_prev) <= cfg.tolerance * u_prev or peak(trials):
                        break
                    direction = 1 if (u - u_prev) * (k - k_prev) > 0 else -1
                tried = [kk for kk, _ in trials]
                nxt = k + direction
                if nxt in tried:
                    nxt = max(tried) + 1 if direction > 0 else min(tried) - 1
                if not 1 <= nxt <= cfg.k_max:
                    break
                k = nxt
            chosen = decide(trials)
            if chosen == 0:
                zero_len = min(2 * zero_len, cfg.max_set_iterations)
                run(0, zero_len)
            else:
                zero_len = cfg.set_iterations
                run(chosen, cfg.set_iterations)
            if since_base[0] >= cfg.baseline_refresh_iterations:
                run(0, cfg.baseline_iterations)
    except _Done:
        return ks


def controller_schedule(utility, iterations: int, cfg: Cascade) -> list[int]:  # type: ignore[no-untyped-def]
    """The same scripted iterations through moesim's controller."""
    controller = cfg.controller()
    request = SimpleNamespace(policy_state=None)
    controller.attach(request)
    ks = []
    for t in range(iterations):
        (k,) = controller.draft_lens([request], None)  # type: ignore[arg-type]
        ks.append(k)
        controller.observe([request], [k], [1], BASE_US if k == 0 else BASE_US / utility(k, t), None)  # type: ignore[arg-type]
    return ks


def landscape(seed: int, k_max: int):  # type: ignore[no-untyped-def]
    """Random utilities per k that change regime every ~150-400 iterations: sometimes unimodal
    around a random best k, sometimes below 1 everywhere, sometimes flat, sometimes jagged."""
    rng = np.random.default_rng(seed)
    regimes, t = [], 0
    while t < 4000:
        kind = rng.integers(4)
        ks = np.arange(k_max + 1)
        if kind == 0:
            best, top = rng.integers(1, k_max + 1), rng.uniform(1.05, 2.5)
            u = top - rng.uniform(0.03, 0.3) * np.abs(ks - best)
        elif kind == 1:
            u = rng.uniform(0.5, 0.99) - 0.05 * ks
        elif kind == 2:
            u = np.full(k_max + 1, rng.uniform(0.9, 1.3)) + rng.uniform(-0.02, 0.02, k_max + 1)
        else:
            u = rng.uniform(0.6, 2.0, k_max + 1)
        regimes.append((t, np.maximum(u, 0.05)))
        t += int(rng.integers(150, 400))

    def utility(k: int, t: int) -> float:
        table = next(u for start, u in reversed(regimes) if start <= t)
        return float(table[k])

    return utility


@pytest.mark.parametrize("seed", range(12))
def test_controller_matches_the_reference_state_machine(seed: int) -> None:
    cfg = Cascade()
    utility = landscape(seed, cfg.k_max)
    assert controller_schedule(utility, 3000, cfg) == reference_schedule(utility, 3000, cfg)


@pytest.mark.parametrize("seed", range(4))
def test_every_constant_is_configurable(seed: int) -> None:
    cfg = Cascade(
        k_max=5, k_init=2, trial_iterations=3, max_trials=3, tolerance=0.2, set_iterations=10, max_set_iterations=50,
        baseline_iterations=3, baseline_refresh_iterations=40,
    )  # fmt: skip
    utility = landscape(100 + seed, cfg.k_max)
    ks = controller_schedule(utility, 2500, cfg)
    assert ks == reference_schedule(utility, 2500, cfg)
    assert max(ks) <= 5 and ks[:3] == [0, 0, 0]


def test_speculation_that_never_pays_backs_off() -> None:
    """U < 1 at k = 1: the paper's early exit after one trial, then k = 0 for 32, 64, 128, ...
    iterations (the k = 0 iterations keep the base time fresh: no extra base phases)."""
    ks = controller_schedule(lambda k, t: 0.7, 500, Cascade())
    expected = [0, 0] + [1] * 4 + [0] * 32 + [1] * 4 + [0] * 64 + [1] * 4 + [0] * 128 + [1] * 4 + [0] * 256 + [1] * 4
    assert ks == expected[:500]


def test_climb_from_the_best_past_k() -> None:
    """Utility rising to k = 4 then falling: the first test climbs 1 → 2 → 3 → 4 (four trials,
    each > 10 % better) and sets 4; the next test starts at 4 (the best in the history), steps
    up to 5 (worse), reverses to 3 (the maximum at 4 is passed) and sets 4 again."""
    u = {1: 1.2, 2: 1.4, 3: 1.6, 4: 1.8, 5: 1.5, 6: 1.2, 7: 1.0, 8: 0.9}
    ks = controller_schedule(lambda k, t: u[k], 2 + 16 + 16 + 12 + 16, Cascade())
    assert ks == [0, 0] + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [4] * 16 + [4] * 4 + [5] * 4 + [3] * 4 + [4] * 16


def test_base_phase_refreshes_about_every_100_iterations() -> None:
    ks = controller_schedule(lambda k, t: 1.5 + 0.1 * k, 400, Cascade(k_max=3))
    zero_runs = [i for i in range(1, len(ks)) if ks[i] == 0 and ks[i - 1] != 0]
    assert ks[:2] == [0, 0] and zero_runs and all(ks[i : i + 2] == [0, 0] for i in zero_runs)
    gaps = np.diff([0, *zero_runs])
    assert np.all((gaps >= 100) & (gaps <= 100 + 16 + 16))


def test_validation() -> None:
    with pytest.raises(FieldError, match="k_init"):
        Cascade(k_max=2, k_init=3)
    with pytest.raises(FieldError, match="baseline_iterations"):
        Cascade(baseline_iterations=0)


def run_server(policy: Cascade, cost: TablePassCost, alpha: float, output: int = 600):  # type: ignore[no-untyped-def]
    server = make_server(
        cost=cost,
        policy=policy,
        acceptance=Geometric(alpha=alpha),
        workload=Workload(prompt_tokens=0, output_tokens=output),
        arrivals=Arrivals(),
        max_batch=1,
        requests=1,
        seed=3,
    )
    return server.run()


def test_model_drafter_keeps_running_at_k0() -> None:
    """At α = 0 Cascade settles at k = 0; with a drafter that costs time, each k = 0 iteration
    still pays one draft step (`drafter_at_k0`), and not when switched off."""
    cost = TablePassCost(np.array([1000.0 + 100.0 * n for n in range(1, 12)]), draft_step_us=40.0)
    on = run_server(Cascade(), cost, 0.0)
    off = run_server(Cascade(drafter_at_k0=False), cost, 0.0)
    decode = on.batch > 0
    assert np.array_equal(on.step_draft_len, off.step_draft_len)
    zero = on.step_draft_len == 0
    assert zero.sum() > 400
    assert np.all(on.draft_us[decode][zero] == 40.0) and np.all(off.draft_us[decode][zero] == 0.0)
    assert np.all(on.draft_us[decode][~zero] == 40.0 * on.step_draft_len[~zero])
    assert on.end_us == pytest.approx(off.end_us + 40.0 * zero.sum())


def test_trial_utility_is_measured_against_the_base_iterations() -> None:
    """α = 1 and T(n) = 1000 + 1000·n: a trial at k has utility (k + 1)·T(1)/T(k + 1) measured
    against the first two iterations at k = 0: U(1) = 2·2000/3000 = 1.33, U(2) = 1.5 (+12.5 %),
    U(3) = 1.6 (+6.7 %, within 10 %): the climb stops and k = 3 is set."""
    cost = TablePassCost(np.array([1000.0 + 1000.0 * n for n in range(1, 12)]))
    record = run_server(Cascade(), cost, 1.0)
    assert record.step_draft_len.tolist()[:30] == [0, 0] + [1] * 4 + [2] * 4 + [3] * 4 + [3] * 16
    assert math.isclose(record.verify_us[record.batch > 0][0], 2000.0)
