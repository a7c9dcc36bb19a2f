"""Reuse features of calibration rows, which carry counts but no routing (`kernels.reuse`).

A row of a measurement table gives n, slots S, distinct experts U and the busiest expert M, and
`routing` names how its pass was drawn (`hw_profiles/microbench/routing.py`):

- `same`: every token picks the same K experts: (n − 1)·K re-reads, all at stack distance K;
  tile reads Σ_e ceil(c_e/T) = U·ceil(n/T).
- `distinct`: slot t·K + j takes expert (t·K + j) mod E: n·K − E re-reads at distance E (when
  n·K > E); counts as even as possible (each expert ⌊S/E⌋ or ⌈S/E⌉ slots).
- `uniform`: each token K distinct experts uniformly: the mean over seeded draws of the pass,
  kept only where a draw has the row's U (at least `MIN_KEPT` draws of `draws_for` a row, else
  all draws), the histogram rescaled to the row's S − U re-reads, the tile reads U plus the
  draws' mean excess (exactly U where the row's M ≤ T). Deterministic: the seed comes from
  (E, K, n, U).
- any other routing, or a row without `experts` / `top_k`: what the counts alone imply, every
  re-read at the working-set distance U and reads U·ceil((S/U)/T) (the time model's own
  assumption without reuse features).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import polars as pl

from moesim.kernels.reuse import DEFAULT_TILES, ReuseFeatures, stream_histogram

MIN_KEPT = 20


def draws_for(slots: int) -> int:
    """Monte Carlo draws of a uniform pass: 200 below 512 slots, else 60."""
    return 200 if slots < 512 else 60


def _counts_reads(counts: np.ndarray, tiles: tuple[int, ...]) -> np.ndarray:
    return np.array([float(np.sum(-(-counts // t))) for t in tiles])


def _same(n: int, k: int, width: int, tiles: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    hist = np.zeros(width)
    if n > 1:
        hist[k] = (n - 1) * k
    return hist, _counts_reads(np.full(k, n), tiles)


def _distinct(n: int, k: int, experts: int, width: int, tiles: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    hist = np.zeros(width)
    slots = n * k
    if slots > experts:
        hist[experts] = slots - experts
    used = min(experts, slots)
    counts = np.full(used, slots // used)
    counts[: slots - counts.sum()] += 1
    return hist, _counts_reads(counts, tiles)


@lru_cache(maxsize=4096)
def _uniform(n: int, k: int, experts: int, distinct: int, most: int, width: int, tiles: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Mean over draws with the row's U (else all): the histogram scaled to S − U re-reads, the
    tile reads U + the draws' mean excess over their own U (exactly U where M ≤ T)."""
    rng = np.random.default_rng([experts, k, n, distinct])
    draws = draws_for(n * k)
    ids = np.argsort(rng.random((draws, n, experts)), axis=2)[:, :, :k].reshape(draws, -1)
    hists = stream_histogram(ids, experts).astype(np.float64)
    counts = np.stack([np.bincount(stream, minlength=experts) for stream in ids])
    used = (counts > 0).sum(axis=1)
    excess = np.stack([_counts_reads(c, tiles) for c in counts]) - used[:, None]
    chosen = used == distinct if np.sum(used == distinct) >= MIN_KEPT else np.ones(draws, bool)
    hist = np.zeros(width)
    hist[: experts + 1] = hists[chosen].mean(axis=0)
    rereads = n * k - distinct
    hist = hist * (rereads / hist.sum()) if hist.sum() > 0 else hist
    reads = distinct + np.where(np.asarray(tiles) >= most, 0.0, excess[chosen].mean(axis=0))
    return hist, reads


def _implied(n: int, slots: int, distinct: int, width: int, tiles: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    hist = np.zeros(width)
    hist[min(distinct, width - 1)] = slots - distinct
    return hist, np.array([distinct * np.ceil(slots / max(distinct, 1) / t - 1e-9) for t in tiles])


def calibration_reuse(frame: pl.DataFrame, tiles: tuple[int, ...] = DEFAULT_TILES) -> ReuseFeatures:
    """Per row: re-read histogram (rows, max E + 1) and tile reads {T: (rows,)} (see the module docstring)."""
    columns = {c: frame[c].to_list() if c in frame.columns else [None] * frame.height for c in ("routing", "experts", "top_k")}
    n, slots, distinct, most = (
        frame[c].to_numpy().astype(np.int64) for c in ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert")
    )
    experts_known = [e for e in columns["experts"] if e is not None]
    width = max([*experts_known, int(distinct.max(initial=1))]) + 1
    memo: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray]] = {}
    hist = np.zeros((frame.height, width))
    reads = np.zeros((frame.height, len(tiles)))
    for i in range(frame.height):
        routing, experts, k = columns["routing"][i], columns["experts"][i], columns["top_k"][i]
        known = experts is not None and k is not None and slots[i] == n[i] * k
        key = (routing if known else None, experts, k, int(n[i]), int(slots[i]), int(distinct[i]), int(most[i]))
        if key not in memo:
            if known and routing == "same" and distinct[i] == k:
                memo[key] = _same(int(n[i]), int(k), width, tiles)
            elif known and routing == "distinct" and distinct[i] == min(experts, slots[i]):
                memo[key] = _distinct(int(n[i]), int(k), int(experts), width, tiles)
            elif known and routing == "uniform":
                memo[key] = _uniform(int(n[i]), int(k), int(experts), int(distinct[i]), int(most[i]), width, tiles)
            else:
                memo[key] = _implied(int(n[i]), int(slots[i]), int(distinct[i]), width, tiles)
        hist[i], reads[i] = memo[key]
    return ReuseFeatures(hist, {t: reads[:, j] for j, t in enumerate(tiles)})
