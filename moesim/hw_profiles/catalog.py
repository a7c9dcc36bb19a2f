"""The device catalog (`data/devices.toml`): datasheet facts and published figures, each cited;
the links between devices and to the host (`data/links.toml`) that devices name; the latency
terms of each fabric's collectives (`data/collectives.toml`, calibrated by
`moesim.sim.validate.collectives` on the shared all-reduce rows)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from moesim.errors import ConfigError


@dataclass(frozen=True)
class DeviceSpec:
    """One device's datasheet facts (dense peaks), with the citation behind them."""

    key: str
    name: str
    aliases: tuple[str, ...]
    backend: str
    memory_gb: float
    l2_cache_bytes: float
    compute_units: int
    peak_bandwidth_gbps: float
    tensor_tflops: float
    vector_tflops: float
    architecture: str
    transfer: float
    citation: str
    published_tokens_per_s: float = 0.0
    published_model_bytes: float = 0.0
    published_citation: str = ""
    peer_link: str = ""
    host_link: str = ""

    @property
    def published_bandwidth_gbps(self) -> float:
        """Effective bandwidth implied by the published decode rate: tokens/s · model bytes (a lower bound)."""
        return self.published_tokens_per_s * self.published_model_bytes / 1e9

    def matches(self, device_name: str) -> bool:
        """Whether a device name (as a runtime reports it) is this device."""
        wanted = device_name.strip().lower()
        return wanted == self.key or any(wanted == alias.lower() for alias in self.aliases)


@dataclass(frozen=True)
class LinkSpec:
    """A link between devices or to the host: bandwidth per direction and the latency of one
    transfer, with the kind of their provenance and the citation; `fabric` (nvlink, pcie, xgmi)
    names the calibrated latency terms its collectives take (`collective_terms`; none: the
    link's own latency per step)."""

    key: str
    name: str
    bandwidth_gbps: float
    latency_us: float
    kind: str
    citation: str
    fabric: str = ""


@dataclass(frozen=True)
class CollectiveTerms:
    """The latency terms of one fabric's collectives: NCCL's per ring step, the engines' custom
    all-reduce's per shot (0: none on this fabric) up to its largest message, each with its
    held-out relative error and where it comes from; `key` is the fabric (nvlink, pcie, xgmi)."""

    key: str
    nccl_step_us: float
    nccl_epsilon: float
    nccl_source: str
    custom_shot_us: float
    custom_epsilon: float
    custom_source: str
    custom_max_bytes: float
    kind: str
    file: str
    sha256: str


def _entries(file: str, cls: type) -> dict:
    data = tomllib.loads(resources.files("moesim.hw_profiles").joinpath("data", file).read_text())
    entries = {}
    for key, table in data.items():
        try:
            entries[key] = cls(key=key, **({**table, "aliases": tuple(table.get("aliases", ()))} if cls is DeviceSpec else table))
        except TypeError as exc:
            raise ConfigError(f"{file}: entry '{key}': {exc}") from None
    return entries


@cache
def catalog() -> dict[str, DeviceSpec]:
    """All catalog entries by key."""
    return _entries("devices.toml", DeviceSpec)


@cache
def links() -> dict[str, LinkSpec]:
    """All link profiles by key."""
    return _entries("links.toml", LinkSpec)


@cache
def collectives() -> dict[str, CollectiveTerms]:
    """The calibrated collective terms by fabric."""
    return _entries("collectives.toml", CollectiveTerms)


def collective_terms(fabric: str) -> CollectiveTerms | None:
    """A fabric's collective terms; None for a link without a fabric (its own latency per step)."""
    return collectives().get(fabric) if fabric else None


def device_of_profile(profile_name: str, device_name: str) -> DeviceSpec | None:
    """The catalog entry a profile describes: by the profile's name (built-in profiles are named
    by their catalog key), else by its device's name or an alias."""
    spec = catalog().get(profile_name)
    if spec is not None:
        return spec
    return next((s for s in catalog().values() if s.name == device_name or s.matches(device_name)), None)


def device_spec(name: str) -> DeviceSpec:
    """A catalog entry by key or alias; an unknown name is one line listing the known keys."""
    spec = catalog().get(name) or lookup_device(name)
    if spec is None:
        raise ConfigError(f"unknown device '{name}' (known: {', '.join(catalog())})")
    return spec


def link_spec(name: str) -> LinkSpec:
    """A link profile by key; an unknown key is one line listing the known ones."""
    if name not in links():
        raise ConfigError(f"unknown link '{name}' (known: {', '.join(links())})")
    return links()[name]


def lookup_device(device_name: str) -> DeviceSpec | None:
    """The catalog entry whose key or alias equals the name (case-insensitive), if any."""
    return next((spec for spec in catalog().values() if spec.matches(device_name)), None)
