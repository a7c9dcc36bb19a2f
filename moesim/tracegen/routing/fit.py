"""Fit the `mixture` routing generator to a trace, per MoE layer, and save/load parameter files.

Method of simulated moments: six statistics per layer, each governed mainly by one parameter,

- `popularity`: the mean overlap |S_a ∩ S_b| / K of tokens from *different* sequences, which
  only the global popularity sets ← the Zipf exponent s (one sequence only: the normalised
  entropy of its expert frequencies, and δ = 0, since a lone sequence's favourites cannot be
  told from global skew);
- `share_far`: the distinct experts in a window of D tokens / (D·K) (D = 16, or a quarter of the
  median sequence length, at least 6) ← the sequence dispersion δ (a sequence with favourite
  experts uses fewer of them);
- `reuse_d`, the overlap |S_t ∩ S_t+d| / K, d = 1..4 ← the lag-d keep probability.

Each statistic is matched by simulating the generator on the source's own sequence layout (same
lengths, so finite-sample effects such as few sequences are reproduced), on `replicates` copies
of it to reduce noise, with common random numbers (each layer draws from its own seed): one
parameter at a time for all layers, by a bracketing search (Illinois regula falsi) started from
closed-form approximations, in Gauss-Seidel rounds until every moment of every layer is within
3·tol. Lags 2..4 are fitted only for layers where one-lag stickiness misses reuse at d = 2..4 by
more than 1 point (parsimony: free lags trade off against q1 and δ). Traces longer than
`max_positions` are fitted on their first sequences up to that many positions.

Parameter files are TOML: `generator` and its per-layer parameters under `[params]`, the source
and the matched moments under `[source]` and `[fit]`. Parameters of a trace with L MoE layers
are mapped onto a preset with another number of MoE layers by relative depth (linear
interpolation), so a fitted trace can drive studies of models no one has traced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.atomic import write_text_atomic
from moesim.errors import InputError
from moesim.kernels.locality import mean_distinct_experts, reuse
from moesim.tomlfile import read_toml
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.routing.synth import GENERATORS, Mixture, RoutingGenerator, make_generator

PARAMS_FORMAT = "moesim-routing-params"
PARAMS_FORMAT_VERSION = 1
LAGS = 4
ZIPF_RANGE = (0.0, 3.0)
LOG_DISPERSION_RANGE = (-3.0, 3.0)  # δ = 10^u; the lower end stands for "no dispersion" (δ = 0)
KEEP_LIMIT = 0.98  # |keep probabilities| of a layer sum to at most this
MIN_POSITIONS_SIMULATED = 16384


@dataclass(frozen=True)
class RoutingMoments:
    """Per-layer statistics a fit matches."""

    popularity: np.ndarray  # (L,) cross-sequence overlap, or normalised entropy for one sequence
    reuse_far: np.ndarray  # (L,) mean overlap over the far distances (start values only)
    reuse: np.ndarray  # (L, LAGS) overlap at d = 1..LAGS
    share_far: np.ndarray  # (L,) distinct experts in a window of D tokens / (D·K)

    def as_columns(self) -> np.ndarray:
        """(L, 2 + LAGS): popularity, share_far, reuse_1..reuse_LAGS (the order of the parameters)."""
        return np.column_stack([self.popularity, self.share_far, self.reuse])


@dataclass(frozen=True)
class FitResult:
    """A fitted generator with the moments it matched."""

    generator: Mixture
    source: RoutingMoments
    fitted: RoutingMoments
    far_distances: tuple[int, int]
    positions: int
    sequences: int

    def table(self, geometry: TraceGeometry) -> pl.DataFrame:
        """Per MoE layer: the fitted parameters and the source's and the fit's reuse and share at D."""
        g = self.generator
        return pl.DataFrame(
            {
                "layer": list(geometry.moe_layers),
                "keep_prob": list(g.keep_prob),  # type: ignore[arg-type]
                "keep_prob_2..4": [list(v) for v in zip(g.keep_prob_2, g.keep_prob_3, g.keep_prob_4, strict=True)],  # type: ignore[arg-type]
                "zipf_exponent": list(g.zipf_exponent),  # type: ignore[arg-type]
                "seq_dispersion": list(g.seq_dispersion),  # type: ignore[arg-type]
                "reuse_1_source": self.source.reuse[:, 0],
                "reuse_1_fitted": self.fitted.reuse[:, 0],
                "share_D_source": self.source.share_far,
                "share_D_fitted": self.fitted.share_far,
            }
        )


def far_window(seq_starts: np.ndarray) -> tuple[int, int]:
    """The far distances (5, D) and window D: D = median sequence length / 4, within 6..16."""
    median = float(np.median(np.diff(seq_starts)))
    return LAGS + 1, int(min(16, max(LAGS + 2, median // 4)))


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


def routing_moments(experts: np.ndarray, seq_starts: np.ndarray, n_experts: int, far: tuple[int, int], blocks: int = 1) -> RoutingMoments:
    """The fitted statistics; the popularity one is averaged over `blocks` equal replicate blocks."""
    overlaps = reuse(experts, seq_starts, n_experts, far[1])
    n_seqs = (len(seq_starts) - 1) // blocks
    parts = []
    for i in range(blocks):
        starts = seq_starts[i * n_seqs : (i + 1) * n_seqs + 1]
        rows = experts[starts[0] : starts[-1]]
        parts.append(cross_sequence_overlap(rows, starts - starts[0], n_experts) if n_seqs > 1 else normalized_entropy(rows, n_experts))
    share = mean_distinct_experts(experts, seq_starts, n_experts, far[1])[:, -1] / (far[1] * experts.shape[2])
    return RoutingMoments(np.mean(parts, axis=0), overlaps[:, far[0] - 1 : far[1]].mean(axis=1), overlaps[:, :LAGS], share)


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


def _generator(x: np.ndarray) -> Mixture:
    """The mixture of parameter rows x = (s, log10 δ, q1..q4) per layer."""
    dispersion = np.where(x[:, 1] <= LOG_DISPERSION_RANGE[0], 0.0, 10.0 ** x[:, 1])
    keep = [tuple(float(v) for v in x[:, 2 + i]) for i in range(LAGS)]
    return Mixture(keep[0], tuple(float(v) for v in x[:, 0]), tuple(float(v) for v in dispersion), *keep[1:])


class _Simulator:
    """Simulated moments of the mixture on a fixed layout with common random numbers."""

    def __init__(self, geometry: TraceGeometry, seq_starts: np.ndarray, far: tuple[int, int], replicates: int, seed: int) -> None:
        self.geometry = geometry
        self.layout = _replicated(seq_starts, replicates)
        self.far = far
        self.replicates = replicates
        self.seed = seed

    def __call__(self, x: np.ndarray, layers: np.ndarray | None = None) -> RoutingMoments:
        """Moments of the given layers (default: all) for parameter rows x; each layer draws from
        its own seed, so its moments do not depend on which other layers are simulated with it."""
        g = self.geometry
        layers = np.arange(len(g.moe_layers)) if layers is None else layers
        ids = []
        for i in layers:
            one = dataclasses.replace(g, moe_layers=(g.moe_layers[i],))
            ids.append(_generator(x[i : i + 1]).generate_layout(one, self.layout, self.seed * 1_000_003 + int(i))[:, 0, :])
        return routing_moments(np.stack(ids, axis=1), self.layout, g.experts, self.far, self.replicates)


def _zipf_weights(n_experts: int, exponents: np.ndarray) -> np.ndarray:
    ranks = np.arange(1, n_experts + 1, dtype=np.float64)
    weights = ranks[None, :] ** -exponents[:, None]
    return weights / weights.sum(axis=1, keepdims=True)


def initial_guess(source: RoutingMoments, geometry: TraceGeometry, several: bool) -> np.ndarray:
    """Start rows (s, log10 δ, q1..q4) from independent-draw approximations: cross-sequence overlap
    ≈ K·Σπ², plateau ≈ K·E[Σθ²] = K(Σπ²·c + 1)/(c + 1) with c = E/δ, and
    reuse_d ≈ plateau + (1 − plateau)·q_d."""
    e, k = geometry.experts, geometry.top_k
    grid = np.linspace(*ZIPF_RANGE, 301)
    weights = _zipf_weights(e, grid)
    if several:
        zipf = np.interp(source.popularity, k * (weights**2).sum(axis=1), grid)
        cross = k * (_zipf_weights(e, zipf) ** 2).sum(axis=1)
        excess = source.reuse_far - cross
        c = (k - source.reuse_far) / np.maximum(excess, 1e-12)
        log_dispersion = np.where(excess > 1e-9, np.log10(e / np.maximum(c, 1e-12)), LOG_DISPERSION_RANGE[0])
    else:
        entropy = -(weights * np.log(weights)).sum(axis=1) / math.log(e)
        zipf = np.interp(-source.popularity, -entropy, grid)
        log_dispersion = np.full_like(zipf, LOG_DISPERSION_RANGE[0])
    plateau = source.reuse_far[:, None]
    keep = (source.reuse - plateau) / np.maximum(1 - plateau, 1e-9)
    keep *= np.minimum(1.0, KEEP_LIMIT / np.maximum(np.abs(keep).sum(axis=1, keepdims=True), 1e-12))
    x = np.column_stack([np.clip(zipf, *ZIPF_RANGE), np.clip(log_dispersion, *LOG_DISPERSION_RANGE), keep])
    return np.nan_to_num(x)


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


WIDTHS = np.array([0.15, 0.4] + [0.05] * LAGS)  # first brackets around the start values
INCREASING = (True, False, *([True] * LAGS))  # each moment against its parameter
LAG_GAP = 0.01  # lags 2..4 are fitted where one-lag stickiness misses reuse_2..4 by more than this


def fit_mixture(
    trace: Trace, seed: int = 0, replicates: int = 0, max_positions: int = 1 << 15, rounds: int = 6, tol: float = 1e-3
) -> FitResult:
    """Fit per-layer (s, δ, q1..q4) of the mixture generator to a trace by simulated moments; rounds
    repeat over the layers whose moments are not all within 3·tol of the source's."""
    g = trace.meta.geometry
    experts, starts = _clip_source(trace, max_positions)
    far = far_window(starts)
    source = routing_moments(experts, starts, g.experts, far)
    if not np.isfinite(source.as_columns()).all():
        raise InputError(f"trace of {g.model}: fitting needs sequences longer than {far[1]} positions (the far overlap)")
    simulate = _Simulator(g, starts, far, replicates or max(1, math.ceil(MIN_POSITIONS_SIMULATED / int(starts[-1]))), seed)
    several = len(starts) > 2
    x = initial_guess(source, g, several)
    x[:, 3:] = 0.0
    targets = source.as_columns()
    fitting = _GaussSeidel(simulate, targets, several, tol, rounds)
    base = [0, 1, 2] if several else [0, 2]
    fitted = fitting.run(x, base, np.ones(x.shape[0], bool))
    # lags 2..LAGS only where one-lag stickiness leaves the short range off by more than LAG_GAP
    needs_lags = (np.abs(fitted.as_columns() - targets)[:, 3:] > LAG_GAP).any(axis=1)
    if needs_lags.any():
        fitted = fitting.run(x, [*base, *range(3, 2 + LAGS)], needs_lags)
    return FitResult(_rounded_generator(x), source, fitted, far, int(starts[-1]), len(starts) - 1)


class _GaussSeidel:
    """Rounds of one-parameter solves (in place on x) until every fitted moment is within 3·tol."""

    def __init__(self, simulate: _Simulator, targets: np.ndarray, several: bool, tol: float, rounds: int) -> None:
        self.simulate, self.targets, self.several, self.tol, self.rounds = simulate, targets, several, tol, rounds

    def _bounds(self, x: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        if j < 2:
            low, high = (ZIPF_RANGE, LOG_DISPERSION_RANGE)[j]
            return np.full(x.shape[0], low), np.full(x.shape[0], high)
        room = KEEP_LIMIT - (np.abs(x[:, 2:]).sum(axis=1) - np.abs(x[:, j]))
        return -room, room

    def run(self, x: np.ndarray, params: list[int], layers: np.ndarray) -> RoutingMoments:
        """Solve the parameters `params` of the masked layers; returns the moments of all layers."""
        open_layers = layers.copy()
        fitted = self.simulate(x)
        for _ in range(self.rounds):
            for j in params:

                def evaluate(values: np.ndarray, idx: np.ndarray, j: int = j) -> np.ndarray:
                    trial = x.copy()
                    trial[:, j] = values
                    return self.simulate(trial, idx).as_columns()[:, j]

                increasing = INCREASING[j] if j else self.several  # one sequence: entropy falls with s
                x[:, j] = _solve(
                    evaluate, self.targets[:, j], x[:, j], *self._bounds(x, j), WIDTHS[j], increasing, self.tol, 10, open_layers
                )
            fitted = self.simulate(x)
            gap = np.abs(fitted.as_columns() - self.targets)[:, params]
            open_layers = layers & (gap > 3 * self.tol).any(axis=1)
            if not open_layers.any():
                break
        return fitted


def _rounded_generator(x: np.ndarray) -> Mixture:
    """The fitted generator with every value to 6 significant digits (a stable parameter file)."""
    generator = _generator(x)
    return Mixture(**{f.name: _rounded(np.asarray(getattr(generator, f.name))) for f in dataclasses.fields(Mixture)})


def _rounded(values: np.ndarray) -> tuple[float, ...]:
    return tuple(float(f"{v:.6g}") for v in values)


# ---- parameter files ------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(float(value)) if math.isfinite(value) else '"nan"'
    return str(value)


def params_toml(generator: RoutingGenerator, source: dict[str, Any], fit: dict[str, Any]) -> str:
    """A parameter file's text."""
    lines = [
        "# Routing-generator parameters for `moesim trace synth --params` (written by `moesim trace fit`).",
        f"format = {_toml_value(PARAMS_FORMAT)}",
        f"format_version = {PARAMS_FORMAT_VERSION}",
        f"generator = {_toml_value(generator.name)}",
        "",
        "[params]  # one value per MoE layer of the source, or one for all",
    ]
    lines += [f"{name} = {_toml_value(value)}" for name, value in dataclasses.asdict(generator).items()]  # type: ignore[call-overload]
    for title, table in (("source", source), ("fit", fit)):
        if table:
            lines += ["", f"[{title}]"] + [f"{name} = {_toml_value(value)}" for name, value in table.items()]
    return "\n".join(lines) + "\n"


def write_fit(path: str | Path, result: FitResult, trace_path: str | Path, geometry: TraceGeometry) -> None:
    """Save a fit as a parameter file (atomically)."""
    trace_path = Path(trace_path)
    source = {
        "trace": trace_path.name,
        "sha256": hashlib.sha256(trace_path.read_bytes()).hexdigest() if trace_path.is_file() else "",
        "model": geometry.model,
        "experts": geometry.experts,
        "top_k": geometry.top_k,
        "moe_layers": list(geometry.moe_layers),
        "positions": result.positions,
        "sequences": result.sequences,
    }
    popularity = "cross-sequence overlap" if result.sequences > 1 else "normalised entropy"
    fit: dict[str, Any] = {
        "method": f"simulated moments: {popularity} <- zipf_exponent, distinct experts per window of D tokens <- seq_dispersion, "
        f"reuse at d <- keep_prob (d = 1) and keep_prob_d (d = 2..{LAGS})",
        "window_D": result.far_distances[1],
    }
    for name, column in (("popularity", 0), ("share_far", 1), *((f"reuse_{d}", 1 + d) for d in range(1, LAGS + 1))):
        fit[f"{name}_source"] = _rounded(result.source.as_columns()[:, column])
        fit[f"{name}_fitted"] = _rounded(result.fitted.as_columns()[:, column])
    write_text_atomic(path, params_toml(result.generator, source, fit))


def _interpolate(value: Any, n_layers: int) -> Any:
    """Per-layer values onto n_layers by relative depth (linear); scalars stay scalars."""
    if not isinstance(value, (list, tuple)):
        return value
    values = np.asarray(value, np.float64)
    if values.shape[0] == n_layers:
        return tuple(values.tolist())
    if values.shape[0] == 1:
        return float(values[0])
    depth_from = np.linspace(0.0, 1.0, values.shape[0])
    depth_to = np.linspace(0.0, 1.0, n_layers) if n_layers > 1 else np.array([0.5])
    return tuple(np.interp(depth_to, depth_from, values).tolist())


def load_params(path: str | Path, geometry: TraceGeometry) -> RoutingGenerator:
    """A generator from a parameter file, its per-layer values mapped onto the geometry's MoE layers."""
    path = Path(path)
    data = read_toml(path, "parameter")
    if data.get("format") != PARAMS_FORMAT:
        raise InputError(f"{path}: key 'format' is {data.get('format')!r}, expected {PARAMS_FORMAT!r}")
    if data.get("format_version") != PARAMS_FORMAT_VERSION:
        raise InputError(f"{path}: key 'format_version' is {data.get('format_version')!r}, this moesim reads {PARAMS_FORMAT_VERSION}")
    name = data.get("generator")
    if name not in GENERATORS:
        raise InputError(f"{path}: key 'generator': {GENERATORS.unknown(name)}")
    params = data.get("params", {})
    if not isinstance(params, dict):
        raise InputError(f"{path}: key 'params' must be a table")
    for key, value in params.items():
        if isinstance(value, list) and (not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise InputError(f"{path}: key 'params.{key}' must be a number or a non-empty list of numbers")
    n_layers = len(geometry.moe_layers)
    try:
        generator = make_generator(name, **{k: _interpolate(v, n_layers) for k, v in params.items()})
        generator.generate(geometry, 2, 1, 0)  # checks every parameter against the geometry
    except (InputError, TypeError) as exc:
        raise InputError(f"{path}: {exc}") from None
    return generator
