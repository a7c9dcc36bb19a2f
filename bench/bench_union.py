"""Speed of one batch union (a benchmark, not a test): per MoE layer U, M, S of 32 windows of 4
tokens (batch 32 at k = 3), 48 MoE layers, top-8 of 128, on a synthetic Qwen3-30B-A3B-shaped
trace, counted from the trace's expert bitmasks (`moesim.kernels.bitsets`) against counting the
ids (`fast_pass.count_ids`, the kernel it replaces) in the same run. Both are called from one
compiled loop of N unions (so no Python call is timed), over the same windows, in three cases:
each lane moving on by 1 to 4 tokens per union, as decoding does (the new tokens' masks, 768
bytes a token here, twice the ids' bytes, come from memory); the same 32 windows every time
(held in the caches: the counting alone); and mixed passes, the moving windows plus a 512-token
prefill chunk from a random row of the prefill region, cut by `PrefillRegion.pieces` into its
partial ends (windows) and a block of checkpoint differences (or two, where it wraps). They must
give the same features for every union. Goal: <= 5 µs per union.

    .venv/bin/python bench/bench_union.py [--unions N] [--repeats R]

Prints µs per union of each and the ratio per case; the last line is `bitset_union_us: X` (the
same windows every union).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from moesim.kernels.jit import njit
from moesim.kernels.unions import PrefillRegion
from moesim.models import load_preset
from moesim.sim.cost.fast_pass import count_union, scratch_for
from moesim.tracegen.routing.synth import Sticky, synthesize

QWEN3 = load_preset("qwen3-30b-a3b")
BATCH, TOKENS, CHUNK = 32, 4, 512


@njit
def _unions(experts, rows, lengths, n_windows, region, lo, hi, n_blocks, union, features, checksums):  # noqa: ANN001, ANN202
    """count_union of union i's windows rows[i, :n_windows[i]] and blocks lo[i, :n_blocks[i]],
    i < N; checksums[i] = Σ_l (U_l + 1000 M_l + 10^6 S_l)."""
    for i in range(rows.shape[0]):
        count_union(experts, rows[i], lengths[i], n_windows[i], region, lo[i], hi[i], n_blocks[i], union, features)
        s = 0
        for layer in range(features.shape[1]):
            s += features[0, layer] + 1000 * features[1, layer] + 1_000_000 * features[2, layer]
        checksums[i] = s


def windows(seq_starts: np.ndarray, n_unions: int, seed: int = 0) -> np.ndarray:
    """(N, 32) first rows: lane b in sequence b, moving on 1..4 tokens per union, wrapping before the end."""
    rng = np.random.default_rng(seed)
    room = np.diff(seq_starts)[:BATCH] - TOKENS
    steps = rng.integers(1, TOKENS + 1, (n_unions, BATCH))
    return (seq_starts[:BATCH] + np.cumsum(steps, axis=0) % room).astype(np.int64)


def decode(rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """The `_unions` arguments of decode-only unions: 32 windows of 4 tokens at `rows` (N, 32), no blocks."""
    n = rows.shape[0]
    none = np.zeros((n, 0), np.int64)
    return rows, np.full(rows.shape, TOKENS, np.int64), np.full(n, BATCH, np.int64), none, none, np.zeros(n, np.int64)


def mixed(rows: np.ndarray, region: PrefillRegion, seed: int = 1) -> tuple[np.ndarray, ...]:
    """The `_unions` arguments of mixed unions: the decode windows at `rows` (N, 32) and a
    `CHUNK`-token prefill chunk from a random region row, in pieces (`PrefillRegion.pieces`)."""
    rng = np.random.default_rng(seed)
    n = rows.shape[0]
    out_rows, out_lengths = np.zeros((n, BATCH + 4), np.int64), np.zeros((n, BATCH + 4), np.int64)
    lo, hi = np.zeros((n, 2), np.int64), np.zeros((n, 2), np.int64)
    n_windows, n_blocks = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i, first in enumerate(rng.integers(0, region.rows, n).tolist()):
        starts, lengths, lows, highs = rows[i].tolist(), [TOKENS] * BATCH, [], []
        region.pieces(first, CHUNK, (starts, lengths), (lows, highs))
        n_windows[i], n_blocks[i] = len(starts), len(lows)
        out_rows[i, : len(starts)], out_lengths[i, : len(starts)] = starts, lengths
        lo[i, : len(lows)], hi[i, : len(lows)] = lows, highs
    return out_rows, out_lengths, n_windows, lo, hi, n_blocks


def best_time(run: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` runs, seconds of this process's CPU time."""
    best = np.inf
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unions", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    trace = synthesize(QWEN3, Sticky(keep_prob=0.3), 4096, BATCH, 0)
    n_layers, n_experts = trace.experts.shape[1], QWEN3.experts
    masks = trace.expert_masks
    assert masks is not None, "the trace's masks do not fit in memory"
    rows = windows(trace.seq_starts, args.unions)
    region = PrefillRegion.of(trace.experts, n_experts)
    shape = f"{BATCH} windows of {TOKENS} tokens, {n_layers} MoE layers, top-{QWEN3.top_k} of {n_experts}"
    cases = {
        "windows moving on as decoding": decode(rows),
        "the same windows every union": decode(np.repeat(rows[:1], args.unions, axis=0)),
        f"mixed: the moving windows plus a {CHUNK}-token prefill chunk (windows and blocks of the region)": mixed(rows, region),
    }
    bitset_us = {}
    for case, case_args in cases.items():
        results = {}
        for name, scratch in (("bitsets", scratch_for(n_layers, n_experts, masks)), ("ids", scratch_for(n_layers, n_experts))):
            union, features, _ = scratch
            sums = np.zeros(args.unions, np.int64)
            head = [a[:2] for a in case_args]
            _unions(trace.experts, *head[:3], region.checkpoints, *head[3:], union, features, sums[:2])  # compile or load
            run = partial(_unions, trace.experts, *case_args[:3], region.checkpoints, *case_args[3:], union, features, sums)
            results[name] = (best_time(run, args.repeats) / args.unions * 1e6, sums)
        (fast_us, fast_sums), (ref_us, ref_sums) = results["bitsets"], results["ids"]
        assert np.array_equal(fast_sums, ref_sums), "the bitset union and the id count disagree"
        print(f"{shape}, {case}:")
        ratio = ref_us / fast_us
        print(f"  counting ids: {ref_us:.2f} us per union; from the expert bitmasks: {fast_us:.2f} us, {ratio:.1f}x faster, same features")
        bitset_us[case] = fast_us
    print(f"bitset_union_us: {bitset_us['the same windows every union']:.2f}")


if __name__ == "__main__":
    main()
