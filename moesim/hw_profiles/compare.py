"""Per-slot vs dedup time per pass size for a default routing: r(n) = BW_dedup / BW_per_slot.

Routing is uniform (each token picks top-K distinct experts uniformly), sampled with a seed;
times are means over samples. With u(n) = U / (n·K) the byte share, r(n) = u(n)·T_per_slot / T_dedup,
and dedup is faster exactly where u(n) < r(n).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from moesim.hw_profiles.families import ExpertFamily
from moesim.hw_profiles.profile import HardwareProfile
from moesim.kernels.features import RoutingFeatures
from moesim.models import ExpertShape

DEFAULT_PASS_SIZES = (*range(1, 17), 24, 32, 48, 64, 96, 128)


def uniform_routing_features(n_tokens: int, experts: int, top_k: int, samples: int, seed: int) -> RoutingFeatures:
    """Features of `samples` passes of n tokens under uniform routing (top-K distinct per token)."""
    rng = np.random.default_rng([seed, n_tokens, experts, top_k])
    picks = np.argpartition(rng.random((samples, n_tokens, experts)), top_k - 1, axis=2)[:, :, :top_k]
    counts = np.zeros((samples, experts), np.int64)
    np.add.at(counts, (np.repeat(np.arange(samples), n_tokens * top_k), picks.reshape(-1)), 1)
    return RoutingFeatures(
        n_tokens=np.full(samples, float(n_tokens)),
        slots=np.full(samples, float(n_tokens * top_k)),
        distinct_experts=(counts > 0).sum(axis=1).astype(np.float64),
        max_tokens_per_expert=counts.max(axis=1).astype(np.float64),
    )


def dedup_comparison(
    profile: HardwareProfile,
    shape: ExpertShape,
    experts: int,
    top_k: int,
    pass_sizes: tuple[int, ...] = DEFAULT_PASS_SIZES,
    samples: int = 64,
    seed: int = 0,
    dedup_families: tuple[str, ...] | None = None,
) -> pl.DataFrame:
    """Per pass size: mean distinct experts, byte share u, per-slot and dedup* times, r per dedup family."""
    per_slot = profile.expert_families.get("per_slot")
    dedups: list[ExpertFamily] = [profile.expert_family(name) for name in (dedup_families or profile.dedup_families)]
    rows = []
    for n in pass_sizes:
        features = uniform_routing_features(n, experts, top_k, samples, seed)
        byte_share = float(features.distinct_experts.mean()) / (n * top_k)
        row: dict[str, float | int | str] = {
            "n": n,
            "distinct_experts": float(features.distinct_experts.mean()),
            "byte_share_u": byte_share,
        }
        times, beyond = {}, []
        for family in ([per_slot] if per_slot else []) + dedups:
            times[family.name] = float(family.time_us(features, shape).mean())
            row[f"{family.name}_us"] = times[family.name]
            factor = float(family.extrapolation_factor(features, shape).max())
            if factor > 1.0:
                beyond.append(f"{family.name} x{factor:.2g}")
        if per_slot:
            for family in dedups:
                row[f"r_{family.name}"] = byte_share * times["per_slot"] / times[family.name]
        row["fastest"] = min(times, key=times.__getitem__)
        row["extrapolated"] = ", ".join(beyond) or "-"
        rows.append(row)
    return pl.DataFrame(rows)
