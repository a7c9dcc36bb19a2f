"""Speculation policies (a registry): the draft length k of every request in every iteration.

A policy is a frozen dataclass (its fields are the config keys of `[policy]`) whose
`controller()` makes the per-run state. Each iteration the engine asks the controller for the
draft lengths of the decoding batch, caps each at the request's remaining tokens − 1, runs the
iteration, and, for adaptive controllers, reports what happened (`observe`). Controllers may
ask the engine what an iteration would cost with other draft lengths (`IterationCoster`).

- off: k = 0 (plain decoding).
- static: the same k for every request.
- oracle: knows each request's true expected tokens τ_i(k) at its current text position and
  the cost model; maximises the batch's expected tokens per time Σ τ_i(k_i) / T(k_1..k_B)
  by one coordinate-ascent sweep per iteration (each request in turn, the others fixed at
  their choices so far, starting from the previous iteration's), ties to the larger k. At
  batch 1 this is exactly argmax_k S(k, α).
- cascade: the utility-driven controller of Saxena et al. (MICRO 2025), as documented in
  docs/simulator.md ("Cascade as implemented").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from moesim.sim.fields import require

TIE_RTOL = 1e-12


class IterationCoster(Protocol):
    """What a controller may ask the engine."""

    def iteration_us(self, batch: list[Any], draft_lens: list[int]) -> float:
        """Draft + verify time of `batch` at these draft lengths (no side effects)."""
        ...


class Controller(Protocol):
    """Per-run policy state."""

    adaptive: bool  # observe() must be called after each iteration

    def attach(self, request: Any) -> None:
        """A request joins the decoding batch."""
        ...

    def draft_lens(self, batch: list[Any], engine: IterationCoster) -> list[int]:
        """Draft length per request of the batch (the engine caps at remaining tokens − 1)."""
        ...

    def observe(self, batch: list[Any], draft_lens: list[int], committed: list[int], iteration_us: float, engine: IterationCoster) -> None:
        """The iteration ran: the draft lengths used, tokens committed per request, draft + verify time."""
        ...


class Policy(Protocol):
    """What every policy config provides."""

    name: ClassVar[str]

    @property
    def k_cap(self) -> int:
        """The largest draft length the policy may choose."""
        ...

    def controller(self) -> Controller:
        """Fresh per-run state."""
        ...


POLICIES: dict[str, type] = {}


def register_policy(cls: type) -> type:
    """Class decorator: make a policy available by its `name`."""
    POLICIES[cls.name] = cls
    return cls


class _Fixed:
    """A controller that always answers the same k."""

    adaptive = False

    def __init__(self, k: int) -> None:
        self._k = k
        self._lists: dict[int, list[int]] = {}

    def attach(self, request: Any) -> None:
        """Nothing to remember per request."""

    def draft_lens(self, batch: list[Any], engine: IterationCoster) -> list[int]:
        """[k] * batch size (one list per batch size, reused)."""
        n = len(batch)
        ks = self._lists.get(n)
        if ks is None:
            ks = self._lists[n] = [self._k] * n
        return ks

    def observe(self, batch: list[Any], draft_lens: list[int], committed: list[int], iteration_us: float, engine: IterationCoster) -> None:
        """Not adaptive."""


@register_policy
@dataclass(frozen=True)
class Off:
    """Plain decoding: k = 0."""

    name: ClassVar[str] = "off"

    @property
    def k_cap(self) -> int:
        """Never drafts."""
        return 0

    def controller(self) -> Controller:
        """k = 0 always."""
        return _Fixed(0)


@register_policy
@dataclass(frozen=True)
class Static:
    """The same draft length k for every request and iteration."""

    name: ClassVar[str] = "static"
    k: int

    def __post_init__(self) -> None:
        require(self.k >= 0, "k", f"must be >= 0, got {self.k}")

    @property
    def k_cap(self) -> int:
        """k."""
        return self.k

    def controller(self) -> Controller:
        """k always."""
        return _Fixed(self.k)


def remaining_limit(request: Any, k_cap: int) -> int:
    """Largest useful draft length: min(k_cap, tokens left − 1)."""
    limit = request.remaining - 1
    return k_cap if k_cap < limit else max(limit, 0)


class _OracleController:
    adaptive = False

    def __init__(self, k_max: int) -> None:
        self._k_max = k_max

    def attach(self, request: Any) -> None:
        """Start from plain decoding."""
        request.policy_state = 0

    def draft_lens(self, batch: list[Any], engine: IterationCoster) -> list[int]:
        """One coordinate-ascent sweep of Σ τ_i(k_i) / T(k) from the previous choices."""
        ks = [r.policy_state for r in batch]
        taus = [r.acceptance.expected_tokens(r.decoded) for r in batch]
        chosen = [min(k, remaining_limit(r, self._k_max)) for k, r in zip(ks, batch, strict=True)]
        total = sum(float(tau[k]) for tau, k in zip(taus, chosen, strict=True))
        for i, request in enumerate(batch):
            others = total - float(taus[i][chosen[i]])
            best_k, best_rate = 0, -math.inf
            for k in range(remaining_limit(request, self._k_max) + 1):
                chosen[i] = k
                rate = (others + float(taus[i][k])) / engine.iteration_us(batch, chosen)
                if rate >= best_rate * (1.0 - TIE_RTOL):
                    best_k, best_rate = k, max(rate, best_rate)
            chosen[i] = best_k
            total = others + float(taus[i][best_k])
            request.policy_state = best_k
        return chosen

    def observe(self, batch: list[Any], draft_lens: list[int], committed: list[int], iteration_us: float, engine: IterationCoster) -> None:
        """Not adaptive: it knows the truth."""


@register_policy
@dataclass(frozen=True)
class Oracle:
    """Best k for each request's true current acceptance and the current batch (see module doc)."""

    name: ClassVar[str] = "oracle"
    k_max: int = 8

    def __post_init__(self) -> None:
        require(self.k_max >= 1, "k_max", f"must be >= 1, got {self.k_max}")

    @property
    def k_cap(self) -> int:
        """k_max."""
        return self.k_max

    def controller(self) -> Controller:
        """Stateless apart from the previous choices."""
        return _OracleController(self.k_max)


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

    def draft_lens(self, batch: list[Any], engine: IterationCoster) -> list[int]:
        """The k of each request's current trial or set phase."""
        return [r.policy_state.k for r in batch]

    def baseline_us(self, batch: list[Any], engine: IterationCoster) -> float:
        """The batch's iteration time at k = 0, refreshed every `baseline_refresh_iterations`
        iterations and whenever the batch size changes."""
        n = len(batch)
        if n != self._baseline_batch or self._baseline_age >= self.config.baseline_refresh_iterations:
            self._baseline_us = engine.iteration_us(batch, [0] * n)
            self._baseline_batch = n
            self._baseline_age = 0
        self._baseline_age += 1
        return self._baseline_us

    def observe(self, batch: list[Any], draft_lens: list[int], committed: list[int], iteration_us: float, engine: IterationCoster) -> None:
        """Accumulate each request's trial; end trials and set phases."""
        relative_cost = iteration_us / self.baseline_us(batch, engine)
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


@register_policy
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


def policy_names() -> list[str]:
    """Registered policies."""
    return list(POLICIES)
