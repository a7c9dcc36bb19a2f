"""Synthetic routing generators (a registry) and the trace synthesiser.

A generator draws, for every sequence and MoE layer, the top-k expert sets of consecutive
tokens. Adding one is adding one class with `@GENERATORS.register`: a frozen dataclass with a
`name`, a `generate_layout(geometry, seq_starts, seed)` method returning ids of shape
(positions, moe_layers, top_k) for sequences of any lengths, and `generate(geometry, tokens,
seqs, seed)`, the same for `seqs` sequences of `tokens` positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numba
import numpy as np

from moesim.errors import InputError
from moesim.models import ModelPreset
from moesim.registry import Registry
from moesim.tracegen.formats.schema import TraceGeometry, TraceMeta
from moesim.tracegen.formats.trace import Trace


class RoutingGenerator(Protocol):
    """What every synthetic routing generator provides."""

    name: ClassVar[str]

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """Expert ids, shape (seqs * tokens, len(moe_layers), top_k), in the smallest id type."""
        ...

    def generate_layout(self, geometry: TraceGeometry, seq_starts: np.ndarray, seed: int) -> np.ndarray:
        """The same for sequences of any lengths (`seq_starts`: first row of each, then the total)."""
        ...


GENERATORS: Registry[RoutingGenerator] = Registry("routing generator", InputError)


MAX_MISSES = 64  # rejected draws of already chosen experts before drawing exactly among the rest


@numba.njit(cache=True)
def _draw_unchosen(log_mass: np.ndarray, chosen: np.ndarray) -> int:
    """One expert among the unchosen, in proportion to its mass (kept as logs: no underflow)."""
    n_experts = log_mass.shape[0]
    top = -np.inf
    for e in range(n_experts):
        if not chosen[e] and log_mass[e] > top:
            top = log_mass[e]
    total = 0.0
    for e in range(n_experts):
        if not chosen[e] and log_mass[e] > -np.inf:
            total += np.exp(log_mass[e] - top)
    r = np.random.random() * total
    last = -1
    for e in range(n_experts):
        if not chosen[e] and log_mass[e] > -np.inf:
            r -= np.exp(log_mass[e] - top)
            last = e
            if r < 0.0:
                return e
    if last >= 0:
        return last
    for e in range(n_experts):  # no expert left with mass: the first free one
        if not chosen[e]:
            return e
    return n_experts - 1


@numba.njit(cache=True)
def _sequence_popularity(cum: np.ndarray, dispersion: float, log_mass: np.ndarray, cum_seq: np.ndarray) -> None:
    """θ ~ Dirichlet(π·E/δ) in log space: log G_e = log Gamma(α_e + 1) + log(U)/α_e (exact, and
    concentrated draws keep the order of their tiny masses); fills log_mass and cum_seq."""
    n_experts = cum.shape[0]
    top = -np.inf
    for e in range(n_experts):
        share = cum[e] - (cum[e - 1] if e > 0 else 0.0)
        if share > 0.0:
            alpha = share * n_experts / dispersion
            log_mass[e] = np.log(np.random.gamma(alpha + 1.0, 1.0)) + np.log(1.0 - np.random.random()) / alpha
            top = max(top, log_mass[e])
        else:
            log_mass[e] = -np.inf
    total = 0.0
    for e in range(n_experts):
        log_mass[e] -= top
        total += np.exp(log_mass[e])
        cum_seq[e] = total


@numba.njit(cache=True)
def _layer_popularity(cum: np.ndarray, dispersion: float, log_mass: np.ndarray, cum_seq: np.ndarray) -> np.ndarray:
    """A sequence's cumulative popularity in one layer: θ drawn into cum_seq when δ > 0, else π
    itself; log_mass holds log θ (or log π) for exact draws among the unchosen."""
    if dispersion > 0.0:
        _sequence_popularity(cum, dispersion, log_mass, cum_seq)
        return cum_seq
    for e in range(cum.shape[0]):
        share = cum[e] - (cum[e - 1] if e > 0 else 0.0)
        log_mass[e] = np.log(share) if share > 0.0 else -np.inf
    return cum


@numba.njit(cache=True)
def _mixture_routing(
    seq_starts: np.ndarray, n_layers: int, k: int, keep_prob: np.ndarray, cum_popularity: np.ndarray, dispersion: np.ndarray, seed: int
) -> np.ndarray:
    """Per sequence and layer, a sequence popularity θ ~ Dirichlet(π·E/δ) (θ = π when δ = 0); then
    slot j of token t picks a lag ℓ with probability |keep_prob[layer, ℓ-1]| (or none): for
    keep_prob > 0 it copies slot j of token t−ℓ, for keep_prob < 0 it bars that expert from token
    t; the remaining slots are drawn without repeats in proportion to θ. δ = 0 and keep_prob = 0
    with uniform π give independent uniform top-k sets."""
    np.random.seed(seed)
    n_experts = cum_popularity.shape[1]
    n_lags = keep_prob.shape[1]
    out = np.empty((seq_starts[-1], n_layers, k), np.int64)
    chosen = np.zeros(n_experts, np.bool_)
    cum_seq = np.empty(n_experts)
    log_mass = np.empty(n_experts)
    barred_ids = np.empty(k, np.int64)
    for s in range(seq_starts.shape[0] - 1):
        a = seq_starts[s]
        b = seq_starts[s + 1]
        for layer in range(n_layers):
            cum = _layer_popularity(cum_popularity[layer], dispersion[layer], log_mass, cum_seq)
            for t in range(a, b):
                filled = 0
                barred = 0
                if t > a:
                    for j in range(k):
                        u = np.random.random()
                        lag = 0
                        for ell in range(n_lags):
                            u -= abs(keep_prob[layer, ell])
                            if u < 0.0:
                                lag = ell + 1
                                break
                        if lag == 0 or t - lag < a:
                            continue
                        e = out[t - lag, layer, j]
                        if chosen[e]:
                            continue
                        if keep_prob[layer, lag - 1] > 0.0:
                            chosen[e] = True
                            out[t, layer, filled] = e
                            filled += 1
                        elif barred + k < n_experts:
                            chosen[e] = True
                            barred_ids[barred] = e
                            barred += 1
                misses = 0
                while filled < k:
                    if misses < MAX_MISSES:
                        e = np.searchsorted(cum, np.random.random() * cum[-1], side="right")
                        if e >= n_experts:
                            e = n_experts - 1
                        if chosen[e]:
                            misses += 1
                            continue
                    else:
                        e = _draw_unchosen(log_mass, chosen)
                    chosen[e] = True
                    out[t, layer, filled] = e
                    filled += 1
                for j in range(k):
                    chosen[out[t, layer, j]] = False
                for j in range(barred):
                    chosen[barred_ids[j]] = False
    return out


def equal_layout(tokens: int, seqs: int) -> np.ndarray:
    """Sequence starts of `seqs` sequences of `tokens` positions each, plus the total."""
    return np.arange(seqs + 1, dtype=np.int64) * tokens


def _per_layer(name: str, value: float | tuple[float, ...], n_layers: int, low: float, high: float) -> np.ndarray:
    values = np.broadcast_to(np.asarray(value, np.float64), (n_layers,)) if np.ndim(value) == 0 else np.asarray(value, np.float64)
    if values.shape != (n_layers,):
        raise InputError(f"generator parameter '{name}' has {values.shape[0]} values, the trace has {n_layers} MoE layers")
    if not np.all((values >= low) & (values <= high)):
        raise InputError(f"generator parameter '{name}' must lie in [{low}, {high}], got {values.tolist()}")
    return values.copy()


def zipf_popularity(n_experts: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Popularity ∝ rank^-exponent over a random permutation of the experts (exponent 0: uniform)."""
    weights = np.arange(1, n_experts + 1, dtype=np.float64) ** -exponent
    return weights[rng.permutation(n_experts)] / weights.sum()


class _MixtureCase:
    """A generator that is a special case of the mixture (`as_mixture`)."""

    def as_mixture(self, n_layers: int) -> Mixture:
        """The equivalent mixture (its parameters checked for `n_layers` MoE layers)."""
        raise NotImplementedError

    def generate_layout(self, geometry: TraceGeometry, seq_starts: np.ndarray, seed: int) -> np.ndarray:
        """Ids for sequences of any lengths (`seq_starts`: first row of each, then the total)."""
        return self.as_mixture(len(geometry.moe_layers)).generate_layout(geometry, seq_starts, seed)

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """The mixture's draws; same seed, same ids."""
        return self.generate_layout(geometry, equal_layout(tokens, seqs), seed)


def _plain_mixture(keep_prob: float | tuple[float, ...], zipf_exponent: float | tuple[float, ...]) -> Mixture:
    """One-lag stickiness and a Zipf popularity, nothing else."""
    return Mixture(keep_prob, zipf_exponent, 0.0, 0.0, 0.0, 0.0)


@GENERATORS.register
@dataclass(frozen=True)
class Uniform(_MixtureCase):
    """Independent uniform top-k sets: P(expert in a token's set) = K/E for every token."""

    name: ClassVar[str] = "uniform"

    def as_mixture(self, n_layers: int) -> Mixture:
        """Uniform routing is the mixture with q = 0, flat popularity and no sequence dispersion."""
        return _plain_mixture(0.0, 0.0)


@GENERATORS.register
@dataclass(frozen=True)
class Zipf(_MixtureCase):
    """Independent tokens, experts drawn by a per-layer Zipf popularity ∝ rank^-exponent."""

    name: ClassVar[str] = "zipf"
    exponent: float | tuple[float, ...] = 1.0

    def as_mixture(self, n_layers: int) -> Mixture:
        """The mixture with q = 0 and no sequence dispersion."""
        return _plain_mixture(0.0, self.exponent)


@GENERATORS.register
@dataclass(frozen=True)
class Sticky(_MixtureCase):
    """Each of token t+1's experts is kept from token t with probability `keep_prob` (per layer or
    one value), else drawn by popularity (Zipf with `zipf_exponent` per layer; 0 = uniform)."""

    name: ClassVar[str] = "sticky"
    keep_prob: float | tuple[float, ...] = 0.3
    zipf_exponent: float | tuple[float, ...] = 0.0

    def as_mixture(self, n_layers: int) -> Mixture:
        """The mixture without sequence dispersion (keep probabilities in [0, 1])."""
        _per_layer("keep_prob", self.keep_prob, n_layers, 0.0, 1.0)
        return _plain_mixture(self.keep_prob, self.zipf_exponent)


@GENERATORS.register
@dataclass(frozen=True)
class Mixture:
    """Short-range stickiness plus per-sequence popularity: overlap with earlier tokens decays, then
    plateaus. Per layer: `keep_prob` q1 (each slot copies the same slot of the previous token with
    probability q1) and `keep_prob_2..4` (of the token 2, 3, 4 back); a negative value bars that
    expert instead (the anti-correlation of looping tiny models); `zipf_exponent` s (global
    popularity π ∝ rank^-s); `seq_dispersion` δ (each sequence draws its own popularity
    θ ~ Dirichlet(π·E/δ); δ = 0: θ = π). With q1 only, overlap at distance d ≈ plateau +
    (1 − plateau)·q1^d, the plateau rising with δ and s. The defaults are the median over the 26
    MoE layers of the fit to both tasks of the built-in real trace `esft-vanilla-lite`
    (docs/tracing.md; per-layer values in its parameter file `esft-vanilla-lite-mixture`)."""

    name: ClassVar[str] = "mixture"
    keep_prob: float | tuple[float, ...] = 0.164
    zipf_exponent: float | tuple[float, ...] = 0.561
    seq_dispersion: float | tuple[float, ...] = 0.211
    keep_prob_2: float | tuple[float, ...] = 0.043
    keep_prob_3: float | tuple[float, ...] = 0.066
    keep_prob_4: float | tuple[float, ...] = 0.021

    def parameters(self, n_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer keep probabilities (L, 4) by lag, Zipf exponents (L,), dispersions (L,), checked."""
        lags = (self.keep_prob, self.keep_prob_2, self.keep_prob_3, self.keep_prob_4)
        names = ("keep_prob", "keep_prob_2", "keep_prob_3", "keep_prob_4")
        keep = np.stack([_per_layer(n, v, n_layers, -1.0, 1.0) for n, v in zip(names, lags, strict=True)], axis=1)
        total = np.abs(keep).sum(axis=1)
        if np.any(total > 1.0 + 1e-9):
            raise InputError(f"generator parameters keep_prob..keep_prob_4: |values| must sum to at most 1 per layer, got {total.tolist()}")
        return (
            keep,
            _per_layer("zipf_exponent", self.zipf_exponent, n_layers, 0.0, 10.0),
            _per_layer("seq_dispersion", self.seq_dispersion, n_layers, 0.0, 1e6),
        )

    def generate_layout(self, geometry: TraceGeometry, seq_starts: np.ndarray, seed: int) -> np.ndarray:
        """Ids for sequences of any lengths (`seq_starts`: first row of each, then the total)."""
        keep, exponents, dispersion = self.parameters(len(geometry.moe_layers))
        rng = np.random.default_rng(seed)
        popularity = np.stack([zipf_popularity(geometry.experts, float(x), rng) for x in exponents])
        starts = np.asarray(seq_starts, np.int64)
        ids = _mixture_routing(starts, len(exponents), geometry.top_k, keep, np.cumsum(popularity, axis=1), dispersion, seed)
        return ids.astype(geometry.expert_id_type.to_pandas_dtype())

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """Draw with the Numba kernel; same seed, same ids."""
        return self.generate_layout(geometry, equal_layout(tokens, seqs), seed)


@numba.njit(cache=True)
def _draw_fresh(cum: np.ndarray, log_mass: np.ndarray, excluded: np.ndarray) -> int:
    """One expert not in `excluded`, in proportion to θ: rejection up to MAX_MISSES, then exactly."""
    n_experts = cum.shape[0]
    for _ in range(MAX_MISSES):
        e = min(np.searchsorted(cum, np.random.random() * cum[-1], side="right"), n_experts - 1)
        if not excluded[e]:
            return e
    return _draw_unchosen(log_mass, excluded)


@numba.njit(cache=True)
def _take(e: int, chosen: np.ndarray, row: np.ndarray, filled: int) -> int:
    """Put expert e in the next free slot of a token's row; returns the slots filled."""
    chosen[e] = True
    row[filled] = e
    return filled + 1


@numba.njit(cache=True)
def _working_set_routing(
    seq_starts: np.ndarray,
    k: int,
    keep_prob: np.ndarray,
    cum_popularity: np.ndarray,
    dispersion: np.ndarray,
    working_set: int,
    working_use: np.ndarray,
    working_persist: np.ndarray,
    seed: int,
) -> np.ndarray:
    """Per sequence and layer: θ ~ Dirichlet(π·E/δ) as in the mixture, and a context of W distinct
    experts drawn from θ; before every token after the first, each context member is replaced with
    probability 1 − ρ by a θ-draw outside the context. Token t takes each context member (in a
    random order) with probability p, while slots remain; then slot j copies slot j of token t − 1
    with probability q (if not taken yet); the remaining slots are drawn without repeats from θ."""
    np.random.seed(seed)
    n_layers, n_experts = cum_popularity.shape
    out = np.empty((seq_starts[-1], n_layers, k), np.int64)
    chosen = np.zeros(n_experts, np.bool_)
    in_context = np.zeros(n_experts, np.bool_)
    context = np.empty(max(working_set, 1), np.int64)
    cum_seq = np.empty(n_experts)
    log_mass = np.empty(n_experts)
    for s in range(seq_starts.shape[0] - 1):
        a = seq_starts[s]
        b = seq_starts[s + 1]
        for layer in range(n_layers):
            cum = _layer_popularity(cum_popularity[layer], dispersion[layer], log_mass, cum_seq)
            for i in range(working_set):
                context[i] = _draw_fresh(cum, log_mass, in_context)
                in_context[context[i]] = True
            for t in range(a, b):
                if t > a:
                    for i in range(working_set):
                        if np.random.random() >= working_persist[layer]:
                            e = _draw_fresh(cum, log_mass, in_context)
                            in_context[context[i]] = False
                            in_context[e] = True
                            context[i] = e
                for i in range(working_set):  # a random order of the context
                    j = i + np.random.randint(0, working_set - i)
                    context[i], context[j] = context[j], context[i]
                filled = 0
                for i in range(working_set):
                    if filled < k and np.random.random() < working_use[layer]:
                        filled = _take(context[i], chosen, out[t, layer], filled)
                if t > a:
                    for j in range(k):
                        if filled >= k:
                            break
                        if np.random.random() < keep_prob[layer] and not chosen[out[t - 1, layer, j]]:
                            filled = _take(out[t - 1, layer, j], chosen, out[t, layer], filled)
                while filled < k:
                    filled = _take(_draw_fresh(cum, log_mass, chosen), chosen, out[t, layer], filled)
                for j in range(k):
                    chosen[out[t, layer, j]] = False
            for i in range(working_set):
                in_context[context[i]] = False
    return out


@GENERATORS.register
@dataclass(frozen=True)
class WorkingSet:
    """A slowly drifting working set on top of per-sequence popularity: what real routing does
    (reuse decays over tens of tokens and bursts run longer than pairwise stickiness gives). Per
    layer: `zipf_exponent` s and `seq_dispersion` δ as in the mixture (θ ~ Dirichlet(π·E/δ) per
    sequence); a context of `working_set` W experts drawn from θ, each replaced before a token
    with probability 1 − `working_persist` ρ; each token takes every context member with
    probability `working_use` p, copies each slot of the previous token with probability
    `keep_prob` q, and draws the rest from θ. p = 0 gives the one-lag mixture. The defaults are
    the median over the 26 MoE layers of the fit to both tasks of the built-in real trace
    `esft-vanilla-lite` (docs/tracing.md; per-layer values in its parameter file
    `esft-vanilla-lite-working-set`)."""

    name: ClassVar[str] = "working-set"
    zipf_exponent: float | tuple[float, ...] = 0.569
    seq_dispersion: float | tuple[float, ...] = 0.201
    keep_prob: float | tuple[float, ...] = 0.122
    working_use: float | tuple[float, ...] = 0.251
    working_persist: float | tuple[float, ...] = 0.923
    working_set: int = 6

    def parameters(self, n_layers: int, n_experts: int) -> tuple[np.ndarray, ...]:
        """Per-layer s, δ, q, p, ρ (checked) and the context size W."""
        if not isinstance(self.working_set, int) or isinstance(self.working_set, bool) or not 0 <= self.working_set < n_experts:
            raise InputError(f"generator parameter 'working_set' must be an integer in 0..{n_experts - 1}, got {self.working_set!r}")
        return (
            _per_layer("zipf_exponent", self.zipf_exponent, n_layers, 0.0, 10.0),
            _per_layer("seq_dispersion", self.seq_dispersion, n_layers, 0.0, 1e6),
            _per_layer("keep_prob", self.keep_prob, n_layers, 0.0, 1.0),
            _per_layer("working_use", self.working_use, n_layers, 0.0, 1.0),
            _per_layer("working_persist", self.working_persist, n_layers, 0.0, 1.0),
        )

    def generate_layout(self, geometry: TraceGeometry, seq_starts: np.ndarray, seed: int) -> np.ndarray:
        """Ids for sequences of any lengths (`seq_starts`: first row of each, then the total)."""
        exponents, dispersion, keep, use, persist = self.parameters(len(geometry.moe_layers), geometry.experts)
        rng = np.random.default_rng(seed)
        popularity = np.cumsum(np.stack([zipf_popularity(geometry.experts, float(x), rng) for x in exponents]), axis=1)
        starts = np.asarray(seq_starts, np.int64)
        ids = _working_set_routing(starts, geometry.top_k, keep, popularity, dispersion, self.working_set, use, persist, seed)
        return ids.astype(geometry.expert_id_type.to_pandas_dtype())

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """Draw with the Numba kernel; same seed, same ids."""
        return self.generate_layout(geometry, equal_layout(tokens, seqs), seed)


def make_generator(name: str, **params: Any) -> RoutingGenerator:
    """A registered generator by name with its parameters."""
    return GENERATORS.create(name, **params)


def synthesize(
    preset: ModelPreset,
    generator: RoutingGenerator,
    tokens: int,
    seqs: int,
    seed: int,
    weight_format: str | None = None,
) -> Trace:
    """A synthetic trace of `seqs` sequences of `tokens` generated positions each."""
    geometry = TraceGeometry.from_preset(preset, weight_format, "synthetic routing")
    if tokens < 1 or seqs < 1:
        raise InputError(f"a synthetic trace needs tokens >= 1 and seqs >= 1, got tokens={tokens}, seqs={seqs}")
    return synthesize_layout(geometry, generator, np.full(seqs, tokens), seed)


def synthesize_layout(geometry: TraceGeometry, generator: RoutingGenerator, lengths: np.ndarray, seed: int) -> Trace:
    """A synthetic trace of sequences of the given lengths (e.g. a recorded trace's, to compare like with like)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size < 1 or lengths.min() < 1:
        raise InputError("a synthetic trace needs at least one sequence of at least one token")
    params = {"name": generator.name, **dataclasses.asdict(generator), "seed": seed}  # type: ignore[call-overload]
    same = lengths.min() == lengths.max()
    meta = TraceMeta(
        geometry=geometry,
        engine="moesim-synth",
        backend="synthetic",
        prompts=f"{lengths.size} synthetic sequences of {lengths[0] if same else f'{lengths.min()}-{lengths.max()}'} tokens",
        generator=params,
    )
    experts = generator.generate_layout(geometry, np.concatenate([[0], np.cumsum(lengths)]), seed)
    return Trace(
        meta=meta,
        seq=np.repeat(np.arange(lengths.size, dtype=np.uint32), lengths),
        pos=np.concatenate([np.arange(n, dtype=np.uint32) for n in lengths]),
        is_prompt=np.zeros(int(lengths.sum()), bool),
        experts=experts,
    )


def generator_from_options(
    preset: ModelPreset,
    uniform: bool = False,
    sticky: float | None = None,
    zipf: float = 0.0,
    params: Path | None = None,
    weight_format: str | None = None,
) -> RoutingGenerator:
    """`trace synth`'s choice: uniform, sticky (keep probability, optional Zipf skew), Zipf alone,
    or a fitted parameter file mapped onto the preset's layers; default uniform."""
    if uniform and sticky is not None:
        raise InputError("--uniform and --sticky exclude each other")
    if uniform and zipf:
        raise InputError("--uniform and --zipf exclude each other")
    if params is not None:
        from moesim.tracegen.routing.params import load_params  # parameter files build on the generators

        if uniform or sticky is not None or zipf:
            raise InputError("--params excludes --uniform, --sticky and --zipf")
        return load_params(params, TraceGeometry.from_preset(preset, weight_format, "synthetic routing"))
    if sticky is not None:
        return Sticky(keep_prob=sticky, zipf_exponent=zipf)
    return Zipf(exponent=zipf) if zipf else Uniform()
