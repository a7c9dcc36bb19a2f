# ruff: noqa: ANN001, ANN201  (compiled kernels: Numba types their arguments and results)
"""The lane's compiled iteration (`_serve`): the server's iterations over the lane's arrays of
request rows (see `moesim.sim.serving.lane` for what it does and where it stops)."""

from __future__ import annotations

import math

import numpy as np

from moesim.kernels.jit import njit
from moesim.sim.cost.fast_pass import NEED_PYTHON, NEED_TABLE, STRAY_ID, pass_total_us

MORE, STOP, REFILL, TABLE, BAD_IDS, PENDING, PREFILL = range(7)
# per request row: the Request attributes synced both ways, then the lane's own
FIELDS = ("remaining", "decoded", "pos", "pos_start", "pos_end", "wraps", "kv_pages", "prompt_tokens", "prefilled", "prefill_target",
          "admit_seq", "swapped")  # fmt: skip
REMAINING, DECODED, POS, POS_START, POS_END, WRAPS, KV_PAGES, PROMPT, PREFILLED, TARGET, ADMIT_SEQ, SWAPPED = range(12)
SEQ, SEQ_ROW, RID, DRAW_AT, DRAW_LEN = range(12, 17)
ARRIVAL, FIRST, FINISH, PREFILL_COST = range(4)  # float columns
ACT, PRE, QUE, PEND = range(4)  # the lane's lists of rows
# counters: list lengths, queue and pending heads/tails, admissions, most running, issued, steps, finished
N_ACT, N_PRE, Q_HEAD, Q_TAIL, P_HEAD, P_TAIL, ADMISSIONS, MAX_RUNNING, ISSUED, N_STEPS, N_FIN, ASKED = range(12)


@njit
def pieces(first_row, tokens, region_rows, stride, rows, lengths, nw, lo, hi, nb):
    """`PrefillRegion.pieces` compiled: the windows and checkpoint blocks of `tokens` region rows
    from `first_row` (mod the region), appended at nw and nb; returns (nw, nb)."""
    row = first_row % region_rows
    left = tokens
    while left:
        end = min(row + left, region_rows)
        b_lo, b_hi = -(-row // stride), end // stride
        if b_lo >= b_hi:
            rows[nw], lengths[nw] = row, end - row
            nw += 1
        else:
            if b_lo * stride > row:
                rows[nw], lengths[nw] = row, b_lo * stride - row
                nw += 1
            lo[nb], hi[nb] = b_lo, b_hi
            nb += 1
            if end > b_hi * stride:
                rows[nw], lengths[nw] = b_hi * stride, end - b_hi * stride
                nw += 1
        left -= end - row
        row = 0
    return nw, nb


@njit
def finish(r, st, sf, lists, cnt, kv, fin, clock, closed, total):
    """The server's `_finish` of row r at `clock`: its pages back, and in a closed loop the next
    request made ahead arrives (queued)."""
    sf[FINISH, r] = clock
    kv[0] += st[KV_PAGES, r]
    st[KV_PAGES, r] = 0
    fin[cnt[N_FIN]] = r
    cnt[N_FIN] += 1
    if closed and (total == 0 or cnt[ISSUED] < total) and cnt[P_HEAD] < cnt[P_TAIL]:
        p = lists[PEND, cnt[P_HEAD]]
        cnt[P_HEAD] += 1
        sf[ARRIVAL, p] = clock
        lists[QUE, cnt[Q_TAIL]] = p
        cnt[Q_TAIL] += 1
        cnt[ISSUED] += 1


@njit
def serve(
    st, sf, draws, lists, cnt, cfg, kv, work, tables, t, dense, comm, experts, region, scratch, out_f, out_i, steps, fin, clock,
    duration, max_iters,
):  # fmt: skip
    """Run up to max_iters server iterations (see the module docstring); returns (status, iterations, clock).
    cfg = k, k cap, token budget, chunked, windows, verify tokens k + 1 (1) or max(k, 1) (0), table
    mode, KV block tokens, extended, max batch, closed, total requests, region rows, region stride.
    tables = (verify, draft) µs per pass size in table mode; in trace mode (unused, the engine's
    overhead O of a drafting iteration flat at longest·(max batch·(k cap + 1) + 1) + verified
    tokens, one zero without engine terms: `custody._overhead_table`)."""
    k_fixed, k_cap, budget, chunked, windows, extra, table_mode, block = cfg[0], cfg[1], cfg[2], cfg[3], cfg[4], cfg[5], cfg[6], cfg[7]
    extended, max_batch, closed, total, region_rows, stride = cfg[8], cfg[9], cfg[10], cfg[11], cfg[12], cfg[13]
    verify_tab, draft_tab = tables
    ks, pages, rows, lengths, lo, hi, chunk_row, chunk_tokens, admitted = work
    kv_on = kv[2]
    out = np.zeros(2)
    done = 0
    while done < max_iters:
        n = cnt[N_ACT]
        n_pre = cnt[N_PRE]
        act = lists[ACT]
        for i in range(n):
            if st[DRAW_AT, act[i]] == st[DRAW_LEN, act[i]]:
                return REFILL, done, clock
        if closed and cnt[P_TAIL] - cnt[P_HEAD] < max_batch and (total == 0 or cnt[ISSUED] + cnt[P_TAIL] - cnt[P_HEAD] < total):
            return PENDING, done, clock
        # ---- draft lengths, then the plan (tentative: nothing changes before the checks pass)
        left = budget
        capped = chunked and budget < n * (k_cap + 1)
        longest = 0
        k_sum = 0
        for i in range(n):
            r = act[i]
            k = min(k_fixed, k_cap)
            if k >= st[REMAINING, r]:
                k = st[REMAINING, r] - 1
            if capped:
                limit = left - (n - i)
                if k > limit:
                    k = limit
                left -= k + 1
            ks[i] = k
            k_sum += k
            longest = max(longest, k)
        free = kv[0]
        if kv_on:
            for i in range(n):
                r = act[i]
                need = -(-(st[PROMPT, r] + st[DECODED, r] + ks[i] + 1) // block)
                pages[i] = max(need, st[KV_PAGES, r])
                if need > st[KV_PAGES, r]:
                    if need - st[KV_PAGES, r] > free:
                        return STOP, done, clock  # a preemption: the scheduler's
                    free -= need - st[KV_PAGES, r]
        n_chunks = 0
        n_admitted = 0
        n_new = 0  # admitted into prefill (chunked)
        prefill_us = 0.0
        q = cnt[Q_HEAD]
        if extended:
            left = budget - k_sum - n
            for j in range(n_pre):
                r = lists[PRE, j]
                pages[max_batch + j] = st[KV_PAGES, r]
                if left <= 0:
                    continue
                tokens = min(st[TARGET, r] - st[PREFILLED, r], left)
                if kv_on:
                    need = -(-(st[PREFILLED, r] + tokens) // block)
                    if need > st[KV_PAGES, r]:
                        if need - st[KV_PAGES, r] > free:
                            return STOP, done, clock
                        free -= need - st[KV_PAGES, r]
                        pages[max_batch + j] = need
                chunk_row[n_chunks], chunk_tokens[n_chunks] = r, tokens
                n_chunks += 1
                left -= tokens
            while q < cnt[Q_TAIL] and (left > 0 or not chunked):
                if n + n_pre + n_new + n_admitted >= max_batch:
                    break
                r = lists[QUE, q]
                if st[SWAPPED, r]:
                    return STOP, done, clock  # a swap-in: the scheduler's
                tokens = min(st[TARGET, r], left) if chunked else st[TARGET, r]
                need = 0
                if kv_on:
                    need = -(-tokens // block)
                    if need - st[KV_PAGES, r] > free:
                        break
                    free -= max(need - st[KV_PAGES, r], 0)
                pages[2 * max_batch + n_new + n_admitted] = max(need, st[KV_PAGES, r])
                if chunked:
                    chunk_row[n_chunks], chunk_tokens[n_chunks] = r, tokens
                    n_chunks += 1
                    n_new += 1
                    left -= tokens
                else:
                    if math.isnan(sf[PREFILL_COST, r]):
                        cnt[ASKED] = r
                        return PREFILL, done, clock
                    admitted[n_admitted] = r
                    n_admitted += 1
                    prefill_us += sf[PREFILL_COST, r]
                q += 1
        else:
            while q < cnt[Q_TAIL] and n + n_admitted < max_batch:
                r = lists[QUE, q]
                if math.isnan(sf[PREFILL_COST, r]):
                    cnt[ASKED] = r
                    return PREFILL, done, clock
                admitted[n_admitted] = r
                n_admitted += 1
                prefill_us += sf[PREFILL_COST, r]
                q += 1
        if n == 0 and n_chunks == 0 and n_admitted == 0:
            return STOP, done, clock  # nothing to run: the loop waits for an arrival
        # ---- the pass
        draft = 0.0
        verify = 0.0
        distinct = math.nan
        seen = -1
        n_tokens = 0
        if n or n_chunks:
            context = 0
            for i in range(n):
                r = act[i]
                k = ks[i]
                start = st[POS, r] if st[POS, r] + k < st[POS_END, r] else st[POS_START, r]
                rows[i] = st[SEQ_ROW, r] + start
                lengths[i] = k + 1 if extra else max(k, 1)
                n_tokens += lengths[i]
                context += st[PROMPT, r] + st[DECODED, r] + 1
            nw, nb = n, 0
            for c in range(n_chunks):
                r = chunk_row[c]
                first = st[PREFILLED, r]
                n_tokens += chunk_tokens[c]
                context += first + chunk_tokens[c]
                if not table_mode:
                    nw, nb = pieces(st[SEQ_ROW, r] + first, chunk_tokens[c], region_rows, stride, rows, lengths, nw, lo, hi, nb)
            if not n_tokens:  # chunks of empty prompts alone: no pass runs
                draft = verify = 0.0
            elif table_mode:
                if n_tokens >= verify_tab.shape[0]:
                    return STOP, done, clock  # beyond the expanded table: the loop asks the cost
                draft = draft_tab[longest] if n else 0.0
                verify = verify_tab[n_tokens]
            else:
                seen = t[1][n_tokens]
                status = pass_total_us(
                    experts, rows, lengths, nw, region, lo, hi, nb, scratch, n_tokens, float(context), float(n + n_chunks), t, dense,
                    comm, out,
                )  # fmt: skip
                if status == NEED_TABLE:
                    cnt[ASKED] = n_tokens
                    return TABLE, done, clock
                if status == NEED_PYTHON:  # a size the ladder prices before its tables: the Python loop's
                    t[1][n_tokens] = seen
                    return STOP, done, clock
                if status == STRAY_ID or status < 0:
                    return BAD_IDS, done, clock
                verify = out[0]
                if n:
                    distinct = out[1]
                if longest and draft_tab.shape[0] > 1:  # the engine's overhead of a drafting iteration (a free drafter's)
                    draft = draft_tab[longest * (max_batch * (k_cap + 1) + 1) + k_sum + n]
        delay = prefill_us + draft + verify
        if duration > 0.0 and clock + delay >= duration:
            if seen >= 0:
                t[1][n_tokens] = seen
            return STOP, done, clock
        # ---- commit the plan
        kv[0] = free
        if kv_on:
            for i in range(n):
                st[KV_PAGES, act[i]] = pages[i]
            for j in range(n_pre):
                st[KV_PAGES, lists[PRE, j]] = pages[max_batch + j]
        for a in range(n_new + n_admitted):
            r = lists[QUE, cnt[Q_HEAD] + a]
            if kv_on:
                st[KV_PAGES, r] = pages[2 * max_batch + a]
            if extended:  # the scheduler's admission order
                cnt[ADMISSIONS] += 1
                st[ADMIT_SEQ, r] = cnt[ADMISSIONS]
            if n_new:
                lists[PRE, n_pre + a] = r
        cnt[Q_HEAD] = q
        cnt[N_PRE] = n_pre + n_new
        if extended:
            cnt[MAX_RUNNING] = max(cnt[MAX_RUNNING], n + n_pre + n_new + n_admitted)
        if windows:
            for i in range(n):
                r = act[i]
                if st[POS, r] + ks[i] >= st[POS_END, r]:
                    st[POS, r] = st[POS_START, r]
                    st[WRAPS, r] += 1
        prefill_tokens = 0
        for c in range(n_chunks):
            prefill_tokens += chunk_tokens[c]
        for a in range(n_admitted):
            prefill_tokens += st[TARGET, admitted[a]]
        out_f[0, done] = clock
        out_f[1, done] = draft
        out_f[2, done] = verify
        out_f[3, done] = distinct
        out_f[4, done] = prefill_us
        out_i[0, done] = n
        out_i[1, done] = kv[1] - kv[0]
        out_i[2, done] = prefill_tokens
        clock = clock + delay
        # ---- after the pass: prefills done (first tokens, or back to decoding after a recompute)
        n_first = 0
        n_back = 0
        first_rows = rows  # reused: the pass is costed
        back_rows = lengths
        for a in range(n_admitted):
            r = admitted[a]
            if extended:
                st[PREFILLED, r] = st[TARGET, r]
            if extended and not math.isnan(sf[FIRST, r]):
                back_rows[n_back] = r
                n_back += 1
            else:
                first_rows[n_first] = r
                n_first += 1
        for c in range(n_chunks):
            r = chunk_row[c]
            st[PREFILLED, r] += chunk_tokens[c]
            if st[PREFILLED, r] == st[TARGET, r]:
                kept = 0
                for j in range(cnt[N_PRE]):
                    if lists[PRE, j] != r:
                        lists[PRE, kept] = lists[PRE, j]
                        kept += 1
                cnt[N_PRE] = kept
                if math.isnan(sf[FIRST, r]):
                    first_rows[n_first] = r
                    n_first += 1
                else:
                    back_rows[n_back] = r
                    n_back += 1
        out_i[3, done] = n_first
        # ---- the decode commits, the finished requests
        s = cnt[N_STEPS]
        finished = False
        for i in range(n):
            r = act[i]
            k = ks[i]
            accepted = min(draws[r, st[DRAW_AT, r]], k)
            st[DRAW_AT, r] += 1
            c = accepted + 1
            st[DECODED, r] += c
            st[POS, r] += c
            st[REMAINING, r] -= c
            finished |= st[REMAINING, r] == 0
            steps[0, s], steps[1, s], steps[2, s] = st[RID, r], k, accepted
            s += 1
        cnt[N_STEPS] = s
        if finished:
            kept = 0
            for i in range(n):
                r = act[i]
                if st[REMAINING, r]:
                    act[kept] = r
                    kept += 1
                else:
                    finish(r, st, sf, lists, cnt, kv, fin, clock, closed, total)
            n = kept
        for a in range(n_first):
            r = first_rows[a]
            sf[FIRST, r] = clock
            if st[REMAINING, r]:
                act[n] = r
                n += 1
            else:
                finish(r, st, sf, lists, cnt, kv, fin, clock, closed, total)
        for a in range(n_back):
            act[n] = back_rows[a]
            n += 1
        cnt[N_ACT] = n
        done += 1
    return MORE, done, clock
