"""A hardware profile (contract 4): device facts, roofline, fixed time per pass, kernel families
and the provenance of every number. Built by `fit`, `derive` or read from TOML (`schema`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moesim.errors import InputError
from moesim.hw_profiles.dispatch import Dispatch
from moesim.hw_profiles.families import DenseFamily, ExpertFamily, Roofline
from moesim.hw_profiles.provenance import Provenance
from moesim.hw_profiles.speculative import SpecPath

BACKENDS = ("cuda", "metal", "cpu", "vulkan")
# published-calibrated: fitted on published measurements (data/public-bench), rows listed in its sources.
STATUSES = ("calibrated", "published-calibrated", "datasheet-scaled", "derived")


@dataclass(frozen=True)
class DeviceFacts:
    """What the profile describes: device, backend, memory, cache, and the software it ran."""

    name: str
    backend: str
    memory_gb: float
    l2_cache_bytes: float
    compute_units: int
    engine: str
    engine_version: str
    driver_version: str
    runtime_version: str


@dataclass(frozen=True)
class HardwareProfile:
    """Per-kernel time models of one device with their held-out errors and provenance."""

    name: str
    description: str
    status: str
    device: DeviceFacts
    roofline: Roofline
    pass_fixed_us: float
    expert_families: dict[str, ExpertFamily]
    dense: DenseFamily
    sources: dict[str, Provenance]
    field_sources: dict[str, str]
    notes: tuple[str, ...] = ()
    derived_from: str = ""
    section_sources: dict[str, str] = field(default_factory=dict)
    dispatch: Dispatch | None = None
    partial: bool = False
    speculative: SpecPath | None = None  # the speculative path's own terms (engine profiles; None: O = 0)
    bench_routed_share: float = 1.0  # share of the experts a benchmark's random tokens route to (`whole_pass`; 1: all)

    @property
    def families(self) -> tuple[str, ...]:
        """Names of the families: the expert families, then 'dense'."""
        return (*self.expert_families, "dense")

    @property
    def dedup_families(self) -> tuple[str, ...]:
        """Names of the deduplicating expert families."""
        return tuple(name for name, family in self.expert_families.items() if family.is_dedup)

    def family(self, name: str) -> ExpertFamily | DenseFamily:
        """A family by name ('per_slot', a 'dedup*' name or 'dense')."""
        if name == "dense":
            return self.dense
        try:
            return self.expert_families[name]
        except KeyError:
            raise InputError(f"profile '{self.name}' has no family '{name}' (families: {', '.join(self.families)})") from None

    def expert_family(self, name: str) -> ExpertFamily:
        """An expert family by name (not 'dense')."""
        family = self.family(name)
        if not isinstance(family, ExpertFamily):
            raise InputError(f"family '{name}' of profile '{self.name}' is not an expert family")
        return family

    def all_notes(self) -> tuple[str, ...]:
        """Stored notes plus one per calibrated bandwidth above the device peak (accepted: cache hits)."""
        notes = list(self.notes)
        peak = self.roofline.peak_bandwidth_gbps
        for family in self.expert_families.values():
            for key in ("hbm_bandwidth_gbps", "cache_bandwidth_gbps"):
                value = getattr(family, key)
                if math.isfinite(value) and value > peak:
                    where = f"families.{family.name}.{key}"
                    notes.append(f"{where} = {value:.0f} GB/s exceeds the peak {peak:.0f} GB/s: accepted as cache hits")
        return tuple(notes)

    def provenance_of(self, field_path: str) -> Provenance:
        """Provenance of a number by its TOML path, e.g. 'roofline.peak_bandwidth_gbps'."""
        section = field_path.rsplit(".", 1)[0]
        source = self.field_sources.get(field_path) or self.section_sources.get(section)
        if source is None:
            raise InputError(f"profile '{self.name}': no number '{field_path}'")
        return self.sources[source]
