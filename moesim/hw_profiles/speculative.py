"""The speculative path's own costs: an optional `[speculative]` table of an engine profile (contract 4).

A speculative iteration costs more than its draft forwards and its verify pass: building the tree
mask and positions, tree attention, rejection sampling, rolling the KV cache back, host syncs
between draft steps, a verify pass run outside the graph plain decoding runs in. moesim carries
them as three linear terms, each with what fixed it (`basis`):

    O(steps, tokens) = iteration_us + draft_step_us · steps + verified_token_us · tokens

(tokens: every verified token of the batch, roots included; O = 0 for a plain decode pass), and
`pass_us`, the time every target forward takes on this engine beyond the profile's families (a
whole-model overhead the kernel rows behind the profile do not see, fixed by the runs' plain
decoding): it adds to plain decoding and to every verify pass alike.

    [speculative]
    pass_us = 4600.0
    iteration_us = 4100.0
    draft_step_us = 0.0
    verified_token_us = 0.0
    heldout_error = 0.35          # relative bound on O (its share of the interval)
    covers = "..."                # the engines and drafters of the runs that fixed it
    note = "..."
    source = "spec-runs"          # a [sources] id; per term `<term>_source` may override
    [speculative.basis]           # per term: the data that fixed it, or why it is 0
    iteration_us = "..."

Readers keep reading every profile without it (O = 0). The built-in engine profiles take theirs
from `data/spec_paths.toml`, fitted on the shared speculative runs (`moesim.sim.validate.spec_runs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moesim.errors import ConfigError
from moesim.hw_profiles.provenance import Provenance

SPEC_TERMS = ("pass_us", "iteration_us", "draft_step_us", "verified_token_us")
_KEYS = {*SPEC_TERMS, "heldout_error", "covers", "note", "source", "basis"}


@dataclass(frozen=True)
class SpecPath:
    """The speculative path's terms of one engine on one device, with their provenance."""

    pass_us: float
    iteration_us: float
    draft_step_us: float
    verified_token_us: float
    heldout_error: float
    provenance: Provenance
    basis: dict[str, str] = field(default_factory=dict)
    covers: str = ""
    note: str = ""
    source_id: str = "speculative"

    def overhead_us(self, draft_steps: int, verified_tokens: int) -> float:
        """O = iteration_us + draft_step_us·steps + verified_token_us·tokens; 0 without drafts."""
        if draft_steps <= 0:
            return 0.0
        return self.iteration_us + self.draft_step_us * draft_steps + self.verified_token_us * verified_tokens

    def table(self) -> dict[str, Any]:
        """The TOML table (basis as a sub-table)."""
        return {
            **{term: getattr(self, term) for term in SPEC_TERMS},
            "heldout_error": self.heldout_error,
            "covers": self.covers or None,
            "note": self.note or None,
            "source": self.source_id,
        }


def spec_path_from_table(table: Any, where: str, sources: dict[str, Provenance], fail: Callable[[str, str], ConfigError]) -> SpecPath:
    """A `[speculative]` table checked: finite terms >= 0, a known source, basis texts."""
    if not isinstance(table, dict):
        raise fail(where, "must be a table")
    for key in table:
        if key not in _KEYS:
            raise fail(f"{where}.{key}", f"is unknown (known: {', '.join(sorted(_KEYS))})")
    values = {}
    for key in (*SPEC_TERMS, "heldout_error"):
        value = table.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise fail(f"{where}.{key}", f"must be a finite number >= 0, got {value!r}")
        values[key] = float(value)
    source = table.get("source")
    if source not in sources:
        raise fail(f"{where}.source", f"names unknown source {source!r} (known: {', '.join(sources) or 'none'})")
    basis = table.get("basis", {})
    if not isinstance(basis, dict) or any(k not in SPEC_TERMS or not isinstance(v, str) for k, v in basis.items()):
        raise fail(f"{where}.basis", f"must be a table of {', '.join(SPEC_TERMS)} = text")
    texts = {key: table.get(key, "") for key in ("covers", "note")}
    for key, text in texts.items():
        if not isinstance(text, str):
            raise fail(f"{where}.{key}", f"must be a string, got {text!r}")
    return SpecPath(**values, provenance=sources[source], basis=dict(basis), source_id=source, **texts)
