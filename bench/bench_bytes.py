"""Benchmark of the routing-feature counters against the streaming floor and the numpy reference.

    python bench/bench_bytes.py [--tokens 1000000] [--seqs 1000] [--ref-rows 16384] [--repeats 3]

Trace: synthetic, Qwen3-30B-A3B shape (48 MoE layers, top-8 of 128 experts, uint8 ids), sticky
routing (q = 0.3), `--tokens` rows in `--seqs` sequences. Timed, each the best of `--repeats`
wall-clock runs after a JIT warm-up:
  (d) floor: one Numba pass summing the expert array in its own dtype (uint8);
  (a) mean U(n) for n = 1..64 (`mean_distinct_experts`), and, to show where its time goes, a
      pass doing only what no exact per-slot method avoids (one table read and write per slot);
  (b) U and M of every window, layer and n = 1..16 (`iter_window_features`, all blocks), and
      the same reduced to a `WindowSummary` (`summarize_windows`);
  (c) the numpy reference for (b) on the first `--ref-rows` rows, scaled linearly to the trace
      (its cost per row does not depend on the position), after checking it equals (b) there.
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

import numba
import numpy as np

from moesim.kernels.locality import mean_distinct_experts
from moesim.kernels.reference import window_features_reference
from moesim.kernels.windows import iter_window_features, summarize_windows, window_features
from moesim.models import load_preset
from moesim.tracegen.schema import TraceGeometry
from moesim.tracegen.synth import Sticky

GENERATOR_SEQS = 5  # sequences generated at a time (the generator works in int64)


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


def best_of(repeats: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


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

    floor_s = best_of(max(args.repeats, 5), lambda: streaming_floor(experts.reshape(-1)))

    def report(label: str, seconds: float, extra: str = "") -> None:
        print(f"{label:<58} {seconds:9.3f} s   {seconds / floor_s:7.1f}x floor{extra}")

    report("(d) streaming floor (sum of all ids, uint8)", floor_s)
    mean_s = best_of(args.repeats, lambda: mean_distinct_experts(experts, starts, n_experts, mean_pass))
    report(f"(a) mean U(n), n = 1..{mean_pass}", mean_s)
    table_s = best_of(args.repeats, lambda: table_pass(experts, n_experts))
    report("(a) lower bound: last-occurrence table read+write per slot", table_s)
    mean_par_s = best_of(args.repeats, lambda: mean_distinct_experts(experts, starts, n_experts, mean_pass, parallel=True))
    report(f"(a) mean U(n), n = 1..{mean_pass}, prange", mean_par_s)

    def all_windows() -> None:
        for _ in iter_window_features(experts, starts, n_experts, window_pass):
            pass

    windows_s = best_of(args.repeats, all_windows)
    report(f"(b) U, M of every window, layer, n = 1..{window_pass}", windows_s)
    summary_s = best_of(args.repeats, lambda: summarize_windows(experts, starts, n_experts, window_pass))
    report("(b) the same reduced to a WindowSummary", summary_s)
    summary_par_s = best_of(args.repeats, lambda: summarize_windows(experts, starts, n_experts, window_pass, parallel=True))
    report("(b) the same reduced to a WindowSummary, prange", summary_par_s)

    fast_peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mib
    ref_rows = min(args.ref_rows, rows)
    fast = window_features(experts, starts, n_experts, window_pass, (0, ref_rows))
    start = time.perf_counter()
    for r0 in range(0, ref_rows, 4096):
        r1 = min(r0 + 4096, ref_rows)
        u, m = window_features_reference(experts, starts, n_experts, window_pass, (r0, r1))
        if not (np.array_equal(u, fast.distinct_experts[r0:r1]) and np.array_equal(m, fast.max_tokens_per_expert[r0:r1])):
            raise SystemExit(f"fast path and reference differ in rows {r0}..{r1}")
    reference_s = (time.perf_counter() - start) * rows / ref_rows
    report(
        f"(c) numpy reference for (b), {ref_rows} rows scaled x{rows / ref_rows:.1f}",
        reference_s,
        f"   {reference_s / windows_s:5.1f}x (b)",
    )

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mib
    print(
        f"peak memory above the pre-trace baseline: trace + (a), (b), (d): {fast_peak_mib:.0f} MiB = "
        f"{fast_peak_mib / array_mib:.2f}x the expert array; with the reference's blocks: {peak_mib:.0f} MiB"
    )
    print(
        f"goals: (a) <= 10x floor: {mean_s / floor_s:.1f}x (prange {mean_par_s / floor_s:.1f}x); "
        f"(b) <= 100x floor: {windows_s / floor_s:.1f}x; (b) >= 20x reference: {reference_s / windows_s:.1f}x"
    )
    print(f"speedup_vs_reference: {reference_s / windows_s:.1f}")


if __name__ == "__main__":
    main()
