"""The server's compiled lane: whole server iterations (draft lengths, KV pages, chunked prefill
or whole prefills, admissions, the pass, the records, the commits, finishes and a closed loop's
new arrivals) run in one compiled call (`kernel.serve`) over the state of every request the lane
holds, kept in arrays of request rows; the Python loop of `moesim.sim.serving.server` is the
reference (tested equal, record for record).

A lane iteration does what the loop and the scheduler (`moesim.sim.serving.scheduler`) do, in
their order: an open loop's arrivals due at the iteration's start (`kernel.arrive`: drawn ahead
from the arrivals' seed with the requests, issued in the order SimPy would give the arrivals'
events and the loop's); draft lengths (a fixed k, capped at the remaining tokens − 1 and by the
token budget under chunked prefill); the decoding requests' pages for their k + 1 positions and
the prefilling requests' next chunks, preempting the youngest running request while too few
pages are free (recomputed later, or swapped to the host over its link: the swap's µs in the
iteration); without a preemption, the admissions (the queue's head while the batch has room, the
budget tokens and its first chunk or whole prompt pages, a swapped request's swap-in); the pass
(a `TablePassCost` lookup, or the trace-driven step-time model in one compiled pass,
`moesim.sim.cost.fast_pass`, decode windows and prefill chunks together, with a drafter that
costs nothing); the records, the window wrap, the acceptance draws (precomputed blocks), the
commits, the prefills that finished (first tokens), the requests that finished and, in a closed
loop, the requests that replace them (made in Python ahead of time: `Lane.pending`).

The plan is tentative until its checks pass: the lane stops, before changing anything, where the
Python loop has to decide: the loop would run out of requests made ahead, a pass size reaches its
tables, a mixed pass's size without tables has a family priced by its lookup ladder (a decode
pass's size, bounded by the batch and k, is tabled at once), the duration would cut the
iteration, or nothing is left to run; and it asks Python for a block of draws that is used up and
for a whole prefill's cost it has not seen. Many iterations run in one call (one `Timeout` for
all of them), closed and open loops alike: nothing outside the lane can change meanwhile (the
arrivals are the lane's).
"""

from __future__ import annotations

import math
from collections import deque
from operator import attrgetter
from typing import Any

import numpy as np

from moesim.kernels.unions import PrefillRegion
from moesim.sim.cost.drafters import draft_steps
from moesim.sim.cost.fast_pass import scratch_for
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.cost.trace_batch import TraceBatchCost
from moesim.sim.serving.acceptance import _BlockDraws
from moesim.sim.serving.lane.kernel import (
    ACT,
    ADMISSIONS,
    ARRIVAL,
    ARRIVED_AT,
    ASKED,
    BAD_IDS,
    DRAW_AT,
    DRAW_LEN,
    FIELDS,
    FINISH,
    FIRST,
    ISSUED,
    LADDER,
    LINK_GBPS,
    LINK_US,
    MAX_RUNNING,
    MORE,
    N_ACT,
    N_FIN,
    N_PRE,
    N_STEPS,
    P_HEAD,
    P_TAIL,
    PAGE_BYTES,
    PEND,
    PENDING,
    PRE,
    PREEMPTS,
    PREFILL,
    PREFILL_COST,
    Q_HEAD,
    Q_TAIL,
    QUE,
    REFILL,
    RID,
    SCANNED,
    SEQ,
    SEQ_ROW,
    STEP_AT,
    STOP,
    SWAP_ON,
    SWAPPED,
    TABLE,
    TARGET,
    serve,
)  # fmt: skip
from moesim.sim.serving.policies import _Fixed

ROWS = DRAW_LEN + 1  # the int columns of a request row
SEGMENT = 4096  # iterations one call may run at most
STEPS_KEPT = 1 << 20  # per-step records one call may write (the batch size divides them into iterations)
_ROW_FIELDS = attrgetter(*FIELDS, "seq", "rid")
_ROW_TIMES = attrgetter("arrival_us", "first_token_us", "finish_us")


def _longest_block(server: Any) -> int:
    return max(1, min(4096, max(server.workload.outputs, default=1)))


def _overhead_table(cost: TraceBatchCost, max_batch: int, k_cap: int) -> np.ndarray:
    """The engine's overhead O of an iteration whose longest draft is k and whose requests verify v
    tokens in all, flat at k·(V + 1) + v (V = max_batch·(k_cap + 1)): what `_Drafting.draft_us` adds
    for a free drafter (0 µs of drafting, no draft model); one zero without engine terms."""
    spec = cost.model.profile.speculative
    if spec is None:
        return np.zeros(1)
    top, layers = max_batch * (k_cap + 1), cost.model.preset.layers
    steps = [draft_steps(cost.drafter, k) for k in range(k_cap + 1)]
    return np.array([0.0 + spec.overhead_us(steps[k], v, 0, max(v - k, 1), layers) if k else 0.0
                     for k in range(k_cap + 1) for v in range(top + 1)])  # fmt: skip


class Lane:
    """The compiled lane of one server run; `Lane.of` says whether the run can use it.

    While `loaded`, the lane holds the batch, the requests in prefill and the queue's head (the
    server's lists are then stale; `store` gives them back); requests made ahead for a closed
    loop (`pending`, not yet issued) stay with the lane across loads."""

    def __init__(self, server: Any, k: int) -> None:
        self.server = server
        cap = server.max_batch
        self.block = _longest_block(server)
        self.rows_total = 0
        self._grow_rows(4 * cap + 8)
        self.reqs: list[Any] = [None] * self.rows_total  # the Request of each row in use
        self.free_rows = list(range(self.rows_total - 1, -1, -1))
        self.pending: deque[Any] = deque()  # made ahead, in request id order (closed loop)
        self.lists = np.zeros((4, self.rows_total), np.int64)
        self.cnt = np.zeros(14, np.int64)
        # windows and blocks of a pass: the decode windows, and per chunk two windows and a block for
        # every time it wraps around the prefill region (chunks of at most the token budget)
        trace_rows = server.cost.trace.experts.shape[0] if isinstance(server.cost, TraceBatchCost) else 1
        region_rows = max(1, trace_rows if trace_rows < 16 else (min(trace_rows, 4096) // 16) * 16)  # as PrefillRegion.of
        wraps = -(-server.scheduling.token_budget // region_rows) + 1
        wide = cap * (server.k_cap + 1) + 2 * cap * (wraps + 1) + 8
        blocks = cap * wraps + 2
        self.work = (
            np.zeros(cap, np.int64), np.zeros(3 * cap, np.int64), np.zeros(3 * cap, np.int64), np.zeros(wide, np.int64),
            np.zeros(wide, np.int64),
            np.zeros(blocks, np.int64), np.zeros(blocks, np.int64), np.zeros(cap, np.int64), np.zeros(cap, np.int64),
            np.zeros(cap, np.int64), np.zeros(2 * cap, np.int64), np.zeros(2 * cap, np.int64), np.zeros(cap, np.int64),
            np.zeros(cap, np.int64), np.zeros(cap, np.int64), np.zeros(cap, np.int64), np.zeros(cap, np.int64),
        )  # fmt: skip
        self.segment = max(1, min(SEGMENT, STEPS_KEPT // cap))  # iterations per call: the step records bounded
        self.out_f = np.zeros((6, self.segment))
        self.out_i = np.zeros((5, self.segment), np.int64)
        self.steps = np.zeros((3, self.segment * cap), np.int64)
        self.fin = np.zeros(self.segment * cap + cap, np.int64)
        self.loaded = False
        self.iterations = 0  # run by the lane (the rest by the Python loop)
        self.prefill_costs: dict[int, float] = {}
        scheduling = server.scheduling
        kv = server.scheduler.kv
        self.kv = np.array([kv.free if kv else 0, kv.capacity if kv else 0, kv is not None], np.int64)
        self.groups = (np.array(kv.windows if kv else (0,), np.int64), np.array(kv.parts if kv else (1,), np.int64))
        budget = scheduling.kv
        self.fl = np.array([0.0, 0.0, 0.0, 1.0, 0.0, math.inf])  # swap (see kernel: SWAP_ON ..), the arrival clock
        if budget is not None and budget.preemption == "swap" and budget.host_link is not None:
            link = budget.host_link
            self.fl[[SWAP_ON, LINK_US, PAGE_BYTES, LINK_GBPS]] = 1.0, link.latency_us, budget.page_bytes, link.bandwidth_gbps
        arrivals = server.arrivals
        self.open = arrivals.open  # the open loop's arrivals are the lane's (drawn ahead from the seed)
        limits = [m for m in (server.total_requests, arrivals.limit) if m]
        self.limit = min(limits) if limits else 0  # the most requests the run issues (0: unbounded)
        self._gaps = arrivals.gaps_us(server.seed) if self.open else iter(())
        self._last_arrival_us = 0.0
        self.decode_max = cap * (server.k_cap + 1)  # decode passes: their sizes tabled at their first pass (ladder-priced families)
        cost = server.cost
        self.table_mode = isinstance(cost, TablePassCost)
        region = None
        if self.table_mode:
            coster = server.coster
            self.tables = (np.asarray(coster.verify, np.float64), np.asarray(coster.draft, np.float64))
            self.experts = np.zeros((1, 1, 1), np.uint8)
            self.scratch = scratch_for(1, 1)
            self.seq_starts = np.zeros(2, np.int64)
        else:
            self.tables = (np.zeros(1), _overhead_table(cost, cap, server.k_cap))
            self.experts = cost.trace.experts
            self.scratch = scratch_for(self.experts.shape[1], cost.trace.meta.geometry.experts, cost.trace.expert_masks)
            self.seq_starts = cost.trace.seq_starts
            longest = cap * (server.k_cap + 1) + (scheduling.token_budget if scheduling.chunked_prefill else 0)
            cost.model.pass_tables.ensure(longest)
            if scheduling.chunked_prefill:
                if cost._region is None:
                    cost._region = PrefillRegion.of(cost.trace.experts, cost.trace.meta.geometry.experts)
                region = cost._region
        self.region = region.checkpoints if region is not None else _NO_REGION
        self.cfg = np.array(
            [k, server.k_cap, scheduling.token_budget, scheduling.chunked_prefill, server.windows is not None,
             0 if scheduling.moesd_slots else 1, self.table_mode, kv.block_tokens if kv else 1, scheduling.extended, cap,
             not arrivals.open, server.total_requests, region.rows if region else 1, region.stride if region else 1, self.open, self.limit],
            np.int64,
        )  # fmt: skip

    @classmethod
    def of(cls, server: Any) -> Lane | None:
        """A lane for runs of a fixed draft length, position-independent acceptance draws and a
        table or one-device trace-driven cost with a drafter that costs nothing, a chain (no draft
        tree) and no spec-path terms; else None."""
        controller = server.controller
        if type(controller) is not _Fixed or server.policy.min_draft_steps or not server.workload.outputs:
            return None
        probe = server.acceptance.bind(0, 2, server.k_cap, server.seed)
        if not isinstance(probe, _BlockDraws) or type(probe).draw is not _BlockDraws.draw:
            return None
        cost = server.cost
        if isinstance(cost, TraceBatchCost):
            one_device = cost.compiled and cost.model.parallel.ranks == 1 and server.windows is not None
            plain_chain = not cost.widths  # no tree (the engine's terms: per-pass constants and `_overhead_table`)
            if not (one_device and plain_chain and cost._drafting.free):
                return None
        elif not isinstance(cost, TablePassCost):
            return None
        return cls(server, controller._k)

    # ---- rows ------------------------------------------------------------------------------

    def _grow_rows(self, rows: int) -> None:
        """Room for `rows` requests (the row arrays grown, their contents kept)."""
        if rows <= self.rows_total:
            return
        old = self.rows_total
        rows = max(rows, 2 * old)
        if old == 0:
            self.st = np.zeros((ROWS, rows), np.int64)
            self.sf = np.full((4, rows), math.nan)
            self.draws = np.zeros((rows, self.block), np.int64)
        else:
            self.st = np.concatenate([self.st, np.zeros((ROWS, rows - old), np.int64)], axis=1)
            self.sf = np.concatenate([self.sf, np.full((4, rows - old), math.nan)], axis=1)
            self.draws = np.concatenate([self.draws, np.zeros((rows - old, self.block), np.int64)])
            self.lists = np.concatenate([self.lists, np.zeros((4, rows - old), np.int64)], axis=1)
            self.reqs += [None] * (rows - old)
            self.free_rows = list(range(rows - 1, old - 1, -1)) + self.free_rows
        self.rows_total = rows

    def _put_many(self, requests: list[Any]) -> list[int]:
        """Rows holding the requests' state (a first block of draws made where one has none)."""
        if not requests:
            return []
        if len(self.free_rows) < len(requests):
            self._grow_rows(self.rows_total + len(requests))
        rows = [self.free_rows.pop() for _ in requests]
        values = np.array([_ROW_FIELDS(q) for q in requests], np.int64).T  # FIELDS, seq, rid
        st, sf = self.st, self.sf
        st[: len(FIELDS), rows] = values[: len(FIELDS)]
        st[SEQ, rows] = values[-2]
        st[SEQ_ROW, rows] = self.seq_starts[values[-2]] if not self.table_mode else 0
        st[RID, rows] = values[-1]
        costs = self.prefill_costs
        sf[:, rows] = np.array([(*_ROW_TIMES(q), costs.get(q.prefill_target, math.nan)) for q in requests]).T
        draws = self.draws
        for r, request in zip(rows, requests, strict=True):
            self.reqs[r] = request
            acceptance = request.acceptance
            if acceptance.counts.size == 0:
                acceptance.refill()
            counts = acceptance.counts
            draws[r, : counts.size] = counts
        st[DRAW_AT, rows] = [q.acceptance.at for q in requests]
        st[DRAW_LEN, rows] = [q.acceptance.counts.size for q in requests]
        return rows

    def _put_draws(self, r: int, acceptance: _BlockDraws) -> None:
        counts = acceptance.counts
        self.draws[r, : counts.size] = counts
        self.st[DRAW_AT, r] = acceptance.at
        self.st[DRAW_LEN, r] = counts.size

    def _get_many(self, rows: list[int]) -> list[Any]:
        """The rows' state back into their Requests; the rows freed."""
        out = []
        ints = self.st[:, rows].T.tolist()
        times = self.sf[FIRST : FINISH + 1, rows].T.tolist()
        for r, row, (first, finish) in zip(rows, ints, times, strict=True):
            request = self.reqs[r]
            for f, name in enumerate(FIELDS):
                setattr(request, name, row[f])
            request.swapped = bool(row[SWAPPED])
            request.acceptance.at = row[DRAW_AT]
            request.first_token_us, request.finish_us = first, finish  # (arrival: set when issued)
            self.reqs[r] = None
            out.append(request)
        self.free_rows += rows
        return out

    # ---- the requests made ahead (closed loop) ---------------------------------------------

    def _top_up(self) -> None:
        """At least 2 × max batch requests made ahead, or every one the run may still issue."""
        server = self.server
        wanted = max(2 * server.max_batch, 256 if self.open else 0)  # an open loop: fewer calls cut short to make more
        self._grow_rows(self.rows_total - len(self.free_rows) + wanted + 1)
        cnt, lists = self.cnt, self.lists
        cnt[P_TAIL] -= cnt[P_HEAD]
        lists[PEND, : cnt[P_TAIL]] = lists[PEND, cnt[P_HEAD] : cnt[P_HEAD] + cnt[P_TAIL]]
        cnt[P_HEAD] = 0
        first = len(server.issued) + len(self.pending)
        last = first + wanted - len(self.pending)
        if self.limit:
            last = min(last, self.limit)
        if last <= first:
            return
        made = server.new_requests(range(first, last))
        if self.open:  # their arrival times, as SimPy adds the gaps
            at = self._last_arrival_us
            for request, gap in zip(made, self._gaps, strict=False):
                at = at + gap
                request.arrival_us = at
            self._last_arrival_us = at
        self.pending.extend(made)
        lists[PEND, cnt[P_TAIL] : cnt[P_TAIL] + len(made)] = self._put_many(made)
        cnt[P_TAIL] += len(made)

    def take_pending(self, rid: int) -> Any | None:
        """The request `rid` if it was made ahead (it leaves the lane), else None."""
        if not self.pending or self.pending[0].rid != rid:
            return None
        request = self.pending.popleft()
        r = int(self.lists[PEND, self.cnt[P_HEAD]])
        self.cnt[P_HEAD] += 1
        self.reqs[r] = None
        self.free_rows.append(r)
        return request

    # ---- the server's lists ----------------------------------------------------------------

    def load(self, active: list[Any], prefilling: list[Any], queue: deque[Any]) -> None:
        """Take the batch, the requests in prefill and the queue from the server's lists."""
        self._grow_rows(len(active) + len(prefilling) + len(queue) + len(self.pending) + 2 * self.server.max_batch + 1)
        lists, cnt = self.lists, self.cnt
        lists[ACT, : len(active)] = self._put_many(active)
        lists[PRE, : len(prefilling)] = self._put_many(prefilling)
        cnt[N_ACT], cnt[N_PRE] = len(active), len(prefilling)
        cnt[Q_HEAD] = cnt[Q_TAIL] = 0
        self._queue_in(queue)
        scheduler = self.server.scheduler
        cnt[ADMISSIONS], cnt[MAX_RUNNING], cnt[ISSUED] = scheduler._admissions, scheduler.max_running, len(self.server.issued)
        cnt[PREEMPTS] = scheduler.preemptions
        self.loaded = True

    def _queue_in(self, queue: deque[Any]) -> None:
        """The lane's queue moved to the front of its list, and the requests queued meanwhile in the
        server's queue (arrivals) after it."""
        self._grow_rows(self.rows_total - len(self.free_rows) + len(queue) + 1)
        cnt, lists = self.cnt, self.lists
        head, tail = int(cnt[Q_HEAD]), int(cnt[Q_TAIL])
        lists[QUE, : tail - head] = lists[QUE, head:tail]
        tail -= head
        if queue:
            lists[QUE, tail : tail + len(queue)] = self._put_many(list(queue))
            tail += len(queue)
            queue.clear()
        cnt[Q_HEAD], cnt[Q_TAIL] = 0, tail

    def store(self, active: list[Any], prefilling: list[Any], queue: deque[Any]) -> None:
        """Give the batch, the requests in prefill and the queue back to the server's lists."""
        if not self.loaded:
            return
        lists, cnt = self.lists, self.cnt
        active[:] = self._get_many(lists[ACT, : cnt[N_ACT]].tolist())
        prefilling[:] = self._get_many(lists[PRE, : cnt[N_PRE]].tolist())
        queued = self._get_many(lists[QUE, cnt[Q_HEAD] : cnt[Q_TAIL]].tolist())
        queue.extendleft(reversed(queued))
        scheduler = self.server.scheduler
        scheduler._admissions, scheduler.max_running = int(cnt[ADMISSIONS]), int(cnt[MAX_RUNNING])
        scheduler.preemptions = int(cnt[PREEMPTS])
        if scheduler.kv is not None:
            scheduler.kv.free = int(self.kv[0])
        self.loaded = False

    # ---- running ---------------------------------------------------------------------------

    def run(
        self, active: list[Any], prefilling: list[Any], queue: deque[Any], clock: float, duration_us: float, most: int
    ) -> tuple[int, int, float]:
        """At most `most` iterations (and the lane's segment) from `clock`: (status, iterations, clock after).
        The requests issued meanwhile (arrivals) join the server's `issued`."""
        server = self.server
        kv = server.scheduler.kv
        if not self.loaded:
            self.load(active, prefilling, queue)
            if kv is not None:
                self.kv[0] = kv.free
        else:
            self._queue_in(queue)
        cost = server.cost
        cnt = self.cnt
        cnt[N_STEPS] = cnt[N_FIN] = 0
        if bool(self.cfg[10]) or self.open:
            self._top_up()
        self.issued_from = int(cnt[P_HEAD])
        most = min(most, self.segment)
        while True:
            if self.table_mode:
                t, dense, comm = _NO_TABLES, self.tables[0], self.tables[0]
            else:
                tables = cost.model.pass_tables
                t, dense, comm = tables.arrays(), tables.dense, tables.comm
            status, done, end = serve(
                self.st, self.sf, self.draws, self.lists, cnt, self.cfg, self.fl, self.kv, self.groups, self.work, self.tables, t,
                dense, comm, self.experts, self.region, self.scratch, self.out_f, self.out_i, self.steps, self.fin, clock, duration_us,
                most,
            )  # fmt: skip
            self._issued()
            if done or status in (STOP, MORE):
                break
            if status == REFILL:
                for r in self.lists[ACT, : cnt[N_ACT]].tolist():
                    if self.st[DRAW_AT, r] == self.st[DRAW_LEN, r]:
                        acceptance = self.reqs[r].acceptance
                        acceptance.at = int(self.st[DRAW_AT, r])
                        acceptance.refill()
                        self._put_draws(r, acceptance)
            elif status == TABLE:
                self._table(int(cnt[ASKED]))
            elif status == LADDER:  # a decode pass's size (the config bounds them): tabled now, else the Python loop's
                if cnt[ASKED] > self.decode_max:
                    status = STOP
                    break
                cost.model.table_pass_size(int(cnt[ASKED]))
            elif status == PREFILL:
                target = int(self.st[TARGET, cnt[ASKED]])
                if target not in self.prefill_costs:
                    self.prefill_costs[target] = server.cost.prefill_us(target)
                rows = np.flatnonzero(self.st[TARGET] == target)
                self.sf[PREFILL_COST, rows] = self.prefill_costs[target]
            elif status == PENDING:
                self._top_up()
                self.issued_from = int(cnt[P_HEAD])
            elif status == BAD_IDS:
                raise ValueError("expert id >= n_experts, or a window outside the trace's rows")
        if kv is not None:
            kv.free = int(self.kv[0])
        self.iterations += done
        return status, done, end

    def _table(self, n_tokens: int) -> None:
        """A pass size reached its tables: tabled if a decode pass's (their sizes are bounded by the
        batch and k) or if a family of it is priced by its ladder; a mixed pass's larger size whose
        families all run compiled keeps their formula instead (the same numbers; its tables, of
        (E + 1) x (n + 1) entries per family, would crowd out the rest)."""
        model = self.server.cost.model
        tables = model.pass_tables
        if n_tokens > self.decode_max and tables.compiled[tables.families_of(n_tokens)].all():
            tables.seen[n_tokens] = np.iinfo(np.int64).min // 2  # never asks again
        else:
            model.table_pass_size(n_tokens)

    def _issued(self) -> None:
        """The requests the last call issued (closed loop: replacing finished ones; open: arrived), to the server's `issued`."""
        head = int(self.cnt[P_HEAD])
        if head == self.issued_from:
            return
        issued = [self.pending.popleft() for _ in range(head - self.issued_from)]
        for request, r in zip(issued, self.lists[PEND, self.issued_from : head].tolist(), strict=True):
            request.arrival_us = float(self.sf[ARRIVAL, r])
        self.server.issued += issued
        self.issued_from = head

    def settle(self, done: int) -> list[Any]:
        """After a run of `done` iterations: the requests that finished (their state given back, their rows freed)."""
        return self._get_many(self.fin[: self.cnt[N_FIN]].tolist())

    # ---- the open loop's arrivals where the Python loop runs ----------------------------------

    def stepped(self) -> None:
        """The Python loop ran an iteration: its next step issues the arrivals due then."""
        self.cnt[SCANNED] = 0

    def next_arrival_us(self) -> float | None:
        """When the next request arrives (None: no more will)."""
        if self.cnt[P_HEAD] == self.cnt[P_TAIL]:
            self._top_up()
        if self.cnt[P_HEAD] == self.cnt[P_TAIL]:
            return None
        return float(self.sf[ARRIVAL, self.lists[PEND, self.cnt[P_HEAD]]])

    def woken(self) -> None:
        """The idle loop woke at the next arrival (`Server._issue` took it): the one request of its step."""
        self.fl[STEP_AT] = self.fl[ARRIVED_AT] = self.server.env.now
        self.cnt[SCANNED] = 1

    def arrive_until(self, end_us: float) -> None:
        """The arrivals before `end_us` not issued yet (the run was cut while the loop waited), to the server's `issued`."""
        while (when := self.next_arrival_us()) is not None and when < end_us:
            request = self.take_pending(len(self.server.issued))
            request.arrival_us = when
            self.server.issued.append(request)

    def records(self, done: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The per-iteration records (floats: start, draft, verify, distinct, prefill µs; ints: batch,
        pages used, prefill tokens, first tokens) and per-step records (request, k, accepted) of
        the last run's iterations (views: copy before the next run)."""
        return self.out_f[:, :done], self.out_i[:, :done], self.steps[:, : self.cnt[N_STEPS]]


_NO_REGION = np.zeros((1, 1, 1), np.int32)
_NO_TABLES = (
    np.zeros((1, 1), np.bool_), np.zeros(1, np.int64), np.zeros((1, 1), np.int64), np.zeros(1), 1, np.zeros((1, 16)), np.zeros((1, 1)),
    np.zeros(1, np.int64), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros(1, np.int64), 1, np.ones(1, np.bool_),
)  # fmt: skip


def exact_delays(now: float, end: float) -> tuple[float, ...]:
    """Delays whose Timeouts, one after the other, bring a SimPy clock (it adds each delay to its
    time) from `now` exactly to `end`: one, or two where no single sum rounds to `end` (a tie
    rounded to even past it) and the rest, end − (now + first), is exact."""
    delay = end - now
    while now + delay < end:
        delay = math.nextafter(delay, math.inf)
    while now + delay > end:
        delay = math.nextafter(delay, -math.inf)
    reached = now + delay
    return (delay,) if reached == end else (delay, end - reached)
