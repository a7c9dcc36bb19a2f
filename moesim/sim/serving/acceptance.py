"""Acceptance models (a registry): how many of a request's k drafted tokens the target accepts.

Every model reduces to one uniform draw u per request and iteration. With S_i = P(at least i
drafts accepted), non-increasing in i, the events {A >= i} = {u < S_i} are nested, so one u
gives the whole count: A = #{i >= 1 : u < S_i}, capped at the largest draft length any policy
may use (k_cap), and the accepted count at draft length k is min(k, A). The uniforms come from
the request's own stream (seeded by the run seed and the request id), so every policy sees
the same acceptance luck at the same point of a request (common random numbers), and the
server never allocates per iteration: draws come precomputed in blocks.

`position` is the number of tokens a request has committed through decode passes so far (0 at
its first decode pass); models whose acceptance depends on the text (regime, recorded) use it,
so the same stretch of a request has the same acceptance under every policy.

Adding a model is one frozen dataclass with `@ACCEPTANCE_MODELS.register`: its fields are the
config keys of `[acceptance]`, and `bind` returns the per-request state.

`bind_many` binds many requests at once: for models whose draws are position-independent blocks
and whose bind draws nothing first (`block_factory` is not None) the first blocks of all the
requests come from one compiled call (`moesim.kernels.pcg`: the same uniforms as each request's
own Generator, bit for bit) and one numpy count, and a request's Generator is made (at the
stream's state after its first block) only if it needs a second block.
"""

from __future__ import annotations

import bisect
import copy
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np

from moesim.fields import FieldError, require
from moesim.kernels.pcg import pcg64_state, stream_uniforms
from moesim.registry import Registry
from moesim.sim.analysis.speculation import tokens_per_pass
from moesim.sim.cost.tree import DEFAULT_SIBLING_RATE, DraftTree, TreeSpec, accepted_survival
from moesim.tracegen.formats.specrun import read_accepted_counts

BLOCK_DRAWS = 4096  # uniforms drawn at once per request (fewer if the request is shorter)
_STREAM_ACCEPTANCE = 0xACCE  # tag separating the acceptance streams from other seeded streams


class RequestAcceptance(Protocol):
    """One request's acceptance process."""

    def draw(self, position: int) -> int:
        """Uncapped accepted count A (<= k_cap) of the pass that starts at `position`."""
        ...

    def expected_tokens(self, position: int) -> np.ndarray:
        """Expected tokens committed by a pass at `position`, for k = 0..k_cap: τ(k) = Σ_{i<=k} S_i."""
        ...


class AcceptanceModel(Protocol):
    """What every acceptance model provides."""

    name: ClassVar[str]

    def check_cap(self, k_cap: int) -> None:
        """Reject draft lengths the model cannot answer for (raise FieldError)."""
        ...

    def bind(self, request_id: int, output_tokens: int, k_cap: int, seed: int) -> RequestAcceptance:
        """The acceptance process of request `request_id`."""
        ...

    def mean_alpha(self, request_id: int, seed: int) -> float:
        """The request's acceptance rate where the model defines one (NaN otherwise), for the outputs."""
        ...

    def block_factory(self, k_cap: int) -> BlockFactory | None:
        """`make(rng, block_size)` of the request states, for models whose draws are position-independent
        blocks and whose bind draws nothing before them (`bind_many` fills their first blocks in bulk); else None."""
        ...


ACCEPTANCE_MODELS: Registry[AcceptanceModel] = Registry("acceptance model")


def request_rng(seed: int, request_id: int) -> np.random.Generator:
    """The request's own random stream for acceptance."""
    return np.random.default_rng([seed, _STREAM_ACCEPTANCE, request_id])


def geometric_count(u: np.ndarray, alpha: float, k_cap: int) -> np.ndarray:
    """A = #{i >= 1 : u < α^i} = floor(ln u / ln α), capped at k_cap (u in (0, 1])."""
    if alpha <= 0.0:
        return np.zeros(u.shape, np.int64)
    if alpha >= 1.0:
        return np.full(u.shape, k_cap, np.int64)
    return np.minimum(np.floor(np.log(u) / math.log(alpha)), k_cap).astype(np.int64)


def survival_count(u: np.ndarray, survival: np.ndarray) -> np.ndarray:
    """A = #{i >= 1 : u < S_i} for a non-increasing survival S_1..S_kcap."""
    return (u[None, :] < survival[:, None]).sum(axis=0).astype(np.int64)


def _uniforms(rng: np.random.Generator, size: int) -> np.ndarray:
    """Uniforms in (0, 1]."""
    return 1.0 - rng.random(size)


def _resumed_rng(state: np.ndarray) -> np.random.Generator:
    """A Generator at a PCG64 state (4 words, `moesim.kernels.pcg`)."""
    bit_generator = np.random.PCG64(0)  # any seed: the state is set next
    bit_generator.state = pcg64_state(state)
    return np.random.Generator(bit_generator)


class _BlockDraws:
    """Draws precomputed in blocks: `fill(u)` turns the next block of uniforms into counts. The
    block is kept as a list (the Python loop's draws) and as an array (the server's compiled lane
    reads it from `counts` and hands its place back through `at`). A state bound in bulk has its
    first block already (as an array: listed when the Python loop first draws from it) and no
    Generator: that is made, at the stream's state after the first block, when a second one is
    needed."""

    __slots__ = ("_block", "_i", "_rng", "_size", "_state", "counts")

    def __init__(self, rng: np.random.Generator | None, size: int) -> None:
        self._rng = rng
        self._size = size
        self._state: np.ndarray | None = None
        self._block: list[int] = []
        self.counts = np.zeros(0, np.int64)
        self._i = 0

    def fill(self, u: np.ndarray) -> np.ndarray:
        """Counts from a block of uniforms."""
        raise NotImplementedError

    def refill(self) -> None:
        """The next block of the stream."""
        if self._rng is None:
            self._rng = _resumed_rng(self._state)  # type: ignore[arg-type]
        self.counts = self.fill(_uniforms(self._rng, self._size))
        self._block = self.counts.tolist()
        self._i = 0

    def _begin(self, counts: np.ndarray, state: np.ndarray) -> None:
        """The first block (drawn in bulk) and the stream's PCG64 state after it."""
        self.counts = counts
        self._state = state

    def _list_block(self) -> None:
        """A block drawn in bulk (an array while the lane reads it) as the Python loop's list."""
        if len(self._block) != self.counts.size:
            self._block = self.counts.tolist()

    def _next_block(self) -> None:
        """The block listed (the place kept), or the next block once it is used up."""
        self._list_block()
        if self._i == len(self._block):
            self.refill()

    @property
    def at(self) -> int:
        """How many counts of the block have been drawn."""
        return self._i

    @at.setter
    def at(self, value: int) -> None:
        self._i = value  # a block drawn in bulk is listed at the next draw

    def draw(self, position: int) -> int:
        """The next count of the stream (position-independent models)."""
        if self._i >= len(self._block):  # used up, or drawn in bulk and not listed yet
            self._next_block()
        i = self._i
        self._i = i + 1
        return self._block[i]


BlockFactory = Callable[[np.random.Generator | None, int], _BlockDraws]


class _GeometricRequest(_BlockDraws):
    __slots__ = ("_alpha", "_k_cap", "_tau")

    def __init__(self, rng: np.random.Generator | None, size: int, alpha: float, k_cap: int) -> None:
        super().__init__(rng, size)
        self._alpha = alpha
        self._k_cap = k_cap
        self._tau: np.ndarray | None = None  # computed when a policy first asks (the oracle)

    def fill(self, u: np.ndarray) -> np.ndarray:
        """A = floor(ln u / ln α) capped."""
        return geometric_count(u, self._alpha, self._k_cap)

    def expected_tokens(self, position: int) -> np.ndarray:
        """τ(k, α) for k = 0..k_cap."""
        if self._tau is None:
            self._tau = tokens_per_pass(np.arange(self._k_cap + 1), self._alpha)
        return self._tau


def _check_alpha(value: float, field: str) -> None:
    require(math.isfinite(value) and 0.0 <= value <= 1.0, field, f"must lie in [0, 1], got {value}")


def _block_size(output_tokens: int) -> int:
    """A request of N output tokens runs at most N - 1 decode passes."""
    return max(1, min(BLOCK_DRAWS, output_tokens))


def bind_many(
    model: AcceptanceModel, request_ids: Sequence[int], output_tokens: Sequence[int], k_cap: int, seed: int
) -> list[RequestAcceptance]:
    """[model.bind(r, n, k_cap, seed) for r, n in zip(request_ids, output_tokens)], the same streams:
    block models' first blocks drawn in one compiled call and counted in one numpy call."""
    make = model.block_factory(k_cap)
    if make is None or len(request_ids) == 0:
        return [model.bind(int(r), int(n), k_cap, seed) for r, n in zip(request_ids, output_tokens, strict=True)]
    sizes = np.clip(np.asarray(output_tokens, np.int64), 1, BLOCK_DRAWS)
    u, offsets, states = stream_uniforms((seed, _STREAM_ACCEPTANCE), np.asarray(request_ids, np.int64), sizes)
    requests = [make(None, size) for size in sizes.tolist()]
    counts = requests[0].fill(u)  # the same model and cap for all: one call, elementwise
    bounds = offsets.tolist()
    for i, request in enumerate(requests):
        request._begin(counts[bounds[i] : bounds[i + 1]], states[i])
    return requests  # type: ignore[return-value]


@ACCEPTANCE_MODELS.register
@dataclass(frozen=True)
class Geometric:
    """Each draft token accepted with probability α given the previous ones were: S_i = α^i.
    α is fixed (`alpha`) or drawn per request from Beta(a, b) (`beta = [a, b]`)."""

    name: ClassVar[str] = "geometric"
    alpha: float | None = None
    beta: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if (self.alpha is None) == (self.beta is None):
            raise FieldError("alpha", "give exactly one of 'alpha' (fixed) or 'beta' = [a, b] (per request)")
        if self.alpha is not None:
            _check_alpha(self.alpha, "alpha")
        if self.beta is not None:
            require(
                len(self.beta) == 2 and all(b > 0 and math.isfinite(b) for b in self.beta),
                "beta",
                f"must be [a, b] with a, b > 0, got {list(self.beta)}",
            )

    def check_cap(self, k_cap: int) -> None:
        """Any draft length is fine."""

    def mean_alpha(self, request_id: int, seed: int) -> float:
        """The request's α (fixed, or its Beta draw: the first draw of its stream)."""
        if self.alpha is not None:
            return self.alpha
        a, b = self.beta  # type: ignore[misc]
        return float(request_rng(seed, request_id).beta(a, b))

    def block_factory(self, k_cap: int) -> BlockFactory | None:
        """A fixed α's requests (a Beta α is the stream's first draw: None)."""
        if self.alpha is None:
            return None
        return functools.partial(_GeometricRequest, alpha=self.alpha, k_cap=k_cap)

    def bind(self, request_id: int, output_tokens: int, k_cap: int, seed: int) -> RequestAcceptance:
        """Geometric draws with the request's α."""
        rng = request_rng(seed, request_id)
        alpha = self.alpha if self.alpha is not None else float(rng.beta(*self.beta))  # type: ignore[misc]
        return _GeometricRequest(rng, _block_size(output_tokens), alpha, k_cap)


class _SurvivalRequest(_BlockDraws):
    __slots__ = ("_survival", "_tau")

    def __init__(self, rng: np.random.Generator | None, size: int, survival: np.ndarray, tau: np.ndarray) -> None:
        super().__init__(rng, size)
        self._survival = survival
        self._tau = tau

    def fill(self, u: np.ndarray) -> np.ndarray:
        """A = #{i : u < S_i}."""
        return survival_count(u, self._survival)

    def expected_tokens(self, position: int) -> np.ndarray:
        """τ(k) = 1 + Σ_{i<=k} S_i."""
        return self._tau


def _survival_factory(survival: np.ndarray) -> BlockFactory:
    """Survival draws with S_1..S_kcap, τ(k) = 1 + Σ_{i<=k} S_i shared by the requests."""
    return functools.partial(_SurvivalRequest, survival=survival, tau=np.concatenate([[1.0], 1.0 + np.cumsum(survival)]))


class _SameSurvival:
    """A model whose requests all draw from one survival S_1..S_kcap (`survival`)."""

    def survival(self, k_cap: int) -> np.ndarray:
        """S_1..S_kcap."""
        raise NotImplementedError

    def check_cap(self, k_cap: int) -> None:
        """Any draft length is fine."""

    def block_factory(self, k_cap: int) -> BlockFactory:
        """Survival draws, the same S for every request."""
        return _survival_factory(self.survival(k_cap))

    def bind(self, request_id: int, output_tokens: int, k_cap: int, seed: int) -> RequestAcceptance:
        """Survival draws, the same S for every request."""
        return self.block_factory(k_cap)(request_rng(seed, request_id), _block_size(output_tokens))


@ACCEPTANCE_MODELS.register
@dataclass(frozen=True)
class Position(_SameSurvival):
    """Position-dependent: draft i (1-based) accepted with probability alphas[i-1] given drafts
    1..i-1 were, so S_i = Π_{j<=i} α_j; positions beyond the list repeat its last value."""

    name: ClassVar[str] = "position"
    alphas: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        require(len(self.alphas) > 0, "alphas", "needs at least one acceptance rate")
        for value in self.alphas:
            _check_alpha(value, "alphas")

    def survival(self, k_cap: int) -> np.ndarray:
        """S_1..S_kcap."""
        conditional = np.array([self.alphas[min(i, len(self.alphas) - 1)] for i in range(k_cap)], np.float64)
        return np.cumprod(conditional)

    def mean_alpha(self, request_id: int, seed: int) -> float:
        """No single α: NaN."""
        return math.nan


@ACCEPTANCE_MODELS.register
@dataclass(frozen=True)
class Tree(_SameSurvival):
    """A draft tree's accepted length (`moesim.sim.cost.tree`): at every depth the drafter's top
    candidate matches with `alpha`, each further sibling with `sibling_rate` of what the higher
    ranks missed; S_d = P(A >= d) of the [drafter]'s tree at the policy's largest draft length (the
    tree at a smaller k is that tree cut at depth k)."""

    name: ClassVar[str] = "tree"
    alpha: float
    sibling_rate: float = DEFAULT_SIBLING_RATE
    shape: TreeSpec = field(default_factory=TreeSpec, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_alpha(self.alpha, "alpha")
        _check_alpha(self.sibling_rate, "sibling_rate")

    def with_shape(self, shape: TreeSpec) -> Tree:
        """The model for the drafter's tree family."""
        bound = copy.copy(self)
        object.__setattr__(bound, "shape", shape)
        return bound

    def draft_tree(self, k_cap: int) -> DraftTree:
        """The drafter's tree at the cap (a pruned beam pruned for this α)."""
        return self.shape.tree(k_cap, np.array([self.alpha]), self.sibling_rate)

    def survival(self, k_cap: int) -> np.ndarray:
        """S_1..S_kcap (0 beyond the tree's depth)."""
        tree = self.draft_tree(k_cap)
        out = np.zeros(k_cap)
        if tree.depth:
            out[: tree.depth] = accepted_survival(tree, np.array([[self.alpha]]), self.sibling_rate)[0]
        return out

    def mean_alpha(self, request_id: int, seed: int) -> float:
        """The top candidate's α."""
        return self.alpha


class _RegimeRequest:
    __slots__ = ("_bounds", "_i", "_k_cap", "_ln_alpha", "_log_u", "_phase_alpha", "_rng", "_size", "_taus")

    def __init__(self, rng: np.random.Generator, size: int, k_cap: int, bounds: list[int], phase_alpha: list[float]) -> None:
        self._rng = rng
        self._size = size
        self._k_cap = k_cap
        self._bounds = bounds  # start position of each phase after the first
        self._phase_alpha = phase_alpha
        self._ln_alpha = [math.log(a) if 0.0 < a < 1.0 else (-math.inf if a <= 0.0 else 0.0) for a in phase_alpha]
        self._taus: dict[float, np.ndarray] = {}
        self._log_u: list[float] = []
        self._i = 0

    def _phase_at(self, position: int) -> int:
        return bisect.bisect_right(self._bounds, position)

    def draw(self, position: int) -> int:
        """A = floor(ln u / ln α) with the α of the phase `position` falls in."""
        i = self._i
        if i == len(self._log_u):
            self._log_u = np.log(_uniforms(self._rng, self._size)).tolist()
            i = 0
        self._i = i + 1
        ln_alpha = self._ln_alpha[self._phase_at(position)]
        if ln_alpha == 0.0:
            return self._k_cap
        if ln_alpha == -math.inf:
            return 0
        count = int(self._log_u[i] / ln_alpha)
        return count if count < self._k_cap else self._k_cap

    def expected_tokens(self, position: int) -> np.ndarray:
        """τ(k, α of the current phase)."""
        alpha = self._phase_alpha[self._phase_at(position)]
        tau = self._taus.get(alpha)
        if tau is None:
            tau = self._taus[alpha] = tokens_per_pass(np.arange(self._k_cap + 1), alpha)
        return tau


_STREAM_REGIME = 0x4E61


@ACCEPTANCE_MODELS.register
@dataclass(frozen=True)
class Regime:
    """Regime-switching: a request's text passes through task phases, each with its own α
    (geometric within a phase). Phase lengths in committed tokens are geometric with mean
    `mean_phase_tokens`; the first phase's regime is drawn uniformly, each next one uniformly
    among the other regimes. The schedule is fixed per request (its own seeded stream), so
    every policy meets the same phases at the same text positions."""

    name: ClassVar[str] = "regime"
    alphas: tuple[float, ...] = ()
    mean_phase_tokens: float = 128.0

    def __post_init__(self) -> None:
        require(len(self.alphas) >= 2, "alphas", "a regime-switching workload needs at least two acceptance rates")
        for value in self.alphas:
            _check_alpha(value, "alphas")
        require(
            math.isfinite(self.mean_phase_tokens) and self.mean_phase_tokens >= 1.0,
            "mean_phase_tokens",
            f"must be >= 1, got {self.mean_phase_tokens}",
        )

    def check_cap(self, k_cap: int) -> None:
        """Any draft length is fine."""

    def schedule(self, request_id: int, output_tokens: int, seed: int) -> tuple[list[int], list[float]]:
        """Phase start positions (after the first phase) and each phase's α, covering the request."""
        rng = np.random.default_rng([seed, _STREAM_REGIME, request_id])
        n = len(self.alphas)
        regime = int(rng.integers(n))
        bounds: list[int] = []
        phase_alpha = [self.alphas[regime]]
        position = 0
        while True:
            position += int(rng.geometric(1.0 / self.mean_phase_tokens))
            if position >= output_tokens:
                return bounds, phase_alpha
            regime = (regime + 1 + int(rng.integers(n - 1))) % n
            bounds.append(position)
            phase_alpha.append(self.alphas[regime])

    def mean_alpha(self, request_id: int, seed: int) -> float:
        """No single α: NaN."""
        return math.nan

    def block_factory(self, k_cap: int) -> None:
        """Draws depend on the position: None."""
        return None

    def bind(self, request_id: int, output_tokens: int, k_cap: int, seed: int) -> RequestAcceptance:
        """Geometric draws with the α of the current phase."""
        bounds, phase_alpha = self.schedule(request_id, output_tokens, seed)
        return _RegimeRequest(request_rng(seed, request_id), _block_size(output_tokens), k_cap, bounds, phase_alpha)


class _RecordedRequest:
    __slots__ = ("_accepted", "_draft_len", "_k_cap", "_period", "_starts", "_taus", "_window")

    def __init__(self, accepted: np.ndarray, draft_len: int, k_cap: int, window: int) -> None:
        self._accepted = accepted.tolist()
        starts = np.concatenate([[0], np.cumsum(accepted + 1)])
        self._starts = starts[:-1].tolist()
        self._period = int(starts[-1])
        self._draft_len = draft_len
        self._k_cap = k_cap
        self._window = window
        self._taus: dict[int, np.ndarray] = {}

    def _step(self, position: int) -> tuple[int, int]:
        local = position % self._period
        return bisect.bisect_right(self._starts, local) - 1, local

    def draw(self, position: int) -> int:
        """The drafts still accepted from `position` on in the recorded step covering it."""
        j, local = self._step(position)
        return min(self._starts[j] + self._accepted[j] - local, self._k_cap)

    def expected_tokens(self, position: int) -> np.ndarray:
        """τ(k, α̂): α̂ = Σa / (Σa + #{a < K}) over the recorded steps within `window` of the current one."""
        j, _ = self._step(position)
        tau = self._taus.get(j)
        if tau is None:
            lo, hi = max(0, j - self._window), min(len(self._accepted), j + self._window + 1)
            counts = np.asarray(self._accepted[lo:hi])
            rejections = int(np.sum(counts < self._draft_len))
            total = int(counts.sum())
            alpha = total / (total + rejections) if total + rejections else 1.0
            tau = self._taus[j] = tokens_per_pass(np.arange(self._k_cap + 1), alpha)
        return tau


@ACCEPTANCE_MODELS.register
@dataclass(frozen=True)
class Recorded:
    """Replays the accepted counts of a speculative run (a list; a speculative-run file, contract 2;
    or a table with an `accepted` column and optional `seq`). Request r replays sequence r mod S by text position: the
    recorded step j covering position p (it started at p_j and accepted a_j drafts) says the
    drafts from p on match up to p_j + a_j, so A = p_j + a_j - p; positions past the recording
    wrap. Exact for k <= the recorded draft length K with a deterministic drafter; longer drafts
    have no recorded outcome and are rejected."""

    name: ClassVar[str] = "recorded"
    accepted: tuple[int, ...] | None = None
    file: Path | None = None
    draft_len: int | None = None
    oracle_window: int = 8
    sequences: tuple[np.ndarray, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if (self.accepted is None) == (self.file is None):
            raise FieldError("accepted", "give exactly one of 'accepted' (a list) or 'file'")
        require(self.oracle_window >= 0, "oracle_window", f"must be >= 0, got {self.oracle_window}")
        if self.accepted is not None:
            seqs, drafted = [np.asarray(self.accepted, np.int64)], None
        else:
            seqs, drafted = read_accepted_counts(self.file)  # type: ignore[arg-type]
        draft_len = self.draft_len if self.draft_len is not None else drafted
        require(draft_len is not None and draft_len >= 1, "draft_len", "is required (the recorded run's draft length, >= 1)")
        key = "accepted" if self.accepted is not None else "file"
        for seq in seqs:
            require(
                seq.size > 0 and seq.dtype.kind in "iu" and bool(np.all((seq >= 0) & (seq <= draft_len))),
                key,
                f"accepted counts must be non-empty integers in [0, draft_len = {draft_len}]",
            )
        object.__setattr__(self, "draft_len", draft_len)
        object.__setattr__(self, "sequences", tuple(s.astype(np.int64) for s in seqs))

    def check_cap(self, k_cap: int) -> None:
        """Drafts longer than the recorded ones have no recorded outcome."""
        require(k_cap <= self.draft_len, "draft_len", f"the recorded run drafted {self.draft_len} tokens, the policy may draft {k_cap}")  # type: ignore[operator]

    def mean_alpha(self, request_id: int, seed: int) -> float:
        """No single α: NaN."""
        return math.nan

    def block_factory(self, k_cap: int) -> None:
        """Replays, no draws: None."""
        return None

    def bind(self, request_id: int, output_tokens: int, k_cap: int, seed: int) -> RequestAcceptance:
        """Replays sequence request_id mod S."""
        seq = self.sequences[request_id % len(self.sequences)]
        return _RecordedRequest(seq, self.draft_len, k_cap, self.oracle_window)  # type: ignore[arg-type]
