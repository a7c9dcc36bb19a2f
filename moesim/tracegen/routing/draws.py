"""The Numba kernels of the synthetic routing generators (`synth`): draws without repeats in
proportion to a popularity, per-sequence popularity, the mixture's and the working set's routing.

Every kernel draws from Numba's generator, seeded once per trace by `seed` and carried over
between calls of this thread: the routing kernels fill `out[t, layer, :]` for a range of layers
of a group of whole sequences, so calls in (sequence, layer) order draw exactly what one call over
the whole trace would, in groups that bound the memory of a long trace.
"""

from __future__ import annotations

import numpy as np

from moesim.kernels.jit import njit

MAX_MISSES = 64  # rejected draws of already chosen experts before drawing exactly among the rest


@njit
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


@njit
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


@njit
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


@njit
def mixture_routing(
    seq_starts: np.ndarray,
    layer_lo: int,
    layer_hi: int,
    keep_prob: np.ndarray,
    cum_popularity: np.ndarray,
    dispersion: np.ndarray,
    out: np.ndarray,
) -> None:
    """Per sequence and layer, a sequence popularity θ ~ Dirichlet(π·E/δ) (θ = π when δ = 0); then
    slot j of token t picks a lag ℓ with probability |keep_prob[layer, ℓ-1]| (or none): for
    keep_prob > 0 it copies slot j of token t−ℓ, for keep_prob < 0 it bars that expert from token
    t; the remaining slots are drawn without repeats in proportion to θ. δ = 0 and keep_prob = 0
    with uniform π give independent uniform top-k sets. Fills layers layer_lo..layer_hi - 1 of
    the sequences starting at seq_starts (rows of `out`)."""
    k = out.shape[2]
    n_experts = cum_popularity.shape[1]
    n_lags = keep_prob.shape[1]
    chosen = np.zeros(n_experts, np.bool_)
    cum_seq = np.empty(n_experts)
    log_mass = np.empty(n_experts)
    barred_ids = np.empty(k, np.int64)
    for s in range(seq_starts.shape[0] - 1):
        a = seq_starts[s]
        b = seq_starts[s + 1]
        for layer in range(layer_lo, layer_hi):
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


@njit
def _draw_fresh(cum: np.ndarray, log_mass: np.ndarray, excluded: np.ndarray) -> int:
    """One expert not in `excluded`, in proportion to θ: rejection up to MAX_MISSES, then exactly."""
    n_experts = cum.shape[0]
    for _ in range(MAX_MISSES):
        e = min(np.searchsorted(cum, np.random.random() * cum[-1], side="right"), n_experts - 1)
        if not excluded[e]:
            return e
    return _draw_unchosen(log_mass, excluded)


@njit
def _take(e: int, chosen: np.ndarray, row: np.ndarray, filled: int) -> int:
    """Put expert e in the next free slot of a token's row; returns the slots filled."""
    chosen[e] = True
    row[filled] = e
    return filled + 1


@njit
def working_set_routing(
    seq_starts: np.ndarray,
    layer_lo: int,
    layer_hi: int,
    keep_prob: np.ndarray,
    cum_popularity: np.ndarray,
    dispersion: np.ndarray,
    working_set: int,
    working_use: np.ndarray,
    working_persist: np.ndarray,
    out: np.ndarray,
) -> None:
    """Per sequence and layer: θ ~ Dirichlet(π·E/δ) as in the mixture, and a context of W distinct
    experts drawn from θ; before every token after the first, each context member is replaced with
    probability 1 − ρ by a θ-draw outside the context. Token t takes each context member (in a
    random order) with probability p, while slots remain; then slot j copies slot j of token t − 1
    with probability q (if not taken yet); the remaining slots are drawn without repeats from θ.
    Fills layers layer_lo..layer_hi - 1 of the sequences starting at seq_starts (rows of `out`)."""
    k = out.shape[2]
    n_experts = cum_popularity.shape[1]
    chosen = np.zeros(n_experts, np.bool_)
    in_context = np.zeros(n_experts, np.bool_)
    context = np.empty(max(working_set, 1), np.int64)
    cum_seq = np.empty(n_experts)
    log_mass = np.empty(n_experts)
    for s in range(seq_starts.shape[0] - 1):
        a = seq_starts[s]
        b = seq_starts[s + 1]
        for layer in range(layer_lo, layer_hi):
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


@njit
def seed(value: int) -> None:
    """Seed Numba's generator (its state carries over between the kernels' calls in this thread)."""
    np.random.seed(value)
