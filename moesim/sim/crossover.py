"""Where deduplicating expert reads wins: byte share u(n), bandwidth ratio r(n), crossover, win set."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def byte_share(distinct_experts: np.ndarray, n_tokens: np.ndarray, top_k: int) -> np.ndarray:
    """u(n) = U(n) / (n·K): the dedup engine's expert bytes relative to the per-slot engine's."""
    return np.asarray(distinct_experts, np.float64) / (np.asarray(n_tokens, np.float64) * top_k)


def bandwidth_ratio(per_slot_us: np.ndarray, dedup_us: np.ndarray, share: np.ndarray) -> np.ndarray:
    """r(n) = BW_dedup / BW_per_slot = u(n) · T_per_slot(n) / T_dedup(n) (effective, on requested bytes)."""
    return np.asarray(share) * np.asarray(per_slot_us, np.float64) / np.asarray(dedup_us, np.float64)


@dataclass(frozen=True)
class WinWindow:
    """Pass sizes where dedup is faster than per-slot: the first (crossover) and all of them."""

    crossover_n: int | None
    dedup_wins: list[int]


def win_window(n_tokens: np.ndarray, per_slot_us: np.ndarray, dedup_us: np.ndarray) -> WinWindow:
    """Dedup wins at n iff T_dedup(n) < T_per_slot(n); it may win in a window and lose again."""
    n = np.asarray(n_tokens)
    wins = np.asarray(dedup_us) < np.asarray(per_slot_us)
    winners = [int(x) for x in n[wins]]
    return WinWindow(winners[0] if winners else None, winners)


def uniform_crossover(experts: int, top_k: int, ratio: float, max_pass: int = 1024) -> int | None:
    """First n with u(n) < r under uniform routing and a constant bandwidth ratio r (the seed's rule)."""
    n = np.arange(1, max_pass + 1)
    share = experts * (1.0 - (1.0 - top_k / experts) ** n) / (n * top_k)
    below = np.flatnonzero(share < ratio)
    return int(n[below[0]]) if below.size else None
