"""Profiles for hardware nobody measured here: a calibrated profile scaled.

`derive_profile` is the what-if: bandwidth terms × X, compute terms × Y, optionally a new fixed
time per pass. `scaled_engine_profile` moves an engine profile to a catalog device of the same
engine by the ratios of their datasheet peaks (never from another engine's kernels, never from
the lab kernels of the H200 calibration); fixed times are kept. Each scaled profile carries the
base's held-out errors plus an assumed transfer uncertainty, so its ε is wider than the base's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from moesim.errors import InputError
from moesim.hw_profiles.catalog import DeviceSpec
from moesim.hw_profiles.dispatch import Dispatch
from moesim.hw_profiles.families import ExpertFamily, Roofline
from moesim.hw_profiles.profile import DeviceFacts, HardwareProfile
from moesim.hw_profiles.provenance import Provenance
from moesim.hw_profiles.schema import check_profile


def _scaled_family(
    family: ExpertFamily,
    bandwidth_scale: float,
    compute_scale: float,
    cache_bytes: float,
    roofline: Roofline,
    provenance: Provenance,
    transfer: float,
    transfer_note: str,
) -> ExpertFamily:
    heldout = family.heldout_error
    if transfer:
        heldout = heldout.with_transfer(math.hypot(heldout.transfer, transfer), transfer_note)
    return dataclasses.replace(
        family,
        hbm_bandwidth_gbps=family.hbm_bandwidth_gbps * bandwidth_scale,
        cache_bandwidth_gbps=family.cache_bandwidth_gbps * bandwidth_scale,
        reread_bandwidth_gbps=family.reread_bandwidth_gbps * bandwidth_scale,
        variant_bandwidth_gbps=tuple(rate * bandwidth_scale for rate in family.variant_bandwidth_gbps),
        cache_bytes=cache_bytes,
        format_bandwidth_gbps={fmt: rate * bandwidth_scale for fmt, rate in family.format_bandwidth_gbps.items()},
        compute_tflops=tuple(rate * compute_scale for rate in family.compute_tflops),
        tile_tflops=family.tile_tflops * compute_scale,
        floor_tflops=family.floor_tflops * compute_scale,
        roofline=roofline,
        heldout_error=heldout,
        provenance=provenance,
        # the ladder's knots, shape fits and whole-pass evidence are the base device's measurements:
        # a scaled family predicts from its fitted rung, bounded by its ε (with the transfer)
        grid=None,
        shape_fits={},
        rung_errors=None,
        pass_transfer=None,
    )


def _scale(
    base: HardwareProfile,
    name: str,
    description: str,
    status: str,
    source_id: str,
    source: Provenance,
    bandwidth_scale: float,
    compute_scale: Callable[[str], float],
    cache_bytes: Callable[[ExpertFamily], float],
    roofline: Roofline,
    device: DeviceFacts,
    pass_fixed_us: float,
    transfer: float = 0.0,
    extra_sources: dict[str, Provenance] | None = None,
) -> HardwareProfile:
    sources = {**base.sources, **(extra_sources or {}), source_id: source}
    families = {
        family_name: _scaled_family(
            family,
            bandwidth_scale,
            compute_scale(family_name),
            cache_bytes(family),
            roofline,
            source,
            transfer,
            source.note or source.citation,
        )
        for family_name, family in base.expert_families.items()
    }
    dense = dataclasses.replace(
        base.dense,
        bandwidth_gbps=base.dense.bandwidth_gbps * bandwidth_scale,
        tflops=base.dense.tflops * compute_scale("dense"),
        attention_tflops=base.dense.attention_tflops * compute_scale("dense"),
        provenance=source,
        heldout_error=base.dense.heldout_error.with_transfer(
            math.hypot(base.dense.heldout_error.transfer, transfer), source.note or source.citation
        ),
    )
    section_sources = {key: source_id for key in base.section_sources}
    section_sources["device"] = source_id
    return HardwareProfile(
        name=name,
        description=description,
        status=status,
        device=device,
        roofline=roofline,
        pass_fixed_us=pass_fixed_us,
        expert_families=families,
        dense=dense,
        sources=sources,
        field_sources={},
        notes=base.notes,
        derived_from=base.name,
        section_sources=section_sources,
        dispatch=base.dispatch,
        partial=base.partial,
        bench_routed_share=base.bench_routed_share,
    )


def derive_profile(
    base: HardwareProfile,
    name: str,
    bandwidth_scale: float,
    compute_scale: float = 1.0,
    pass_fixed_us: float | None = None,
) -> HardwareProfile:
    """What-if hardware: every bandwidth × bandwidth_scale, every FLOP rate × compute_scale."""
    for label, value in (("--bandwidth-scale", bandwidth_scale), ("--compute-scale", compute_scale)):
        if not (value > 0 and math.isfinite(value)):
            raise InputError(f"{label} must be a positive number, got {value}")
    if pass_fixed_us is not None and not (pass_fixed_us >= 0 and math.isfinite(pass_fixed_us)):
        raise InputError(f"--fixed-us must be >= 0, got {pass_fixed_us}")
    fixed = base.pass_fixed_us if pass_fixed_us is None else pass_fixed_us
    what = f"bandwidths x{bandwidth_scale:g}, compute x{compute_scale:g}, fixed time per pass {fixed:g} us"
    source = Provenance("assumed", note=f"what-if derived from profile '{base.name}': {what}; held-out errors are the base's")
    roofline = Roofline(base.roofline.peak_bandwidth_gbps * bandwidth_scale, base.roofline.peak_tflops * compute_scale)
    device = dataclasses.replace(base.device, name=f"{base.device.name} (what-if: {what})")
    derived = _scale(
        base,
        name,
        f"What-if from '{base.name}': {what}",
        "derived",
        "what-if",
        source,
        bandwidth_scale,
        lambda _family: compute_scale,
        lambda family: family.cache_bytes,
        roofline,
        device,
        fixed,
    )
    return check_profile(derived, f"--bandwidth-scale {bandwidth_scale:g} --compute-scale {compute_scale:g} on '{base.name}'")


def scaled_engine_profile(
    base: HardwareProfile,
    spec: DeviceSpec,
    base_spec: DeviceSpec,
    name: str,
    dispatch: Dispatch,
    transfer: tuple[float, str] | None = None,
) -> HardwareProfile:
    """An engine profile moved to another device by its datasheet (status 'datasheet-scaled'):
    bandwidths x the ratio of peak bandwidths, FLOP rates x the ratio of tensor peaks, fixed times
    kept, the target's own dispatch (device class), held-out errors kept plus a transfer
    uncertainty: `transfer` (the value and where it comes from, e.g. what held-out devices of the
    engine show), else the catalog's assumed one. Only from a calibration of the same engine."""
    bandwidth_scale = spec.peak_bandwidth_gbps / base_spec.peak_bandwidth_gbps
    compute_scale = spec.tensor_tflops / base_spec.tensor_tflops
    uncertainty, said = transfer or (spec.transfer, f"relative transfer uncertainty {spec.transfer:.2f} assumed")
    note = (
        f"{base.name} ({base.device.engine}) scaled to the {spec.name}: bandwidths x{bandwidth_scale:.4f} "
        f"(peak {spec.peak_bandwidth_gbps:g} vs {base_spec.peak_bandwidth_gbps:g} GB/s), FLOP rates x{compute_scale:.4f} "
        f"(tensor peak {spec.tensor_tflops:g} vs {base_spec.tensor_tflops:g} TFLOP/s), fixed times kept; {said}"
    )
    source = Provenance("assumed", note=note)
    device = DeviceFacts(spec.name, spec.backend, spec.memory_gb, spec.l2_cache_bytes, spec.compute_units, base.device.engine,
                         base.device.engine_version, "", "")  # fmt: skip
    profile = _scale(
        base,
        name,
        f"{base.device.engine} on the {spec.name}: datasheet-scaled from {base.name} (uncertain)" + (" (partial)" if base.partial else ""),
        "datasheet-scaled",
        "scaled",
        source,
        bandwidth_scale,
        lambda _family: compute_scale,
        lambda family: family.cache_bytes,
        Roofline(spec.peak_bandwidth_gbps, spec.tensor_tflops),
        device,
        base.pass_fixed_us,
        uncertainty,
        {"device-datasheet": Provenance("datasheet", citation=spec.citation)},
    )
    sources = {key: value for key, value in profile.sources.items() if key in ("scaled", "device-datasheet", dispatch.source)}
    section_sources = {**profile.section_sources, "device": "device-datasheet", "roofline": "device-datasheet"}
    return dataclasses.replace(profile, sources=sources, section_sources=section_sources, dispatch=dispatch)
