# ruff: noqa: ANN001  (compiled kernels: Numba types their arguments)
"""The union of a batch's windows counted from per-token expert bitmasks (Numba).

A trace's masks (`fill_masks`, once per trace): `masks[t, l]` is W = ceil(E / 64) words whose
bit e % 64 of word e // 64 is set when token row t selects expert e at MoE layer l; the rows are
contiguous per token (L·W words) and one extra all-zero row T pads the counter's groups of 8.
They hold each token's experts as a set, so a trace with an id >= E or an id twice in one
token's layer cannot use them (`fill_masks` says which; the caller counts ids instead).

Per layer of the union of windows (`bitset_union`):
    U = popcount(OR of the tokens' masks),  M = max_e c_e,  S = tokens · K,
with c_e, the tokens selecting expert e, held bit-sliced: plane p has bit p of every c_e, so
adding 8 tokens is a carry-save adder tree (Harley–Seal: ones, twos, fours kept across groups,
the eights carried up the higher planes), one loop over the words that LLVM vectorises; M is
read from the planes top down (keep the experts whose bit p is set while any is, p = P−1..0),
and the OR of all planes is the union's mask.
"""

from __future__ import annotations

import numpy as np

from moesim.kernels.jit import njit
from moesim.kernels.windows import _popcount

MASKS_OK, MASKS_STRAY, MASKS_REPEATED = 0, 1, 2  # what `fill_masks` found
MAX_PLANES = 32  # counts below 2**32 (a pass of fewer than 4·10^9 tokens)
GROUP = 8  # tokens per carry-save adder tree


def mask_words(n_experts: int) -> int:
    """Words of one token's layer: ceil(E / 64)."""
    return -(-n_experts // 64)


def masks_bytes(n_rows: int, n_layers: int, n_experts: int) -> int:
    """Bytes of a trace's masks: (T + 1) · L · ceil(E / 64) · 8."""
    return (n_rows + 1) * n_layers * mask_words(n_experts) * 8


def empty_masks(n_layers: int, n_experts: int) -> np.ndarray:
    """No masks (0 rows): `bitset_union`'s callers count ids instead."""
    return np.zeros((0, n_layers, mask_words(n_experts)), np.uint64)


def union_planes(n_layers: int, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The scratch `bitset_union` reuses: MAX_PLANES planes and two rows (carries, the union) of L·W words,
    one more of L·W, and a group's rows."""
    return np.zeros((MAX_PLANES + 2, n_layers * mask_words(n_experts)), np.uint64), np.zeros(GROUP, np.int64)


@njit
def fill_masks(experts, n_experts, masks):  # noqa: ANN201
    """masks[t, l] = the set of experts[t, l, :] as bits, masks[T] = 0; returns MASKS_OK, or
    MASKS_STRAY (an id >= n_experts), MASKS_REPEATED (an id twice in one token's layer: fewer than
    K bits set). One pass without branches: the checks are folded into two flags."""
    n_rows, n_layers, k = experts.shape
    n_words = masks.shape[2]
    one, last, low = np.uint64(1), np.uint64(n_words - 1), np.uint64(63)
    masks[n_rows] = 0
    stray = False
    repeated = False
    for t in range(n_rows):
        for layer in range(n_layers):
            for w in range(n_words):
                masks[t, layer, w] = 0
            for j in range(k):
                e = np.uint64(experts[t, layer, j])
                stray |= e >= n_experts
                masks[t, layer, min(e >> np.uint64(6), last)] |= one << (e & low)
            bits = 0
            for w in range(n_words):
                bits += _popcount(masks[t, layer, w])
            repeated |= bits != k
    return MASKS_STRAY if stray else MASKS_REPEATED if repeated else MASKS_OK


@njit(inline="always")
def _csa(a, b, c):  # noqa: ANN202
    """A carry-save adder of three bit vectors: (carry, sum) = ((a & b) | (c & (a ^ b)), a ^ b ^ c)."""
    u = a ^ b
    return (a & b) | (u & c), u ^ c


@njit
def _add_group(flat, group, planes, n_words, n_planes):  # noqa: ANN202
    """Add the masks of rows group[0..7] to the bit-sliced counters (planes 0..n_planes−1)."""
    r0, r1, r2, r3 = group[0], group[1], group[2], group[3]
    r4, r5, r6, r7 = group[4], group[5], group[6], group[7]
    carry = planes[MAX_PLANES]
    ones, twos, fours = planes[0], planes[1], planes[2]
    for x in range(n_words):
        o, tw, fo = ones[x], twos[x], fours[x]
        t_a, o = _csa(o, flat[r0, x], flat[r1, x])
        t_b, o = _csa(o, flat[r2, x], flat[r3, x])
        f_a, tw = _csa(tw, t_a, t_b)
        t_a, o = _csa(o, flat[r4, x], flat[r5, x])
        t_b, o = _csa(o, flat[r6, x], flat[r7, x])
        f_b, tw = _csa(tw, t_a, t_b)
        eights, fo = _csa(fo, f_a, f_b)
        ones[x], twos[x], fours[x] = o, tw, fo
        carry[x] = eights
    for p in range(3, n_planes):  # the eights up the planes, while any carry is left
        plane = planes[p]
        left = np.uint64(0)
        for x in range(n_words):
            c = carry[x]
            next_carry = plane[x] & c
            plane[x] = plane[x] ^ c
            carry[x] = next_carry
            left |= next_carry
        if left == 0:
            break


@njit
def bitset_union(masks, rows, lengths, n_windows, top_k, planes, group, features):  # noqa: ANN201
    """features[0, l], [1, l], [2, l] = distinct experts, max tokens per expert and slots of layer
    l over windows rows[i] .. rows[i] + lengths[i] − 1 (i < n_windows) of `masks` (see the module
    docstring); `planes`, `group` from `union_planes`. Returns Σ_l U_l."""
    n_rows, n_layers, n_words_layer = masks.shape
    n_words = n_layers * n_words_layer
    flat = masks.reshape(n_rows, n_words)
    pad = n_rows - 1  # the all-zero row
    n_tokens = 0
    for w in range(n_windows):
        n_tokens += lengths[w]
    n_planes = 3
    while (1 << n_planes) <= n_tokens:
        n_planes += 1
    for p in range(n_planes):
        planes[p, :n_words] = 0
    w, t, end = -1, 0, 0
    left = n_tokens
    while left > 0:
        for g in range(GROUP):
            if left == 0:
                group[g] = pad
                continue
            while t == end:
                w += 1
                t, end = rows[w], rows[w] + lengths[w]
            group[g] = t
            t += 1
            left -= 1
        _add_group(flat, group, planes, n_words, n_planes)
    slots = n_tokens * top_k
    present, hits = planes[MAX_PLANES], planes[MAX_PLANES + 1]
    present[:n_words] = planes[0, :n_words]
    for p in range(1, n_planes):  # the union: experts with a count > 0
        plane = planes[p]
        for x in range(n_words):
            present[x] |= plane[x]
    for x in range(n_words):
        hits[x] = _popcount(present[x])
    total = 0
    for layer in range(n_layers):
        u = 0
        for x in range(layer * n_words_layer, (layer + 1) * n_words_layer):
            u += np.int64(hits[x])
        features[0, layer] = u
        features[1, layer] = 0
        features[2, layer] = slots
        total += u
    top = n_planes - 1
    while top >= 0 and not _any(planes[top], n_words):
        top -= 1
    for p in range(top, -1, -1):  # the largest count, bit by bit from the top: keep the experts
        plane = planes[p]  # (of each layer) with bit p set, if any has it
        for x in range(n_words):
            hits[x] = present[x] & plane[x]
        for layer in range(n_layers):  # branch-free: which layers keep bit p depends on the data
            lo = layer * n_words_layer
            found = np.uint64(0)
            for x in range(lo, lo + n_words_layer):
                found |= hits[x]
            has = np.int64(found != 0)
            features[1, layer] |= has << p
            keep = np.uint64(0) - np.uint64(has)
            for x in range(lo, lo + n_words_layer):
                present[x] = (hits[x] & keep) | (present[x] & ~keep)
    return total


@njit(inline="always")
def _any(words, n):  # noqa: ANN202
    """Any bit set in words[:n]."""
    found = np.uint64(0)
    for x in range(n):
        found |= words[x]
    return found != 0
