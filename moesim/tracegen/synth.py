"""Synthetic routing generators (a registry) and the trace synthesiser.

A generator draws, for every sequence and MoE layer, the top-k expert sets of consecutive
tokens. Adding one is adding one class with `@register_generator`: a frozen dataclass with a
`name` and a `generate(geometry, tokens, seqs, seed)` method returning ids of shape
(seqs * tokens, moe_layers, top_k).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numba
import numpy as np

from moesim.errors import InputError
from moesim.models import ModelPreset
from moesim.tracegen.schema import TraceGeometry, TraceMeta
from moesim.tracegen.trace import Trace


class RoutingGenerator(Protocol):
    """What every synthetic routing generator provides."""

    name: ClassVar[str]

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """Expert ids, shape (seqs * tokens, len(moe_layers), top_k), in the smallest id type."""
        ...


GENERATORS: dict[str, type[RoutingGenerator]] = {}


def register_generator(cls: type[RoutingGenerator]) -> type[RoutingGenerator]:
    """Class decorator: make a generator available by its `name`."""
    GENERATORS[cls.name] = cls
    return cls


@numba.njit(cache=True)
def _sticky_routing(
    tokens: int, seqs: int, n_layers: int, k: int, keep_prob: np.ndarray, cum_popularity: np.ndarray, seed: int
) -> np.ndarray:
    """Each expert of token t+1 is kept from token t with probability keep_prob[layer], else drawn
    (without repeats) in proportion to the layer's popularity; keep_prob = 0 with uniform
    popularity gives independent uniform top-k sets."""
    np.random.seed(seed)
    n_experts = cum_popularity.shape[1]
    out = np.empty((seqs * tokens, n_layers, k), np.int64)
    chosen = np.zeros(n_experts, np.bool_)
    for s in range(seqs):
        for layer in range(n_layers):
            q = keep_prob[layer]
            cum = cum_popularity[layer]
            for t in range(tokens):
                row = s * tokens + t
                filled = 0
                if t > 0:
                    for j in range(k):
                        if np.random.random() < q:
                            e = out[row - 1, layer, j]
                            out[row, layer, filled] = e
                            chosen[e] = True
                            filled += 1
                while filled < k:
                    e = np.searchsorted(cum, np.random.random() * cum[-1], side="right")
                    if e >= n_experts:
                        e = n_experts - 1
                    if not chosen[e]:
                        chosen[e] = True
                        out[row, layer, filled] = e
                        filled += 1
                for j in range(k):
                    chosen[out[row, layer, j]] = False
    return out


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


@register_generator
@dataclass(frozen=True)
class Uniform:
    """Independent uniform top-k sets: P(expert in a token's set) = K/E for every token."""

    name: ClassVar[str] = "uniform"

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """Uniform routing is sticky routing with q = 0 and flat popularity."""
        return Sticky(keep_prob=0.0).generate(geometry, tokens, seqs, seed)


@register_generator
@dataclass(frozen=True)
class Sticky:
    """Each of token t+1's experts is kept from token t with probability `keep_prob` (per layer or
    one value), else drawn by popularity (Zipf with `zipf_exponent` per layer; 0 = uniform)."""

    name: ClassVar[str] = "sticky"
    keep_prob: float | tuple[float, ...] = 0.3
    zipf_exponent: float | tuple[float, ...] = 0.0

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """Draw with the Numba kernel; same seed, same ids."""
        n_layers = len(geometry.moe_layers)
        keep = _per_layer("keep_prob", self.keep_prob, n_layers, 0.0, 1.0)
        exponents = _per_layer("zipf_exponent", self.zipf_exponent, n_layers, 0.0, 10.0)
        rng = np.random.default_rng(seed)
        popularity = np.stack([zipf_popularity(geometry.experts, float(x), rng) for x in exponents])
        ids = _sticky_routing(tokens, seqs, n_layers, geometry.top_k, keep, np.cumsum(popularity, axis=1), seed)
        return ids.astype(geometry.expert_id_type.to_pandas_dtype())


def make_generator(name: str, **params: Any) -> RoutingGenerator:
    """A registered generator by name with its parameters."""
    try:
        cls = GENERATORS[name]
    except KeyError:
        raise InputError(f"unknown routing generator '{name}' (known: {', '.join(GENERATORS)})") from None
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(params) - known
    if unknown:
        raise InputError(f"routing generator '{name}' has no parameter '{sorted(unknown)[0]}'")
    return cls(**params)


def synthesize(
    preset: ModelPreset,
    generator: RoutingGenerator,
    tokens: int,
    seqs: int,
    seed: int,
    weight_format: str | None = None,
) -> Trace:
    """A synthetic trace of `seqs` sequences of `tokens` generated positions each."""
    if preset.kind != "moe":
        raise InputError(f"model preset '{preset.name}' has no experts; synthetic routing needs a MoE model")
    if tokens < 1 or seqs < 1:
        raise InputError(f"a synthetic trace needs tokens >= 1 and seqs >= 1, got tokens={tokens}, seqs={seqs}")
    geometry = TraceGeometry.from_preset(preset, weight_format)
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
