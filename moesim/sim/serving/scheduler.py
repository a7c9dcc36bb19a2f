"""Scheduling beyond a batch size, as vLLM's v1 scheduler does it: KV-cache pages (admission waits
for pages; a running request that cannot grow preempts the youngest running request, recomputed
later or swapped to the host) and chunked prefill beside decode under a token budget per
iteration (Sarathi-Serve's stall-free batching).

Each iteration, in order (`Scheduler.plan`):

1. the decoding requests, oldest first, take their pages for the k + 1 positions their pass
   writes; while one cannot, the youngest running request (the last admitted) is preempted,
   which may be the request itself;
2. with chunked prefill, requests whose prompt is not done take their next chunk, as much of
   it as the token budget left after the decode and verify tokens allows (the server has
   already capped draft lengths so that every decoding request gets its tokens first);
3. if nobody was preempted this iteration, queued requests are admitted in order while the
   batch holds fewer than `max_batch`, the budget has tokens left (chunked) and their first
   chunk (or whole prompt) finds pages. A swapped request comes back with a swap-in and decodes
   from the next iteration on; a recomputed one prefills its prompt and the tokens it had
   committed, and then decodes (no new token: the KV is what it lost).

Preemption follows vLLM: the victim's pages go back to the pool and it goes to the front of the
queue. `recompute` (vLLM's default) redoes its KV as a prefill; `swap` moves its pages to the host
over the device's host link and back (a request still in prefill is always recomputed).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moesim.sim.serving.memory import KVBudget, KVCache

Request = Any  # moesim.sim.serving.server.Request (the server imports this module)


@dataclass(frozen=True)
class Scheduling:
    """How the server batches beyond `max_batch`: KV memory (None: not modelled) and chunked
    prefill under a token budget per iteration."""

    kv: KVBudget | None = None
    chunked_prefill: bool = False
    token_budget: int = 2048
    moesd_slots: bool = False  # verify passes costed at k tokens per request (MoESD), not k + 1

    @property
    def extended(self) -> bool:
        """Whether the scheduler decides admissions (memory or chunked prefill on)."""
        return self.kv is not None or self.chunked_prefill


class Plan:
    """One iteration's scheduling decisions."""

    __slots__ = ("active", "admitted", "chunks", "ks", "preempted", "prefill_us", "resumed", "swap_us", "victims")

    def __init__(self) -> None:
        self.active: list[Request] = []
        self.ks: list[int] = []
        self.admitted: list[Request] = []  # whole prefills in this pass (not chunked)
        self.chunks: list[tuple[Request, int, int]] = []  # (request, first position, tokens)
        self.resumed: list[Request] = []  # swapped back in: decoding again next iteration
        self.victims: list[Request] = []
        self.preempted = 0
        self.prefill_us = 0.0
        self.swap_us = 0.0


class Scheduler:
    """Admissions, pages and preemptions of one server run (see the module docstring)."""

    def __init__(self, scheduling: Scheduling, queue: deque[Request], max_batch: int) -> None:
        self.scheduling = scheduling
        self.queue = queue
        self.max_batch = max_batch
        budget = scheduling.kv
        self.kv = KVCache(budget) if budget is not None else None
        self.preemptions = 0
        self.max_running = 0
        self._admissions = 0

    def plan(self, active: list[Request], ks: list[int], prefilling: list[Request], prefill_cost: Callable[[int], float]) -> Plan:
        """The iteration's plan: the decoding batch and its draft lengths without the preempted,
        whole prefills, chunks, swap-ins, prefill and swap µs."""
        kv = self.kv
        chunked = self.scheduling.chunked_prefill
        plan = Plan()
        victims = plan.victims
        if kv is not None:
            block, windowed = kv.block_tokens, kv.windowed
            for i, request in enumerate(active):
                written = request.prompt_tokens + request.decoded
                # without windows no block is dropped: a request's pages change only when its pass reaches a new block
                if (windowed or -(-(written + ks[i] + 1) // block) > request.kv_pages) and request not in victims:
                    self._grow(request, written + ks[i] + 1, written, active, prefilling, plan)
        left = self.scheduling.token_budget - sum(ks) - len(ks)
        for request in prefilling:
            if request in victims or left <= 0:
                continue
            tokens = min(request.prefill_target - request.prefilled, left)
            if self._grow(request, request.prefilled + tokens, request.prefilled, active, prefilling, plan):
                plan.chunks.append((request, request.prefilled, tokens))
                left -= tokens
        if victims:
            kept = [i for i, request in enumerate(active) if request not in victims]
            active, ks = [active[i] for i in kept], [ks[i] for i in kept]
            prefilling[:] = [r for r in prefilling if r not in victims]
            plan.chunks = [chunk for chunk in plan.chunks if chunk[0] not in victims]
        queue = self.queue
        while not victims and queue and (left > 0 or not chunked):
            if len(active) + len(prefilling) + len(plan.admitted) + len(plan.resumed) >= self.max_batch:
                break
            request = queue[0]
            if request.swapped:
                written = request.prompt_tokens + request.decoded
                if not kv.grow(request, written, written):  # type: ignore[union-attr]
                    break
                plan.swap_us += self.scheduling.kv.swap_us(request.kv_pages)  # type: ignore[union-attr]
                request.swapped = False
                plan.resumed.append(request)
            elif chunked:
                tokens = min(request.prefill_target, left)
                if kv is not None and not kv.grow(request, tokens, 0):
                    break
                plan.chunks.append((request, 0, tokens))
                prefilling.append(request)
                left -= tokens
            else:
                if kv is not None and not kv.grow(request, request.prefill_target, 0):
                    break
                plan.admitted.append(request)
                plan.prefill_us += prefill_cost(request.prefill_target)
            queue.popleft()
            self._admissions += 1
            request.admit_seq = self._admissions
        running = len(active) + len(prefilling) + len(plan.admitted) + len(plan.resumed)
        if running > self.max_running:
            self.max_running = running
        plan.active, plan.ks, plan.preempted = active, ks, len(victims)
        return plan

    def _grow(self, request: Request, tokens: int, computed: int, active: list[Request], prefilling: list[Request], plan: Plan) -> bool:
        """Pages for `tokens` positions of `request` (`computed` written before the pass), preempting the youngest
        running request while too few are free (False: the request preempted itself)."""
        kv = self.kv
        if kv is None:
            return True
        while not kv.grow(request, tokens, computed):
            victim = max((r for r in (*active, *prefilling) if r not in plan.victims), key=lambda r: r.admit_seq)
            plan.swap_us += self._preempt(victim)
            plan.victims.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request) -> float:
        """Give the victim's pages back and put it at the front of the queue: a decoding victim's
        KV is swapped to the host under `swap` (the µs returned), else recomputed later (a prefill
        of its prompt and the tokens committed so far)."""
        kv = self.kv
        budget = self.scheduling.kv
        assert kv is not None and budget is not None
        self.preemptions += 1
        victim.preemptions += 1
        moved = 0.0
        decoding = not math.isnan(victim.first_token_us) and victim.prefilled == victim.prefill_target
        if budget.preemption == "swap" and decoding:
            moved = budget.swap_us(victim.kv_pages)
            victim.swapped = True
        else:
            victim.prefill_target = victim.prompt_tokens + victim.decoded
            victim.prefilled = 0
        kv.release(victim)
        self.queue.appendleft(victim)
        return moved

    @staticmethod
    def prefilled(
        admitted: list[Request], chunks: list[tuple[Request, int, int]], prefilling: list[Request]
    ) -> tuple[list[Request], list[Request]]:
        """After the pass: whole prefills are done and chunks advance their requests; a request
        whose prefill is done yields its first token (first list) or, after a preemption, rejoins
        the decoding batch (second list)."""
        first: list[Request] = []
        resumed: list[Request] = []
        for request in admitted:
            request.prefilled = request.prefill_target
            (first if math.isnan(request.first_token_us) else resumed).append(request)
        for request, _, tokens in chunks:
            request.prefilled += tokens
            if request.prefilled == request.prefill_target:
                prefilling.remove(request)
                (first if math.isnan(request.first_token_us) else resumed).append(request)
        return first, resumed

    def describe(self, longest_request_tokens: int) -> dict[str, Any]:
        """The memory figures of the summary: the budget, preemptions, the most requests held at
        once, and how many requests of the longest length fit without preemption."""
        budget = self.scheduling.kv
        assert budget is not None and self.kv is not None
        return {
            **budget.describe(),
            "preemptions": self.preemptions,
            "max_running": self.max_running,
            "max_batch_full_length": budget.pages // budget.pass_pages(longest_request_tokens, 1),
        }
