"""Routings of benchmark passes and the features a kernel's time depends on (pure numpy).

Three routing levels, as in the shared H200 measurements: `same` (every token of the pass picks
the same top-k set, so distinct experts U = k), `uniform` (independent uniform top-k sets) and
`distinct` (as many distinct experts as possible, U = min(E, n·k)); and a measurement plan's
passes (`planned`: a given U and busiest-expert count M, `moesim microbench ... --plan`). Every
runner draws its passes here, so a table's `routing` column means the same thing whichever engine
produced it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from moesim.errors import InputError
from moesim.fields import option
from moesim.kernels.features import RoutingFeatures, consecutive_runs
from moesim.parsing import parse_int_ranges

ROUTINGS = ("same", "uniform", "distinct")
PLANNED = "planned"  # the routing of a measurement plan's passes: given U and M (`planned_ids`)

# Pass sizes every runner measures by default: single tokens to 16-token verify passes, then the
# batched sizes where a deduplicating kernel turns compute-bound.
DEFAULT_PASS_SIZES = (*range(1, 17), 24, 32, 48, 64)


def routing_seed(seed: int, *parts: object) -> int:
    """A stable per-pass seed: crc32 of the parts, mixed with the run's seed."""
    return (zlib.crc32("/".join(map(str, parts)).encode()) ^ (seed * 0x9E3779B1)) & 0xFFFFFFFF


def routing_ids(routing: str, n_tokens: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """Expert ids of one pass, shape (n_tokens, top_k), each row k distinct experts."""
    if routing not in ROUTINGS:
        raise InputError(f"unknown routing '{routing}' (known: {', '.join(ROUTINGS)})")
    if not 1 <= top_k <= experts:
        raise InputError(f"top_k must lie in 1..experts, got top_k={top_k}, experts={experts}")
    if n_tokens < 1:
        raise InputError(f"a pass needs at least one token, got n_tokens={n_tokens}")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(experts)  # random expert labels, so no routing favours low ids
    if routing == "same":
        return np.repeat(labels[None, :top_k], n_tokens, axis=0)
    if routing == "distinct":
        slot = np.arange(n_tokens)[:, None] * top_k + np.arange(top_k)[None, :]
        return labels[slot % experts]
    return np.argsort(rng.random((n_tokens, experts)), axis=1)[:, :top_k]


def planned_problem(n_tokens: int, experts: int, top_k: int, distinct: int, most: int) -> str | None:
    """Why no pass of n tokens, each picking k distinct of E experts, has U distinct experts and M
    tokens on its busiest one (None when one does): k <= U <= min(E, n·k), ceil(n·k/U) <= M <= n
    and M + (U - 1) <= n·k (every other expert takes a slot)."""
    slots = n_tokens * top_k
    if not top_k <= distinct <= min(experts, slots):
        return f"distinct experts must lie in {top_k}..{min(experts, slots)} (top-k..min(experts, n·top-k)), got {distinct}"
    low, high = -(-slots // distinct), min(n_tokens, slots - (distinct - 1))
    if not low <= most <= high:
        return f"max tokens per expert must lie in {low}..{high} for {distinct} distinct experts of {slots} slots, got {most}"
    return None


def planned_ids(n_tokens: int, experts: int, top_k: int, distinct: int, most: int, seed: int) -> np.ndarray:
    """Expert ids (n_tokens, top_k) of a pass with exactly U = `distinct` experts and M = `most`
    tokens on the busiest: the busiest expert takes M slots, the other U − 1 the rest as evenly as
    possible; the experts' slots laid out run after run and dealt to tokens column by column
    (slot j·n + t is token t's j-th), so no token picks an expert twice (each run is <= n long)."""
    problem = planned_problem(n_tokens, experts, top_k, distinct, most)
    if problem is not None:
        raise InputError(f"a planned pass of {n_tokens} tokens: {problem}")
    rest = n_tokens * top_k - most
    counts = np.full(distinct - 1, rest // max(distinct - 1, 1), np.int64)
    counts[: rest - int(counts.sum())] += 1
    rng = np.random.default_rng(seed)
    labels = rng.permutation(experts)[:distinct]  # random expert labels, as for the other routings
    runs = np.repeat(labels, np.concatenate(([most], counts)))
    return runs.reshape(top_k, n_tokens).T[rng.permutation(n_tokens)]


def pass_features(ids: np.ndarray, experts: int) -> RoutingFeatures:
    """Tokens n, slots n·k, distinct experts U and the largest token count of one expert."""
    counts = np.bincount(np.asarray(ids).ravel(), minlength=experts)
    return RoutingFeatures(
        n_tokens=np.asarray(ids.shape[0]),
        slots=np.asarray(ids.size),
        distinct_experts=np.asarray(int(np.count_nonzero(counts))),
        max_tokens_per_expert=np.asarray(int(counts.max())),
    )


def gate_weights(n_tokens: int, top_k: int, seed: int) -> np.ndarray:
    """Positive combine weights of each token's slots, summing to 1 per token: shape (n, k)."""
    raw = np.random.default_rng(seed).random((n_tokens, top_k)) + 0.1
    return raw / raw.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class ExpertPlan:
    """The slots of one pass in expert order: what a deduplicating kernel iterates over.

    Slot s = t·k + j is token t's j-th choice. `order` lists the slots sorted by expert (stable);
    expert `present[i]` owns `order[starts[i]:starts[i + 1]]`; `group_ends[e]` is the number of
    sorted slots with expert <= e (the offsets of a grouped GEMM over all E experts).
    """

    slot_tokens: np.ndarray
    slot_experts: np.ndarray
    order: np.ndarray
    present: np.ndarray
    starts: np.ndarray
    group_ends: np.ndarray

    @property
    def sorted_tokens(self) -> np.ndarray:
        """Token of each slot in expert order."""
        return self.slot_tokens[self.order]


def expert_plan(ids: np.ndarray, experts: int) -> ExpertPlan:
    """Group a pass's slots by expert (host-side, before any timing)."""
    n_tokens, top_k = ids.shape
    slot_experts = np.asarray(ids, np.int64).ravel()
    slot_tokens = np.repeat(np.arange(n_tokens, dtype=np.int64), top_k)
    order = np.argsort(slot_experts, kind="stable")
    counts = np.bincount(slot_experts, minlength=experts)
    present = np.flatnonzero(counts)
    starts = np.concatenate(([0], np.cumsum(counts[present])))
    return ExpertPlan(slot_tokens, slot_experts, order, present, starts, np.cumsum(counts))


MAX_PASS_SIZES = 4096  # pass sizes one microbenchmark measures, each up to MAX_PASS_SIZE tokens
MAX_PASS_SIZE = 1 << 16


def parse_pass_sizes(text: str) -> tuple[int, ...]:
    """'1-16,24,32' -> (1, ..., 16, 24, 32): sorted, unique, each in 1..MAX_PASS_SIZE."""
    return parse_int_ranges(text, "pass sizes", 1, MAX_PASS_SIZE, MAX_PASS_SIZES)


def format_pass_sizes(sizes: tuple[int, ...]) -> str:
    """(1, ..., 16, 24, 32) -> '1-16,24,32' (the inverse of `parse_pass_sizes`)."""
    runs = consecutive_runs(sorted(set(sizes)))
    return ",".join(f"{lo}-{hi}" if hi > lo + 1 else ",".join(map(str, range(lo, hi + 1))) for lo, hi in runs)


def pass_sizes_option(default: tuple[int, ...]) -> Any:
    """The pass sizes of a microbenchmark config, written on a command line as e.g. 1-16,24,32."""
    return option(default, "Tokens per pass, e.g. 1-16,24,32.", parse=parse_pass_sizes, show=format_pass_sizes)


def routings_option() -> Any:
    """The routings of a microbenchmark config (all by default), one --routing per value."""
    return option(ROUTINGS, "same, uniform, distinct (repeatable; default all).", repeat="--routing")
