"""The step-time model's per-(U, M) layer tables (`StepTimeModel.layer_time_table`: time_us of one
MoE layer for every distinct-expert count U = 0..E and max tokens per expert M = 0..n at a pass
of n tokens), kept once per process and in the disk cache (`moesim.cache`), so that the cells of
a sweep, its workers and later runs build each table once.

A table is a pure function of the family's definition at the weight format (every field of the
profile's family: its fit, knots, shape fits, bounds), the expert shape, the number of experts,
top-k and n: that is its key, never a profile's name or path. A process keeps up to
KEPT_BYTES of tables (the oldest dropped first); the disk keeps what `moesim.cache` bounds. How
often a size was priced without tables is counted over every model of the process (the cells of
a sweep), so a size gets its tables after TABLE_AFTER_PASSES such passes in all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moesim.cache import CacheGroup, content_digest, group
from moesim.hw_profiles.families import ExpertFamily
from moesim.models import ExpertShape

KIND = "layer-tables"
KEPT_BYTES = 512 * 2**20  # tables a process keeps in memory, over all families
_MEMORY: dict[tuple[str, int], np.ndarray] = {}
_HELD = {"bytes": 0}
_PRICED: dict[tuple[str, int], int] = {}  # passes of a size priced without tables, over every model of the process
_DIGESTS: dict[int, tuple[ExpertFamily, str]] = {}  # id → (the family, kept alive so its id is not reused; its digest)


def _family_digest(family: ExpertFamily) -> str:
    entry = _DIGESTS.get(id(family))
    if entry is None or entry[0] is not family:
        if len(_DIGESTS) >= 256:
            _DIGESTS.clear()
        entry = _DIGESTS[id(family)] = (family, content_digest(family))
    return entry[1]


@dataclass
class FamilyTables:
    """The tables of one family at one expert shape, experts and top-k, per pass size."""

    key: str
    experts: int
    disk: CacheGroup | None
    _on_disk: set[int] | None = field(default=None, init=False)

    @classmethod
    def of(cls, family: ExpertFamily, shape: ExpertShape, experts: int, top_k: int) -> FamilyTables:
        """The tables of `family` (as the step-time model passes it, before its weight format's rates) for the shape."""
        parts = (_family_digest(family), shape, experts, top_k)
        return cls(content_digest(*parts), experts, group(KIND, *parts))

    def cached_sizes(self) -> set[int]:
        """Pass sizes whose tables this process holds or the disk cache lists (read when first asked)."""
        if self._on_disk is None:
            names = self.disk.names() if self.disk is not None else set()
            self._on_disk = {int(name[1:]) for name in names if name[:1] == "n" and name[1:].isdigit()}
        return self._on_disk | {n for key, n in _MEMORY if key == self.key}

    def count_pass(self, n_tokens: int) -> int:
        """Count one pass of this size priced without tables, by any model of the process; returns the count so far."""
        count = _PRICED[(self.key, n_tokens)] = _PRICED.get((self.key, n_tokens), 0) + 1
        return count

    def table(self, n_tokens: int, build: Callable[[], np.ndarray]) -> np.ndarray:
        """The (E + 1, n + 1) table of a pass size: from this process, else the disk, else `build()` (then kept in both)."""
        table = _MEMORY.get((self.key, n_tokens))
        if table is not None:
            return table
        shape = (self.experts + 1, n_tokens + 1)
        name = f"n{n_tokens}"
        loaded = self.disk.load(name, {"time_us": (shape, np.dtype(np.float64))}) if self.disk is not None else None
        if loaded is not None:
            table = loaded["time_us"]
        else:
            table = np.ascontiguousarray(build(), np.float64)
            if table.shape != shape:
                raise ValueError(f"layer table of shape {table.shape}, expected {shape}")
            if self.disk is not None:
                self.disk.store(name, {"time_us": table})
        table.setflags(write=False)  # shared by every model of the process
        _keep(self.key, n_tokens, table)
        return table


def _keep(key: str, n_tokens: int, table: np.ndarray) -> None:
    while _MEMORY and _HELD["bytes"] + table.nbytes > KEPT_BYTES:
        _HELD["bytes"] -= _MEMORY.pop(next(iter(_MEMORY))).nbytes
    _MEMORY[(key, n_tokens)] = table
    _HELD["bytes"] += table.nbytes
