"""Speed of binding requests' acceptance streams (a benchmark, not a test).

Per request, what the server pays when a request starts: its acceptance state bound and its first
block of draws made. Reference: `model.bind` + `refill` (a numpy Generator per request: SeedSequence,
PCG64, Generator, then the block). Bulk: `bind_many` over batches of 64 requests (the server's
compiled lane makes requests ahead in such batches): one compiled call draws every first block
(`moesim.kernels.pcg`), one numpy call counts them, no Generator is made. Both must give the same
counts (asserted). Requests of 256 output tokens (a first block of 256 draws), k_cap = 3.

    .venv/bin/python bench/bench_acceptance.py [--requests N] [--repeats N]

Times are CPU time of this process (`time.process_time`, best of --repeats runs). Prints one line
per model: µs per request, reference and bulk, and the ratio.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from moesim.sim.serving.acceptance import Geometric, Position, Tree, bind_many

MODELS = {"geometric α=0.7": Geometric(alpha=0.7), "position": Position(alphas=(0.9, 0.7, 0.5)), "tree α=0.7": Tree(alpha=0.7)}
OUTPUT_TOKENS = 256
K_CAP = 3
SEED = 7
BATCH = 64


def best_of(repeats: int, run: Callable[[], Any]) -> tuple[float, Any]:
    """Least CPU time of `repeats` runs, and the last run's result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.process_time()
        result = run()
        best = min(best, time.process_time() - start)
    return best, result


def reference(model: Any, rids: list[int]) -> list[Any]:
    """bind + first block, request by request."""
    out = []
    for rid in rids:
        request = model.bind(rid, OUTPUT_TOKENS, K_CAP, SEED)
        request.refill()
        out.append(request)
    return out


def bulk(model: Any, rids: list[int]) -> list[Any]:
    """bind_many in batches of 64."""
    out = []
    for lo in range(0, len(rids), BATCH):
        batch = rids[lo : lo + BATCH]
        out += bind_many(model, batch, [OUTPUT_TOKENS] * len(batch), K_CAP, SEED)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rids = list(range(args.requests))
    bulk(Geometric(alpha=0.5), rids[:2])  # compile (or load) the kernel outside the timing
    print(f"{'model':<18} {'bind + refill':>14} {'bind_many':>10} {'ratio':>7}   ({args.requests} requests of {OUTPUT_TOKENS} outputs)")
    for name, model in MODELS.items():
        ref_s, ref = best_of(args.repeats, lambda model=model: reference(model, rids))
        bulk_s, got = best_of(args.repeats, lambda model=model: bulk(model, rids))
        assert all(np.array_equal(a.counts, b.counts) for a, b in zip(ref, got, strict=True)), name
        ref_us, bulk_us = 1e6 * ref_s / len(rids), 1e6 * bulk_s / len(rids)
        print(f"{name:<18} {ref_us:11.2f} µs {bulk_us:7.2f} µs {ref_us / bulk_us:6.1f}x")


if __name__ == "__main__":
    main()
