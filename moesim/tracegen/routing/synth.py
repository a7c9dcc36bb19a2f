"""Synthetic routing generators (a registry) and the trace synthesiser.

A generator draws, for every sequence and MoE layer, the top-k expert sets of consecutive
tokens. Adding one is adding one class with `@GENERATORS.register`: a frozen dataclass with a
`name` and a `generate(geometry, tokens, seqs, seed)` method returning ids of shape
(seqs * tokens, moe_layers, top_k).
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
            cum = cum_popularity[layer]
            if dispersion[layer] > 0.0:
                _sequence_popularity(cum, dispersion[layer], log_mass, cum_seq)
                cum = cum_seq
            else:
                for e in range(n_experts):
                    share = cum[e] - (cum[e - 1] if e > 0 else 0.0)
                    log_mass[e] = np.log(share) if share > 0.0 else -np.inf
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


@GENERATORS.register
@dataclass(frozen=True)
class Uniform:
    """Independent uniform top-k sets: P(expert in a token's set) = K/E for every token."""

    name: ClassVar[str] = "uniform"

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """Uniform routing is the mixture with q = 0, flat popularity and no sequence dispersion."""
        return Mixture(keep_prob=0.0, zipf_exponent=0.0, seq_dispersion=0.0).generate(geometry, tokens, seqs, seed)


@GENERATORS.register
@dataclass(frozen=True)
class Zipf:
    """Independent tokens, experts drawn by a per-layer Zipf popularity ∝ rank^-exponent."""

    name: ClassVar[str] = "zipf"
    exponent: float | tuple[float, ...] = 1.0

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """The mixture with q = 0 and no sequence dispersion."""
        return Mixture(keep_prob=0.0, zipf_exponent=self.exponent, seq_dispersion=0.0).generate(geometry, tokens, seqs, seed)


@GENERATORS.register
@dataclass(frozen=True)
class Sticky:
    """Each of token t+1's experts is kept from token t with probability `keep_prob` (per layer or
    one value), else drawn by popularity (Zipf with `zipf_exponent` per layer; 0 = uniform)."""

    name: ClassVar[str] = "sticky"
    keep_prob: float | tuple[float, ...] = 0.3
    zipf_exponent: float | tuple[float, ...] = 0.0

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """The mixture without sequence dispersion; same seed, same ids."""
        _per_layer("keep_prob", self.keep_prob, len(geometry.moe_layers), 0.0, 1.0)
        mixture = Mixture(keep_prob=self.keep_prob, zipf_exponent=self.zipf_exponent, seq_dispersion=0.0)
        return mixture.generate(geometry, tokens, seqs, seed)


@GENERATORS.register
@dataclass(frozen=True)
class Mixture:
    """Short-range stickiness plus per-sequence popularity: overlap with earlier tokens decays, then
    plateaus. Per layer: `keep_prob` q1 (each slot copies the same slot of the previous token with
    probability q1) and `keep_prob_2..4` (of the token 2, 3, 4 back); a negative value bars that
    expert instead (the anti-correlation of looping tiny models); `zipf_exponent` s (global
    popularity π ∝ rank^-s); `seq_dispersion` δ (each sequence draws its own popularity
    θ ~ Dirichlet(π·E/δ); δ = 0: θ = π). With q1 only, overlap at distance d ≈ plateau +
    (1 − plateau)·q1^d, the plateau rising with δ and s. The defaults give 38/32/31/31% at
    d = 1..4 for top-8 of 128 experts, within 1.5 points of the published 38.1/32.9/30.1/29.9%
    (docs/routing.md)."""

    name: ClassVar[str] = "mixture"
    keep_prob: float | tuple[float, ...] = 0.13
    zipf_exponent: float | tuple[float, ...] = 0.0
    seq_dispersion: float | tuple[float, ...] = 6.0
    keep_prob_2: float | tuple[float, ...] = 0.0
    keep_prob_3: float | tuple[float, ...] = 0.0
    keep_prob_4: float | tuple[float, ...] = 0.0

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
    params = {"name": generator.name, **dataclasses.asdict(generator), "seed": seed}  # type: ignore[call-overload]
    meta = TraceMeta(
        geometry=geometry,
        engine="moesim-synth",
        backend="synthetic",
        prompts=f"{seqs} synthetic sequences of {tokens} tokens",
        generator=params,
    )
    experts = generator.generate(geometry, tokens, seqs, seed)
    n = seqs * tokens
    return Trace(
        meta=meta,
        seq=np.repeat(np.arange(seqs, dtype=np.uint32), tokens),
        pos=np.tile(np.arange(tokens, dtype=np.uint32), seqs),
        is_prompt=np.zeros(n, bool),
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
        from moesim.tracegen.routing.fit import load_params  # the fit builds on the generators

        if uniform or sticky is not None or zipf:
            raise InputError("--params excludes --uniform, --sticky and --zipf")
        return load_params(params, TraceGeometry.from_preset(preset, weight_format, "synthetic routing"))
    if sticky is not None:
        return Sticky(keep_prob=sticky, zipf_exponent=zipf)
    return Zipf(exponent=zipf) if zipf else Uniform()
