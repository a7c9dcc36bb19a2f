# ruff: noqa: ANN001, ANN201  (compiled kernels: Numba types their arguments and results)
"""The lane's compiled iteration (`_serve`): the server's iterations over the lane's arrays of
request rows (see `moesim.sim.serving.lane` for what it does and where it stops)."""

from __future__ import annotations

import math

import numpy as np

from moesim.kernels.jit import njit
from moesim.sim.cost.fast_pass import NEED_PYTHON, NEED_TABLE, STRAY_ID, pass_total_us
from moesim.sim.serving.memory import block_top, kv_pages

pages_of, top_of = njit(kv_pages), njit(block_top)  # the scheduler's page count and the blocks' positions, compiled

MORE, STOP, REFILL, TABLE, BAD_IDS, PENDING, PREFILL, LADDER = range(8)
# per request row: the Request attributes synced both ways, then the lane's own
FIELDS = ("remaining", "decoded", "pos", "pos_start", "pos_end", "wraps", "kv_pages", "kv_tokens", "prompt_tokens", "prefilled",
          "prefill_target", "admit_seq", "swapped", "preemptions")  # fmt: skip
REMAINING, DECODED, POS, POS_START, POS_END, WRAPS, KV_PAGES, KV_TOKENS, PROMPT, PREFILLED, TARGET, ADMIT_SEQ, SWAPPED = range(13)
PREEMPTIONS = 13
SEQ, SEQ_ROW, RID, DRAW_AT, DRAW_LEN = range(14, 19)
ARRIVAL, FIRST, FINISH, PREFILL_COST = range(4)  # float columns
ACT, PRE, QUE, PEND = range(4)  # the lane's lists of rows
# counters: list lengths, queue and pending heads/tails, admissions, most running, issued, steps, finished, what a stop asks,
# preemptions, whether the arrivals due at the loop's current step were issued
N_ACT, N_PRE, Q_HEAD, Q_TAIL, P_HEAD, P_TAIL, ADMISSIONS, MAX_RUNNING, ISSUED, N_STEPS, N_FIN, ASKED, PREEMPTS, SCANNED = range(14)
# floats: swap preemption (on, host link latency µs, page bytes, link GB/s); the open loop's arrival clock (the loop's last
# step, when it scheduled its next event; the last arrival issued)
SWAP_ON, LINK_US, PAGE_BYTES, LINK_GBPS, STEP_AT, ARRIVED_AT = range(6)
# per-iteration records: floats start, draft, verify, distinct, prefill µs, swap µs; ints batch, pages used, prefill tokens,
# first tokens, preempted


@njit
def arrive(sf, lists, cnt, fl, clock, limit):
    """The open loop's arrivals due at a step of the server's loop at `clock`, queued in order, as
    SimPy orders them: every arrival before `clock`, and one at `clock` only if it is the first
    and the arrival before it came no later than the loop's previous step (its event was scheduled
    before the loop's). False, with nothing issued, when the requests made ahead run out first
    and more may come (`limit`: the most the run issues, 0 unbounded)."""
    p = cnt[P_HEAD]
    while p < cnt[P_TAIL]:
        at = sf[ARRIVAL, lists[PEND, p]]
        if not (at < clock or (p == cnt[P_HEAD] and at == clock and fl[ARRIVED_AT] <= fl[STEP_AT])):
            break
        p += 1
    if p == cnt[P_TAIL] and (limit == 0 or cnt[ISSUED] + p - cnt[P_HEAD] < limit):
        return False
    for i in range(cnt[P_HEAD], p):
        lists[QUE, cnt[Q_TAIL]] = lists[PEND, i]
        cnt[Q_TAIL] += 1
        fl[ARRIVED_AT] = sf[ARRIVAL, lists[PEND, i]]
    cnt[ISSUED] += p - cnt[P_HEAD]
    cnt[P_HEAD] = p
    fl[STEP_AT] = clock
    cnt[SCANNED] = 1
    return True


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
    st[KV_PAGES, r] = st[KV_TOKENS, r] = 0
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
def swap_us(fl, pages):
    """`KVBudget.swap_us` compiled: latency + pages · page bytes / bandwidth."""
    return fl[LINK_US] + pages * fl[PAGE_BYTES] / (fl[LINK_GBPS] * 1e3)


@njit
def drop_skipped(pages, tops, slot, written, block, wins, parts, free):
    """The scheduler's `KVCache.grow` dropping the blocks before a slot's windows (`written` positions
    written), tentatively; returns the free pages."""
    held = pages_of(tops[slot], written, block, wins, parts)
    free += pages[slot] - held
    pages[slot] = held
    return free


@njit
def preempt_youngest(st, sf, lists, n, n_pre, max_batch, pages, victim, victims, n_vict, fl):
    """The scheduler's `_grow` choosing its victim, tentatively: the youngest running request not
    yet preempted (slot i < max_batch: decoding request i; max_batch + j: prefilling request j)
    is marked; returns (its slot, victims, the µs its swap-out takes, the pages it frees)."""
    best, youngest = -1, -1
    for i in range(n + n_pre):
        slot = i if i < n else max_batch + i - n
        if victim[slot]:
            continue
        r = lists[ACT, i] if i < n else lists[PRE, i - n]
        if st[ADMIT_SEQ, r] > youngest:
            best, youngest = slot, st[ADMIT_SEQ, r]
    r = lists[ACT, best] if best < max_batch else lists[PRE, best - max_batch]
    victim[best] = 1
    victims[n_vict] = best
    moved = 0.0
    if fl[SWAP_ON] and not math.isnan(sf[FIRST, r]) and st[PREFILLED, r] == st[TARGET, r]:
        moved = swap_us(fl, pages[best])
    return best, n_vict + 1, moved, pages[best]


@njit
def make_room(st, sf, lists, n, n_pre, max_batch, pages, victim, victims, n_vict, fl, slot, need, free, swap):
    """The youngest preempted (`preempt_youngest`) while slot `slot` needs `need` pages, more than
    it holds and the free ones, or until it is the victim itself; returns (victims, free pages,
    swap-out µs so far)."""
    while need - pages[slot] > free:
        got, n_vict, moved, freed = preempt_youngest(st, sf, lists, n, n_pre, max_batch, pages, victim, victims, n_vict, fl)
        swap += moved
        free += freed
        if got == slot:
            break
    return n_vict, free, swap


@njit
def preempt(st, sf, lists, cnt, victims, n_vict, fl):
    """The scheduler's `_preempt` of the victims' rows, in order: pages back (counted already),
    swapped (a decoding request under swap) or to recompute (its prompt and committed tokens),
    each put at the front of the queue."""
    head, tail = cnt[Q_HEAD], cnt[Q_TAIL]
    if head < n_vict:  # room at the front: the queue moved up
        for x in range(tail - 1, head - 1, -1):
            lists[QUE, x - head + n_vict] = lists[QUE, x]
        tail += n_vict - head
        head = n_vict
    for v in range(n_vict):
        r = victims[v]
        st[PREEMPTIONS, r] += 1
        cnt[PREEMPTS] += 1
        if fl[SWAP_ON] and not math.isnan(sf[FIRST, r]) and st[PREFILLED, r] == st[TARGET, r]:
            st[SWAPPED, r] = 1
        else:
            st[TARGET, r] = st[PROMPT, r] + st[DECODED, r]
            st[PREFILLED, r] = 0
            sf[PREFILL_COST, r] = math.nan  # its new prefill's cost: asked of Python where unknown
        st[KV_PAGES, r] = st[KV_TOKENS, r] = 0
        head -= 1
        lists[QUE, head] = r
    cnt[Q_HEAD], cnt[Q_TAIL] = head, tail


@njit
def serve(
    st, sf, draws, lists, cnt, cfg, fl, kv, groups, work, tables, t, dense, comm, experts, region, scratch, out_f, out_i, steps, fin, clock,
    duration, max_iters,
):  # fmt: skip
    """Run up to max_iters server iterations (see the module docstring); returns (status, iterations, clock).
    cfg = k, k cap, token budget, chunked, windows, verify tokens k + 1 (1) or max(k, 1) (0), table
    mode, KV block tokens, extended, max batch, closed, total requests, region rows, region stride,
    open loop (arrivals the lane's), the most requests it issues (0: unbounded).
    tables = (verify, draft) µs per pass size in table mode; in trace mode (verify unused) the
    engine's overhead O of a drafting iteration, flat at longest·(max batch·(k cap + 1) + 1) +
    the live requests' verified tokens, one zero without engine terms: `custody._overhead_table`."""
    k_fixed, k_cap, budget, chunked, windows, extra, table_mode, block = cfg[0], cfg[1], cfg[2], cfg[3], cfg[4], cfg[5], cfg[6], cfg[7]
    extended, max_batch, closed, total, region_rows, stride = cfg[8], cfg[9], cfg[10], cfg[11], cfg[12], cfg[13]
    open_loop, limit = cfg[14], cfg[15]
    verify_tab, draft_tab = tables
    ks, pages, tops, rows, lengths, lo, hi, chunk_row, chunk_tokens, admitted, victim, victims, chunk_slot, kinds, live, live_ks = work[:16]
    resumed = work[16]
    kv_on = kv[2]
    wins, parts = groups  # the KV-cache groups' windows and shares of a page (`KVCache`)
    windowed = wins.shape[0] > 1 or wins[0] != 0  # else no block is ever dropped (`KVCache.windowed`)
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
        if open_loop and not cnt[SCANNED] and not arrive(sf, lists, cnt, fl, clock, limit):
            return PENDING, done, clock
        # ---- draft lengths, then the plan (tentative: nothing changes before the checks pass)
        left = budget
        capped = chunked and budget < n * (k_cap + 1)
        k_sum = 0
        for i in range(n):
            r = act[i]
            k = min(k_fixed, k_cap)
            if k >= st[REMAINING, r]:
                k = st[REMAINING, r] - 1
            if capped:
                limit_k = left - (n - i)
                if k > limit_k:
                    k = limit_k
                left -= k + 1
            ks[i] = k
            k_sum += k
        free = kv[0]
        n_vict = 0
        swap = 0.0
        for i in range(n):
            victim[i] = 0
            pages[i], tops[i] = st[KV_PAGES, act[i]], st[KV_TOKENS, act[i]]
        for j in range(n_pre):
            victim[max_batch + j] = 0
            pages[max_batch + j], tops[max_batch + j] = st[KV_PAGES, lists[PRE, j]], st[KV_TOKENS, lists[PRE, j]]
        if kv_on:  # the decoding requests' pages, oldest first, preempting the youngest while too few are free
            for i in range(n):
                if victim[i]:
                    continue
                r = act[i]
                written = st[PROMPT, r] + st[DECODED, r]
                top = max(top_of(written + ks[i] + 1, block), tops[i])
                if windowed:
                    free = drop_skipped(pages, tops, i, written, block, wins, parts, free)
                elif top == tops[i]:
                    continue  # no window, no new block: its pages stay
                need = pages_of(top, written, block, wins, parts)
                if need > pages[i]:
                    n_vict, free, swap = make_room(
                        st, sf, lists, n, n_pre, max_batch, pages, victim, victims, n_vict, fl, i, need, free, swap
                    )
                if not victim[i]:
                    free -= need - pages[i]
                    pages[i], tops[i] = need, top
        n_chunks = 0
        n_admitted = 0
        n_new = 0  # admitted into prefill (chunked)
        n_res = 0  # swapped back in
        prefill_us = 0.0
        q = cnt[Q_HEAD]
        if extended:
            left = budget - k_sum - n
            for j in range(n_pre):
                slot = max_batch + j
                if victim[slot] or left <= 0:
                    continue
                r = lists[PRE, j]
                tokens = min(st[TARGET, r] - st[PREFILLED, r], left)
                if kv_on:
                    if windowed:
                        free = drop_skipped(pages, tops, slot, st[PREFILLED, r], block, wins, parts, free)
                    top = max(top_of(st[PREFILLED, r] + tokens, block), tops[slot])
                    need = pages_of(top, st[PREFILLED, r], block, wins, parts)
                    n_vict, free, swap = make_room(
                        st, sf, lists, n, n_pre, max_batch, pages, victim, victims, n_vict, fl, slot, need, free, swap
                    )
                    if victim[slot]:
                        continue
                    free -= need - pages[slot]
                    pages[slot], tops[slot] = need, top
                chunk_row[n_chunks], chunk_tokens[n_chunks], chunk_slot[n_chunks] = r, tokens, slot
                n_chunks += 1
                left -= tokens
            if n_vict:  # the victims' chunks dropped (their tokens stay spent, as the scheduler's)
                kept = 0
                for c in range(n_chunks):
                    if not victim[chunk_slot[c]]:
                        chunk_row[kept], chunk_tokens[kept], chunk_slot[kept] = chunk_row[c], chunk_tokens[c], chunk_slot[c]
                        kept += 1
                n_chunks = kept
            while n_vict == 0 and q < cnt[Q_TAIL] and (left > 0 or not chunked):
                if n + n_pre + n_new + n_admitted + n_res >= max_batch:
                    break
                r = lists[QUE, q]
                a = n_new + n_admitted + n_res
                if st[SWAPPED, r]:
                    written = st[PROMPT, r] + st[DECODED, r]
                    need = pages_of(written, written, block, wins, parts)  # a queued request holds no pages
                    if need > free:
                        break
                    free -= need
                    pages[2 * max_batch + a], tops[2 * max_batch + a] = need, top_of(written, block)
                    swap += swap_us(fl, pages[2 * max_batch + a])
                    kinds[a] = 2
                    resumed[n_res] = r
                    n_res += 1
                    q += 1
                    continue
                tokens = min(st[TARGET, r], left) if chunked else st[TARGET, r]
                need = 0
                if kv_on:
                    need = pages_of(tokens, 0, block, wins, parts)  # a queued request holds no pages
                    if need > free:
                        break
                    free -= need
                pages[2 * max_batch + a], tops[2 * max_batch + a] = need, top_of(tokens, block)
                if chunked:
                    chunk_row[n_chunks], chunk_tokens[n_chunks], chunk_slot[n_chunks] = r, tokens, -1
                    n_chunks += 1
                    n_new += 1
                    left -= tokens
                    kinds[a] = 1
                else:
                    if math.isnan(sf[PREFILL_COST, r]):
                        cnt[ASKED] = r
                        return PREFILL, done, clock
                    admitted[n_admitted] = r
                    n_admitted += 1
                    prefill_us += sf[PREFILL_COST, r]
                    kinds[a] = 0
                q += 1
        else:
            while q < cnt[Q_TAIL] and n + n_admitted < max_batch:
                r = lists[QUE, q]
                if math.isnan(sf[PREFILL_COST, r]):
                    cnt[ASKED] = r
                    return PREFILL, done, clock
                admitted[n_admitted] = r
                kinds[n_admitted] = 0
                n_admitted += 1
                prefill_us += sf[PREFILL_COST, r]
                q += 1
        n_live = 0
        longest = 0
        for i in range(n):
            if not victim[i]:
                live[n_live], live_ks[n_live] = act[i], ks[i]
                longest = max(longest, ks[i])
                n_live += 1
        if n_live == 0 and n_chunks == 0 and n_admitted == 0 and n_res == 0:
            return STOP, done, clock  # nothing to run: the loop waits for an arrival
        # ---- the pass
        draft = 0.0
        verify = 0.0
        distinct = math.nan
        seen = -1
        n_tokens = 0
        if n_live or n_chunks:
            context = 0
            for i in range(n_live):
                r = live[i]
                k = live_ks[i]
                start = st[POS, r] if st[POS, r] + k < st[POS_END, r] else st[POS_START, r]
                rows[i] = st[SEQ_ROW, r] + start
                lengths[i] = k + 1 if extra else max(k, 1)
                n_tokens += lengths[i]
                context += st[PROMPT, r] + st[DECODED, r] + 1
            nw, nb = n_live, 0
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
                draft = draft_tab[longest] if n_live else 0.0
                verify = verify_tab[n_tokens]
            else:
                seen = t[1][n_tokens]
                status = pass_total_us(
                    experts, rows, lengths, nw, region, lo, hi, nb, scratch, n_tokens, float(context), float(n_live + n_chunks), t,
                    dense, comm, out,
                )  # fmt: skip
                if status == NEED_TABLE:
                    cnt[ASKED] = n_tokens
                    return TABLE, done, clock
                if status == NEED_PYTHON:  # a size the ladder prices before its tables: tabled ahead, or the Python loop's
                    t[1][n_tokens] = seen
                    cnt[ASKED] = n_tokens
                    return LADDER, done, clock
                if status == STRAY_ID or status < 0:
                    return BAD_IDS, done, clock
                verify = out[0]
                if n_live:
                    distinct = out[1]
                if longest and draft_tab.shape[0] > 1:  # the engine's overhead of a drafting iteration (a free drafter's)
                    verified = n_live
                    for i in range(n_live):
                        verified += live_ks[i]
                    draft = draft_tab[longest * (max_batch * (k_cap + 1) + 1) + verified]
        delay = prefill_us + draft + verify
        if extended:
            delay = delay + swap
        if duration > 0.0 and clock + delay >= duration:
            if seen >= 0:
                t[1][n_tokens] = seen
            return STOP, done, clock
        # ---- commit the plan
        kv[0] = free
        for v in range(n_vict):  # the victims' rows, before the lists are compacted
            slot = victims[v]
            victims[v] = act[slot] if slot < max_batch else lists[PRE, slot - max_batch]
        kept = 0
        for i in range(n):
            if not victim[i]:
                st[KV_PAGES, act[i]], st[KV_TOKENS, act[i]] = pages[i], tops[i]
                act[kept] = act[i]
                kept += 1
        kept = 0
        for j in range(n_pre):
            if not victim[max_batch + j]:
                r = lists[PRE, j]
                st[KV_PAGES, r], st[KV_TOKENS, r] = pages[max_batch + j], tops[max_batch + j]
                lists[PRE, kept] = r
                kept += 1
        n_pre_live = kept
        for a in range(n_new + n_admitted + n_res):
            r = lists[QUE, cnt[Q_HEAD] + a]
            if kv_on:
                st[KV_PAGES, r], st[KV_TOKENS, r] = pages[2 * max_batch + a], tops[2 * max_batch + a]
            if extended:  # the scheduler's admission order
                cnt[ADMISSIONS] += 1
                st[ADMIT_SEQ, r] = cnt[ADMISSIONS]
            if kinds[a] == 1:
                lists[PRE, kept] = r
                kept += 1
            elif kinds[a] == 2:
                st[SWAPPED, r] = 0
        cnt[Q_HEAD] = q
        cnt[N_PRE] = kept
        if n_vict:
            preempt(st, sf, lists, cnt, victims, n_vict, fl)
        if extended:
            cnt[MAX_RUNNING] = max(cnt[MAX_RUNNING], n_live + n_pre_live + n_new + n_admitted + n_res)
        n = n_live
        if windows:
            for i in range(n):
                r = act[i]
                if st[POS, r] + live_ks[i] >= st[POS_END, r]:
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
        out_f[5, done] = swap
        out_i[0, done] = n
        out_i[1, done] = kv[1] - kv[0]
        out_i[2, done] = prefill_tokens
        out_i[4, done] = n_vict
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
            k = live_ks[i]
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
        for a in range(n_res):
            act[n] = resumed[a]
            n += 1
        cnt[N_ACT] = n
        cnt[SCANNED] = 0
        done += 1
    return MORE, done, clock
