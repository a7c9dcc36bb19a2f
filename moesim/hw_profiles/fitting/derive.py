"""Profiles for hardware nobody measured here: a calibrated profile scaled.

`derive_profile` is the what-if: bandwidth terms × X, compute terms × Y, optionally a new fixed
time per pass. `profile_for_device` scales the calibrated H200 profile to a catalog device:
bandwidth by the ratio of effective bandwidths (datasheet peak × effective fraction), compute
by the ratio of the peaks the kernel runs on (FP32 cores for the hand-written per-slot and dedup
kernels, tensor cores for GEMM-based ones), the cache by the device's L2; fixed and serial-path
times are kept. Each scaled profile carries the base's held-out errors plus an assumed transfer
uncertainty, so its ε is wider than the calibrated one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from moesim.errors import InputError
from moesim.hw_profiles.catalog import DeviceSpec, catalog
from moesim.hw_profiles.families import ExpertFamily, Roofline
from moesim.hw_profiles.fitting.calibrate import CACHE_SHARE
from moesim.hw_profiles.profile import DeviceFacts, HardwareProfile
from moesim.hw_profiles.provenance import Provenance

TENSOR_FAMILIES = ("dedup_grouped_gemm", "dedup_loop")


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
        cache_bytes=cache_bytes,
        compute_tflops=tuple(rate * compute_scale for rate in family.compute_tflops),
        roofline=roofline,
        heldout_error=heldout,
        provenance=provenance,
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
        notes=(),
        derived_from=base.name,
        section_sources=section_sources,
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
    return _scale(
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


def effective_fraction(spec: DeviceSpec, base_spec: DeviceSpec, base: HardwareProfile) -> tuple[float, str, str]:
    """Effective/peak bandwidth of a device, the kind of evidence, and how it was obtained.

    CUDA: the base device's measured read-ceiling fraction (assumed to carry over; published
    llama.cpp decode rates are only lower bounds there, dominated by per-token overhead on fast
    GPUs). Metal: the published llama.cpp decode rate × model bytes / peak (a conservative lower
    bound), or the mean of the Metal devices that have one.
    """
    base_fraction = base.dense.bandwidth_gbps / base_spec.peak_bandwidth_gbps
    if spec.backend != "metal":
        return base_fraction, "assumed", f"effective/peak bandwidth {base_fraction:.3f} as measured on the {base_spec.name} (read ceiling)"
    if spec.published_tokens_per_s:
        fraction = spec.published_bandwidth_gbps / spec.peak_bandwidth_gbps
        return fraction, "published", f"effective/peak bandwidth {fraction:.3f} from {spec.published_citation}"
    published = [
        s.published_bandwidth_gbps / s.peak_bandwidth_gbps for s in catalog().values() if s.backend == "metal" and s.published_tokens_per_s
    ]
    fraction = sum(published) / len(published)
    return fraction, "assumed", f"effective/peak bandwidth {fraction:.3f}: mean of the Metal devices with a published llama.cpp decode rate"


def profile_for_device(base: HardwareProfile, spec: DeviceSpec, base_spec: DeviceSpec) -> HardwareProfile:
    """The calibrated base profile scaled to a catalog device (status 'datasheet-scaled')."""
    fraction, kind, how = effective_fraction(spec, base_spec, base)
    bandwidth_scale = spec.peak_bandwidth_gbps * fraction / base.dense.bandwidth_gbps

    def compute_scale(family: str) -> float:
        if family == "dense" or family in TENSOR_FAMILIES:
            return spec.tensor_tflops / base_spec.tensor_tflops
        return spec.vector_tflops / base_spec.vector_tflops

    note = (
        f"{base.name} calibration scaled to {spec.name}: bandwidths x{bandwidth_scale:.4f} ({how}), FP32-core compute "
        f"x{spec.vector_tflops / base_spec.vector_tflops:.4f}, tensor compute x{spec.tensor_tflops / base_spec.tensor_tflops:.4f}, "
        f"cache = half the L2, fixed and serial-path times kept from the {base_spec.name}; uncertain: relative transfer "
        f"uncertainty {spec.transfer:.2f} assumed ({spec.architecture} vs the calibrated device)"
    )
    extra = {"device-datasheet": Provenance("datasheet", citation=spec.citation)}
    if kind == "published":
        extra["published-decode"] = Provenance("published", citation=spec.published_citation)
    source = Provenance("assumed", note=note)
    device = DeviceFacts(
        spec.name,
        spec.backend,
        spec.memory_gb,
        spec.l2_cache_bytes,
        spec.compute_units,
        engine="not measured: kernels as calibrated on the base device",
        engine_version="",
        driver_version="",
        runtime_version="",
    )
    roofline = Roofline(spec.peak_bandwidth_gbps, spec.tensor_tflops)
    profile = _scale(
        base,
        spec.key,
        f"{spec.name}: datasheet-scaled from the {base_spec.name} calibration (uncertain)",
        "datasheet-scaled",
        "scaled",
        source,
        bandwidth_scale,
        compute_scale,
        lambda _family: CACHE_SHARE * spec.l2_cache_bytes,
        roofline,
        device,
        base.pass_fixed_us,
        spec.transfer,
        extra,
    )
    section_sources = {**profile.section_sources, "device": "device-datasheet", "roofline": "device-datasheet"}
    field_sources = {"families.dense.bandwidth_gbps": "published-decode"} if kind == "published" else {}
    return dataclasses.replace(profile, section_sources=section_sources, field_sources=field_sources)
