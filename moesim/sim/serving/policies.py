"""Speculation policies (a registry): the draft length k of every request in every iteration.

A policy is a frozen dataclass (its fields are the config keys of `[policy]`) whose
`controller()` makes the per-run state. Each iteration the server asks the controller for the
draft lengths of the decoding batch, caps each at the request's remaining tokens − 1, runs the
iteration, and, for adaptive controllers, reports what happened (`observe`). Controllers may
ask the server what an iteration would cost with other draft lengths (`IterationCoster`).

- off: k = 0 (plain decoding).
- static: the same k for every request.
- oracle: knows each request's true expected tokens τ_i(k) at its current text position and
  the cost model; maximises the batch's expected tokens per time Σ τ_i(k_i) / T(k_1..k_B)
  by one coordinate-ascent sweep per iteration (each request in turn, the others fixed at
  their choices so far, starting from the previous iteration's), ties to the larger k. At
  batch 1 this is exactly argmax_k S(k, α).
- cascade (`cascade.py`): the utility-driven controller of Saxena et al. (MICRO 2025), as its
  paper describes it (docs/simulator.md, "Cascade: the paper and moesim line by line").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from moesim.fields import require
from moesim.registry import Registry
from moesim.sim.analysis.speculation import TIE_RTOL


class IterationCoster(Protocol):
    """What a controller may ask the server."""

    def iteration_us(self, batch: list[Any], draft_lens: list[int]) -> float:
        """Draft + verify time of `batch` at these draft lengths (no side effects)."""
        ...


class Controller(Protocol):
    """Per-run policy state."""

    adaptive: bool  # observe() must be called after each iteration

    def attach(self, request: Any) -> None:
        """A request joins the decoding batch."""
        ...

    def draft_lens(self, batch: list[Any], server: IterationCoster) -> list[int]:
        """Draft length per request of the batch (the server caps at remaining tokens − 1)."""
        ...

    def observe(self, batch: list[Any], draft_lens: list[int], committed: list[int], iteration_us: float, server: IterationCoster) -> None:
        """The iteration ran: the draft lengths used, tokens committed per request, draft + verify time."""
        ...


class Policy(Protocol):
    """What every policy config provides."""

    name: ClassVar[str]

    @property
    def k_cap(self) -> int:
        """The largest draft length the policy may choose."""
        ...

    @property
    def min_draft_steps(self) -> int:
        """Draft steps every request costs per iteration even at k = 0 (a drafter kept running)."""
        ...

    def controller(self) -> Controller:
        """Fresh per-run state."""
        ...


POLICIES: Registry[Policy] = Registry("policy")


class _Fixed:
    """A controller that always answers the same k."""

    adaptive = False

    def __init__(self, k: int) -> None:
        self._k = k
        self._lists: dict[int, list[int]] = {}

    def attach(self, request: Any) -> None:
        """Nothing to remember per request."""

    def draft_lens(self, batch: list[Any], server: IterationCoster) -> list[int]:
        """[k] * batch size (one list per batch size, reused)."""
        n = len(batch)
        ks = self._lists.get(n)
        if ks is None:
            ks = self._lists[n] = [self._k] * n
        return ks

    def observe(self, batch: list[Any], draft_lens: list[int], committed: list[int], iteration_us: float, server: IterationCoster) -> None:
        """Not adaptive."""


@POLICIES.register
@dataclass(frozen=True)
class Off:
    """Plain decoding: k = 0."""

    name: ClassVar[str] = "off"
    min_draft_steps: ClassVar[int] = 0

    @property
    def k_cap(self) -> int:
        """Never drafts."""
        return 0

    def controller(self) -> Controller:
        """k = 0 always."""
        return _Fixed(0)


@POLICIES.register
@dataclass(frozen=True)
class Static:
    """The same draft length k for every request and iteration."""

    name: ClassVar[str] = "static"
    min_draft_steps: ClassVar[int] = 0
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

    def draft_lens(self, batch: list[Any], server: IterationCoster) -> list[int]:
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
                rate = (others + float(taus[i][k])) / server.iteration_us(batch, chosen)
                if rate >= best_rate * (1.0 - TIE_RTOL):
                    best_k, best_rate = k, max(rate, best_rate)
            chosen[i] = best_k
            total = others + float(taus[i][best_k])
            request.policy_state = best_k
        return chosen

    def observe(self, batch: list[Any], draft_lens: list[int], committed: list[int], iteration_us: float, server: IterationCoster) -> None:
        """Not adaptive: it knows the truth."""


@POLICIES.register
@dataclass(frozen=True)
class Oracle:
    """Best k for each request's true current acceptance and the current batch (see module doc)."""

    name: ClassVar[str] = "oracle"
    min_draft_steps: ClassVar[int] = 0
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
