"""Speed of the SimPy server (a benchmark, not a test).

1. Batch 1 on precomputed costs (a TablePassCost): simulated verification passes per second of
   the SimPy server, against a plain-Python loop of the same logic (same acceptance draws, same
   cost lookups, same records) in the same run. Goal: >= 200,000 passes/s.
2. Batch 32 with the routing union taken from the trace each iteration: server iterations per
   second when every verify pass asks a BatchCostModel for the union of the 32 requests' windows
   on a synthetic trace, counted by the Numba batch-union counter, against the same union
   counted with numpy in the same run (both must agree); and through the trace-driven step-time
   model (`TraceBatchCost`: the counter plus the profile's time model). Goal: >= 5,000 iterations/s.
3. Batch 32 serving as engines do it (issue 16's case): the trace-driven step-time model with
   KV-cache pages (the H200's memory next to Qwen3-30B-A3B's BF16 weights, 16-token pages) and
   chunked prefill under a 2048-token budget, requests of 512 prompt and 256 output tokens in a
   closed loop of 32 (a request finishes every few iterations and its successor's prompt joins
   the verify pass), static k = 3, on vLLM's fused-MoE H200 engine profile with its dispatch, and
   on the lab H200 profile with family `best` (its lookup ladder prices untabled pass sizes in
   numpy); also with both off (whole prefills that stall the batch). The loop alone: the run is
   timed after one run of the same length built the pass sizes' tables (start-up, cached on disk
   between runs), for the compiled lane and for the numpy reference path (the Python loop, the
   union counter and numpy lookups) in the same run; both must give the same iterations, passes
   and end time. Goal: >= 40,000 iterations/s.
4. Open loops (issue 27's cases): 2,000 requests of 512 + 256 tokens arriving as a Poisson stream
   at the rate a closed loop of 32 completes them (so the batch stays near its cap of 32), the
   same step-time model, KV pages and chunked prefill, at static k = 3 and with speculation off;
   and the same under memory pressure (pages for a third of the batch: preemptions by recompute,
   and by swap over the H200's PCIe 5 host link). The compiled lane (its own arrivals,
   preemptions and swaps) against the numpy reference in the same run (same iterations, passes
   and end time asserted). Goal: >= 40,000 iterations/s each.

Every case prints the server's rate with its compiled lane and with its Python loop alone
(`Server(lane=False)`, the same cost model): where a case cannot use the lane (an adaptive policy,
a cost model asked through the protocol) the two are the same loop, and the lane costs nothing.

    .venv/bin/python bench/bench_simulate.py [--passes N] [--iterations N] [--repeats N]

Times are CPU time of this process (`time.process_time`, best of --repeats runs, 5 by default), so other
processes on a shared machine disturb them less (the references of cases 3 and 4, best of 2).
Prints one line per measurement, then `open_loop_iterations_per_s: N` and
`memory_pressure_iterations_per_s: N` (the slower of k = 3 and speculation off; recompute) and
last `passes_per_s: X` (the server, case 1).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from moesim.hw_profiles import load_profile
from moesim.hw_profiles.catalog import catalog, links
from moesim.kernels.unions import union_features, union_scratch
from moesim.models import load_preset
from moesim.sim.cost.drafters import make_drafter
from moesim.sim.cost.parallel import Parallelism
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.cost.trace_batch import TraceBatchCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.cascade import Cascade
from moesim.sim.serving.memory import MemorySection, kv_budget
from moesim.sim.serving.policies import Off, Policy, Static
from moesim.sim.serving.scheduler import Scheduling
from moesim.sim.serving.server import Server
from moesim.sim.serving.workload import Arrivals, TraceWindows, Workload
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.routing.synth import Sticky, synthesize

QWEN3 = load_preset("qwen3-30b-a3b")
TABLE = TablePassCost(np.array([900.0 + 150.0 * n for n in range(1, 300)]), draft_step_us=30.0)
ALPHA = 0.7


def server_batch1(policy: Policy, passes: int, lane: bool = True) -> tuple[float, float, int]:
    """(wall seconds of the run, simulated end time, passes) for one request of ~`passes` passes
    (`lane`: the server's compiled lane on, else its Python loop only)."""
    tokens = int(passes * 2.5) if policy.k_cap else passes
    server = Server(
        cost=TABLE,
        policy=policy,
        acceptance=Geometric(alpha=ALPHA),
        workload=Workload(prompt_tokens=0, output_tokens=tokens),
        arrivals=Arrivals(),
        max_batch=1,
        requests=1,
        duration_us=0.0,
        seed=0,
        lane=lane,
    )
    start = time.process_time()
    record = server.run()
    wall = time.process_time() - start
    return wall, record.end_us, record.step_request.size


def plain_loop_batch1(k_static: int, tokens: int) -> tuple[float, float, int]:
    """The same logic without SimPy: a static-k request decoded pass by pass, records appended."""
    draws = Geometric(alpha=ALPHA).bind(0, tokens, k_static, 0)
    verify = [0.0] + [TABLE.pass_us(n) for n in range(1, k_static + 2)]
    draft = [TABLE.draft_step_us * k for k in range(k_static + 1)]
    start = time.process_time()
    now = 0.0
    remaining, decoded, passes = tokens - 1, 0, 0
    rec_start, rec_draft, rec_verify, rec_k, rec_acc = [], [], [], [], []
    while remaining:
        k = k_static if k_static < remaining else remaining - 1
        rec_start.append(now)
        now += draft[k] + verify[k + 1]
        rec_draft.append(draft[k])
        rec_verify.append(verify[k + 1])
        accepted = draws.draw(decoded)
        if accepted > k:
            accepted = k
        decoded += accepted + 1
        remaining -= accepted + 1
        rec_k.append(k)
        rec_acc.append(accepted)
        passes += 1
    return time.process_time() - start, now, passes


class ConstantCost:
    """A cost model asked through the protocol (numpy arrays per pass) that does no work: what the
    server itself costs per iteration, the budget left for the routing counter."""

    def verify_us(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray) -> float:
        """A fixed pass time."""
        return 3000.0

    def draft_us(self, draft_lens: np.ndarray, context_tokens: np.ndarray) -> float:
        """Free drafting."""
        return 0.0

    def prefill_us(self, prompt_tokens: int) -> float:
        """Free prefill."""
        return 0.0


class UnionCost:
    """A trace-driven cost model for the benchmark: per verify pass, the distinct experts of the
    union of the batch's windows in each MoE layer, turned into time as fixed + per-distinct-expert
    time (illustrative numbers). `counter` is 'numba' (moesim.kernels.unions.union_features, the
    batch-union counter) or 'numpy' (gather the ids, key them by layer, bincount)."""

    def __init__(self, trace: Trace, counter: str, fixed_us: float = 2000.0, expert_us: float = 4.0) -> None:
        self.experts = trace.experts
        self.seq_starts = trace.seq_starts
        self.n_layers = trace.experts.shape[1]
        self.n_experts = trace.meta.geometry.experts
        self.counter = counter
        self.scratch = union_scratch(self.n_layers, self.n_experts)
        self.layer_offset = (np.arange(self.n_layers) * self.n_experts).astype(np.uint16)[None, :, None]
        self.fixed_us = fixed_us
        self.expert_us = expert_us
        self.distinct_sum = 0

    def distinct(self, first_rows: np.ndarray, n_tokens: np.ndarray) -> int:
        """Σ over layers of the union's distinct experts."""
        if self.counter == "numba":
            u, _ = union_features(self.experts, first_rows, n_tokens, self.n_experts, self.scratch)
            return int(u.sum())
        offsets = np.cumsum(n_tokens) - n_tokens
        rows = np.repeat(first_rows - offsets, n_tokens) + np.arange(int(n_tokens.sum()))
        keys = self.experts[rows].astype(np.uint16) + self.layer_offset
        return int(np.count_nonzero(np.bincount(keys.ravel(), minlength=self.n_layers * self.n_experts)))

    def verify_us(self, seqs: np.ndarray, starts: np.ndarray, n_tokens: np.ndarray, context_tokens: np.ndarray) -> float:
        """Fixed time + time per distinct expert of the union, summed over layers."""
        distinct = self.distinct(self.seq_starts[seqs] + starts, n_tokens)
        self.distinct_sum += distinct
        return self.fixed_us + self.expert_us * distinct

    def draft_us(self, draft_lens: np.ndarray, context_tokens: np.ndarray) -> float:
        """An n-gram drafter: free."""
        return 0.0

    def prefill_us(self, prompt_tokens: int) -> float:
        """Prefill: 10 µs per prompt token."""
        return 10.0 * prompt_tokens


def server_batch32(trace: Trace, duration_us: float, cost: object, lane: bool = True) -> tuple[float, int]:
    """(wall seconds, iterations) of a full batch of 32 on the numpy-union cost, static k = 3,
    for `duration_us` of simulated time (requests never finish, so the batch stays full)."""
    windows = TraceWindows.from_trace(trace, offset_stride=0, window_max=4, source="bench")
    server = Server(
        cost=cost,
        policy=Static(k=3),
        acceptance=Geometric(alpha=ALPHA),
        workload=Workload(prompt_tokens=0, output_tokens=10**9),
        arrivals=Arrivals(concurrency=32),
        max_batch=32,
        requests=0,
        duration_us=duration_us,
        seed=0,
        windows=windows,
        lane=lane,
    )
    start = time.process_time()
    record = server.run()
    return time.process_time() - start, record.prefill_us.size


def server_serving(
    trace: Trace, duration_us: float, cost: object, scheduling: Scheduling, lane: bool = True
) -> tuple[float, int, int, float, int]:
    """(wall seconds, iterations, prefill iterations, end time, passes) of a closed loop of 32
    requests of 512 prompt and 256 output tokens at static k = 3 for `duration_us` of simulated time."""
    windows = TraceWindows.from_trace(trace, offset_stride=0, window_max=4, source="bench")
    server = Server(
        cost=cost,  # type: ignore[arg-type]
        policy=Static(k=3),
        acceptance=Geometric(alpha=ALPHA),
        workload=Workload(prompt_tokens=512, output_tokens=256),
        arrivals=Arrivals(concurrency=32),
        max_batch=32,
        requests=0,
        duration_us=duration_us,
        seed=0,
        windows=windows,
        scheduling=scheduling,
        lane=lane,
    )
    start = time.process_time()
    record = server.run()
    prefills = record.prefill_tokens if record.prefill_tokens is not None else record.admitted
    wall = time.process_time() - start
    return wall, record.prefill_us.size, int(np.count_nonzero(prefills)), record.end_us, record.step_request.size


def server_open_loop(
    trace: Trace, cost: object, scheduling: Scheduling, policy: Policy, arrivals: Arrivals, requests: int = 2000, lane: bool = True
) -> tuple[float, int, float, int, float, int]:
    """(wall seconds, iterations, end time, passes, mean batch, preemptions) of `requests` requests of
    512 prompt and 256 output tokens arriving as `arrivals`, batch cap 32."""
    windows = TraceWindows.from_trace(trace, offset_stride=0, window_max=4, source="bench")
    server = Server(
        cost=cost,  # type: ignore[arg-type]
        policy=policy,
        acceptance=Geometric(alpha=ALPHA),
        workload=Workload(prompt_tokens=512, output_tokens=256),
        arrivals=arrivals,
        max_batch=32,
        requests=requests,
        duration_us=0.0,
        seed=0,
        windows=windows,
        scheduling=scheduling,
        lane=lane,
    )
    start = time.process_time()
    record = server.run()
    wall = time.process_time() - start
    preempted = int(record.preempted.sum()) if record.preempted is not None else 0
    return wall, record.prefill_us.size, record.end_us, record.step_request.size, float(record.batch.mean()), preempted


def open_loops(trace: Trace, repeats: int) -> dict[str, float]:
    """Case 4 (see the module docstring): per case the lane's rate, printed with the references'."""
    profile, family = "nvidia-h200-vllm", "dispatch"
    h200 = catalog()["nvidia-h200"]
    full = kv_budget(MemorySection(), QWEN3, "BF16", None, h200, Parallelism(), None)
    third = (32 // 3) * -(-(512 + 256 + 3) // 16)  # pages for a third of the batch at full length
    host = links()[h200.host_link]
    squeezed = {
        p: kv_budget(MemorySection(pages=third, preemption=p), QWEN3, "BF16", None, h200, Parallelism(), host)
        for p in ("recompute", "swap")
    }
    rates: dict[str, float] = {}
    for policy in (Static(k=3), Off()):
        fast = TraceBatchCost(StepTimeModel(QWEN3, load_profile(profile), family), trace, make_drafter("ngram", QWEN3))
        reference = TraceBatchCost(StepTimeModel(QWEN3, load_profile(profile), family), trace, make_drafter("ngram", QWEN3), compiled=False)
        chunked = Scheduling(full, chunked_prefill=True, token_budget=2048)
        pilot = server_open_loop(trace, fast, chunked, policy, Arrivals(concurrency=32), requests=500)
        arrivals = Arrivals(kind="poisson", rate_per_s=500 / (pilot[2] / 1e6))  # the closed loop's completion rate
        name = f"k={policy.k_cap}" if policy.k_cap else "speculation off"
        cases = [("open_loop", chunked, "")] + [
            (f"memory_pressure[{p}]", Scheduling(b, chunked_prefill=True, token_budget=2048), f", {third} pages, preemption by {p}")
            for p, b in squeezed.items()
        ]  # fmt: skip
        for label, scheduling, memory in cases:
            lane, loop, ref = open_case(trace, (fast, reference), scheduling, policy, arrivals, repeats)
            rates[f"{label}, {name}"] = lane[1] / lane[0]
            print(
                f"simpy server,      open loop, Poisson at {arrivals.rate_per_s:.2f} requests/s, 2,000 requests of 512+256 tokens, "
                f"batch cap 32 (mean {lane[4]:.1f}), {name}, step-time model ({profile}, family {family}), KV pages + chunked prefill"
                f"{memory} ({lane[5]} preemptions): the compiled lane {lane[1] / lane[0]:,.0f} iterations/s; the Python loop "
                f"{loop[1] / loop[0]:,.0f} (lane {loop[0] / lane[0]:.1f}x); the numpy reference {ref[1] / ref[0]:,.0f} "
                f"(lane {ref[0] / lane[0]:.1f}x), same iterations, passes and end time"
            )
    return rates


def open_case(
    trace: Trace, costs: tuple[object, object], scheduling: Scheduling, policy: Policy, arrivals: Arrivals, repeats: int
) -> tuple[tuple[Any, ...], ...]:
    """One open-loop case, each measure after a start-up run that built the pass sizes' tables: the
    lane, the Python loop on the compiled cost and on the numpy reference (`costs`), all agreeing."""
    fast, reference = costs
    server_open_loop(trace, fast, scheduling, policy, arrivals)
    lane = best_of(repeats, lambda: server_open_loop(trace, fast, scheduling, policy, arrivals))
    loop = best_of(min(repeats, 2), lambda: server_open_loop(trace, fast, scheduling, policy, arrivals, lane=False))
    server_open_loop(trace, reference, scheduling, policy, arrivals, lane=False)
    ref = best_of(min(repeats, 2), lambda: server_open_loop(trace, reference, scheduling, policy, arrivals, lane=False))
    agree = (ref[1], ref[2], ref[3]) == (loop[1], loop[2], loop[3]) == (lane[1], lane[2], lane[3])
    assert agree, "the lane, the Python loop and the numpy reference disagree"
    return lane, loop, ref


def lane_and_loop(label: str, repeats: int, measure: Callable[[bool], tuple[Any, ...]]) -> float:
    """Print a case's rate (iterations per CPU second: measure(lane) -> (wall, iterations, ...))
    with the compiled lane and with the Python loop alone; returns the lane's."""
    lane = best_of(repeats, lambda: measure(True))
    loop = best_of(repeats, lambda: measure(False))
    lane_rate, loop_rate = lane[1] / lane[0], loop[1] / loop[0]
    print(f"  {label}: with the lane {lane_rate:,.0f} iterations/s, the Python loop alone {loop_rate:,.0f} ({loop[0] / lane[0]:.2f}x)")
    return lane[1] / lane[0]


def best_of(repeats: int, measure: Callable[[], tuple[Any, ...]]) -> tuple[Any, ...]:
    """The fastest of `repeats` runs (other processes only ever slow a run down)."""
    return min((measure() for _ in range(repeats)), key=lambda result: result[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=300_000)
    parser.add_argument("--iterations", type=int, default=3_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    repeats = args.repeats

    server_batch1(Static(k=3), 2000)  # warm-up (imports, first allocations)
    wall_loop, end_loop, passes_loop = best_of(repeats, lambda: plain_loop_batch1(3, int(args.passes * 2.5)))
    wall, end_us, passes = best_of(repeats, lambda: server_batch1(Static(k=3), args.passes))
    wall_py, end_py, passes_py = best_of(repeats, lambda: server_batch1(Static(k=3), args.passes, lane=False))
    assert passes == passes_loop == passes_py and abs(end_us - end_loop) <= 1e-6 * end_loop, "server and plain loop disagree"
    assert end_us == end_py, "the lane and the server's Python loop disagree"
    print(f"plain-python loop, batch 1, static k=3: {passes_loop / wall_loop:,.0f} passes/s ({passes_loop} passes)")
    print(f"simpy server,      batch 1, static k=3: {passes / wall:,.0f} passes/s, {wall / wall_loop:.2f}x the plain loop's time")
    print(f"simpy server, Python loop only (no lane): {passes_py / wall_py:,.0f} passes/s, {wall_py / wall_loop:.2f}x the plain loop")
    wall_c, _, passes_c = best_of(repeats, lambda: server_batch1(Cascade(), args.passes))
    print(f"simpy server,      batch 1, cascade:    {passes_c / wall_c:,.0f} passes/s (an adaptive policy: the Python loop)")
    lane_and_loop("batch 1, cascade (passes)", repeats, lambda lane: server_batch1(Cascade(), args.passes, lane)[::2])
    trace = synthesize(QWEN3, Sticky(keep_prob=0.3), 4096, 32, 0)
    wall_e, iters_e = best_of(repeats, lambda: server_batch32(trace, 3000.0 * args.iterations, ConstantCost()))
    print(f"simpy server,      batch 32, static k=3, protocol cost doing no work: {iters_e / wall_e:,.0f} iterations/s")
    constant = 3000.0 * args.iterations
    lane_and_loop("batch 32, protocol cost (no lane)", repeats, lambda lane: server_batch32(trace, constant, ConstantCost(), lane))
    numba_cost, numpy_cost = UnionCost(trace, "numba"), UnionCost(trace, "numpy")
    check = [server_batch32(trace, 1e6, cost)[1] for cost in (numba_cost, numpy_cost)]  # also the JIT warm-up
    assert check[0] == check[1] and numba_cost.distinct_sum == numpy_cost.distinct_sum > 0, "numba and numpy unions disagree"
    _, pilot_iters = server_batch32(trace, 1e6, numba_cost)
    duration_us = 1e6 * args.iterations / max(pilot_iters, 1)
    wall32, iters32 = best_of(repeats, lambda: server_batch32(trace, duration_us, numba_cost))
    wall_np, iters_np = best_of(repeats, lambda: server_batch32(trace, duration_us, numpy_cost))
    shape = "32 windows of 4 tokens, 48 MoE layers, top-8 of 128, synthetic Qwen3-30B-A3B-shaped trace"
    print(f"simpy server,      batch 32, static k=3, union from the trace by numpy ({shape}): {iters_np / wall_np:,.0f} iterations/s")
    print(
        f"simpy server,      batch 32, static k=3, union from the trace by the batch-union counter: {iters32 / wall32:,.0f} "
        f"iterations/s, {wall_np / wall32:.1f}x the numpy union's rate"
    )
    lane_and_loop("batch 32, union cost (protocol: no lane)", repeats, lambda lane: server_batch32(trace, duration_us, numba_cost, lane))
    step_rates = {}
    for family in ("dedup", "best"):
        step_cost = TraceBatchCost(StepTimeModel(QWEN3, load_profile("nvidia-h200"), family), trace, make_drafter("ngram", QWEN3))
        _, pilot_iters = server_batch32(trace, 1e6, step_cost)
        duration_us = 1e6 * args.iterations / max(pilot_iters, 1)
        print(
            f"simpy server,      batch 32, static k=3, the trace-driven step-time model (TraceBatchCost: union counter + "
            f"nvidia-h200 profile, family {family}):"
        )
        step_rates[family] = lane_and_loop(
            "requests never finish", repeats, lambda lane, cost=step_cost, d=duration_us: server_batch32(trace, d, cost, lane)
        )
    h200 = catalog()["nvidia-h200"]
    budget = kv_budget(MemorySection(), QWEN3, "BF16", None, h200, Parallelism(), None)
    serving = Scheduling(budget, chunked_prefill=True, token_budget=2048)
    serving_rates = {}
    # vLLM's fused MoE on the H200 (an engine profile: its families run compiled) with vLLM's own
    # dispatch, as a vLLM server with chunked prefill runs; and the lab H200 profile (family best),
    # whose lookup ladder prices a pass size through its per-(U, M) tables once tabled, in numpy before
    for profile, family in (("nvidia-h200-vllm", "dispatch"), ("nvidia-h200", "best")):
        for label, scheduling in (("KV pages + chunked prefill", serving), ("neither (whole prefills)", Scheduling())):
            step_cost = TraceBatchCost(StepTimeModel(QWEN3, load_profile(profile), family), trace, make_drafter("ngram", QWEN3))
            _, pilot_iters, *_ = server_serving(trace, 1e6, step_cost, scheduling)
            duration_us = 1e6 * args.iterations / max(pilot_iters, 1)
            server_serving(trace, duration_us, step_cost, scheduling)  # start-up: the pass sizes' tables (cached on disk between runs)
            fast = best_of(repeats, lambda c=step_cost, d=duration_us, sc=scheduling: server_serving(trace, d, c, sc))
            wall_sv, iters_sv, prefills, end_sv, passes_sv = fast
            serving_rates[profile, label] = iters_sv / wall_sv
            print(
                f"simpy server,      batch 32, static k=3, step-time model ({profile}, family {family}), 512+256-token requests, "
                f"{label}: {iters_sv / wall_sv:,.0f} iterations/s ({prefills} of {iters_sv} iterations prefilled)"
            )
            reference_cost = TraceBatchCost(
                StepTimeModel(QWEN3, load_profile(profile), family), trace, make_drafter("ngram", QWEN3), compiled=False
            )
            server_serving(trace, duration_us, reference_cost, scheduling, lane=False)  # the same start-up
            ref = best_of(repeats, lambda c=reference_cost, d=duration_us, sc=scheduling: server_serving(trace, d, c, sc, lane=False))
            assert (ref[1], ref[3], ref[4]) == (iters_sv, end_sv, passes_sv), "the compiled path and the numpy reference disagree"
            print(
                f"  the numpy reference (union counter + numpy lookups, the server's Python loop): {ref[1] / ref[0]:,.0f} "
                f"iterations/s; the compiled path {ref[0] / wall_sv:.1f}x faster, same passes and end time"
            )
            loop = best_of(min(repeats, 2), lambda c=step_cost, d=duration_us, sc=scheduling: server_serving(trace, d, c, sc, lane=False))
            print(f"  the Python loop alone on the compiled cost: {loop[1] / loop[0]:,.0f} iterations/s (lane {loop[0] / wall_sv:.1f}x)")
        ratio = serving_rates[profile, "KV pages + chunked prefill"] / serving_rates[profile, "neither (whole prefills)"]
        print(f"  {profile}: KV + chunked prefill at {ratio:.2f}x the rate without ({budget.pages:,} pages of 16 tokens)")
    open_rates = open_loops(trace, repeats)
    for profile in ("nvidia-h200-vllm", "nvidia-h200"):
        print(f"iterations_per_s_batch32_serving[{profile}]: {serving_rates[profile, 'KV pages + chunked prefill']:.0f}")
    for label, key in (
        ("open_loop", "open_loop"),
        ("memory_pressure_swap", "memory_pressure[swap]"),
        ("memory_pressure", "memory_pressure[recompute]"),
    ):
        print(f"{label}_iterations_per_s: {min(rate for case, rate in open_rates.items() if case.startswith(key)):.0f}")
    print(f"iterations_per_s_batch32: {step_rates['dedup']:.0f}")
    print(f"passes_per_s: {passes / wall:.0f}")


if __name__ == "__main__":
    main()
