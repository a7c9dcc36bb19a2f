"""The expert family's time formula as compiled code: one call per pass or per expert-parallel pass
(the simulator's path where no per-(U, M) table applies), equal to `ExpertFamily.time_us` for the
families `ExpertFamily.compiled` admits (tested in tests/test_hw_profiles.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from moesim.kernels.jit import njit

if TYPE_CHECKING:
    from moesim.hw_profiles.families import ExpertFamily
    from moesim.models import ExpertShape


def parameters(family: ExpertFamily, shape: ExpertShape, top_k: int) -> tuple[np.ndarray, ...]:
    """`element_time_us`'s parameters (its docstring's order), tile widths, and the compute and
    serial coefficient of every tile variant, for one expert shape and top-k."""
    c = family.coefficients()
    variant = family._variant_coefficients()
    structure = family.structure
    scalars = [
        float(structure.tokens_per_read), family.cache_bytes, shape.expert_bytes, float(shape.hidden),
        float(shape.intermediate), c["fixed"], c["per_expert"], c["per_slot"], c["hbm"], c["cache"],
        family.roofline.peak_bandwidth_gbps, family.roofline.ceiling_tflops(family.floor_tflops), c.get("tile", 0.0),
        float(structure.tile_tokens), float(structure.tile_step), float(top_k), float(structure.tile_doubling),
    ]  # fmt: skip
    return (
        np.array(scalars),
        np.asarray(structure.variants, np.float64),
        np.ascontiguousarray(variant["compute"], np.float64),
        np.ascontiguousarray(variant["serial"], np.float64),
    )


@njit
def element_time_us(u, s, cmax, params, widths, compute, serial) -> float:  # noqa: ANN001
    """`ExpertFamily.inputs_time_us` of one pass of a family priced by its fitted terms alone, compiled: the same terms in the same order
    (`base_columns`, `model_time_us`, the roofline floor); `params` = tokens_per_read, cache_bytes,
    expert_bytes, hidden, intermediate, the fixed, per_expert, per_slot, hbm and cache
    coefficients, peak bandwidth and the FLOP ceiling (`Roofline.ceiling_tflops`), the tile coefficient, tile_tokens, tile_step,
    top-k (a pass of s slots has s / top-k tokens) and tile_doubling (`ExpertStructure.tile_width`)."""
    t_read = params[0]
    cache_bytes, b, h, inter = params[1], params[2], params[3], params[4]
    fixed, per_expert, per_slot, hbm, cache = params[5], params[6], params[7], params[8], params[9]
    safe_u = max(u, 1.0)
    if t_read == 1.0:
        reads, chunks, tokens = s, 1.0, 1.0
    elif t_read == 0.0:
        reads, chunks, tokens = u, 1.0, cmax
    else:
        chunks = math.ceil(s / safe_u / t_read - 1e-9)
        reads, tokens = u * chunks, min(cmax, t_read)
    rereads = max(reads - u, 0.0)
    hit = min(1.0, cache_bytes / (safe_u * b))
    active = 1.0 if s > 0 else 0.0
    v = 0
    if widths.shape[0]:
        v = min(np.searchsorted(widths, min(cmax, t_read) - 1e-9), widths.shape[0] - 1)
    flops = s * 6.0 * h * inter
    total = flops * compute[v] + active * tokens * chunks * (h + inter) * serial[v]
    if fixed:
        total = total + fixed * active
    if per_expert:
        total = total + per_expert * u
    if per_slot:
        total = total + per_slot * s
    if hbm:
        total = total + hbm * (b * (u + rereads * (1.0 - hit)))
    if cache:
        total = total + cache * (b * rereads * hit)
    tile, tile_tokens, tile_step = params[12], params[13], params[14]
    if tile_tokens and tile:
        width = tile_tokens
        if tile_step:
            steps = math.ceil(s / params[15] / tile_step - 1e-9)
            if params[16]:
                steps = 2.0 ** math.ceil(math.log2(max(steps, 1.0)) - 1e-9)
            width = min(tile_tokens, tile_step * steps)
        width = max(width, 1.0)
        total = total + tile * (active * u * math.ceil(s / safe_u / width - 1e-9) * width * 6.0 * h * inter)
    return max(total, max(u * b / (params[10] * 1e3), flops / (params[11] * 1e6)))


@njit
def pass_times_us(slots, distinct, most, params, widths, compute, serial, out) -> None:  # noqa: ANN001
    """`element_time_us` of every pass of flat arrays, into `out`."""
    for i in range(slots.shape[0]):
        out[i] = element_time_us(distinct[i], slots[i], most[i], params, widths, compute, serial)


@njit
def slowest_rank_layers_us(slots, distinct, most, params, widths, compute, serial) -> float:  # noqa: ANN001
    """Σ over layers of the slowest rank's time, for (ranks, layers) arrays."""
    total = 0.0
    for layer in range(slots.shape[1]):
        slowest = 0.0
        for r in range(slots.shape[0]):
            slowest = max(slowest, element_time_us(distinct[r, layer], slots[r, layer], most[r, layer], params, widths, compute, serial))
        total += slowest
    return total
