"""Cascade (Saxena et al., MICRO 2025): utility-driven speculation, per request, as its paper
describes it (read through a summary of the paper; docs/simulator.md, "Cascade: the paper and
moesim line by line"). A policy of the registry in `policies`.

Per request: a **base** phase of `baseline_iterations` iterations at k = 0 measures the
iteration time without speculation, T_base (mean of the request's latest k = 0 iterations; any
k = 0 iteration refreshes it, and a base phase runs again before a test phase once
`baseline_refresh_iterations` iterations have passed without one). A **test** phase runs trials
of `trial_iterations` iterations at one k; a trial's utility is U = Σ tokens / Σ (T_iter / T_base).
The first trial runs at the non-zero k of the best utility in the request's history (`k_init`
without history); a trial at k = 1 with U < 1 ends the test with k = 0; otherwise the climb moves
k by the sign of ΔU/ΔK between the last two trials (up after the first trial if U ≥ 1, down if
not), and stops when two consecutive utilities differ by at most `tolerance` (relative), when a
maximum has been passed (a tried k above both tried neighbours), when the next k would be 0 or
above `k_max`, or after `max_trials` trials. The **set** phase runs the best tried k (ties: the
smaller) for `set_iterations` iterations, or k = 0 when the best utility is below 1, for a set
phase that doubles each time k = 0 is chosen (capped at `max_set_iterations`; a k > 0 resets it).
With `drafter_at_k0` a model drafter keeps running at k = 0 (one draft step per iteration, its
cost counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from moesim.fields import require
from moesim.sim.serving.policies import POLICIES, Controller, IterationCoster

BASE, TEST, SET = 0, 1, 2


class CascadeState:
    """Cascade's per-request state."""

    __slots__ = (
        "base_times",
        "base_us",
        "history",
        "k",
        "left",
        "phase",
        "since_base",
        "trial_iters",
        "trial_rel",
        "trial_tokens",
        "trials",
        "zero_set_len",
    )

    def __init__(self, baseline_iterations: int, set_iterations: int) -> None:
        self.phase = BASE
        self.k = 0
        self.left = baseline_iterations
        self.trials: list[tuple[int, float]] = []
        self.history: dict[int, float] = {}  # latest utility of each non-zero k tried
        self.trial_tokens = 0
        self.trial_rel = 0.0
        self.trial_iters = 0
        self.zero_set_len = set_iterations
        self.base_times: list[float] = []
        self.base_us = math.nan
        self.since_base = 0


def maximum_passed(trials: list[tuple[int, float]]) -> bool:
    """A tried k whose utility is above those of both tried neighbours k − 1 and k + 1."""
    utility = dict(trials)
    return any(k - 1 in utility and k + 1 in utility and u > utility[k - 1] and u > utility[k + 1] for k, u in utility.items())


class _CascadeController:
    adaptive = True

    def __init__(self, config: Cascade) -> None:
        self.config = config

    def attach(self, request: Any) -> None:
        """A new request starts with a base phase at k = 0."""
        request.policy_state = CascadeState(self.config.baseline_iterations, self.config.set_iterations)

    def draft_lens(self, batch: list[Any], server: IterationCoster) -> list[int]:
        """The k of each request's current phase."""
        return [r.policy_state.k for r in batch]

    def observe(self, batch: list[Any], draft_lens: list[int], committed: list[int], iteration_us: float, server: IterationCoster) -> None:
        """Each request measures T_base on its k = 0 iterations, accumulates its trial, ends phases."""
        cfg = self.config
        for request, k, tokens in zip(batch, draft_lens, committed, strict=True):
            state: CascadeState = request.policy_state
            if k == 0:
                state.base_times.append(iteration_us)
                if len(state.base_times) > cfg.baseline_iterations:
                    del state.base_times[0]
                state.base_us = sum(state.base_times) / len(state.base_times)
                state.since_base = 0
            else:
                state.since_base += 1
            if state.phase == TEST:
                state.trial_tokens += tokens
                state.trial_rel += iteration_us / state.base_us
                state.trial_iters += 1
                if state.trial_iters == cfg.trial_iterations:
                    self._end_trial(state)
                continue
            state.left -= 1
            if state.left == 0:
                if state.phase == SET and state.since_base >= cfg.baseline_refresh_iterations:
                    state.phase, state.k, state.left = BASE, 0, cfg.baseline_iterations
                else:
                    self._start_test(state)

    def _start_test(self, state: CascadeState) -> None:
        state.phase = TEST
        state.trials = []
        state.k = self.first_candidate(state.history)

    def first_candidate(self, history: dict[int, float]) -> int:
        """The non-zero k of the best utility in the request's history (ties: the smaller k); `k_init` without history."""
        if not history:
            return self.config.k_init
        return max(history.items(), key=lambda item: (item[1], -item[0]))[0]

    def _end_trial(self, state: CascadeState) -> None:
        utility = state.trial_tokens / state.trial_rel
        state.trials.append((state.k, utility))
        state.history[state.k] = utility
        state.trial_tokens, state.trial_rel, state.trial_iters = 0, 0.0, 0
        next_k = self.next_candidate(state.trials)
        if next_k is not None:
            state.k = next_k
            return
        state.phase = SET
        state.k = self.choose(state.trials)
        if state.k == 0:
            state.zero_set_len = min(2 * state.zero_set_len, self.config.max_set_iterations)
            state.left = state.zero_set_len
        else:
            state.zero_set_len = self.config.set_iterations
            state.left = self.config.set_iterations

    def choose(self, trials: list[tuple[int, float]]) -> int:
        """k = 0 after a trial at k = 1 below utility 1; else the tried k of the highest utility
        (ties: the smaller k), or 0 when that utility is below 1."""
        k_last, u_last = trials[-1]
        if k_last == 1 and u_last < 1.0:
            return 0
        best_k, best_u = max(trials, key=lambda trial: (trial[1], -trial[0]))
        return best_k if best_u >= 1.0 else 0

    def next_candidate(self, trials: list[tuple[int, float]]) -> int | None:
        """The next trial's k, or None when the test phase is over (see the module docstring)."""
        cfg = self.config
        k_cur, u_cur = trials[-1]
        if (k_cur == 1 and u_cur < 1.0) or len(trials) >= cfg.max_trials:
            return None
        if len(trials) == 1:
            direction = 1 if u_cur >= 1.0 else -1
        else:
            k_prev, u_prev = trials[-2]
            if abs(u_cur - u_prev) <= cfg.tolerance * u_prev or maximum_passed(trials):
                return None
            direction = 1 if (u_cur - u_prev) * (k_cur - k_prev) > 0 else -1
        tried = [k for k, _ in trials]
        candidate = k_cur + direction
        if candidate in tried:
            candidate = max(tried) + 1 if direction > 0 else min(tried) - 1
        return candidate if 1 <= candidate <= cfg.k_max else None


@POLICIES.register
@dataclass(frozen=True)
class Cascade:
    """Utility-driven speculation (Cascade): per request, a measured base time at k = 0, test phases
    of short trials over k (hill-climbing), set phases with the best k, speculation off when its
    utility is below 1 (see the module docstring)."""

    name: ClassVar[str] = "cascade"
    k_max: int = 8
    k_init: int = 1
    trial_iterations: int = 4
    max_trials: int = 4
    tolerance: float = 0.10
    set_iterations: int = 16
    max_set_iterations: int = 1024
    baseline_iterations: int = 2
    baseline_refresh_iterations: int = 100
    drafter_at_k0: bool = True

    def __post_init__(self) -> None:
        require(self.k_max >= 1, "k_max", f"must be >= 1, got {self.k_max}")
        require(1 <= self.k_init <= self.k_max, "k_init", f"must lie in [1, k_max = {self.k_max}], got {self.k_init}")
        require(self.trial_iterations >= 1, "trial_iterations", f"must be >= 1, got {self.trial_iterations}")
        require(self.max_trials >= 1, "max_trials", f"must be >= 1, got {self.max_trials}")
        require(math.isfinite(self.tolerance) and self.tolerance >= 0, "tolerance", f"must be >= 0, got {self.tolerance}")
        require(self.set_iterations >= 1, "set_iterations", f"must be >= 1, got {self.set_iterations}")
        require(
            self.max_set_iterations >= self.set_iterations,
            "max_set_iterations",
            f"must be >= set_iterations, got {self.max_set_iterations}",
        )
        require(self.baseline_iterations >= 1, "baseline_iterations", f"must be >= 1, got {self.baseline_iterations}")
        require(
            self.baseline_refresh_iterations >= 1, "baseline_refresh_iterations", f"must be >= 1, got {self.baseline_refresh_iterations}"
        )

    @property
    def k_cap(self) -> int:
        """k_max."""
        return self.k_max

    @property
    def min_draft_steps(self) -> int:
        """One draft step per iteration at k = 0 when a model drafter keeps running (`drafter_at_k0`)."""
        return 1 if self.drafter_at_k0 else 0

    def controller(self) -> Controller:
        """Fresh Cascade state."""
        return _CascadeController(self)
