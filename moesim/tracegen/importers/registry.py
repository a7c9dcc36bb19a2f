"""The registry of routing importers (one class per source)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Protocol

from moesim.errors import InputError
from moesim.registry import Registry
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace


class RoutingImporter(Protocol):
    """What every importer provides."""

    name: ClassVar[str]

    def read(self, path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
        """The routing at `path` as a validated trace of `geometry`."""
        ...


ROUTING_SOURCES: Registry[RoutingImporter] = Registry("routing source", InputError)
