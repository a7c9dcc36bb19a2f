"""The SimPy server: continuous batching of speculative decoding, one process per server.

Each iteration of the server:
1. admits queued requests (FIFO) while the batch holds fewer than `max_batch`; each admitted
   request is prefilled in this iteration (its prefill pass, `prefill_us(prompt_tokens)`, runs
   before the decode pass and stalls the batch; not mixed into decode passes) and yields its first
   output token at the iteration's end; it decodes from the next iteration on;
2. asks the policy for the draft length k of every decoding request, capped at the request's
   remaining tokens − 1;
3. costs the iteration: drafting (`draft_us(k per request, context)`), then one verify pass of
   the batch (`verify_us` over each request's window of k + 1 positions of its trace sequence,
   see `moesim.sim.serving.workload.TraceWindows`);
4. advances the clock by prefill + draft + verify, then draws each request's accepted count
   (its acceptance model, min(k, A)) and commits accepted + 1 tokens;
5. retires finished requests (closed loop: each is replaced by a new arrival at once).

With KV memory or chunked prefill (`Scheduling`), step 1 is the scheduler's
(`moesim.sim.serving.scheduler`): pages, preemptions, and prefill chunks that share the verify
pass (`mixed_us`) under a token budget, the draft lengths capped so that decode and verify
tokens come first. A policy with `min_draft_steps` (Cascade's drafter kept running at k = 0)
costs at least that many draft steps per iteration; under `moesd_slots` a verify window is
costed at max(k, 1) tokens instead of k + 1.

An open loop's arrivals are a second process, the reference. Costs come from a `BatchCostModel`;
a `TablePassCost` is expanded into lookup lists before the loop starts. Where the run allows it
(a fixed draft length, block acceptance draws, a table or one-device trace cost, a free drafter),
the compiled lane (`moesim.sim.serving.lane`) runs the iterations and this loop, the reference,
takes only those the lane hands back; an open loop's arrivals are then the lane's (drawn ahead
from the same gaps, issued at each step of this loop in the order SimPy gives the two processes'
events), and this loop waits for the next one when it has nothing to run. Everything the outputs need goes into `Records` (lists
here, array segments from the lane; no per-iteration allocation beyond them).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from moesim.sim.cost.pass_table import BatchCostModel, PrefillChunks, TablePassCost
from moesim.sim.serving.acceptance import AcceptanceModel, RequestAcceptance, bind_many
from moesim.sim.serving.lane import Lane, exact_delays
from moesim.sim.serving.policies import Controller, Policy
from moesim.sim.serving.records import Records
from moesim.sim.serving.scheduler import Scheduler, Scheduling
from moesim.sim.serving.workload import Arrivals, TraceWindows, Workload

PROGRESS_EVERY = 4096  # iterations between progress callbacks


class Request:
    """One request's state during the run."""

    __slots__ = (
        "acceptance",
        "admit_seq",
        "arrival_us",
        "decoded",
        "finish_us",
        "first_token_us",
        "kv_pages",
        "kv_tokens",
        "output_tokens",
        "policy_state",
        "pos",
        "pos_end",
        "pos_start",
        "preemptions",
        "prefill_target",
        "prefilled",
        "prompt_tokens",
        "remaining",
        "rid",
        "seq",
        "swapped",
        "trace_start",
        "wraps",
    )

    def __init__(self, rid: int, arrival_us: float, prompt_tokens: int, output_tokens: int, acceptance: RequestAcceptance) -> None:
        self.rid = rid
        self.arrival_us = arrival_us
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.acceptance = acceptance
        self.remaining = output_tokens - 1  # tokens left after the prefill's first token
        self.decoded = 0  # tokens committed by decode passes
        self.first_token_us = math.nan
        self.finish_us = math.nan
        self.policy_state: Any = None
        self.seq = -1
        self.pos = 0
        self.pos_start = 0
        self.pos_end = 0
        self.trace_start = -1
        self.wraps = 0
        self.kv_pages = 0  # KV-cache pages held (memory modelled)
        self.kv_tokens = 0  # the positions they are for (whole blocks of the most it has written, drafts included)
        self.prefill_target = prompt_tokens  # positions to prefill: the prompt, or what a preemption lost
        self.prefilled = 0  # positions prefilled so far (chunked prefill)
        self.swapped = False  # preempted with its KV swapped to the host
        self.preemptions = 0
        self.admit_seq = 0  # admission order (the youngest running request is preempted first)


@dataclass
class ServerRecord:
    """What one run produced, as flat arrays (turned into tables by `moesim.sim.serving.outputs`)."""

    end_us: float
    # per iteration
    start_us: np.ndarray
    prefill_us: np.ndarray
    draft_us: np.ndarray
    verify_us: np.ndarray
    batch: np.ndarray  # decoding requests
    admitted: np.ndarray  # requests whose prefill yielded their first token
    distinct_experts: np.ndarray  # mean distinct experts per MoE layer of the verify pass (NaN: not reported or no decode)
    # per (iteration, decoding request), iteration-major
    step_request: np.ndarray
    step_draft_len: np.ndarray
    step_accepted: np.ndarray
    # per request, in request id order (issued requests only)
    requests: list[Request]
    # per iteration, with KV memory or chunked prefill modelled (None otherwise)
    prefill_tokens: np.ndarray | None = None  # positions prefilled (prompt chunks, recomputed KV)
    kv_pages_used: np.ndarray | None = None  # pages held at the pass (drafts included, before rollback)
    kv_pages_free: np.ndarray | None = None
    preempted: np.ndarray | None = None  # requests preempted
    swap_us: np.ndarray | None = None  # KV moved to and from the host (swap preemption)
    memory: dict[str, Any] | None = None  # the KV budget, preemptions, largest batch held in memory


class _TableCoster:
    """Pass times of a TablePassCost expanded into lists: verify by total tokens, draft by max k."""

    def __init__(self, cost: TablePassCost, max_total: int, k_cap: int, verify_extra: int, draft_floor: int) -> None:
        self.cost = cost
        self.verify = [0.0] + [cost.pass_us(n) for n in range(1, max_total + 1)]
        self.draft = [cost.draft_step_us * k for k in range(max(k_cap, draft_floor) + 1)]
        self.extra = verify_extra
        self.floor = draft_floor

    def iteration(self, batch: list[Request], draft_lens: list[int]) -> tuple[float, float]:
        """(draft µs, verify µs)."""
        steps = max(draft_lens)
        if steps < self.floor:
            steps = self.floor
        if self.extra:
            return self.draft[steps], self.verify[sum(draft_lens) + len(draft_lens)]
        return self.draft[steps], self.verify[sum(k if k else 1 for k in draft_lens)]

    def mixed(self, batch: list[Request], draft_lens: list[int], chunks: list[tuple[Request, int, int]]) -> tuple[float, float]:
        """(draft µs, verify µs) of a pass that also prefills the chunks (request, first position, tokens)."""
        draft = 0.0
        tokens = 0
        if batch:
            steps = max(max(draft_lens), self.floor)
            draft = self.draft[steps]
            tokens = sum(draft_lens) + len(draft_lens) if self.extra else sum(k if k else 1 for k in draft_lens)
        tokens += sum(c for _, _, c in chunks)
        return draft, self.verify[tokens] if tokens < len(self.verify) else self.cost.pass_us(tokens)


class _ProtocolCoster:
    """Any BatchCostModel, asked with the batch's windows as numpy arrays."""

    def __init__(self, cost: BatchCostModel, verify_extra: int, draft_floor: int) -> None:
        self.cost = cost
        self.extra = verify_extra
        self.floor = draft_floor

    def _arrays(self, batch: list[Request], draft_lens: list[int]) -> tuple[np.ndarray, ...]:
        """Draft steps, sequences, window starts, verify tokens and contexts; windows that would
        cross a sequence end are costed where the server will put them (wrapped)."""
        ks = np.array(draft_lens, np.int64)
        seqs = np.array([r.seq for r in batch], np.int64)
        starts = np.array([r.pos if r.pos + k < r.pos_end else r.pos_start for r, k in zip(batch, draft_lens, strict=True)], np.int64)
        context = np.array([r.prompt_tokens + r.decoded + 1 for r in batch], np.int64)
        steps = np.maximum(ks, self.floor) if self.floor else ks
        return steps, seqs, starts, ks + 1 if self.extra else np.maximum(ks, 1), context

    def iteration(self, batch: list[Request], draft_lens: list[int]) -> tuple[float, float]:
        """(draft µs, verify µs) of the batch at these draft lengths."""
        steps, seqs, starts, tokens, context = self._arrays(batch, draft_lens)
        return self.cost.draft_us(steps, context), self.cost.verify_us(seqs, starts, tokens, context)

    def mixed(self, batch: list[Request], draft_lens: list[int], chunks: list[tuple[Request, int, int]]) -> tuple[float, float]:
        """(draft µs, verify µs) of a pass that also prefills the chunks (request, first position, tokens)."""
        steps, seqs, starts, tokens, context = self._arrays(batch, draft_lens)
        draft = self.cost.draft_us(steps, context) if batch else 0.0
        prefill = PrefillChunks(
            np.array([r.seq for r, _, _ in chunks], np.int64),
            np.array([start for _, start, _ in chunks], np.int64),
            np.array([c for _, _, c in chunks], np.int64),
        )
        return draft, self.cost.mixed_us(seqs, starts, tokens, context, prefill)


class Server:
    """One simulated server serving a workload under a policy (see the module docstring)."""

    def __init__(
        self,
        *,
        cost: BatchCostModel,
        policy: Policy,
        acceptance: AcceptanceModel,
        workload: Workload,
        arrivals: Arrivals,
        max_batch: int,
        requests: int,
        duration_us: float,
        seed: int,
        windows: TraceWindows | None = None,
        progress: Callable[[float], None] | None = None,
        scheduling: Scheduling | None = None,
        lane: bool = True,
    ) -> None:
        if requests <= 0 and not duration_us > 0:
            raise ValueError("a run needs a request count or a duration")
        self.cost = cost
        self.policy = policy
        self.controller: Controller = policy.controller()
        self.acceptance = acceptance
        self.workload = workload
        self.arrivals = arrivals
        self.max_batch = max_batch
        self.total_requests = requests  # 0: unlimited (the duration ends the run)
        self.duration_us = duration_us
        self.seed = seed
        self.windows = windows
        self.progress = progress
        self.k_cap = policy.k_cap
        self.scheduling = scheduling or Scheduling()
        extra = 0 if self.scheduling.moesd_slots else 1
        floor = policy.min_draft_steps
        if isinstance(cost, TablePassCost):
            longest = max_batch * (self.k_cap + 1) + (self.scheduling.token_budget if self.scheduling.chunked_prefill else 0)
            self.coster: _TableCoster | _ProtocolCoster = _TableCoster(cost, longest, self.k_cap, extra, floor)
        else:
            self.coster = _ProtocolCoster(cost, extra, floor)
        self.env = simpy.Environment()
        self.queue: deque[Request] = deque()
        self.scheduler = Scheduler(self.scheduling, self.queue, max_batch)
        self.issued: list[Request] = []
        self.records = Records()
        self.completed = 0
        self._wake: simpy.Event | None = None
        self.lane = Lane.of(self) if lane else None  # the compiled lane (None: the Python loop only)

    # ---- services for controllers -----------------------------------------------------------

    def iteration_us(self, batch: list[Request], draft_lens: list[int]) -> float:
        """Draft + verify time of `batch` at `draft_lens` (no side effects)."""
        draft, verify = self.coster.iteration(batch, draft_lens)
        return draft + verify

    # ---- requests ---------------------------------------------------------------------------

    def new_request(self, rid: int) -> Request:
        """Request `rid` as it arrives (its arrival time is the clock's when it is issued)."""
        prompt, output = self.workload.lengths(rid)
        return self._request(rid, prompt, output, self.acceptance.bind(rid, output, self.k_cap, self.seed))

    def new_requests(self, rids: range) -> list[Request]:
        """`new_request` of each of `rids`, their acceptance streams bound together (`bind_many`: the same streams)."""
        lengths = [self.workload.lengths(rid) for rid in rids]
        streams = bind_many(self.acceptance, rids, [output for _, output in lengths], self.k_cap, self.seed)
        return [self._request(rid, p, o, a) for rid, (p, o), a in zip(rids, lengths, streams, strict=True)]

    def _request(self, rid: int, prompt: int, output: int, acceptance: RequestAcceptance) -> Request:
        request = Request(rid, self.env.now, prompt, output, acceptance)
        if self.windows is not None:
            request.seq, request.pos, request.pos_start, request.pos_end = self.windows.place(rid)
            request.trace_start = request.pos
        return request

    def _issue(self) -> None:
        """The next request arrives now and is queued (made ahead by the lane in a closed loop)."""
        rid = len(self.issued)
        request = self.lane.take_pending(rid) if self.lane is not None else None
        if request is None:
            request = self.new_request(rid)
        request.arrival_us = self.env.now
        self.issued.append(request)
        self.queue.append(request)
        if self._wake is not None:
            wake, self._wake = self._wake, None
            wake.succeed()

    def _can_issue(self) -> bool:
        return not self.total_requests or len(self.issued) < self.total_requests

    def _arrivals(self) -> Generator[simpy.Event, None, None]:
        """The open loop's arrivals (the reference: with the lane, its own, drawn ahead from the same gaps)."""
        timeout = self.env.timeout
        for gap in self.arrivals.gaps_us(self.seed):
            if not self._can_issue():
                return
            yield timeout(gap)
            self._issue()

    # ---- the loop ---------------------------------------------------------------------------

    def _loop(self) -> Generator[simpy.Event, None, None]:
        env = self.env
        timeout = env.timeout
        queue = self.queue
        controller = self.controller
        adaptive = controller.adaptive
        coster = self.coster
        prefill_cost = self.cost.prefill_us
        windows = self.windows is not None
        max_batch = self.max_batch
        closed = self.arrivals.kind == "closed"
        k_cap = self.k_cap
        scheduler = self.scheduler
        kv = scheduler.kv
        chunked = self.scheduling.chunked_prefill
        extended = self.scheduling.extended  # memory or chunked prefill: the scheduler decides admissions
        budget = self.scheduling.token_budget
        no_admissions: tuple[Request, ...] = ()
        active: list[Request] = []
        prefilling: list[Request] = []  # chunked prefill: admitted, prompt not yet done
        records = self.records
        lists = records.lists
        rec_start, rec_draft, rec_verify, rec_batch, rec_distinct = (lists[c] for c in ("start", "draft", "verify", "batch", "distinct"))
        rec_prefill_tokens, rec_pages, rec_preempted, rec_swap = (lists[c] for c in ("prefill_tokens", "pages", "preempted", "swap"))
        # a cost model that counts the verify pass's routing says so after each call (`last_distinct_experts`)
        reports = self.cost if hasattr(self.cost, "last_distinct_experts") else None
        rec_admit_at, rec_prefill, rec_admitted = records.admit_at, records.prefill, records.admitted  # sparse: iterations that prefilled
        step_request, step_k, step_acc = lists["step_request"], lists["step_k"], lists["step_acc"]
        progress = self.progress
        countdown = PROGRESS_EVERY
        clock = env.now
        lane = self.lane
        lane_arrivals = lane is not None and lane.open  # the open loop's arrivals drawn ahead, issued by the lane
        while True:
            if lane is not None and (lane.loaded or active or prefilling or queue or lane_arrivals):
                _, done, end = lane.run(active, prefilling, queue, clock, self.duration_us, countdown)
                if done:
                    self._lane_records(lane, done)
                    for delay in exact_delays(clock, end):
                        yield timeout(delay)
                    clock = env.now
                    self.completed += len(lane.settle(done))
                    countdown -= done
                    if not countdown:
                        countdown = PROGRESS_EVERY
                        if progress is not None:
                            progress(self._done_fraction())
                    continue
                lane.store(active, prefilling, queue)  # the Python loop takes this iteration
            admitted: tuple[Request, ...] | list[Request] = no_admissions
            prefill_us = 0.0
            if not extended and queue and len(active) < max_batch:
                admitted = []
                while queue and len(active) + len(admitted) < max_batch:
                    request = queue.popleft()
                    admitted.append(request)
                    prefill_us += prefill_cost(request.prompt_tokens)
            n = len(active)
            ks: list[int] = []
            if n:
                wanted = controller.draft_lens(active, self)
                left = budget
                capped = chunked and budget < n * (k_cap + 1)  # else every verify window fits the budget
                for i in range(n):
                    k = wanted[i]
                    if k > k_cap:
                        k = k_cap
                    remaining = active[i].remaining
                    if k >= remaining:
                        k = remaining - 1
                    if capped:  # decode and verify tokens first, each request at least one
                        limit = left - (n - i)
                        if k > limit:
                            k = limit
                        left -= k + 1
                    ks.append(k)
            chunks: list[tuple[Request, int, int]] = []
            swap_us = 0.0
            if extended:
                plan = scheduler.plan(active, ks, prefilling, prefill_cost)
                active, ks, admitted, chunks, prefill_us, swap_us = (
                    plan.active,
                    plan.ks,
                    plan.admitted,
                    plan.chunks,
                    plan.prefill_us,
                    plan.swap_us,
                )
                n = len(active)
            if n:
                if chunks:
                    draft_us, verify_us = coster.mixed(active, ks, chunks)
                else:
                    draft_us, verify_us = coster.iteration(active, ks)
                rec_distinct.append(reports.last_distinct_experts if reports is not None else math.nan)
                if windows:
                    for i in range(n):
                        request = active[i]
                        if request.pos + ks[i] >= request.pos_end:
                            request.pos = request.pos_start
                            request.wraps += 1
            elif admitted or chunks or (extended and plan.resumed):
                draft_us = verify_us = 0.0
                if chunks:
                    draft_us, verify_us = coster.mixed(active, ks, chunks)
                rec_distinct.append(math.nan)
            else:
                if lane_arrivals:  # the loop waits for the next arrival, the lane's
                    when = lane.next_arrival_us()  # type: ignore[union-attr]
                    if when is None:
                        return
                    if self.duration_us > 0 and when >= self.duration_us:
                        yield env.event()  # the run ends first
                    for delay in exact_delays(clock, when):
                        yield timeout(delay)
                    self._issue()
                    lane.woken()  # type: ignore[union-attr]
                    clock = env.now
                    continue
                if not self._can_issue():
                    return
                self._wake = env.event()
                yield self._wake
                clock = env.now
                continue
            rec_start.append(clock)
            if extended:
                rec_prefill_tokens.append(sum(c for _, _, c in chunks) + sum(r.prefill_target for r in admitted))
                rec_pages.append(kv.capacity - kv.free if kv is not None else 0)
                rec_preempted.append(plan.preempted)
                rec_swap.append(swap_us)
                yield timeout(prefill_us + draft_us + verify_us + swap_us)
            else:
                yield timeout(prefill_us + draft_us + verify_us)
            clock = env.now
            resumed: list[Request] = []
            if extended:
                admitted, resumed = scheduler.prefilled(admitted, chunks, prefilling)
                resumed += plan.resumed
            first_tokens = len(admitted)
            if first_tokens or prefill_us:
                rec_admit_at.append(records.flushed + len(rec_draft))
                rec_prefill.append(prefill_us)
                rec_admitted.append(first_tokens)
            rec_draft.append(draft_us)
            rec_verify.append(verify_us)
            rec_batch.append(n)
            if n:
                committed = [] if adaptive else None
                finished = False
                for i in range(n):
                    request = active[i]
                    k = ks[i]
                    accepted = request.acceptance.draw(request.decoded)
                    if accepted > k:
                        accepted = k
                    c = accepted + 1
                    request.decoded += c
                    request.pos += c
                    request.remaining -= c
                    if not request.remaining:
                        finished = True
                    step_request.append(request.rid)
                    step_k.append(k)
                    step_acc.append(accepted)
                    if committed is not None:
                        committed.append(c)
                if committed is not None:
                    controller.observe(active, ks, committed, draft_us + verify_us, self)
                if finished:
                    still = []
                    for request in active:
                        if request.remaining:
                            still.append(request)
                        else:
                            self._finish(request, clock, closed)
                    active = still
            for request in admitted:
                request.first_token_us = clock
                if request.remaining:
                    controller.attach(request)
                    active.append(request)
                else:
                    self._finish(request, clock, closed)
            if resumed:
                active.extend(resumed)
            if lane_arrivals:
                lane.stepped()  # type: ignore[union-attr]
            countdown -= 1
            if not countdown:
                countdown = PROGRESS_EVERY
                if progress is not None:
                    progress(self._done_fraction())

    def _lane_records(self, lane: Lane, done: int) -> None:
        """Add the lane's last iterations to the records (after the loop's own)."""
        f, i, steps = lane.records(done)
        first, prefill = i[3], f[4]
        admissions = np.flatnonzero((first != 0) | (prefill != 0.0))
        columns = {"start": f[0], "draft": f[1], "verify": f[2], "distinct": f[3], "batch": i[0]}
        if self.scheduling.extended:
            columns |= {"prefill_tokens": i[2], "pages": i[1], "preempted": i[4], "swap": f[5]}
        columns |= {"step_request": steps[0], "step_k": steps[1], "step_acc": steps[2]}
        self.records.add(columns, admissions, prefill[admissions], first[admissions])

    def _finish(self, request: Request, now: float, closed: bool) -> None:
        request.finish_us = now
        if self.scheduler.kv is not None:
            self.scheduler.kv.release(request)
        self.completed += 1
        if closed and self._can_issue():
            self._issue()

    def _done_fraction(self) -> float:
        if self.total_requests:
            fraction = self.completed / self.total_requests
            if self.duration_us > 0:
                fraction = max(fraction, self.env.now / self.duration_us)
            return min(fraction, 1.0)
        return min(self.env.now / self.duration_us, 1.0)

    def run(self) -> ServerRecord:
        """Simulate until every request is done or the duration has passed."""
        if self.arrivals.kind == "closed":
            for _ in range(min(self.arrivals.concurrency, self.total_requests or self.arrivals.concurrency)):
                self._issue()
        elif self.lane is None:
            self.env.process(self._arrivals())
        self.env.process(self._loop())
        if self.duration_us > 0:
            self.env.run(until=self.duration_us)
            if self.lane is not None and self.lane.open:
                self.lane.arrive_until(self.duration_us)  # what the arrivals' process would have issued meanwhile
        else:
            self.env.run()
        return self._record()

    def _record(self) -> ServerRecord:
        if self.lane is not None:
            self.lane.store([], [], deque())  # the requests' state back (the lists are no longer needed)
        records = self.records
        n_iter = records.iterations()  # an iteration cut by the duration has a start but no end
        prefill = np.zeros(n_iter)
        admitted = np.zeros(n_iter, np.int64)
        prefill[records.admit_at] = records.prefill
        admitted[records.admit_at] = records.admitted
        return ServerRecord(
            end_us=float(self.env.now),
            start_us=records.column("start")[:n_iter],
            prefill_us=prefill,
            draft_us=records.column("draft"),
            verify_us=records.column("verify"),
            batch=records.column("batch"),
            admitted=admitted,
            distinct_experts=records.column("distinct")[:n_iter],
            step_request=records.column("step_request"),
            step_draft_len=records.column("step_k"),
            step_accepted=records.column("step_acc"),
            requests=self.issued,
            **self._extended_record(n_iter),
        )

    def _extended_record(self, n_iter: int) -> dict[str, Any]:
        """The per-iteration columns and summary figures of memory and chunked prefill (none when both are off)."""
        if not self.scheduling.extended:
            return {}
        prefill_tokens, pages, preempted, swap = (self.records.column(c)[:n_iter] for c in ("prefill_tokens", "pages", "preempted", "swap"))
        out: dict[str, Any] = {"prefill_tokens": prefill_tokens, "preempted": preempted}
        kv = self.scheduler.kv
        if kv is not None:
            out["kv_pages_used"] = pages
            out["kv_pages_free"] = kv.capacity - out["kv_pages_used"]
            out["swap_us"] = swap
            longest = max(p + o for p, o in zip(self.workload.prompts, self.workload.outputs, strict=True)) + self.k_cap
            out["memory"] = self.scheduler.describe(longest)
        return out
