"""A profile as plain data for `profile show` (rich tables and JSON alike), and its per-slot vs dedup
comparison.

Per-slot vs dedup time per pass size for a default routing: r(n) = BW_dedup / BW_per_slot.

Routing is uniform (each token picks top-K distinct experts uniformly), sampled with a seed;
times are means over samples. With u(n) = U / (n·K) the byte share, r(n) = u(n)·T_per_slot / T_dedup,
and dedup is faster exactly where u(n) < r(n).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import polars as pl

from moesim.hw_profiles.builtin import builtin_names, load_profile
from moesim.hw_profiles.families import ExpertFamily
from moesim.hw_profiles.heldout import ErrorStats
from moesim.hw_profiles.ladder.rungs import RUNGS
from moesim.hw_profiles.profile import HardwareProfile
from moesim.hw_profiles.speculative import SPEC_TERMS
from moesim.kernels.features import RoutingFeatures
from moesim.models import ExpertShape


def _percent(stats: ErrorStats | None) -> str:
    return "-" if stats is None else f"{100 * stats.median:.1f} ({100 * stats.p90:.1f})"


def _rates(values: tuple[float, ...]) -> str:
    return "/".join("inf" if math.isinf(v) else f"{v:.3g}" for v in values)


def _family_row(family: ExpertFamily) -> dict[str, Any]:
    h = family.heldout_error
    return {
        "family": family.name,
        "structure": family.structure.describe(),
        "fixed_us": family.fixed_us,
        "hbm_gbps": family.hbm_bandwidth_gbps,
        "cache_gbps": family.cache_bandwidth_gbps,
        "compute_tflops": _rates(family.compute_tflops) + (f" (floor {family.floor_tflops:.3g})" if family.floor_tflops < math.inf else ""),
        "per_expert_us": family.per_expert_us,
        "shape_out_%": _percent(h.leave_one_shape_out),
        "routing_out_%": _percent(h.leave_one_routing_out),
        "in_sample_%": _percent(h.in_sample),
        "epsilon_%": 100 * h.epsilon,
        "source": family.provenance.kind,
    }


def _ladder_row(family: ExpertFamily) -> dict[str, Any]:
    """The family's lookup ladder: knots, fitted shapes, each rung's bound, pass-level terms."""
    errors = family.rung_errors
    row: dict[str, Any] = {
        "family": family.name,
        "knots": 0 if family.grid is None else int(family.grid.time_us.size),
        "shape_fits": ", ".join(f"{label} ×{fit.fit_weight:g}" for label, fit in family.shape_fits.items()) or "-",
    }
    for rung in RUNGS:
        one = errors.one_layer.get(rung) if errors else None
        whole = errors.whole_pass.get(rung) if errors else None
        cells = [f"{100 * stats.p90:.1f}" if stats else "-" for stats in (one, whole)]
        row[f"{rung}_p90_%"] = " / ".join(cells)
    transfer = family.pass_transfer
    row["pass_terms"] = (
        "-" if transfer is None else (f"a={transfer.a:.4g}, b={transfer.b_us:.3g} µs" if transfer.applied else "none (a=1, b=0)")
    )
    row["bound_basis"] = family.bound_basis
    return row


def _heldout_dict(family: Any) -> dict[str, Any]:
    h = family.heldout_error
    out: dict[str, Any] = {
        split: getattr(h, split).to_dict() if getattr(h, split) else None
        for split in ("leave_one_shape_out", "leave_one_routing_out", "in_sample")
    }
    out.update(transfer=h.transfer, epsilon=h.epsilon, epsilon_median=h.epsilon_median, coverage=h.coverage)
    return out


def describe_profile(profile: HardwareProfile) -> dict[str, Any]:
    """Device, roofline, pass, families (table rows and full parameters), sources and notes."""
    families: dict[str, Any] = {}
    for name, family in profile.expert_families.items():
        families[name] = {
            **family.parameters(),
            "calibrated_range": {k: list(v) for k, v in family.calibrated_range.bounds.items()},
            "heldout_error": _heldout_dict(family),
            "provenance": dataclasses.asdict(family.provenance),
            "note": family.note,
        }
    dense = profile.dense
    families["dense"] = {
        "bandwidth_gbps": dense.bandwidth_gbps,
        "tflops": dense.tflops,
        "launch_us": dense.launch_us,
        "heldout_error": _heldout_dict(dense),
        "provenance": dataclasses.asdict(dense.provenance),
    }
    dense_row = {
        "family": "dense",
        "structure": "launch per kernel + bytes / bandwidth + flops / rate",
        "fixed_us": dense.launch_us,
        "hbm_gbps": dense.bandwidth_gbps,
        "cache_gbps": math.nan,
        "compute_tflops": _rates((dense.tflops,)),
        "per_expert_us": math.nan,
        "shape_out_%": "-",
        "routing_out_%": "-",
        "in_sample_%": "-",
        "epsilon_%": 100 * dense.heldout_error.epsilon,
        "source": dense.provenance.kind,
    }
    d = profile.device
    device_line = (
        f"device {d.name} ({d.backend}), {d.memory_gb:g} GB; engine {d.engine or '-'} {d.engine_version}; "
        f"driver {d.driver_version or '-'}; "
        f"roofline {profile.roofline.peak_bandwidth_gbps:g} GB/s, {profile.roofline.peak_tflops:g} TFLOP/s; "
        f"fixed time per pass {profile.pass_fixed_us:g} µs"
    )
    return {
        "name": profile.name,
        "device_line": device_line,
        "description": profile.description,
        "status": profile.status,
        "derived_from": profile.derived_from,
        "device": dataclasses.asdict(profile.device),
        "roofline": dataclasses.asdict(profile.roofline),
        "pass_fixed_us": profile.pass_fixed_us,
        "families": families,
        "family_rows": [*(_family_row(f) for f in profile.expert_families.values()), dense_row],
        "partial": profile.partial,
        "dispatch": dispatch_rows(profile),
        "ladder_rows": [_ladder_row(f) for f in profile.expert_families.values()],
        **({"speculative": speculative_rows(profile)} if profile.speculative is not None else {}),
        "sources": {key: dataclasses.asdict(source) for key, source in profile.sources.items()},
        "source_rows": [{"id": key, "kind": source.kind, "backs": source.label()} for key, source in profile.sources.items()],
        "notes": list(profile.all_notes()),
    }


def builtin_entries() -> list[dict[str, Any]]:
    """One entry per built-in profile: name, device, engine and its version, status, whether the
    calibration is partial, backend, peak bandwidth, families."""
    entries = []
    for profile_name in builtin_names():
        profile = load_profile(profile_name)
        entries.append(
            {
                "name": profile.name,
                "device": profile.device.name,
                "engine": profile.device.engine,
                "engine_version": profile.device.engine_version,
                "status": profile.status,
                "partial": profile.partial,
                "backend": profile.device.backend,
                "peak_bandwidth_gbps": profile.roofline.peak_bandwidth_gbps,
                "families": list(profile.families),
            }
        )
    return entries


def speculative_rows(profile: HardwareProfile) -> list[dict[str, Any]]:
    """The spec-path terms as table rows: term, value (µs), what fixed it."""
    spec = profile.speculative
    if spec is None:
        return []
    return [
        {
            "term": term,
            "us": getattr(spec, term),
            "uncertainty": spec.uncertainty.get(term, 0.0),
            "kind": spec.kinds.get(term, spec.provenance.kind),
            "basis": spec.basis.get(term, spec.provenance.label()),
        }
        for term in SPEC_TERMS
    ]


def dispatch_rows(profile: HardwareProfile) -> list[dict[str, Any]]:
    """The engine's dispatch as table rows (empty for a profile without one)."""
    if profile.dispatch is None:
        return []
    rows = []
    for rule in profile.dispatch.rules:
        table = rule.to_table()
        conditions = ", ".join(f"{key} {value}" for key, value in table.items() if key not in ("family", "formats", "note"))
        rows.append(
            {"family": rule.family, "formats": " ".join(rule.formats) or "any", "when": conditions or "otherwise", "note": rule.note}
        )
    return rows


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
