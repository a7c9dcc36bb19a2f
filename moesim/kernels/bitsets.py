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
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

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


def union_planes(n_layers: int, n_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scratch `bitset_union` reuses: MAX_PLANES planes and two rows (carries, the union) of L·W
    words, a group's rows, and one layer's dense counts (64·W int32, zero) for `bitset_union_blocks`."""
    words = mask_words(n_experts)
    return np.zeros((MAX_PLANES + 2, n_layers * words), np.uint64), np.zeros(GROUP, np.int64), np.zeros(64 * words, np.int32)


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
def _add_windows(masks, rows, lengths, n_windows, planes, group):  # noqa: ANN202
    """The windows' tokens counted into planes 0..P−1 (zeroed first), P = max(3, bit_length(tokens));
    returns (tokens, P)."""
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
    return n_tokens, n_planes


@njit
def bitset_union(masks, rows, lengths, n_windows, top_k, planes, group, features):  # noqa: ANN201
    """features[0, l], [1, l], [2, l] = distinct experts, max tokens per expert and slots of layer
    l over windows rows[i] .. rows[i] + lengths[i] − 1 (i < n_windows) of `masks` (see the module
    docstring); `planes`, `group` from `union_planes`. Returns Σ_l U_l."""
    _, n_layers, n_words_layer = masks.shape
    n_words = n_layers * n_words_layer
    n_tokens, n_planes = _add_windows(masks, rows, lengths, n_windows, planes, group)
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


@intrinsic
def _add_counts(typingctx, tally, base, planes, column, top):  # noqa: ANN202
    """tally[base + b] += Σ_{p <= top} (bit b of planes[p, column]) · 2^p for b < 64: the 64 experts
    of one word read out of the planes, top down (c = 2c + bits), the 64 counts kept in a vector
    (LLVM's <64 x i32>, the word's bits as its <64 x i1> mask: on AVX-512 a mask register and
    vpmovm2d, elsewhere LLVM's lowering of the same operations)."""
    if not (_is_c_array(tally, types.int32, 1) and _is_c_array(planes, types.uint64, 2)):
        return None
    if not all(isinstance(x, types.Integer) for x in (base, column, top)):
        return None
    vector = ir.VectorType(ir.IntType(32), 64)

    def codegen(context, builder, signature, args):  # noqa: ANN202
        tally_type, _, planes_type, _, _ = signature.args
        tally_v, base_v, planes_v, column_v, top_v = (
            context.cast(builder, v, t, types.intp) if isinstance(t, types.Integer) else v
            for v, t in zip(args, signature.args, strict=True)
        )
        at = cgutils.get_item_pointer(context, builder, tally_type, context.make_array(tally_type)(context, builder, tally_v), [base_v])
        at = builder.bitcast(at, vector.as_pointer())
        words = context.make_array(planes_type)(context, builder, planes_v)
        counts = cgutils.alloca_once_value(builder, ir.Constant(vector, None))
        one = ir.Constant(top_v.type, 1)
        n = builder.add(top_v, one)
        with cgutils.for_range(builder, n) as loop:
            p = builder.sub(top_v, loop.index)
            word = builder.load(cgutils.get_item_pointer(context, builder, planes_type, words, [p, column_v]))
            bits = builder.zext(builder.bitcast(word, ir.VectorType(ir.IntType(1), 64)), vector)
            c = builder.load(counts)
            builder.store(builder.add(builder.add(c, c), bits), counts)
        builder.store(builder.add(builder.load(at, align=4), builder.load(counts)), at, align=4)
        return context.get_dummy_value()

    return types.void(tally, base, planes, column, top), codegen


def _is_c_array(t: types.Type, dtype: types.Type, ndim: int) -> bool:
    return isinstance(t, types.Array) and t.dtype == dtype and t.ndim == ndim and t.layout == "C"


@njit
def bitset_union_blocks(  # noqa: ANN201
    masks, rows, lengths, n_windows, checkpoints, block_lo, block_hi, n_blocks, n_experts, planes, group, tally, features
):
    """`bitset_union` of the windows plus blocks of checkpoint differences (b < n_blocks): per layer
    c_e = Σ_p bit_e(plane p)·2^p + Σ_b (checkpoints[block_hi[b], l, e] − checkpoints[block_lo[b], l, e]),
    then U = #{c_e > 0}, M = max_e c_e, S = Σ_e c_e (as `count_ids` counts them), the c_e of a layer
    in `tally` (64·ceil(E / 64) int32 of `union_planes`, zero on entry and exit). Returns Σ_l U_l."""
    _, n_layers, n_words_layer = masks.shape
    if tally.shape[0] < 64 * n_words_layer:
        raise ValueError("tally must come from union_planes(n_layers, n_experts)")
    _, n_planes = _add_windows(masks, rows, lengths, n_windows, planes, group)
    total = 0
    for layer in range(n_layers):
        lo = layer * n_words_layer
        top = n_planes - 1  # the highest plane with a bit of this layer
        while top >= 0 and not _any(planes[top, lo:], n_words_layer):
            top -= 1
        for w in range(n_words_layer):
            _add_counts(tally, 64 * w, planes, lo + w, top)
        for b in range(n_blocks):
            high, low = checkpoints[block_hi[b], layer], checkpoints[block_lo[b], layer]
            for e in range(n_experts):
                tally[e] += high[e] - low[e]
        u = 0
        m = 0
        s = 0
        for e in range(n_experts):
            c = tally[e]
            u += c > 0
            m = max(m, c)
            s += c
            tally[e] = 0
        features[0, layer] = u
        features[1, layer] = m
        features[2, layer] = s
        total += u
    return total
