"""The device catalog (`data/devices.toml`): datasheet facts and published figures, each cited."""

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

    @property
    def published_bandwidth_gbps(self) -> float:
        """Effective bandwidth implied by the published decode rate: tokens/s · model bytes (a lower bound)."""
        return self.published_tokens_per_s * self.published_model_bytes / 1e9

    def matches(self, device_name: str) -> bool:
        """Whether a device name (as a runtime reports it) is this device."""
        wanted = device_name.strip().lower()
        return wanted == self.key or any(wanted == alias.lower() for alias in self.aliases)


@cache
def catalog() -> dict[str, DeviceSpec]:
    """All catalog entries by key."""
    data = tomllib.loads(resources.files("moesim.hw_profiles").joinpath("data", "devices.toml").read_text())
    specs = {}
    for key, table in data.items():
        try:
            specs[key] = DeviceSpec(key=key, **{**table, "aliases": tuple(table.get("aliases", ()))})
        except TypeError as exc:
            raise ConfigError(f"devices.toml: entry '{key}': {exc}") from None
    return specs


def lookup_device(device_name: str) -> DeviceSpec | None:
    """The catalog entry whose key or alias equals the name (case-insensitive), if any."""
    return next((spec for spec in catalog().values() if spec.matches(device_name)), None)
