# ruff: noqa: ANN001  (compiled kernels: Numba types their arguments)
"""One pass of the trace-driven step-time model in one compiled call (the simulator's per-iteration
cost; the reference is `TraceBatchCost` through `union_pass`/`union_features` and
`StepTimeModel.counts_pass_us`, tested equal bit for bit):

    T(pass) = min over the pass's families of Σ_layers time(U_l, M_l) + dense + fixed (+ collectives)

with U_l, M_l counted from the union of the pass's windows of the trace (from the trace's expert
bitmasks, `moesim.kernels.bitsets`, where it has them, a mixed pass's prefill region's blocks
added as counts; else by counting ids), time(U, M) looked up in the per-(U, M) table of
the pass size once the size has been costed `TABLE_AFTER_PASSES` times (`layer_time_table`,
built through `time_us`'s ladder) and, before, computed by the families' compiled formula
(`family_kernel.element_time_us`) where every family of the pass is `ExpertFamily.compiled`,
summed over layers in numpy's pairwise order. A family priced by its lookup ladder (not
`compiled`) is never priced by the formula: an untabled size returns NEED_PYTHON with the
features counted and the caller prices them in Python. No array is allocated per call: counts,
per-layer features and tables live in `PassTables`.
"""

from __future__ import annotations

import numpy as np

from moesim.hw_profiles.family_kernel import element_time_us
from moesim.kernels.bitsets import bitset_union, bitset_union_blocks, empty_masks, union_planes
from moesim.kernels.jit import njit

NEED_TABLE = -1  # the pass size has been costed often enough: build its tables and call again
STRAY_ID = -2  # an expert id >= the number of experts
NEED_PYTHON = -4  # an untabled size of a family the formula does not price (its ladder): priced in Python
TABLE_BYTES_KEPT = 256 * 2**20  # tables of the compiled path beyond this are dropped (rebuilt on demand)


@njit
def _block_sum(a, lo, n):  # noqa: ANN202
    """Σ a[lo:lo+n], n <= 128, as numpy sums a block: eight accumulators, then the tail."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - (n % 8):
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit
def pairwise_sum(a, lo, n):  # noqa: ANN201
    """Σ a[lo:lo+n] in numpy's order (pairwise halves down to blocks of <= 128, eight accumulators
    per block): the same bits as `a.sum()`. Iterative (a recursive kernel cannot be cached): the
    halving tree is walked in post-order with an explicit stack of partial sums."""
    if n <= 128:
        return _block_sum(a, lo, n)
    starts = np.empty(64, np.int64)
    sizes = np.empty(64, np.int64)
    state = np.zeros(64, np.int64)  # 0: not split yet, 1: left half summed (its sum in partial)
    partial = np.empty(64)
    depth = 0
    starts[0], sizes[0], state[0] = lo, n, 0
    result = 0.0
    while depth >= 0:
        size = sizes[depth]
        if size <= 128:
            value = _block_sum(a, starts[depth], size)
        elif state[depth] == 0:
            half = size // 2
            half -= half % 8
            state[depth] = 1
            starts[depth + 1], sizes[depth + 1], state[depth + 1] = starts[depth], half, 0
            depth += 1
            continue
        elif state[depth] == 1:
            half = size // 2
            half -= half % 8
            state[depth] = 2
            starts[depth + 1], sizes[depth + 1], state[depth + 1] = starts[depth] + half, size - half, 0
            depth += 1
            continue
        else:
            value = partial[depth] + partial[depth + 1]
        depth -= 1
        if depth < 0:
            result = value
        elif state[depth] == 1:
            partial[depth] = value  # the left half's sum
        else:
            partial[depth + 1] = value  # the right half's sum
    return result


@njit
def count_union(experts, rows, lengths, n_windows, checkpoints, block_lo, block_hi, n_blocks, union, features):  # noqa: ANN201
    """features[0, l], [1, l], [2, l] = distinct experts, max tokens per expert and slots of layer l
    over windows rows[i] .. rows[i] + lengths[i] − 1 (i < n_windows) and blocks of checkpoint
    differences (b < n_blocks); `union` = (counts, masks, planes, group, tally) of `scratch_for`. From the
    trace's expert bitmasks (`moesim.kernels.bitsets`) when it has them (the blocks' counts added
    to the windows' counts read out of the bit planes), else by counting ids (`count_ids`): the
    same features. Returns Σ_l U_l, or −1 for an expert id >= E."""
    counts, masks, planes, group, tally = union
    if masks.shape[0] == experts.shape[0] + 1:
        if n_blocks == 0:
            return bitset_union(masks, rows, lengths, n_windows, experts.shape[2], planes, group, features)
        n_experts = counts.shape[1] - 1
        args = (masks, rows, lengths, n_windows, checkpoints, block_lo, block_hi, n_blocks, n_experts, planes, group, tally, features)
        return bitset_union_blocks(*args)
    return count_ids(experts, rows, lengths, n_windows, checkpoints, block_lo, block_hi, n_blocks, counts.shape[1] - 1, counts, features)


@njit
def count_ids(experts, rows, lengths, n_windows, checkpoints, block_lo, block_hi, n_blocks, n_experts, counts, features):  # noqa: ANN201
    """`count_union` by counting every id of the windows (and adding the blocks' counts) into
    `counts` (L, E + 1), zero on entry and exit; an id >= E lands in column E."""
    _, n_layers, k = experts.shape
    width = counts.shape[1]
    for w in range(n_windows):
        for t in range(rows[w], rows[w] + lengths[w]):
            for layer in range(n_layers):
                for j in range(k):
                    counts[layer, min(np.intp(experts[t, layer, j]), width - 1)] += 1
    for b in range(n_blocks):
        lo, hi = block_lo[b], block_hi[b]
        for layer in range(n_layers):
            for e in range(n_experts):
                counts[layer, e] += checkpoints[hi, layer, e] - checkpoints[lo, layer, e]
    stray = 0
    total = 0
    for layer in range(n_layers):
        u = 0
        m = 0
        s = 0
        for e in range(n_experts):
            c = counts[layer, e]
            u += c > 0
            m = max(m, c)
            s += c
            counts[layer, e] = 0
        for e in range(n_experts, width):
            stray |= counts[layer, e]
            counts[layer, e] = 0
        features[0, layer] = u
        features[1, layer] = m
        features[2, layer] = s
        total += u
    return -1 if stray else total


@njit
def expert_us(n_tokens, features, t, layer_buf):  # noqa: ANN201
    """The pass's expert time from its per-layer features (see the module docstring); NEED_TABLE
    when the size has just reached its tables, NEED_PYTHON (the size not counted) when an untabled
    size has a family the formula does not price. `t` is a `PassTables.arrays()` tuple."""
    select, seen, offsets, buf, after, params, widths, n_widths, compute, serial, n_coef, top_k, compiled = t
    n_families = select.shape[1]
    n_layers = features.shape[1]
    first = -1
    for f in range(n_families):
        if select[n_tokens, f]:
            first = f
            break
    tabled = offsets[first, n_tokens] >= 0
    if not tabled:
        if seen[n_tokens] + 1 >= after:
            return np.float64(NEED_TABLE)
        for f in range(n_families):
            if select[n_tokens, f] and not compiled[f]:
                return np.float64(NEED_PYTHON)
        seen[n_tokens] += 1
    best = np.inf
    slots = float(n_tokens * top_k)
    for f in range(n_families):
        if not select[n_tokens, f]:
            continue
        if tabled:
            base = offsets[f, n_tokens]
            columns = n_tokens + 1
            for layer in range(n_layers):
                layer_buf[layer] = buf[base + features[0, layer] * columns + features[1, layer]]
        else:
            w, c = widths[f, : n_widths[f]], compute[f, : n_coef[f]]
            s = serial[f, : n_coef[f]]
            for layer in range(n_layers):
                layer_buf[layer] = element_time_us(float(features[0, layer]), slots, float(features[1, layer]), params[f], w, c, s)
        best = min(best, pairwise_sum(layer_buf, 0, n_layers))
    return best


@njit
def plus_dense(expert, n_tokens, context_tokens, sequences, dense, comm):  # noqa: ANN201
    """`StepTimeModel._plus_dense` compiled, the same operations in the same order; `dense` =
    weight bytes, KV bytes per token, params, kernels, launch µs, bandwidth GB/s, FLOP coefficient,
    attention priced (1/0), attention FLOPs per context token, attention coefficient, devices,
    fixed µs, engine time priced (1/0: `comm` then holds the collectives plus the engine's time per
    forward of each pass size), the number of sliding windows, then per window W, its layers' KV
    bytes per token and attention FLOPs per context token (the full layers' in the first terms;
    each sequence's queries at the mean context: `moesim.models.window_keys` of span 1, min(c, W))."""
    weight_bytes, kv, params, kernels = dense[0], dense[1], dense[2], dense[3]
    launch, bandwidth, flop_coefficient = dense[4], dense[5], dense[6]
    per_sequence = context_tokens / sequences
    kv_windowed, attention_windowed = 0.0, 0.0
    for g in range(int(dense[13])):
        window = dense[14 + 3 * g]
        keys = per_sequence if per_sequence <= window else window
        kv_windowed = kv_windowed + dense[15 + 3 * g] * sequences * keys
        attention_windowed = attention_windowed + dense[16 + 3 * g] * sequences * keys
    bytes_read = weight_bytes + (kv * context_tokens + kv_windowed)
    flops = 2.0 * params * n_tokens
    total_dense = launch * kernels + bytes_read / (bandwidth * 1e3) + flops * flop_coefficient
    if dense[7]:
        attention = dense[8] * n_tokens / sequences * context_tokens + attention_windowed * n_tokens / sequences
        total_dense += (attention / dense[10]) * dense[9]
    total = expert + total_dense + dense[11]
    if dense[10] > 1.0 or dense[12]:
        total = total + comm[n_tokens]
    return total


class PassTables:
    """What the compiled pass needs of a step-time model, kept between calls: per pass size the
    families it may take and how often it was costed, the per-(U, M) tables in one flat buffer,
    the families' compiled parameters, the dense terms and the collectives per pass size."""

    def __init__(
        self,
        families: list[tuple[np.ndarray, ...] | None],
        dense: np.ndarray,
        top_k: int,
        after: int,
        resolve: object,
        ready: list[set[int]] | None = None,
    ) -> None:
        self.ready = ready or [set() for _ in families]  # per family: sizes whose tables are built already (tabled at their first pass)
        self.compiled = np.array([f is not None for f in families], np.bool_)  # None: priced by its ladder, not the formula
        families = [f if f is not None else _NO_PARAMS for f in families]
        self.n_families = len(families)
        self.params = np.ascontiguousarray(np.stack([f[0] for f in families]))
        self.n_widths = np.array([f[1].size for f in families], np.int64)
        self.n_coef = np.array([f[2].size for f in families], np.int64)
        self.widths = _padded([f[1] for f in families])
        self.compute = _padded([f[2] for f in families])
        self.serial = _padded([f[3] for f in families])
        self.dense = np.asarray(dense, np.float64)
        self.top_k = top_k
        self.after = after
        self._resolve = resolve  # n_max -> (select (n_max + 1, F) bool, comm (n_max + 1,) float)
        self.select = np.zeros((0, self.n_families), np.bool_)
        self.comm = np.zeros(0)
        self.seen = np.zeros(0, np.int64)
        self.offsets = np.full((self.n_families, 0), -1, np.int64)
        self.buf = np.zeros(0)
        self.used = 0
        self.ensure(64)

    def ensure(self, n_max: int) -> None:
        """Room for passes of up to n_max tokens."""
        size = self.seen.size
        if n_max < size:
            return
        grown = max(n_max + 1, 2 * size)
        self.select, self.comm = self._resolve(grown - 1)  # type: ignore[operator]
        self.seen = np.concatenate([self.seen, np.zeros(grown - size, np.int64)])
        if any(self.ready):
            built = np.zeros((grown, self.n_families), np.bool_)
            for f, sizes in enumerate(self.ready):
                built[[n for n in sizes if n < grown], f] = True
            ready = np.flatnonzero((built | ~self.select[:grown]).all(axis=1)[size:]) + size
            self.seen[ready] = self.after - 1  # their next pass asks for their tables
        self.offsets = np.concatenate([self.offsets, np.full((self.n_families, grown - size), -1, np.int64)], axis=1)

    def families_of(self, n_tokens: int) -> np.ndarray:
        """Indices of the families a pass of n tokens may take."""
        return np.flatnonzero(self.select[n_tokens])

    def add_table(self, family: int, n_tokens: int, table: np.ndarray) -> None:
        """Keep one family's (E + 1, n + 1) table of a pass size."""
        flat = np.ascontiguousarray(table, np.float64).ravel()
        if (self.used + flat.size) * 8 > TABLE_BYTES_KEPT:
            self.offsets[:] = -1
            self.used = 0
        if self.used + flat.size > self.buf.size:
            self.buf = np.concatenate([self.buf[: self.used], np.zeros(max(self.used + flat.size, 2 * self.buf.size) - self.used)])
        self.buf[self.used : self.used + flat.size] = flat
        self.offsets[family, n_tokens] = self.used
        self.used += flat.size

    def arrays(self) -> tuple:
        """The tuple `expert_us` takes (rebuilt after any growth)."""
        return (
            self.select, self.seen, self.offsets, self.buf, self.after, self.params, self.widths, self.n_widths,
            self.compute, self.serial, self.n_coef, self.top_k, self.compiled,
        )  # fmt: skip


_NO_PARAMS = (np.zeros(16), np.zeros(0), np.zeros(1), np.zeros(1))  # never read: the family is not `compiled`


def _padded(rows: list[np.ndarray]) -> np.ndarray:
    out = np.zeros((len(rows), max(1, *(r.size for r in rows))))
    for i, r in enumerate(rows):
        out[i, : r.size] = r
    return out


OUTSIDE = -3  # a window outside the trace's rows


@njit
def pass_total_us(  # noqa: ANN201
    experts,
    rows,
    lengths,
    n_windows,
    region,
    lo,
    hi,
    n_blocks,
    scratch,
    n_tokens,
    context,
    sequences,
    t,
    dense,
    comm,
    out,
):
    """One pass: out[0] = its time (µs), out[1] = mean distinct experts per layer; returns 0, or
    NEED_TABLE, STRAY_ID, OUTSIDE (nothing counted), NEED_PYTHON (out[1] and the features in
    `scratch` counted, the time not). `scratch` = (union buffers, features, layer_buf) of
    `scratch_for`, `region` the prefill region's checkpoints."""
    union, features, layer_buf = scratch
    for w in range(n_windows):
        if rows[w] < 0 or lengths[w] < 0 or rows[w] + lengths[w] > experts.shape[0]:
            return OUTSIDE
    distinct = count_union(experts, rows, lengths, n_windows, region, lo, hi, n_blocks, union, features)
    if distinct < 0:
        return STRAY_ID
    out[1] = float(distinct) / features.shape[1]
    expert = expert_us(n_tokens, features, t, layer_buf)
    if expert < 0.0:  # NEED_TABLE or NEED_PYTHON (a time is never negative)
        return int(expert)
    out[0] = plus_dense(expert, n_tokens, context, sequences, dense, comm)
    return 0


def scratch_for(n_layers: int, n_experts: int, masks: np.ndarray | None = None) -> tuple:
    """The buffers `pass_total_us` reuses: the union's (counts (zero), the trace's expert bitmasks
    or none, and `union_planes`' bit planes, group of rows and dense tally), per-layer features,
    per-layer times."""
    planes, group, tally = union_planes(n_layers, n_experts)
    union = (
        np.zeros((n_layers, n_experts + 1), np.int32),
        masks if masks is not None else empty_masks(n_layers, n_experts),
        planes,
        group,
        tally,
    )
    return union, np.zeros((3, n_layers), np.int64), np.zeros(n_layers)
