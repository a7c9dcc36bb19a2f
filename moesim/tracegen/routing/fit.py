"""Fit a routing generator to a trace, per MoE layer, by the method of simulated moments.

Each fittable family has a table of moment ↔ parameter pairs (`FAMILIES`): every parameter is
matched to the one statistic it mainly governs, for every layer at once. Statistics per layer:

- `popularity`: the mean overlap |S_a ∩ S_b| / K of tokens from *different* sequences, which
  only the global popularity sets (one sequence only: the normalised entropy of its expert
  frequencies, and δ = 0, since a lone sequence's favourites cannot be told from global skew);
- `reuse_d`: the overlap |S_t ∩ S_t+d| / K of tokens d apart in one sequence;
- `share_n`: the distinct experts in a window of n tokens / (n·K) (windows inside a sequence).

`mixture`: popularity ← Zipf exponent s, share_D ← dispersion δ (D = 16, or a quarter of the
median sequence length, at least 6), reuse_d ← keep_prob (d = 1) and keep_prob_d (d = 2..4).
Lags 2..4 are freed only for layers where one-lag stickiness misses reuse at d = 2..4 by more
than a point (parsimony: free lags trade off against q1 and δ).
`working-set`: popularity ← s, reuse_1 ← keep_prob q, share_4 ← working_use p, share_16 ←
working_persist ρ, share_N ← δ (N = the largest of 64, 48, 32 that at least a quarter of the
sequences reach); W is fixed (6).

Each statistic is matched by simulating the generator on the source's own sequence layout (same
lengths, so finite-sample effects such as few sequences are reproduced), on `replicates` copies
of it to reduce noise, with common random numbers (each layer draws from its own seed): one
parameter at a time for all layers, by a bracketing search (Illinois regula falsi) from start
values, in Gauss-Seidel rounds until every moment of every layer is within 3·tol. Traces longer
than `max_positions` are fitted on their first sequences up to that many positions.
Parameter files: `moesim.tracegen.routing.params`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.kernels.locality import mean_distinct_experts, reuse
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.routing.synth import Mixture, RoutingGenerator, WorkingSet

LAGS = 4
ZIPF_RANGE = (0.0, 3.0)
LOG_DISPERSION_RANGE = (-3.0, 3.0)  # δ = 10^u; the lower end stands for "no dispersion" (δ = 0)
KEEP_LIMIT = 0.98  # |keep probabilities| of a layer sum to at most this
MIN_POSITIONS_SIMULATED = 16384
LAG_GAP = 0.01  # mixture: lags 2..4 are fitted where one-lag stickiness misses reuse_2..4 by more than this


@dataclass(frozen=True)
class MomentPair:
    """A moment matched by a parameter: `moment` rises with `parameter` when `increasing`; the
    search starts at `start` with a bracket of ± `width` inside [low, high]; `log10`: the fitted
    column is log10 of the value, its lower end standing for 0."""

    moment: str
    parameter: str
    increasing: bool
    width: float
    low: float
    high: float
    start: float = 0.0
    log10: bool = False

    def values(self, column: np.ndarray) -> tuple[float, ...]:
        """The generator's per-layer values from the fitted column."""
        if self.log10:
            column = np.where(column <= self.low, 0.0, 10.0**column)
        return tuple(float(v) for v in column)


@dataclass(frozen=True)
class FitFamily:
    """How a generator family is fitted: its pairs for a source layout (several sequences or one),
    the values it keeps fixed, the parameters freed only where the base fit misses their moment by
    more than LAG_GAP, and an optional closed-form start."""

    generator: type
    pairs: Callable[[np.ndarray, bool], tuple[MomentPair, ...]]
    fixed: dict[str, Any] = field(default_factory=dict)
    optional: tuple[str, ...] = ()
    start: Callable[[np.ndarray, np.ndarray, TraceGeometry, bool], np.ndarray] | None = None

    def make(self, pairs: tuple[MomentPair, ...], x: np.ndarray) -> RoutingGenerator:
        """The generator of parameter rows x (one column per pair)."""
        values = {p.parameter: p.values(x[:, j]) for j, p in enumerate(pairs)}
        return self.generator(**{**self.fixed, **values})


def far_window(seq_starts: np.ndarray) -> tuple[int, int]:
    """The mixture's far distances (5, D) and window D: D = median sequence length / 4, within 6..16."""
    median = float(np.median(np.diff(seq_starts)))
    return LAGS + 1, int(min(16, max(LAGS + 2, median // 4)))


def long_window(seq_starts: np.ndarray) -> int:
    """The largest of 64, 48, 32 (else 16) that at least a quarter of the sequences reach."""
    lengths = np.diff(seq_starts)
    return next((n for n in (64, 48, 32) if (lengths >= n).mean() >= 0.25), 16)


def _mixture_pairs(seq_starts: np.ndarray, several: bool) -> tuple[MomentPair, ...]:
    pairs = [MomentPair("popularity", "zipf_exponent", several, 0.15, *ZIPF_RANGE)]  # one sequence: entropy falls with s
    if several:
        pairs.append(MomentPair(f"share_{far_window(seq_starts)[1]}", "seq_dispersion", False, 0.4, *LOG_DISPERSION_RANGE, log10=True))
    names = ("keep_prob", *(f"keep_prob_{d}" for d in range(2, LAGS + 1)))
    return (*pairs, *(MomentPair(f"reuse_{d}", name, True, 0.05, -KEEP_LIMIT, KEEP_LIMIT) for d, name in enumerate(names, 1)))


def _working_set_pairs(seq_starts: np.ndarray, several: bool) -> tuple[MomentPair, ...]:
    pairs = [
        MomentPair("popularity", "zipf_exponent", several, 0.15, *ZIPF_RANGE, start=0.5),
        MomentPair("reuse_1", "keep_prob", True, 0.05, 0.0, KEEP_LIMIT, start=0.1),
        MomentPair("share_4", "working_use", False, 0.1, 0.0, 1.0, start=0.3),
        MomentPair("share_16", "working_persist", False, 0.05, 0.0, 0.999, start=0.9),
    ]
    if several:
        pairs.append(MomentPair(f"share_{long_window(seq_starts)}", "seq_dispersion", False, 0.4, *LOG_DISPERSION_RANGE, -1.0, True))
    return tuple(pairs)


# ---- statistics -----------------------------------------------------------------------------


def normalized_entropy(experts: np.ndarray, n_experts: int) -> np.ndarray:
    """H(frequencies)/log E of each layer's expert selections: shape (L,)."""
    n_layers = experts.shape[1]
    counts = np.zeros((n_layers, n_experts))
    for layer in range(n_layers):
        counts[layer] = np.bincount(experts[:, layer, :].reshape(-1).astype(np.intp), minlength=n_experts)
    p = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    return h / math.log(n_experts) if n_experts > 1 else np.zeros(n_layers)


def cross_sequence_overlap(experts: np.ndarray, seq_starts: np.ndarray, n_experts: int) -> np.ndarray:
    """Mean |S_a ∩ S_b| / K over token pairs from different sequences: Σ_e f_i(e)·f_j(e) / K averaged
    over sequence pairs i ≠ j, f_i(e) = slots of sequence i on expert e per token: shape (L,)."""
    n_seqs, n_layers, k = len(seq_starts) - 1, experts.shape[1], experts.shape[2]
    seq_of_row = np.repeat(np.arange(n_seqs), np.diff(seq_starts))
    cell = (np.arange(n_layers)[None, :, None] * n_seqs + seq_of_row[:, None, None]) * n_experts + experts.astype(np.intp)
    freq = np.bincount(cell.reshape(-1), minlength=n_layers * n_seqs * n_experts).reshape(n_layers, n_seqs, n_experts).astype(np.float64)
    freq /= np.diff(seq_starts)[None, :, None]
    total = freq.sum(axis=1)
    pairs = (total * total).sum(axis=1) - (freq * freq).sum(axis=(1, 2))
    return pairs / (n_seqs * (n_seqs - 1) * k)


def _popularity(experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, blocks: int) -> np.ndarray:
    """Cross-sequence overlap (entropy for one sequence), averaged over `blocks` equal replicate blocks."""
    n_seqs = (len(seq_starts) - 1) // blocks
    parts = []
    for i in range(blocks):
        starts = seq_starts[i * n_seqs : (i + 1) * n_seqs + 1]
        rows = experts[starts[0] : starts[-1]]
        parts.append(cross_sequence_overlap(rows, starts - starts[0], n_experts) if n_seqs > 1 else normalized_entropy(rows, n_experts))
    return np.mean(parts, axis=0)


def routing_moments(names: list[str], experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, blocks: int = 1) -> np.ndarray:
    """The named statistics per layer, shape (L, len(names)) (see the module docstring)."""
    k = experts.shape[2]
    sizes = [int(n.split("_")[1]) for n in names if n.startswith("share_")]
    lags = [int(n.split("_")[1]) for n in names if n.startswith("reuse_")]
    distinct = mean_distinct_experts(experts, seq_starts, n_experts, max(sizes)) if sizes else None
    overlaps = reuse(experts, seq_starts, n_experts, max(lags)) if lags else None
    columns = []
    for name in names:
        kind, _, size = name.partition("_")
        if kind == "popularity":
            columns.append(_popularity(experts, seq_starts, n_experts, blocks))
        elif kind == "share":
            columns.append(distinct[:, int(size) - 1] / (int(size) * k))  # type: ignore[index]
        else:
            columns.append(overlaps[:, int(size) - 1])  # type: ignore[index]
    return np.column_stack(columns)


def _replicated(seq_starts: np.ndarray, copies: int) -> np.ndarray:
    lengths = np.diff(seq_starts)
    return np.concatenate([[0], np.cumsum(np.tile(lengths, copies))]).astype(np.int64)


def _clip_source(trace: Trace, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    starts = trace.seq_starts
    keep = max(1, min(int(np.searchsorted(starts, max_positions, side="right")) - 1, trace.n_seqs))
    end = int(starts[keep])
    if keep == 1 and end > max_positions:  # one long sequence: its prefix
        return trace.experts[:max_positions], np.array([0, max_positions], np.int64)
    return trace.experts[:end], starts[: keep + 1].copy()


# ---- the mixture's closed-form start --------------------------------------------------------


def _zipf_weights(n_experts: int, exponents: np.ndarray) -> np.ndarray:
    ranks = np.arange(1, n_experts + 1, dtype=np.float64)
    weights = ranks[None, :] ** -exponents[:, None]
    return weights / weights.sum(axis=1, keepdims=True)


def _mixture_start(experts: np.ndarray, seq_starts: np.ndarray, geometry: TraceGeometry, several: bool) -> np.ndarray:
    """Start rows (s, [log10 δ], q1, 0, 0, 0) from independent-draw approximations: cross-sequence
    overlap ≈ K·Σπ², plateau ≈ K·E[Σθ²] = K(Σπ²·c + 1)/(c + 1) with c = E/δ (the plateau is the
    mean reuse at distances 5..D), and reuse_1 ≈ plateau + (1 − plateau)·q1."""
    e, k = geometry.experts, geometry.top_k
    near, far = far_window(seq_starts)
    overlaps = reuse(experts, seq_starts, e, far)
    reuse_far, reuse_1 = overlaps[:, near - 1 : far].mean(axis=1), overlaps[:, 0]
    grid = np.linspace(*ZIPF_RANGE, 301)
    weights = _zipf_weights(e, grid)
    popularity = _popularity(experts, seq_starts, e, 1)
    columns = []
    if several:
        zipf = np.interp(popularity, k * (weights**2).sum(axis=1), grid)
        excess = reuse_far - k * (_zipf_weights(e, zipf) ** 2).sum(axis=1)
        c = (k - reuse_far) / np.maximum(excess, 1e-12)
        log_dispersion = np.where(excess > 1e-9, np.log10(e / np.maximum(c, 1e-12)), LOG_DISPERSION_RANGE[0])
        columns += [np.clip(zipf, *ZIPF_RANGE), np.clip(log_dispersion, *LOG_DISPERSION_RANGE)]
    else:
        entropy = -(weights * np.log(weights)).sum(axis=1) / math.log(e)
        columns.append(np.clip(np.interp(-popularity, -entropy, grid), *ZIPF_RANGE))
    keep = np.clip((reuse_1 - reuse_far) / np.maximum(1 - reuse_far, 1e-9), -KEEP_LIMIT, KEEP_LIMIT)
    return np.nan_to_num(np.column_stack([*columns, keep, np.zeros((keep.shape[0], LAGS - 1))]))


MIXTURE_LAGS = tuple(f"keep_prob_{d}" for d in range(2, LAGS + 1))
FAMILIES: dict[str, FitFamily] = {
    "mixture": FitFamily(Mixture, _mixture_pairs, {"seq_dispersion": 0.0}, MIXTURE_LAGS, _mixture_start),
    "working-set": FitFamily(WorkingSet, _working_set_pairs, {"seq_dispersion": 0.0, "working_set": 6}),
}


# ---- the search -----------------------------------------------------------------------------


class _Simulator:
    """Simulated moments of a family on a fixed layout with common random numbers."""

    def __init__(
        self, family: FitFamily, pairs: tuple[MomentPair, ...], geometry: TraceGeometry, seq_starts: np.ndarray, replicates: int, seed: int
    ) -> None:
        self.family, self.pairs, self.geometry = family, pairs, geometry
        self.names = [p.moment for p in pairs]
        self.layout = _replicated(seq_starts, replicates)
        self.replicates = replicates
        self.seed = seed

    def __call__(self, x: np.ndarray, layers: np.ndarray | None = None) -> np.ndarray:
        """Moments (len(layers), M) of the given layers (default: all) for parameter rows x; each layer
        draws from its own seed, so its moments do not depend on which other layers are simulated with it."""
        g = self.geometry
        layers = np.arange(len(g.moe_layers)) if layers is None else layers
        ids = []
        for i in layers:
            one = dataclasses.replace(g, moe_layers=(g.moe_layers[i],))
            generator = self.family.make(self.pairs, x[i : i + 1])
            ids.append(generator.generate_layout(one, self.layout, self.seed * 1_000_003 + int(i))[:, 0, :])  # type: ignore[attr-defined]
        return routing_moments(self.names, np.stack(ids, axis=1), self.layout, g.experts, self.replicates)


def _solve(
    evaluate: Callable[[np.ndarray, np.ndarray], np.ndarray],
    target: np.ndarray,
    x0: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    width: float,
    increasing: bool,
    tol: float,
    iterations: int,
    layers: np.ndarray,
) -> np.ndarray:
    """Per layer of the mask `layers`, x in [low, high] with evaluate(x, layers) = target (evaluate
    monotone), by Illinois regula falsi from the bracket x0 ± width, widened to the range on the
    side where the target lies beyond it; a layer stops once |evaluate − target| < tol (only
    layers still searching are simulated); an unreachable target clamps x to the nearer end."""
    sign = 1.0 if increasing else -1.0

    def f(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
        out = np.zeros_like(x)
        idx = np.flatnonzero(mask)
        if idx.size:
            out[idx] = sign * (evaluate(x, idx) - target[idx])
        return out

    a, b = np.clip(x0 - width, low, high), np.clip(x0 + width, low, high)
    fa, fb = f(a, layers), f(b, layers)
    below, above = layers & (fa > 0), layers & (fb < 0)  # the target lies beyond the bracket: widen it to the range
    a = np.where(below, low, a)
    fa = np.where(below, f(a, below), fa)
    b = np.where(above, high, b)
    fb = np.where(above, f(b, above), fb)
    active = layers & (fa < 0) & (fb > 0) & (np.minimum(-fa, fb) >= tol)
    x = np.where(layers, np.where(np.abs(fa) <= np.abs(fb), a, b), x0)
    side = np.zeros_like(x)
    for _ in range(iterations):
        if not active.any():
            break
        x = np.where(active, (a * fb - b * fa) / np.where(fb == fa, 1.0, fb - fa), x)
        fx = f(x, active)
        left = active & (fx < 0)
        right = active & (fx >= 0)
        a, fa = np.where(left, x, a), np.where(left, fx, fa)
        b, fb = np.where(right, x, b), np.where(right, fx, fb)
        fb = np.where(left & (side < 0), fb / 2, fb)  # Illinois: halve the end that stayed twice
        fa = np.where(right & (side > 0), fa / 2, fa)
        side = np.where(left, -1.0, np.where(right, 1.0, side))
        active &= np.abs(fx) >= tol
    return x


class _GaussSeidel:
    """Rounds of one-parameter solves (in place on x) until every fitted moment is within 3·tol."""

    def __init__(self, simulate: _Simulator, targets: np.ndarray, tol: float, rounds: int) -> None:
        self.simulate, self.targets, self.tol, self.rounds = simulate, targets, tol, rounds
        self.pairs = simulate.pairs

    def _bounds(self, x: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        pair = self.pairs[j]
        low, high = np.full(x.shape[0], pair.low), np.full(x.shape[0], pair.high)
        if not pair.parameter.startswith("keep_prob"):
            return low, high
        keeps = [i for i, p in enumerate(self.pairs) if p.parameter.startswith("keep_prob")]
        room = KEEP_LIMIT - (np.abs(x[:, keeps]).sum(axis=1) - np.abs(x[:, j]))  # the keep probabilities share KEEP_LIMIT
        return np.maximum(low, -room), np.minimum(high, room)

    def run(self, x: np.ndarray, params: list[int], layers: np.ndarray) -> np.ndarray:
        """Solve the parameters `params` of the masked layers; returns the moments of all layers."""
        open_layers = layers.copy()
        fitted = self.simulate(x)
        for _ in range(self.rounds):
            for j in params:

                def evaluate(values: np.ndarray, idx: np.ndarray, j: int = j) -> np.ndarray:
                    trial = x.copy()
                    trial[:, j] = values
                    return self.simulate(trial, idx)[:, j]

                pair = self.pairs[j]
                bounds = self._bounds(x, j)
                x[:, j] = _solve(evaluate, self.targets[:, j], x[:, j], *bounds, pair.width, pair.increasing, self.tol, 10, open_layers)
            fitted = self.simulate(x)
            gap = np.abs(fitted - self.targets)[:, params]
            open_layers = layers & (gap > 3 * self.tol).any(axis=1)
            if not open_layers.any():
                break
        return fitted


@dataclass(frozen=True)
class FitResult:
    """A fitted generator with the pairs it matched and their moments (source and fitted, (L, M))."""

    generator: RoutingGenerator
    pairs: tuple[MomentPair, ...]
    source: np.ndarray
    fitted: np.ndarray
    positions: int
    sequences: int

    def table(self, geometry: TraceGeometry) -> pl.DataFrame:
        """Per MoE layer: the fitted parameters and the largest gap between a fitted and a source moment
        (every moment of both is in the parameter file)."""
        columns: dict[str, Any] = {"layer": list(geometry.moe_layers)}
        for pair in self.pairs:
            columns[pair.parameter] = [round(v, 4) for v in getattr(self.generator, pair.parameter)]
        columns["worst_gap"] = np.abs(self.fitted - self.source).max(axis=1)
        return pl.DataFrame(columns)

    def method(self) -> str:
        """The pairs in words."""
        return "simulated moments: " + ", ".join(f"{p.moment} <- {p.parameter}" for p in self.pairs)


def fit_generator(
    trace: Trace,
    family: str = "mixture",
    seed: int = 0,
    replicates: int = 0,
    max_positions: int = 1 << 15,
    rounds: int = 6,
    tol: float = 1e-3,
) -> FitResult:
    """Fit the per-layer parameters of a generator family (a key of FAMILIES) to a trace by simulated
    moments; rounds repeat over the layers whose moments are not all within 3·tol of the source's."""
    if family not in FAMILIES:
        raise InputError(f"routing generator '{family}' cannot be fitted (fittable: {', '.join(FAMILIES)})")
    spec = FAMILIES[family]
    g = trace.meta.geometry
    if max_positions < 1:
        raise InputError(f"fitting needs max_positions (--max-positions) >= 1, got {max_positions}")
    experts, starts = _clip_source(trace, max_positions)
    several = len(starts) > 2
    pairs = spec.pairs(starts, several)
    longest = max(int(p.moment.split("_")[1]) for p in pairs if p.moment != "popularity")
    targets = routing_moments([p.moment for p in pairs], experts, starts, g.experts)
    if not np.isfinite(targets).all():
        raise InputError(f"trace of {g.model}: fitting '{family}' needs sequences longer than {longest} positions")
    replicates = replicates or max(1, math.ceil(MIN_POSITIONS_SIMULATED / int(starts[-1])))
    simulate = _Simulator(spec, pairs, g, starts, replicates, seed)
    n_layers = experts.shape[1]
    x = spec.start(experts, starts, g, several) if spec.start else np.tile([p.start for p in pairs], (n_layers, 1)).astype(np.float64)
    fitting = _GaussSeidel(simulate, targets, tol, rounds)
    optional = [j for j, p in enumerate(pairs) if p.parameter in spec.optional]
    base = [j for j in range(len(pairs)) if j not in optional]
    fitted = fitting.run(x, base, np.ones(n_layers, bool))
    if optional:  # freed only where the base fit misses their moments
        needs = (np.abs(fitted - targets)[:, optional] > LAG_GAP).any(axis=1)
        if needs.any():
            fitted = fitting.run(x, base + optional, needs)
    return FitResult(_rounded(spec, pairs, x), pairs, targets, fitted, int(starts[-1]), len(starts) - 1)


def fit_mixture(trace: Trace, **options: Any) -> FitResult:
    """`fit_generator` for the mixture."""
    return fit_generator(trace, "mixture", **options)


def _rounded(spec: FitFamily, pairs: tuple[MomentPair, ...], x: np.ndarray) -> RoutingGenerator:
    """The fitted generator with every fitted value to 6 significant digits (a stable parameter file)."""
    generator = spec.make(pairs, x)
    rounded = {p.parameter: tuple(float(f"{v:.6g}") for v in getattr(generator, p.parameter)) for p in pairs}
    return dataclasses.replace(generator, **rounded)  # type: ignore[type-var]
