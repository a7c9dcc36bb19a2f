# ruff: noqa: ANN001  (compiled kernels: Numba types their arguments)
"""The server's compiled decode lane: iterations in which the batch only decodes (no admission,
prefill chunk, preemption or swap can happen) run in one compiled call over the batch's state
held in arrays, the Python loop of `moesim.sim.serving.server` being the reference (tested equal,
record for record).

A lane iteration does what the loop does, in its order: draft lengths (a fixed k, capped at the
remaining tokens − 1 and by the token budget under chunked prefill), KV pages for the k + 1
positions of every request, the pass (a `TablePassCost` lookup, or the trace-driven step-time
model in one compiled pass, `moesim.sim.cost.fast_pass`, with a drafter that costs nothing),
the records, the window wrap, the acceptance draws (precomputed blocks) and the commits. It
stops, before changing anything, where the Python loop has to decide (a request would need a
page that is not free, a block of draws is used up, a pass size reaches its tables, a pass size
without tables has a family priced by its lookup ladder and never by the compiled formula, the
duration would cut the iteration) and after an iteration in which a request finished. Several
iterations run in one call (one `Timeout` for all of them) only when nothing outside the batch
can change meanwhile: a closed loop with nothing queued, or a full batch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from moesim.kernels.jit import njit
from moesim.sim.cost.fast_pass import NEED_PYTHON, NEED_TABLE, count_union, expert_us, plus_dense, scratch_for
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.cost.trace_batch import TraceBatchCost
from moesim.sim.serving.acceptance import _BlockDraws
from moesim.sim.serving.policies import _Fixed

MORE, FINISHED, STOP, REFILL, TABLE, BAD_IDS = range(6)
FIELDS = ("remaining", "decoded", "pos", "pos_start", "pos_end", "wraps", "kv_pages", "prompt_tokens")
REMAINING, DECODED, POS, POS_START, POS_END, WRAPS, KV_PAGES, PROMPT, SEQ_ROW, RID, DRAW_AT, DRAW_LEN, SLOT = range(13)
SEGMENT = 4096  # iterations one call may run at most


@njit
def _decode(  # noqa: ANN202
    st,
    draws,
    n,
    cfg,
    kv,
    ks,
    rows,
    lengths,
    tables,
    t,
    dense,
    comm,
    experts,
    region,
    scratch,
    out_f,
    out_i,
    steps,
    clock,
    duration,
    max_iters,
):
    """Run up to max_iters decode iterations (see the module docstring); returns (status, iterations, clock).
    cfg = k, k cap, token budget, chunked, windows, verify tokens k + 1 (1) or max(k, 1) (0), table mode, KV block tokens."""
    k_fixed, k_cap, budget, chunked, windows, extra, table_mode, block = cfg[0], cfg[1], cfg[2], cfg[3], cfg[4], cfg[5], cfg[6], cfg[7]
    verify_tab, draft_tab = tables
    union_buf, features, layer_buf = scratch
    done = 0
    while done < max_iters:
        for i in range(n):
            if st[DRAW_AT, i] == st[DRAW_LEN, i]:
                return REFILL, done, clock
        left = budget
        capped = chunked and budget < n * (k_cap + 1)
        longest = 0
        for i in range(n):
            k = min(k_fixed, k_cap)
            if k >= st[REMAINING, i]:
                k = st[REMAINING, i] - 1
            if capped:
                limit = left - (n - i)
                if k > limit:
                    k = limit
                left -= k + 1
            ks[i] = k
            longest = max(longest, k)
        if kv[2]:
            wanted = 0
            for i in range(n):
                need = -(-(st[PROMPT, i] + st[DECODED, i] + ks[i] + 1) // block)
                if need > st[KV_PAGES, i]:
                    wanted += need - st[KV_PAGES, i]
            if wanted > kv[0]:
                return STOP, done, clock
        n_tokens = 0
        context = 0
        for i in range(n):
            k = ks[i]
            start = st[POS, i] if st[POS, i] + k < st[POS_END, i] else st[POS_START, i]
            rows[i] = st[SEQ_ROW, i] + start
            lengths[i] = k + 1 if extra else max(k, 1)
            n_tokens += lengths[i]
            context += st[PROMPT, i] + st[DECODED, i] + 1
        distinct = math.nan
        seen = -1
        if table_mode:
            draft = draft_tab[longest]
            verify = verify_tab[n_tokens]
        else:
            draft = 0.0
            seen = t[1][n_tokens]
            union = count_union(experts, rows, lengths, n, region, rows[:0], rows[:0], 0, union_buf, features)
            if union < 0:
                return BAD_IDS, done, clock
            expert = expert_us(n_tokens, features, t, layer_buf)
            if expert == NEED_TABLE:
                return TABLE, done, clock
            if expert == NEED_PYTHON:  # a size the ladder prices before its tables: the Python loop's
                return STOP, done, clock
            verify = plus_dense(expert, n_tokens, float(context), float(n), dense, comm)
            distinct = float(union) / features.shape[1]
        delay = draft + verify
        if duration > 0.0 and clock + delay >= duration:
            if seen >= 0:
                t[1][n_tokens] = seen
            return STOP, done, clock
        if kv[2]:
            for i in range(n):
                need = -(-(st[PROMPT, i] + st[DECODED, i] + ks[i] + 1) // block)
                if need > st[KV_PAGES, i]:
                    kv[0] -= need - st[KV_PAGES, i]
                    st[KV_PAGES, i] = need
        out_f[0, done] = clock
        out_f[1, done] = draft
        out_f[2, done] = verify
        out_f[3, done] = distinct
        out_i[0, done] = n
        out_i[1, done] = kv[1] - kv[0]
        finished = False
        base = done * st.shape[1]
        for i in range(n):
            k = ks[i]
            if windows and st[POS, i] + k >= st[POS_END, i]:
                st[POS, i] = st[POS_START, i]
                st[WRAPS, i] += 1
            accepted = min(draws[st[SLOT, i], st[DRAW_AT, i]], k)
            st[DRAW_AT, i] += 1
            c = accepted + 1
            st[DECODED, i] += c
            st[POS, i] += c
            st[REMAINING, i] -= c
            finished |= st[REMAINING, i] == 0
            steps[0, base + i] = st[RID, i]
            steps[1, base + i] = k
            steps[2, base + i] = accepted
        clock = clock + delay
        done += 1
        if finished:
            return FINISHED, done, clock
    return MORE, done, clock


def _longest_block(server: Any) -> int:
    return max(1, min(4096, max(server.workload.outputs, default=1)))


class Lane:
    """The decode lane of one server run; `Lane.of` says whether the run can use it."""

    def __init__(self, server: Any, k: int) -> None:
        cap = server.max_batch
        self.server = server
        self.state = np.zeros((13, cap), np.int64)
        self.free_slots = list(range(cap))
        self.active: list[Any] = []
        self.draws = np.zeros((cap, _longest_block(server)), np.int64)
        self.ks = np.zeros(cap, np.int64)
        self.rows = np.zeros(cap, np.int64)
        self.lengths = np.zeros(cap, np.int64)
        self.out_f = np.zeros((4, SEGMENT))
        self.out_i = np.zeros((2, SEGMENT), np.int64)
        self.steps = np.zeros((3, SEGMENT * cap), np.int64)
        self.loaded = False
        self.n = 0
        scheduling = server.scheduling
        kv = server.scheduler.kv
        self.kv = np.array([kv.free if kv else 0, kv.capacity if kv else 0, kv is not None], np.int64)
        cost = server.cost
        self.table_mode = isinstance(cost, TablePassCost)
        extra = 0 if scheduling.moesd_slots else 1
        self.cfg = np.array(
            [k, server.k_cap, scheduling.token_budget, scheduling.chunked_prefill, server.windows is not None, extra, self.table_mode,
             kv.block_tokens if kv else 1],
            np.int64,
        )  # fmt: skip
        if self.table_mode:
            coster = server.coster
            self.tables = (np.asarray(coster.verify, np.float64), np.asarray(coster.draft, np.float64))
            self.experts = np.zeros((1, 1, 1), np.uint8)
            self.scratch = scratch_for(1, 1)
        else:
            self.tables = (np.zeros(1), np.zeros(1))
            self.experts = cost.trace.experts
            self.scratch = scratch_for(self.experts.shape[1], cost.trace.meta.geometry.experts, cost.trace.expert_masks)
            self.seq_starts = cost.trace.seq_starts
            cost.model.pass_tables.ensure(cap * (server.k_cap + 1))

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
            plain_chain = not cost.widths and cost.model.profile.speculative is None  # no tree, no spec-path terms
            if not (one_device and plain_chain and cost._drafting.free):
                return None
        elif not isinstance(cost, TablePassCost):
            return None
        return cls(server, controller._k)

    # ---- the batch's state ----------------------------------------------------------------

    def load(self, active: list[Any]) -> None:
        """Take the batch's state from its requests (`active`, kept in step with the lane)."""
        self.active = active
        self.n = len(active)
        self.free_slots = list(range(self.state.shape[1]))
        for i, request in enumerate(active):
            self.state[SLOT, i] = self.free_slots.pop()
            self._put(i, request)
        kv = self.server.scheduler.kv
        if kv is not None:
            self.kv[0] = kv.free
        self.loaded = True

    def _put(self, i: int, request: Any) -> None:
        st = self.state
        for f, name in enumerate(FIELDS):
            st[f, i] = getattr(request, name)
        st[SEQ_ROW, i] = self.seq_starts[request.seq] if not self.table_mode else 0
        st[RID, i] = request.rid
        self._put_draws(i, request.acceptance)

    def _put_draws(self, i: int, acceptance: _BlockDraws) -> None:
        counts = acceptance.counts
        self.draws[self.state[SLOT, i], : counts.size] = counts
        self.state[DRAW_AT, i] = acceptance.at
        self.state[DRAW_LEN, i] = counts.size

    def _get(self, i: int, request: Any) -> None:
        row = self.state[:, i].tolist()
        for f, name in enumerate(FIELDS):
            setattr(request, name, row[f])
        request.acceptance.at = row[DRAW_AT]

    def store(self) -> None:
        """Give the batch's state back to its requests (the Python loop takes over)."""
        if not self.loaded:
            return
        for i, request in enumerate(self.active):
            self._get(i, request)
        self.loaded = False  # the pool's free pages were given back when the lane last ran

    # ---- running --------------------------------------------------------------------------

    def run(self, active: list[Any], clock: float, duration_us: float, most: int) -> tuple[int, int, float]:
        """At most `most` (<= SEGMENT) decode iterations from `clock`: (status, iterations, clock after)."""
        kv = self.server.scheduler.kv
        if not self.loaded:
            self.load(active)
        elif kv is not None:
            self.kv[0] = kv.free
        cost = self.server.cost
        while True:
            if self.table_mode:
                t, dense, comm = _NO_TABLES, self.tables[0], self.tables[0]
            else:
                tables = cost.model.pass_tables
                t, dense, comm = tables.arrays(), tables.dense, tables.comm
            status, done, end = _decode(
                self.state, self.draws, self.n, self.cfg, self.kv, self.ks, self.rows, self.lengths, self.tables, t, dense, comm,
                self.experts, _NO_REGION, self.scratch, self.out_f, self.out_i, self.steps, clock, duration_us, most,
            )  # fmt: skip
            if done or status in (STOP, MORE, FINISHED):
                break
            if status == REFILL:
                for i in np.flatnonzero(self.state[DRAW_AT, : self.n] == self.state[DRAW_LEN, : self.n]).tolist():
                    acceptance = active[i].acceptance
                    acceptance.at = int(self.state[DRAW_AT, i])
                    acceptance.refill()
                    self._put_draws(i, acceptance)
            elif status == TABLE:
                cost.model.table_pass_size(int(self.lengths[: self.n].sum()))
            else:
                raise ValueError("expert id >= n_experts")
        if kv is not None:
            kv.free = int(self.kv[0])
        if done and not self.table_mode:
            cost.last_distinct_experts = float(self.out_f[3, done - 1])
        return status, done, end

    def records(self, done: int) -> tuple[list, ...]:
        """The per-iteration and per-step records of the last run's iterations, as lists."""
        f, i, steps = self.out_f[:, :done], self.out_i[:, :done], self.steps
        width = self.state.shape[1]
        n = self.n
        if n == width:
            flat = steps[:, : done * width]
        else:
            index = (np.arange(done)[:, None] * width + np.arange(n)[None, :]).ravel()
            flat = steps[:, index]
        return (*f.tolist(), *i.tolist(), *flat.tolist())

    def finished(self, active: list[Any]) -> list[Any]:
        """Requests of the batch that finished in the last iteration (their state given back), the
        rest kept in order in the lane and in `active`."""
        left = self.state[REMAINING, : self.n]
        done = np.flatnonzero(left == 0).tolist()
        out = [active[i] for i in done]
        for i in done:
            self._get(i, active[i])
        self.free_slots.extend(self.state[SLOT, done].tolist())
        keep = np.flatnonzero(left != 0)
        self.state[:, : keep.size] = self.state[:, keep]
        self.n = int(keep.size)
        active[:] = [active[i] for i in keep.tolist()]
        return out


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
