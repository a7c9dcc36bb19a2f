"""Benchmark of the routing-feature counters against the streaming floor and the numpy reference.

    python bench/bench_bytes.py [--tokens 1000000] [--seqs 1000] [--ref-rows 16384] [--repeats 3]

Times are wall clock, the CPU time of the same run in parentheses (on a shared machine, a serial
line whose wall time exceeds its CPU time waited for a core; ratios use wall times).

Trace: synthetic, Qwen3-30B-A3B shape (48 MoE layers, top-8 of 128 experts, uint8 ids), sticky
routing (q = 0.3), `--tokens` rows in `--seqs` sequences. Timed, each the best of `--repeats`
wall-clock runs after a JIT warm-up:
  (d) floor: one Numba pass summing the expert array in its own dtype (uint8);
  (a) mean U(n) for n = 1..64 (`mean_distinct_experts`), and, to show where its time goes, a
      pass doing only what no exact per-slot method avoids (one table read and write per slot);
  (b) U and M of every window, layer and n = 1..16 (`iter_window_features`, all blocks), and
      the same reduced to a `WindowSummary` (`summarize_windows`);
  (c) the numpy reference for (b) on the first `--ref-rows` rows, scaled linearly to the trace
      (its cost per row does not depend on the position), after checking it equals (b) there;
  (e) `union_features` calls per second on 32 random ragged windows (a simulator iteration).
Serial and `parallel=True` (numba.prange over row ranges) are reported separately. Peak memory
is the process's peak RSS above the RSS just before the trace was built (after the JIT warm-up),
read after (a), (b), (d) and again after (c). The last line is
`speedup_vs_reference: X` = (c) / (b), both serial.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from typing import NamedTuple

import numba
import numpy as np

from moesim.kernels.locality import mean_distinct_experts
from moesim.kernels.reference import window_features_reference
from moesim.kernels.unions import union_features, union_scratch
from moesim.kernels.windows import iter_window_features, summarize_windows, window_features
from moesim.models import load_preset
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.routing.synth import Sticky

GENERATOR_SEQS = 5  # sequences generated at a time (the generator works in int64)
UNION_BATCH = 32


@numba.njit(cache=True)
def streaming_floor(flat: np.ndarray) -> int:
    """Read every id once: the cheapest pass over the expert array."""
    total = np.uint64(0)
    for i in range(flat.shape[0]):
        total += flat[i]
    return total


@numba.njit(cache=True)
def table_pass(experts: np.ndarray, n_experts: int) -> int:
    """Only the part of (a) no exact per-slot method avoids: read and rewrite the slot's
    last-occurrence entry (a gap per slot, summed so that nothing is optimised away)."""
    n_rows, n_layers, k = experts.shape
    last = np.zeros((n_layers, n_experts), np.int32)
    total = 0
    for t in range(n_rows):
        for layer in range(n_layers):
            for j in range(k):
                e = np.intp(experts[t, layer, j])
                total += min(t - last[layer, e], 64)
                last[layer, e] = t
    return total


def build_trace(tokens: int, seqs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    geometry = TraceGeometry.from_preset(load_preset("qwen3-30b-a3b"))
    per_seq = tokens // seqs
    experts = np.empty((per_seq * seqs, len(geometry.moe_layers), geometry.top_k), np.uint8)
    for first in range(0, seqs, GENERATOR_SEQS):
        count = min(GENERATOR_SEQS, seqs - first)
        rows = slice(first * per_seq, (first + count) * per_seq)
        experts[rows] = Sticky(keep_prob=0.3).generate(geometry, per_seq, count, seed + first)
    return experts, np.arange(0, experts.shape[0] + 1, per_seq, dtype=np.int64)


class Timing(NamedTuple):
    wall_s: float
    cpu_s: float


def best_of(repeats: int, run: Callable[[], object]) -> Timing:
    """The run with the best wall-clock time of `repeats`, with its CPU time."""
    best = Timing(float("inf"), float("nan"))
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        run()
        wall = time.perf_counter() - start
        if wall < best.wall_s:
            best = Timing(wall, time.process_time() - cpu)
    return best


def union_calls_per_s(experts: np.ndarray, n_experts: int, seed: int, calls: int = 5000) -> float:
    """`union_features` calls per second, each on UNION_BATCH random ragged windows, one scratch."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, (calls, UNION_BATCH))
    starts = rng.integers(0, experts.shape[0] - 8, (calls, UNION_BATCH))
    scratch = union_scratch(experts.shape[1], n_experts)
    union_features(experts, starts[0], lengths[0], n_experts, scratch)
    start = time.perf_counter()
    for i in range(calls):
        union_features(experts, starts[i], lengths[i], n_experts, scratch)
    return calls / (time.perf_counter() - start)


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--seqs", type=int, default=1000)
    parser.add_argument("--ref-rows", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n_experts, mean_pass, window_pass = 128, 64, 16

    # JIT warm-up on a small trace, before the memory baseline
    small, small_starts = build_trace(4000, 4, args.seed)
    streaming_floor(small.reshape(-1))
    table_pass(small, n_experts)
    for parallel in (False, True):
        mean_distinct_experts(small, small_starts, n_experts, mean_pass, parallel=parallel)
        summarize_windows(small, small_starts, n_experts, window_pass, parallel=parallel)
    window_features(small, small_starts, n_experts, window_pass)
    union_calls_per_s(small, n_experts, args.seed, calls=2)
    del small, small_starts
    baseline_mib = rss_mib()

    experts, starts = build_trace(args.tokens, args.seqs, args.seed)
    rows = experts.shape[0]
    array_mib = experts.nbytes / 2**20
    print(
        f"trace: {rows} tokens in {len(starts) - 1} sequences x {experts.shape[1]} MoE layers x top-{experts.shape[2]} "
        f"of {n_experts} experts, {experts.dtype}, {array_mib:.0f} MiB; sticky routing q = 0.3; "
        f"{numba.get_num_threads()} Numba threads; best of {args.repeats} runs"
    )

    floor = best_of(max(args.repeats, 5), lambda: streaming_floor(experts.reshape(-1)))

    def report(label: str, timing: Timing, extra: str = "") -> float:
        ratio = timing.wall_s / floor.wall_s
        print(f"{label:<58} {timing.wall_s:9.3f} s (cpu {timing.cpu_s:8.3f} s)  {ratio:7.1f}x floor{extra}")
        return ratio

    report("(d) streaming floor (sum of all ids, uint8)", floor)
    mean_x = report(
        f"(a) mean U(n), n = 1..{mean_pass}", best_of(args.repeats, lambda: mean_distinct_experts(experts, starts, n_experts, mean_pass))
    )
    report("(a) lower bound: last-occurrence table read+write per slot", best_of(args.repeats, lambda: table_pass(experts, n_experts)))
    mean_par = best_of(args.repeats, lambda: mean_distinct_experts(experts, starts, n_experts, mean_pass, parallel=True))
    mean_par_x = report(f"(a) mean U(n), n = 1..{mean_pass}, prange", mean_par)

    def all_windows() -> None:
        for _ in iter_window_features(experts, starts, n_experts, window_pass):
            pass

    windows = best_of(args.repeats, all_windows)
    windows_x = report(f"(b) U, M of every window, layer, n = 1..{window_pass}", windows)
    report(
        "(b) the same reduced to a WindowSummary", best_of(args.repeats, lambda: summarize_windows(experts, starts, n_experts, window_pass))
    )
    summary_par = best_of(args.repeats, lambda: summarize_windows(experts, starts, n_experts, window_pass, parallel=True))
    report("(b) the same reduced to a WindowSummary, prange", summary_par)
    unions_per_s = union_calls_per_s(experts, n_experts, args.seed)
    print(
        f"(e) union of {UNION_BATCH} ragged windows of 1..8 rows (one simulator iteration): {unions_per_s:,.0f} calls/s "
        f"({1e6 / unions_per_s:.1f} us per call)"
    )
    fast_peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mib

    ref_rows = min(args.ref_rows, rows)
    fast = window_features(experts, starts, n_experts, window_pass, (0, ref_rows))
    start, cpu_start = time.perf_counter(), time.process_time()
    for r0 in range(0, ref_rows, 4096):
        r1 = min(r0 + 4096, ref_rows)
        u, m = window_features_reference(experts, starts, n_experts, window_pass, (r0, r1))
        if not (np.array_equal(u, fast.distinct_experts[r0:r1]) and np.array_equal(m, fast.max_tokens_per_expert[r0:r1])):
            raise SystemExit(f"fast path and reference differ in rows {r0}..{r1}")
    scale = rows / ref_rows
    reference = Timing((time.perf_counter() - start) * scale, (time.process_time() - cpu_start) * scale)
    speedup = reference.wall_s / windows.wall_s
    report(f"(c) numpy reference for (b), {ref_rows} rows scaled x{scale:.1f}", reference, f"   {speedup:5.1f}x (b)")

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mib
    print(
        f"peak memory above the pre-trace baseline: trace + (a), (b), (d): {fast_peak_mib:.0f} MiB = "
        f"{fast_peak_mib / array_mib:.2f}x the expert array; with the reference's blocks: {peak_mib:.0f} MiB"
    )
    print(
        f"goals: (a) <= 10x floor: {mean_x:.1f}x (prange {mean_par_x:.1f}x); (b) <= 100x floor: {windows_x:.1f}x; "
        f"(b) >= 20x reference: {speedup:.1f}x"
    )
    print(f"speedup_vs_reference: {speedup:.1f}")


if __name__ == "__main__":
    main()
