"""Speed of the server with sliding-window KV pages (a benchmark, not a test).

gpt-oss-20b's KV-cache groups (12 full layers, 12 of window 128: half a page each) against the
same pages with every layer sized for the whole context, on a table cost: 4,000 requests of
500 + 300 tokens in a closed loop of 32 under chunked prefill (budget 512) in 300 pages (memory
pressure: preemptions by recompute), static k = 3. Prints request steps (a decoding request's
pass) per CPU second of the compiled lane and of the Python loop alone (400 requests), best of
--repeats runs after a start-up run, and the windowed run's rate over the unwindowed one's (the
windowed run holds more requests per iteration: steps, not iterations, measure the work).

    .venv/bin/python bench/bench_kv_windows.py [--repeats N]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from moesim.models import load_preset
from moesim.sim.cost.parallel import Parallelism
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.memory import FULL_ONLY, KVBudget, MemorySection, kv_budget
from moesim.sim.serving.policies import Static
from moesim.sim.serving.scheduler import Scheduling
from moesim.sim.serving.server import Server
from moesim.sim.serving.workload import Arrivals, Workload

TABLE = TablePassCost(np.array([900.0 + 40.0 * n for n in range(1, 3000)]), draft_step_us=20.0, prefill_us_per_token=2.0)


def run(budget: KVBudget, lane: bool) -> tuple[float, int, int, int]:
    """(CPU seconds, request steps, iterations, preemptions) of one run."""
    server = Server(
        cost=TABLE, policy=Static(k=3), acceptance=Geometric(alpha=0.7), workload=Workload(prompt_tokens=500, output_tokens=300),
        arrivals=Arrivals(concurrency=32), max_batch=32, requests=4000 if lane else 400, duration_us=0.0, seed=0,
        scheduling=Scheduling(budget, chunked_prefill=True, token_budget=512), lane=lane,
    )  # fmt: skip
    start = time.process_time()
    record = server.run()
    assert (server.lane is not None) == lane and record.memory is not None
    return time.process_time() - start, record.step_request.size, record.draft_us.size, record.memory["preemptions"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    windowed = kv_budget(MemorySection(pages=300), load_preset("gpt-oss-20b"), "MXFP4", None, None, Parallelism(), None)
    budgets = {"windowed": windowed, "whole context": dataclasses.replace(windowed, windows=FULL_ONLY[0], parts=FULL_ONLY[1])}
    rates = {}
    for lane in (True, False):
        for name, budget in budgets.items():
            run(budget, lane)  # start-up (compiles the lane's kernel once, cached on disk)
            wall, steps, iterations, preemptions = min((run(budget, lane) for _ in range(args.repeats)), key=lambda r: r[0])
            rates[name, lane] = steps / wall
            path = "the compiled lane" if lane else "the Python loop alone"
            print(
                f"{path}, {name}: {steps:,} request steps in {iterations:,} iterations ({steps / iterations:.1f} a pass), "
                f"{preemptions:,} preemptions: {steps / wall:,.0f} steps/s"
            )
        print(f"  windowed / whole context: {rates['windowed', lane] / rates['whole context', lane]:.2f}x the steps per second")


if __name__ == "__main__":
    main()
