"""numpy's seeded streams without a Generator per stream (Numba): `default_rng([*prefix, key])`'s
uniforms for many keys in one compiled call, bit for bit, and each stream's PCG64 state after.

A simulation gives every request its own stream, `np.random.default_rng([seed, tag, request_id])`;
making that Generator (SeedSequence, PCG64, Generator objects) costs tens of microseconds, far
more than the few hundred doubles a request draws. The algorithms, written here from numpy's
sources (github.com/numpy/numpy: `numpy/random/bit_generator.pyx` at 0293e8ee:
`_coerce_to_uint32_array`, `hashmix`, `mix`, `SeedSequence.mix_entropy`, `generate_state`;
`numpy/random/_pcg64.pyx`: `PCG64.__init__`; `numpy/random/src/pcg64/pcg64.h` at 0190305d and
`pcg64.c` at 12f02376: `pcg_setseq_128_srandom_r`, `pcg_setseq_128_step_r`,
`pcg_output_xsl_rr_128_64`, `pcg64_set_seed`; the double: `(next64 >> 11) · 2⁻⁵³`), tested
against numpy's own Generators (tests/test_acceptance_streams.py):

1. Entropy words: each non-negative int becomes its 32-bit words, lowest first (0 is one word 0);
   the list's words are concatenated.
2. SeedSequence pool (4 words of 32 bits): word i = hashmix(entropy[i] or 0), then every pool word
   mixed with the hash of every other (in order src, dst), then every entropy word beyond the
   fourth mixed into every pool word. hashmix(v) = ((v ^ h) · h') with h' = h · MULT_A carried on,
   then v ^= v >> 16; mix(x, y) = (MIX_MULT_L · x − MIX_MULT_R · y), then ^= >> 16 (all mod 2³²).
3. generate_state(4, uint64): 8 words of 32 bits cycling over the pool, each (p ^ h) · h'
   with h' = h · MULT_B carried on (h starting at INIT_B), ^= >> 16; pairs little-endian into 4
   uint64 words v0..v3.
4. PCG64 seeding: initstate = v0·2⁶⁴ + v1, initseq = v2·2⁶⁴ + v3; inc = 2·initseq + 1 (mod 2¹²⁸),
   state = 0, one step, state += initstate, one step (numpy's native 128-bit path; its emulated
   one, for compilers without a 128-bit integer, carries another bit into inc's high word).
5. Step: state = state · M + inc (mod 2¹²⁸), emulated here with 64-bit halves (the 64 × 64 → 128
   product from 32-bit pieces); output XSL-RR: rotr64(hi ^ lo, hi >> 58), drawn after each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moesim.kernels.jit import njit

_M32 = np.uint64(0xFFFFFFFF)
_S16 = np.uint64(16)
_S32 = np.uint64(32)
_INIT_A = np.uint64(0x43B0D7E5)
_MULT_A = np.uint64(0x931E8875)
_INIT_B = np.uint64(0x8B51F9DD)
_MULT_B = np.uint64(0x58F38DED)
_MIX_MULT_L = np.uint64(0xCA01F9DD)
_MIX_MULT_R = np.uint64(0x4973F715)
_POOL = 4  # SeedSequence's default pool size (words of 32 bits)
_MULT_HI = np.uint64(2549297995355413924)  # PCG64's 128-bit multiplier, high and low halves
_MULT_LO = np.uint64(4865540595714422341)
_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_TWO_POW_M53 = 1.0 / 9007199254740992.0


def entropy_words(entropy: Sequence[int]) -> np.ndarray:
    """The 32-bit words (uint64 holding < 2³²) numpy's SeedSequence makes of a list of non-negative ints."""
    words: list[int] = []
    for value in entropy:
        value = int(value)
        if value < 0:
            raise ValueError(f"entropy must be non-negative, got {value}")
        words.append(value & 0xFFFFFFFF)
        value >>= 32
        while value:
            words.append(value & 0xFFFFFFFF)
            value >>= 32
    return np.array(words, np.uint64)


@njit(inline="always")
def _hashmix(value, hash_const):  # noqa: ANN001, ANN202
    """v = (value ^ h) · h' with h' = h · MULT_A, then v ^ (v >> 16) (mod 2³²); returns (v, h')."""
    value = value ^ hash_const
    hash_const = (hash_const * _MULT_A) & _M32
    value = (value * hash_const) & _M32
    return value ^ (value >> _S16), hash_const


@njit(inline="always")
def _mix(x, y):  # noqa: ANN001, ANN202
    """r = MIX_MULT_L · x − MIX_MULT_R · y, then r ^ (r >> 16) (mod 2³²)."""
    r = (_MIX_MULT_L * x - _MIX_MULT_R * y) & _M32
    return r ^ (r >> _S16)


@njit(inline="always")
def _mul_hi(x, y):  # noqa: ANN001, ANN202
    """The high 64 bits of the 128-bit product x · y, from 32-bit pieces."""
    x_lo, x_hi = x & _M32, x >> _S32
    y_lo, y_hi = y & _M32, y >> _S32
    low = x_lo * y_lo
    mid = x_hi * y_lo + (low >> _S32)  # < 2⁶⁴: (2³² − 1)² + 2³² − 1
    cross = (mid & _M32) + x_lo * y_hi  # < 2⁶⁴ likewise
    return x_hi * y_hi + (mid >> _S32) + (cross >> _S32)


@njit(inline="always")
def _step(s_hi, s_lo, i_hi, i_lo):  # noqa: ANN001, ANN202
    """state · M + inc (mod 2¹²⁸) in 64-bit halves."""
    hi = _mul_hi(s_lo, _MULT_LO) + s_lo * _MULT_HI + s_hi * _MULT_LO
    lo = s_lo * _MULT_LO + i_lo
    carry = _ONE if lo < i_lo else _ZERO
    return hi + i_hi + carry, lo


@njit(inline="always")
def _output(s_hi, s_lo):  # noqa: ANN001, ANN202
    """XSL-RR: (hi ^ lo) rotated right by hi >> 58."""
    value = s_hi ^ s_lo
    rot = s_hi >> np.uint64(58)
    return (value >> rot) | (value << ((np.uint64(64) - rot) & np.uint64(63)))


@njit
def _seed(words, n_words, pool):  # noqa: ANN001, ANN202
    """PCG64's (state hi, state lo, inc hi, inc lo) seeded from SeedSequence(words[:n_words]) (steps 2-4);
    `pool` is scratch of 2 × 4 words."""
    hash_const = _INIT_A
    for i in range(_POOL):
        pool[i], hash_const = _hashmix(words[i] if i < n_words else _ZERO, hash_const)
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                hashed, hash_const = _hashmix(pool[src], hash_const)
                pool[dst] = _mix(pool[dst], hashed)
    for src in range(_POOL, n_words):
        for dst in range(_POOL):
            hashed, hash_const = _hashmix(words[src], hash_const)
            pool[dst] = _mix(pool[dst], hashed)
    hash_const = _INIT_B
    v = pool[_POOL:]  # the 4 state words of 64 bits
    v[:] = _ZERO
    for i in range(2 * _POOL):
        value = pool[i % _POOL] ^ hash_const
        hash_const = (hash_const * _MULT_B) & _M32
        value = (value * hash_const) & _M32
        value ^= value >> _S16
        v[i // 2] |= value << (_S32 if i % 2 else _ZERO)
    i_hi = (v[2] << _ONE) | (v[3] >> np.uint64(63))
    i_lo = (v[3] << _ONE) | _ONE
    s_hi, s_lo = _step(_ZERO, _ZERO, i_hi, i_lo)
    s_lo = s_lo + v[1]
    s_hi = s_hi + v[0] + (_ONE if s_lo < v[1] else _ZERO)
    s_hi, s_lo = _step(s_hi, s_lo, i_hi, i_lo)
    return s_hi, s_lo, i_hi, i_lo


@njit
def _seed_state(words, out):  # noqa: ANN001, ANN202
    """out[:] = the PCG64 state (state hi, state lo, inc hi, inc lo) of SeedSequence(words)."""
    out[0], out[1], out[2], out[3] = _seed(words, words.shape[0], np.empty(2 * _POOL, np.uint64))


@njit
def fill_stream_uniforms(prefix, keys, offsets, out, states) -> None:  # noqa: ANN001
    """For stream i (entropy = prefix words + the words of keys[i]): out[offsets[i]:offsets[i + 1]]
    = 1 − Generator.random(n) and states[i] = its PCG64 (state hi, state lo, inc hi, inc lo) after."""
    n_prefix = prefix.shape[0]
    words = np.empty(n_prefix + 2, np.uint64)
    words[:n_prefix] = prefix
    pool = np.empty(2 * _POOL, np.uint64)
    for i in range(keys.shape[0]):
        key = keys[i]
        words[n_prefix] = key & _M32
        n_words = n_prefix + 1
        if key >> _S32:
            words[n_prefix + 1] = key >> _S32
            n_words += 1
        s_hi, s_lo, i_hi, i_lo = _seed(words, n_words, pool)
        for j in range(offsets[i], offsets[i + 1]):
            s_hi, s_lo = _step(s_hi, s_lo, i_hi, i_lo)
            out[j] = 1.0 - np.float64(_output(s_hi, s_lo) >> np.uint64(11)) * _TWO_POW_M53
        states[i, 0], states[i, 1], states[i, 2], states[i, 3] = s_hi, s_lo, i_hi, i_lo


def seed_state(entropy: Sequence[int]) -> np.ndarray:
    """PCG64(SeedSequence(entropy))'s state as 4 uint64 words (state hi, state lo, inc hi, inc lo)."""
    out = np.empty(4, np.uint64)
    _seed_state(entropy_words(entropy), out)
    return out


def stream_uniforms(prefix: Sequence[int], keys: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each key, `1 − default_rng([*prefix, key]).random(size)` (uniforms in (0, 1]), laid end to
    end: (the uniforms, offsets (key i's are uniforms[offsets[i]:offsets[i + 1]]), the (n, 4)
    PCG64 states after the draws, as `seed_state`)."""
    keys = np.asarray(keys)
    if keys.size and (keys.dtype.kind not in "iu" or (keys.dtype.kind == "i" and int(keys.min()) < 0)):
        raise ValueError("keys must be non-negative integers")
    sizes = np.asarray(sizes, np.int64)
    if sizes.shape != keys.shape or (sizes.size and int(sizes.min()) < 0):
        raise ValueError("sizes must be non-negative, one per key")
    offsets = np.zeros(keys.size + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    out = np.empty(int(offsets[-1]), np.float64)
    states = np.empty((keys.size, 4), np.uint64)
    fill_stream_uniforms(entropy_words(prefix), keys.astype(np.uint64), offsets, out, states)
    return out, offsets, states


def pcg64_state(words: np.ndarray) -> dict:
    """numpy's `PCG64.state` dict of 4 state words (state hi, state lo, inc hi, inc lo)."""
    s_hi, s_lo, i_hi, i_lo = (int(w) for w in words)
    return {"bit_generator": "PCG64", "state": {"state": (s_hi << 64) | s_lo, "inc": (i_hi << 64) | i_lo}, "has_uint32": 0, "uinteger": 0}
