"""Synthetic routing generators (a registry) and the trace synthesiser.

A generator draws, for every sequence and MoE layer, the top-k expert sets of consecutive
tokens. Adding one is adding one class with `@GENERATORS.register`: a frozen `Checked` dataclass
(its fields are its parameters, with their bounds) with a `name` and a `filler(geometry, seed)`
returning the function that fills the ids of a group of whole sequences for a range of layers
(its Numba kernel in `draws`, drawing from the generator seeded once per trace); `generate`,
`generate_layout` and `iter_groups` (groups of whole sequences, for traces larger than memory)
come from `Drawn`. Seeds lie in 0..MAX_SEED (Numba's generator takes 32 bits: larger seeds
would repeat smaller ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np

from moesim.errors import InputError
from moesim.fields import Checked, FieldError, checked, construct
from moesim.machine import check_fits
from moesim.models import ModelPreset
from moesim.registry import Registry
from moesim.tracegen.formats.schema import TraceGeometry, TraceMeta
from moesim.tracegen.formats.trace import MAX_BATCH_ROWS, Trace, TraceWriter
from moesim.tracegen.routing import draws

Progress = Callable[[int, int], None]  # (positions done, positions in all)
Fill = Callable[[np.ndarray, int, int, np.ndarray], None]  # (sequence starts, first layer, end layer, ids out)
MAX_SEED = (1 << 32) - 1
MAX_POSITIONS = (1 << 32) - 1  # `seq` and `pos` are uint32
GROUP_POSITIONS = 1 << 20  # positions generated (and held) at a time when streaming to a file


class RoutingGenerator(Protocol):
    """What every synthetic routing generator provides."""

    name: ClassVar[str]

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """Expert ids, shape (seqs * tokens, len(moe_layers), top_k), in the smallest id type."""
        ...

    def generate_layout(self, geometry: TraceGeometry, seq_starts: np.ndarray, seed: int) -> np.ndarray:
        """The same for sequences of any lengths (`seq_starts`: first row of each, then the total)."""
        ...

    def iter_groups(
        self, geometry: TraceGeometry, seq_starts: np.ndarray, seed: int, max_positions: int = ..., progress: Progress | None = None
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """(first sequence, end sequence, ids) of consecutive groups of whole sequences."""
        ...


GENERATORS: Registry[RoutingGenerator] = Registry("routing generator", InputError)


class Drawn:
    """What a generator with a `filler` (its Numba kernel, prepared for a geometry and seed) gets."""

    def filler(self, geometry: TraceGeometry, seed: int) -> Fill:
        """The kernel filling ids of a group of sequences for a range of layers, parameters checked."""
        raise NotImplementedError

    def iter_groups(
        self,
        geometry: TraceGeometry,
        seq_starts: np.ndarray,
        seed: int,
        max_positions: int = GROUP_POSITIONS,
        progress: Progress | None = None,
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """(first sequence, end sequence, ids of their positions) for consecutive groups of whole
        sequences of at most `max_positions` positions (or one longer sequence, a few layers at a
        time), in the smallest id type: the same ids as one call. `progress(done, total)` after each."""
        fill = self.filler(geometry, seed)
        starts = np.asarray(seq_starts, np.int64)
        n_layers, total = len(geometry.moe_layers), int(starts[-1])
        dtype = geometry.expert_id_type.to_pandas_dtype()
        draws.seed(seed)
        first = 0
        while first < starts.shape[0] - 1:
            end = max(first + 1, int(np.searchsorted(starts, starts[first] + max_positions, side="right")) - 1)
            local = starts[first : end + 1] - starts[first]
            ids = np.empty((int(local[-1]), n_layers, geometry.top_k), dtype)
            step = n_layers if end > first + 1 else max(1, (n_layers * max_positions) // max(1, int(local[-1])))
            for lo in range(0, n_layers, step):
                hi = min(n_layers, lo + step)
                fill(local, lo, hi, ids)
                if progress is not None:
                    progress(int(starts[first]) + int(local[-1]) * hi // n_layers, total)
            yield first, end, ids
            first = end

    def generate_layout(self, geometry: TraceGeometry, seq_starts: np.ndarray, seed: int) -> np.ndarray:
        """Ids for sequences of any lengths (`seq_starts`: first row of each, then the total)."""
        ((_, _, ids),) = self.iter_groups(geometry, seq_starts, seed, max_positions=max(1, int(seq_starts[-1])))
        return ids

    def generate(self, geometry: TraceGeometry, tokens: int, seqs: int, seed: int) -> np.ndarray:
        """Draw with the Numba kernel; same seed, same ids."""
        return self.generate_layout(geometry, equal_layout(tokens, seqs), seed)


def equal_layout(tokens: int, seqs: int) -> np.ndarray:
    """Sequence starts of `seqs` sequences of `tokens` positions each, plus the total."""
    return np.arange(seqs + 1, dtype=np.int64) * tokens


def equal_lengths(tokens: int, seqs: int) -> np.ndarray:
    """`seqs` lengths of `tokens` positions, refused before allocating when outside 1..MAX_POSITIONS
    or when the layout alone (lengths, starts, row numbers: 24 bytes a sequence) cannot fit memory."""
    if not (1 <= seqs <= MAX_POSITIONS and 1 <= tokens <= MAX_POSITIONS):
        raise InputError(f"a synthetic trace needs 1..{MAX_POSITIONS} sequences of 1..{MAX_POSITIONS} tokens, got {seqs} of {tokens}")
    check_fits(f"the layout of {seqs} synthetic sequences", 24 * seqs)
    return np.full(seqs, tokens, np.int64)


def _per_layer(name: str, value: float | tuple[float, ...], n_layers: int, low: float, high: float) -> np.ndarray:
    values = np.broadcast_to(np.asarray(value, np.float64), (n_layers,)) if np.ndim(value) == 0 else np.asarray(value, np.float64)
    if values.shape != (n_layers,):
        raise InputError(f"generator parameter '{name}' has {values.shape[0]} values, the trace has {n_layers} MoE layers")
    if not np.all((values >= low) & (values <= high)):
        raise InputError(f"generator parameter '{name}' must lie in [{low}, {high}], got {values.tolist()}")
    return values.copy()


ZIPF = {"ge": 0.0, "le": 10.0}
LAG = {"ge": -1.0, "le": 1.0}
DISPERSION = {"ge": 0.0, "le": 1e6}


def zipf_popularity(n_experts: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Popularity ∝ rank^-exponent over a random permutation of the experts (exponent 0: uniform)."""
    weights = np.arange(1, n_experts + 1, dtype=np.float64) ** -exponent
    return weights[rng.permutation(n_experts)] / weights.sum()


class _MixtureCase(Drawn):
    """A generator that is a special case of the mixture (`as_mixture`)."""

    def as_mixture(self, n_layers: int) -> Mixture:
        """The equivalent mixture (its parameters checked for `n_layers` MoE layers)."""
        raise NotImplementedError

    def filler(self, geometry: TraceGeometry, seed: int) -> Fill:
        """The mixture's kernel; same seed, same ids."""
        return self.as_mixture(len(geometry.moe_layers)).filler(geometry, seed)


def _plain_mixture(keep_prob: float | tuple[float, ...], zipf_exponent: float | tuple[float, ...]) -> Mixture:
    """One-lag stickiness and a Zipf popularity, nothing else."""
    return Mixture(keep_prob, zipf_exponent, 0.0, 0.0, 0.0, 0.0)


@GENERATORS.register
@dataclass(frozen=True)
class Uniform(_MixtureCase, Checked):
    """Independent uniform top-k sets: P(expert in a token's set) = K/E for every token."""

    name: ClassVar[str] = "uniform"

    def as_mixture(self, n_layers: int) -> Mixture:
        """Uniform routing is the mixture with q = 0, flat popularity and no sequence dispersion."""
        return _plain_mixture(0.0, 0.0)


@GENERATORS.register
@dataclass(frozen=True)
class Zipf(_MixtureCase, Checked):
    """Independent tokens, experts drawn by a per-layer Zipf popularity ∝ rank^-exponent."""

    name: ClassVar[str] = "zipf"
    exponent: float | tuple[float, ...] = checked(1.0, **ZIPF)

    def as_mixture(self, n_layers: int) -> Mixture:
        """The mixture with q = 0 and no sequence dispersion."""
        return _plain_mixture(0.0, self.exponent)


@GENERATORS.register
@dataclass(frozen=True)
class Sticky(_MixtureCase, Checked):
    """Each of token t+1's experts is kept from token t with probability `keep_prob` (per layer or
    one value), else drawn by popularity (Zipf with `zipf_exponent` per layer; 0 = uniform)."""

    name: ClassVar[str] = "sticky"
    keep_prob: float | tuple[float, ...] = checked(0.3, ge=0.0, le=1.0)
    zipf_exponent: float | tuple[float, ...] = checked(0.0, **ZIPF)

    def as_mixture(self, n_layers: int) -> Mixture:
        """The mixture without sequence dispersion."""
        return _plain_mixture(self.keep_prob, self.zipf_exponent)


@GENERATORS.register
@dataclass(frozen=True)
class Mixture(Drawn, Checked):
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
    keep_prob: float | tuple[float, ...] = checked(0.164, **LAG)
    zipf_exponent: float | tuple[float, ...] = checked(0.561, **ZIPF)
    seq_dispersion: float | tuple[float, ...] = checked(0.211, **DISPERSION)
    keep_prob_2: float | tuple[float, ...] = checked(0.043, **LAG)
    keep_prob_3: float | tuple[float, ...] = checked(0.066, **LAG)
    keep_prob_4: float | tuple[float, ...] = checked(0.021, **LAG)

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

    def filler(self, geometry: TraceGeometry, seed: int) -> Fill:
        """The mixture's kernel with the popularity of `seed`."""
        keep, exponents, dispersion = self.parameters(len(geometry.moe_layers))
        rng = np.random.default_rng(seed)
        cum = np.cumsum(np.stack([zipf_popularity(geometry.experts, float(x), rng) for x in exponents]), axis=1)
        return lambda starts, lo, hi, out: draws.mixture_routing(starts, lo, hi, keep, cum, dispersion, out)


@GENERATORS.register
@dataclass(frozen=True)
class WorkingSet(Drawn, Checked):
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
    zipf_exponent: float | tuple[float, ...] = checked(0.569, **ZIPF)
    seq_dispersion: float | tuple[float, ...] = checked(0.201, **DISPERSION)
    keep_prob: float | tuple[float, ...] = checked(0.122, ge=0.0, le=1.0)
    working_use: float | tuple[float, ...] = checked(0.251, ge=0.0, le=1.0)
    working_persist: float | tuple[float, ...] = checked(0.923, ge=0.0, le=1.0)
    working_set: int = checked(6, ge=0, lt=1 << 16)

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

    def filler(self, geometry: TraceGeometry, seed: int) -> Fill:
        """The working set's kernel with the popularity of `seed`."""
        exponents, dispersion, keep, use, persist = self.parameters(len(geometry.moe_layers), geometry.experts)
        rng = np.random.default_rng(seed)
        cum = np.cumsum(np.stack([zipf_popularity(geometry.experts, float(x), rng) for x in exponents]), axis=1)
        size = self.working_set
        return lambda starts, lo, hi, out: draws.working_set_routing(starts, lo, hi, keep, cum, dispersion, size, use, persist, out)


def make_generator(name: str, params: dict | None = None) -> RoutingGenerator:
    """A registered generator by name, its parameters checked by the schema layer (types and
    ranges; a problem is a FieldError naming the parameter)."""
    if not isinstance(name, str) or name not in GENERATORS:
        raise FieldError("", GENERATORS.unknown(name))
    return construct(GENERATORS.get(name), params or {})


def _synth_meta(geometry: TraceGeometry, generator: RoutingGenerator, lengths: np.ndarray, seed: int) -> TraceMeta:
    """The trace's metadata, after checking the request: 1 <= lengths < 2^32, seed in 0..MAX_SEED."""
    if lengths.size < 1 or lengths.min() < 1 or lengths.size > MAX_POSITIONS or lengths.max() > MAX_POSITIONS:
        raise InputError(f"a synthetic trace needs 1..{MAX_POSITIONS} sequences of 1..{MAX_POSITIONS} tokens")
    if not 0 <= seed <= MAX_SEED:
        raise InputError(f"a synthetic trace needs a seed in 0..{MAX_SEED}, got {seed}")
    params = {"name": generator.name, **dataclasses.asdict(generator), "seed": seed}  # type: ignore[call-overload]
    same = lengths.min() == lengths.max()
    return TraceMeta(
        geometry=geometry,
        engine="moesim-synth",
        backend="synthetic",
        prompts=f"{lengths.size} synthetic sequences of {lengths[0] if same else f'{lengths.min()}-{lengths.max()}'} tokens",
        generator=params,
    )


def synth_sizes(geometry: TraceGeometry, longest: int, positions: int, in_memory: bool) -> tuple[int, int]:
    """(bytes of memory, bytes of file) a synthetic trace needs: its ids (all of them in memory, or
    the largest group streamed to a file) and the file's rows (seq, pos, layer, is_prompt, ids)."""
    id_bytes = 1 if geometry.experts <= 256 else 2
    per_position = len(geometry.moe_layers) * geometry.top_k * id_bytes
    held = positions if in_memory else max(longest, min(positions, GROUP_POSITIONS))
    memory = held * (per_position + 9) + (0 if in_memory else MAX_BATCH_ROWS * 40)
    file = positions * len(geometry.moe_layers) * (10 + geometry.top_k * id_bytes) + (1 << 16)
    return memory, file


def _what(label: str, geometry: TraceGeometry, lengths: np.ndarray) -> str:
    shape = f"{lengths.size} sequences of {lengths.max()} tokens" if lengths.min() == lengths.max() else f"{int(lengths.sum())} tokens"
    return f"{label} ({shape}, {len(geometry.moe_layers)} MoE layers, top-{geometry.top_k})"


def synthesize(
    preset: ModelPreset,
    generator: RoutingGenerator,
    tokens: int,
    seqs: int,
    seed: int,
    weight_format: str | None = None,
) -> Trace:
    """A synthetic trace of `seqs` sequences of `tokens` generated positions each (in memory;
    one that cannot fit is refused with its size before any work)."""
    geometry = TraceGeometry.from_preset(preset, weight_format, "synthetic routing")
    return synthesize_layout(geometry, generator, equal_lengths(tokens, seqs), seed)


def synthesize_layout(geometry: TraceGeometry, generator: RoutingGenerator, lengths: np.ndarray, seed: int) -> Trace:
    """A synthetic trace of sequences of the given lengths (e.g. a recorded trace's, to compare like with like)."""
    lengths = np.asarray(lengths, np.int64)
    meta = _synth_meta(geometry, generator, lengths, seed)
    check_fits(_what("the synthetic trace", geometry, lengths), synth_sizes(geometry, int(lengths.max()), int(lengths.sum()), True)[0])
    experts = generator.generate_layout(geometry, np.concatenate([[0], np.cumsum(lengths)]), seed)
    return Trace(
        meta=meta,
        seq=np.repeat(np.arange(lengths.size, dtype=np.uint32), lengths),
        pos=np.concatenate([np.arange(n, dtype=np.uint32) for n in lengths]),
        is_prompt=np.zeros(int(lengths.sum()), bool),
        experts=experts,
    )


def synthesize_to(
    path: Path,
    geometry: TraceGeometry,
    generator: RoutingGenerator,
    lengths: np.ndarray,
    seed: int,
    progress: Progress | None = None,
) -> TraceMeta:
    """Write the trace `synthesize_layout` would make to `path`, streaming groups of whole sequences
    (memory: one group, at least one sequence); refused before any work, with its estimate, when
    memory or disk cannot hold it."""
    lengths = np.asarray(lengths, np.int64)
    meta = _synth_meta(geometry, generator, lengths, seed)
    memory, file = synth_sizes(geometry, int(lengths.max()), int(lengths.sum()), in_memory=False)
    check_fits(_what(f"the synthetic trace {path}", geometry, lengths), memory, file, Path(path).parent)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    with TraceWriter(path, meta) as writer:
        for first, end, ids in generator.iter_groups(geometry, starts, seed, GROUP_POSITIONS, progress):
            for s in range(first, end):
                writer.append(s, 0, ids[starts[s] - starts[first] : starts[s + 1] - starts[first]], False)
                writer.end_sequence()
    return meta
