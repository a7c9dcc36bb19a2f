"""Cascade (Saxena et al., MICRO 2025): utility-driven speculation, per request, as documented in
docs/simulator.md ("Cascade as implemented"). A policy of the registry in `policies`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from moesim.fields import require
from moesim.sim.serving.policies import POLICIES, Controller, IterationCoster

TEST, SET = 0, 1


class CascadeState:
    """Cascade's per-request state."""

    __slots__ = ("direction", "k", "left", "phase", "trial_iters", "trial_rel", "trial_tokens", "trials", "zero_set_len")

    def __init__(self, k_init: int, set_iterations: int) -> None:
        self.phase = TEST
        self.k = k_init
        self.trials: list[tuple[int, float]] = []
        self.direction = 1
        self.trial_tokens = 0
        self.trial_rel = 0.0
        self.trial_iters = 0
        self.left = 0
        self.zero_set_len = set_iterations


class _CascadeController:
    adaptive = True

    def __init__(self, config: Cascade) -> None:
        self.config = config
        self._baseline_us = math.nan
        self._baseline_batch = 0
        self._baseline_age = 0

    def attach(self, request: Any) -> None:
        """A new request starts with a test phase at k_init."""
        request.policy_state = CascadeState(self.config.k_init, self.config.set_iterations)

    def draft_lens(self, batch: list[Any], server: IterationCoster) -> list[int]:
        """The k of each request's current trial or set phase."""
        return [r.policy_state.k for r in batch]

    def baseline_us(self, batch: list[Any], server: IterationCoster) -> float:
        """The batch's iteration time at k = 0, refreshed every `baseline_refresh_iterations`
        iterations and whenever the batch size changes."""
        n = len(batch)
        if n != self._baseline_batch or self._baseline_age >= self.config.baseline_refresh_iterations:
            self._baseline_us = server.iteration_us(batch, [0] * n)
            self._baseline_batch = n
            self._baseline_age = 0
        self._baseline_age += 1
        return self._baseline_us

    def observe(self, batch: list[Any], draft_lens: list[int], committed: list[int], iteration_us: float, server: IterationCoster) -> None:
        """Accumulate each request's trial; end trials and set phases."""
        relative_cost = iteration_us / self.baseline_us(batch, server)
        trial_iterations = self.config.trial_iterations
        for request, tokens in zip(batch, committed, strict=True):
            state: CascadeState = request.policy_state
            if state.phase == TEST:
                state.trial_tokens += tokens
                state.trial_rel += relative_cost
                state.trial_iters += 1
                if state.trial_iters == trial_iterations:
                    self._end_trial(state)
            else:
                state.left -= 1
                if state.left == 0:
                    self._start_test(state)

    def _start_test(self, state: CascadeState) -> None:
        state.phase = TEST
        state.trials = []
        state.direction = 1
        if state.k == 0:
            state.k = self.config.k_init

    def _end_trial(self, state: CascadeState) -> None:
        utility = state.trial_tokens / state.trial_rel
        state.trials.append((state.k, utility))
        state.trial_tokens, state.trial_rel, state.trial_iters = 0, 0.0, 0
        next_k = self.next_candidate(state)
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
        """The tried k of the highest utility (ties: the smaller k); 0 (speculation off) when that
        utility is below 1."""
        best_k, best_u = max(trials, key=lambda trial: (trial[1], -trial[0]))
        return best_k if best_u >= 1.0 else 0

    def next_candidate(self, state: CascadeState) -> int | None:
        """Hill-climbing from the first trial's k: step up; keep stepping in the same direction
        while a step beats every earlier trial by more than the tolerance; if the first step up
        does not, step down from the start instead. None: the test phase is over (also after
        `max_trials` trials, or when the next k would leave [1, k_max] or was tried)."""
        cfg = self.config
        trials = state.trials
        if len(trials) >= cfg.max_trials:
            return None
        k_first, k_last = trials[0][0], trials[-1][0]
        if len(trials) == 1:
            state.direction = 1 if k_first < cfg.k_max else -1
            candidate = k_first + state.direction
        elif trials[-1][1] > max(u for _, u in trials[:-1]) * (1.0 + cfg.tolerance):
            candidate = k_last + state.direction
        elif len(trials) == 2 and state.direction == 1:
            state.direction = -1
            candidate = k_first - 1
        else:
            return None
        tried = {k for k, _ in trials}
        return candidate if 1 <= candidate <= cfg.k_max and candidate not in tried else None


@POLICIES.register
@dataclass(frozen=True)
class Cascade:
    """Utility-driven speculation (Cascade): per request, test phases of short trials over k
    (hill-climbing), set phases with the best k, speculation off when its utility is below 1."""

    name: ClassVar[str] = "cascade"
    k_max: int = 8
    k_init: int = 1
    trial_iterations: int = 4
    max_trials: int = 4
    tolerance: float = 0.10
    set_iterations: int = 16
    max_set_iterations: int = 1024
    baseline_refresh_iterations: int = 16

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
        require(
            self.baseline_refresh_iterations >= 1, "baseline_refresh_iterations", f"must be >= 1, got {self.baseline_refresh_iterations}"
        )

    @property
    def k_cap(self) -> int:
        """k_max."""
        return self.k_max

    def controller(self) -> Controller:
        """Fresh Cascade state."""
        return _CascadeController(self)
