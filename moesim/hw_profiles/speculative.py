"""The engine's time beyond the kernels and the speculative path's own costs: an optional
`[speculative]` table of an engine profile (contract 4; issue 24 generalised it to every forward).

A forward of an engine costs more than its kernels: the host's scheduling, input preparation and
sampling every iteration (`pass_us`), and, when the pass runs eager (no CUDA graph: the engine
never captures one, or the pass is wider than the largest size it captured, or a verify pass the
engine runs outside its graph), every layer's kernel launches (`launch_us_per_layer`):

    E(n, layers) = pass_us + launch_us_per_layer · layers · [n > graph_max_tokens]

A speculative iteration adds what its draft forwards and its verify pass do not show (building
the tree, rejection sampling, rolling the KV cache back, host syncs between draft steps); a draft
*model* is a whole forward with its own per-forward time (`draft_model_layers` > 0 adds E of its
layers to every draft step):

    O(steps, tokens) = iteration_us + steps · (draft_step_us + E_draft) + verified_token_us · tokens
                       + launch_us_per_layer · layers · [verify_eager and tokens <= graph_max_tokens]

(tokens: every verified token of the batch, roots included; O = 0 for a plain decode pass; the
last term: a verify pass the engine runs outside its graph though its size was captured; vLLM
V0's batch-expansion scoring shows as a larger `verified_token_us`). Both are linear in the terms,
so a fit reads each term's coefficient from these formulas at unit terms (`unit`). Each term has its kind
(`kinds`: calibrated, transferred, published, assumed) and its relative uncertainty (`uncertainty`,
a half-width: the term lies in value · (1 ± u)); `heldout_error` bounds what the terms leave out.

    [speculative]
    engine = "vLLM V1"            # the engine and version the terms describe
    pass_us = 1700.0
    launch_us_per_layer = 0.0
    graph_max_tokens = 512        # 0: the engine runs every forward eager
    verify_eager = false
    iteration_us = 300.0
    draft_step_us = 0.0
    verified_token_us = 0.0
    heldout_error = 0.35          # relative bound on E + O beyond the terms' own uncertainty
    covers = "..."                # the engines and drafters of the runs that fixed it
    note = "..."
    source = "spec-runs"          # a [sources] id
    [speculative.basis]           # per term: the data that fixed it, or why it is 0
    iteration_us = "..."
    [speculative.uncertainty]     # per term: relative half-width
    pass_us = 0.2
    [speculative.kinds]           # per term: calibrated | transferred | published | assumed
    pass_us = "calibrated"

Readers keep reading every profile without it (E = O = 0) and every table written before issue 24
(its new keys default to no launches and no eager verify). The built-in engine profiles take
theirs from `data/spec_paths.toml`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moesim.errors import ConfigError
from moesim.hw_profiles.provenance import Provenance

SPEC_TERMS = ("pass_us", "launch_us_per_layer", "draft_step_us", "iteration_us", "verified_token_us")
TERM_KINDS = ("calibrated", "transferred", "published", "assumed")
_FLAGS = ("graph_max_tokens", "verify_eager", "engine")
_KEYS = {*SPEC_TERMS, *_FLAGS, "heldout_error", "covers", "note", "source", "basis", "uncertainty", "kinds"}
NO_GRAPH_LIMIT = 1 << 30  # graph_max_tokens of a table that names none: every forward priced as captured


@dataclass(frozen=True)
class SpecPath:
    """The engine's terms beyond the kernels on one device, with their provenance and uncertainty."""

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
    launch_us_per_layer: float = 0.0
    graph_max_tokens: int = NO_GRAPH_LIMIT
    verify_eager: bool = False
    engine: str = ""
    uncertainty: dict[str, float] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)

    def eager(self, n_tokens: int) -> bool:
        """Whether a forward of n tokens runs outside the graph (wider than the largest captured)."""
        return n_tokens > self.graph_max_tokens

    def forward_us(self, n_tokens: int, layers: int, scale: dict[str, float] | None = None, eager: bool | None = None) -> float:
        """E = pass_us + launch_us_per_layer·layers when the forward of n tokens runs eager (`eager`
        as measured, else beyond the captured sizes); each term times scale[term] (default 1)."""
        s = scale or {}
        run_eager = self.eager(n_tokens) if eager is None else eager
        launches = self.launch_us_per_layer * s.get("launch_us_per_layer", 1.0) * layers if run_eager else 0.0
        return self.pass_us * s.get("pass_us", 1.0) + launches

    def overhead_us(
        self,
        draft_steps: int,
        verified_tokens: int,
        draft_model_layers: int = 0,
        draft_rows: int = 1,
        target_layers: int = 0,
        scale: dict[str, float] | None = None,
    ) -> float:
        """O = iteration_us + steps·(draft_step_us + E_draft) + verified_token_us·tokens, plus the
        target's launches when its verify runs eager inside the captured sizes; 0 without drafts."""
        if draft_steps <= 0:
            return 0.0
        s = scale or {}
        step = self.draft_step_us * s.get("draft_step_us", 1.0)
        if draft_model_layers:
            step += self.forward_us(draft_rows, draft_model_layers, s)
        iteration = self.iteration_us * s.get("iteration_us", 1.0) + step * draft_steps
        if self.verify_eager and not self.eager(verified_tokens):
            iteration += self.launch_us_per_layer * s.get("launch_us_per_layer", 1.0) * target_layers
        return iteration + self.verified_token_us * s.get("verified_token_us", 1.0) * verified_tokens

    def unit(self, term: str) -> SpecPath:
        """These flags with `term` = 1 and every other term 0: E and O at it are that term's coefficient."""
        ones = {t: float(t == term) for t in SPEC_TERMS}
        return dataclasses.replace(self, **ones)

    def uncertain_terms(self) -> tuple[str, ...]:
        """The nonzero terms with an uncertainty."""
        return tuple(t for t in SPEC_TERMS if getattr(self, t) > 0 and self.uncertainty.get(t, 0.0) > 0)

    def extreme_scale(self, sign: float) -> dict[str, float]:
        """Every term at (1 + sign·its uncertainty)·(1 + sign·heldout_error): the low (−1) or high (+1) end of E and O."""
        return {t: (1.0 + sign * self.uncertainty.get(t, 0.0)) * (1.0 + sign * self.heldout_error) for t in SPEC_TERMS}

    def corner_scales(self, only: str | None = None) -> list[dict[str, float]]:
        """Every corner of the terms' box as scales: each uncertain term at (1 ± its uncertainty),
        every term at (1 ± heldout_error) besides; `only`: that term's two ends alone ('heldout_error'
        for the common factor)."""
        if only is not None:
            if only == "heldout_error":
                return [dict.fromkeys(SPEC_TERMS, 1.0 + s * self.heldout_error) for s in (-1.0, 1.0)]
            return [{only: 1.0 + s * self.uncertainty.get(only, 0.0)} for s in (-1.0, 1.0)]
        terms = self.uncertain_terms()
        out = []
        for signs in itertools.product((-1.0, 1.0), repeat=len(terms)):
            for h in (-1.0, 1.0) if self.heldout_error else (0.0,):
                common = 1.0 + h * self.heldout_error
                scale = dict.fromkeys(SPEC_TERMS, common)
                scale.update({t: (1.0 + s * self.uncertainty[t]) * common for t, s in zip(terms, signs, strict=True)})
                out.append(scale)
        return out

    def table(self) -> dict[str, Any]:
        """The TOML table (basis, uncertainty and kinds as sub-tables)."""
        flags: dict[str, Any] = {"engine": self.engine or None, "verify_eager": self.verify_eager}
        if self.graph_max_tokens != NO_GRAPH_LIMIT:
            flags["graph_max_tokens"] = self.graph_max_tokens
        return {
            **flags,
            **{term: getattr(self, term) for term in SPEC_TERMS},
            "heldout_error": self.heldout_error,
            "covers": self.covers or None,
            "note": self.note or None,
            "source": self.source_id,
        }

    def sub_tables(self) -> dict[str, dict[str, Any]]:
        """basis, uncertainty and kinds (those that are not empty)."""
        tables = {"basis": self.basis, "uncertainty": self.uncertainty, "kinds": self.kinds}
        return {name: dict(table) for name, table in tables.items() if table}


def spec_path_from_table(table: Any, where: str, sources: dict[str, Provenance], fail: Callable[[str, str], ConfigError]) -> SpecPath:
    """A `[speculative]` table checked: finite terms >= 0, a known source, basis texts, per-term uncertainties and kinds."""
    if not isinstance(table, dict):
        raise fail(where, "must be a table")
    for key in table:
        if key not in _KEYS:
            raise fail(f"{where}.{key}", f"is unknown (known: {', '.join(sorted(_KEYS))})")
    values: dict[str, Any] = {}
    for key in (*SPEC_TERMS, "heldout_error"):
        value = table.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise fail(f"{where}.{key}", f"must be a finite number >= 0, got {value!r}")
        values[key] = float(value)
    graph = table.get("graph_max_tokens", NO_GRAPH_LIMIT)
    if isinstance(graph, bool) or not isinstance(graph, int) or graph < 0:
        raise fail(f"{where}.graph_max_tokens", f"must be an integer >= 0, got {graph!r}")
    eager = table.get("verify_eager", False)
    if not isinstance(eager, bool):
        raise fail(f"{where}.verify_eager", f"must be true or false, got {eager!r}")
    source = table.get("source")
    if source not in sources:
        raise fail(f"{where}.source", f"names unknown source {source!r} (known: {', '.join(sources) or 'none'})")
    basis = table.get("basis", {})
    if not isinstance(basis, dict) or any(k not in SPEC_TERMS or not isinstance(v, str) for k, v in basis.items()):
        raise fail(f"{where}.basis", f"must be a table of {', '.join(SPEC_TERMS)} = text")
    spread = table.get("uncertainty", {})
    if not isinstance(spread, dict) or any(
        k not in SPEC_TERMS or isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf for k, v in spread.items()
    ):
        raise fail(f"{where}.uncertainty", f"must be a table of {', '.join(SPEC_TERMS)} = a finite number >= 0")
    kinds = table.get("kinds", {})
    if not isinstance(kinds, dict) or any(k not in SPEC_TERMS or v not in TERM_KINDS for k, v in kinds.items()):
        raise fail(f"{where}.kinds", f"must be a table of {', '.join(SPEC_TERMS)} = one of {', '.join(TERM_KINDS)}")
    texts = {key: table.get(key, "") for key in ("covers", "note", "engine")}
    for key, text in texts.items():
        if not isinstance(text, str):
            raise fail(f"{where}.{key}", f"must be a string, got {text!r}")
    return SpecPath(
        **values,
        provenance=sources[source],
        basis=dict(basis),
        source_id=source,
        graph_max_tokens=graph,
        verify_eager=eager,
        uncertainty={k: float(v) for k, v in spread.items()},
        kinds=dict(kinds),
        **texts,
    )
