"""An engine's dispatch: which kernel family runs a pass of n tokens in a weight format.

A serving engine does not let the user pick its MoE kernel: llama.cpp's CUDA backend runs a
mat-vec kernel per token slot (MMVQ) up to a few tokens and a mat-mat kernel (MMQ, MMF) above,
Metal switches from `mul_mv_id` to `mul_mm_id` at 32 tokens, MLX sorts tokens for `gather_qmm`
once there are enough of them per expert, vLLM's fused MoE picks its block size by the number of
tokens against the number of experts. A `Dispatch` is that choice as data: an ordered list of
rules, the first one whose conditions hold names the family. Conditions (all that are given must
hold), for a pass of n tokens, top-k K and E experts:

    weight format in `formats` (empty: every format)
    min_tokens <= n <= max_tokens                   (0: no upper bound)
    min_slots <= n·K <= max_slots (0: no bound),  n·K/E >= min_slots_per_expert
    n / E <= max_tokens_per_expert                  (0: no bound)

TOML (contract 4, optional table of an engine profile):

    [dispatch]
    source = "engine-source"          # the sources entry citing the engine's code
    [[dispatch.rules]]
    family = "per_slot"
    formats = ["Q4_0", "Q4_K"]
    max_tokens = 8
    [[dispatch.rules]]
    family = "dedup_mmq"
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesim.errors import ConfigError, InputError

_INT_CONDITIONS = ("min_tokens", "max_tokens", "min_slots", "max_slots")
_FLOAT_CONDITIONS = ("min_slots_per_expert", "max_tokens_per_expert")


@dataclass(frozen=True)
class DispatchRule:
    """One rule: the family it names and the conditions under which the engine runs it."""

    family: str
    formats: tuple[str, ...] = ()
    min_tokens: int = 1
    max_tokens: int = 0
    min_slots: int = 0
    max_slots: int = 0
    min_slots_per_expert: float = 0.0
    max_tokens_per_expert: float = 0.0
    note: str = ""

    def applies(self, weight_format: str, n_tokens: np.ndarray, experts: int, top_k: int) -> np.ndarray:
        """Whether the rule holds for each pass size (bool array of n_tokens' shape)."""
        n = np.asarray(n_tokens, np.float64)
        if self.formats and weight_format.upper() not in self.formats:
            return np.zeros(n.shape, bool)
        ok = n >= self.min_tokens
        if self.max_tokens:
            ok &= n <= self.max_tokens
        ok &= n * top_k >= self.min_slots
        if self.max_slots:
            ok &= n * top_k <= self.max_slots
        ok &= n * top_k / experts >= self.min_slots_per_expert - 1e-12
        if self.max_tokens_per_expert:
            ok &= n / experts <= self.max_tokens_per_expert + 1e-12
        return ok

    def to_table(self) -> dict[str, Any]:
        """The rule as TOML keys (defaults left out)."""
        table: dict[str, Any] = {"family": self.family}
        if self.formats:
            table["formats"] = list(self.formats)
        for key in (*_INT_CONDITIONS, *_FLOAT_CONDITIONS):
            value = getattr(self, key)
            if value != DispatchRule.__dataclass_fields__[key].default:
                table[key] = value
        if self.note:
            table["note"] = self.note
        return table


@dataclass(frozen=True)
class Dispatch:
    """The ordered rules of an engine's kernel choice, and the source that backs them."""

    rules: tuple[DispatchRule, ...]
    source: str
    families: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "families", tuple(dict.fromkeys(rule.family for rule in self.rules)))

    def family_for(self, weight_format: str, n_tokens: np.ndarray | float, experts: int, top_k: int) -> np.ndarray:
        """The family the engine runs for each pass size (first rule that holds); one line when none does."""
        n = np.atleast_1d(np.asarray(n_tokens, np.float64))
        chosen = np.full(n.shape, "", dtype=object)
        for rule in self.rules:
            fresh = (chosen == "") & rule.applies(weight_format, n, experts, top_k)
            chosen[fresh] = rule.family
        missing = np.flatnonzero(chosen == "")
        if missing.size:
            raise InputError(
                f"the engine's dispatch names no kernel for weight format {weight_format} at {int(n.flat[missing[0]])} tokens per pass"
            )
        return chosen.astype(str).reshape(np.shape(n_tokens))

    def families_for(self, weight_format: str) -> tuple[str, ...]:
        """Families some rule can choose for a weight format."""
        fmt = weight_format.upper()
        return tuple(dict.fromkeys(r.family for r in self.rules if not r.formats or fmt in r.formats))

    def switches(self, weight_format: str, experts: int, top_k: int, max_tokens: int) -> list[tuple[int, str, str]]:
        """(n, family below, family from n) wherever the chosen family changes for n = 2..max_tokens."""
        n = np.arange(1, max_tokens + 1)
        chosen = self.family_for(weight_format, n, experts, top_k)
        return [(int(n[i]), str(chosen[i - 1]), str(chosen[i])) for i in range(1, len(n)) if chosen[i] != chosen[i - 1]]


def _fail(origin: str, path: str, message: str) -> ConfigError:
    return ConfigError(f"{origin}: field '{path}' {message}")


def _rule_from_table(table: Any, path: str, origin: str, families: tuple[str, ...]) -> DispatchRule:
    if not isinstance(table, dict):
        raise _fail(origin, path, "must be a table")
    allowed = {"family", "formats", "note", *_INT_CONDITIONS, *_FLOAT_CONDITIONS}
    for key in table:
        if key not in allowed:
            raise _fail(origin, f"{path}.{key}", "is unknown")
    family = table.get("family")
    if family not in families:
        raise _fail(origin, f"{path}.family", f"names {family!r}, not a family of this profile ({', '.join(families)})")
    formats = table.get("formats", [])
    if not isinstance(formats, list) or not all(isinstance(f, str) and f for f in formats):
        raise _fail(origin, f"{path}.formats", f"must be a list of weight format names, got {formats!r}")
    values: dict[str, Any] = {"family": family, "formats": tuple(f.upper() for f in formats), "note": str(table.get("note", ""))}
    for key in _INT_CONDITIONS:
        if key in table:
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _fail(origin, f"{path}.{key}", f"must be an integer >= 0, got {value!r}")
            values[key] = value
    for key in _FLOAT_CONDITIONS:
        if key in table:
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise _fail(origin, f"{path}.{key}", f"must be a finite number >= 0, got {value!r}")
            values[key] = float(value)
    rule = DispatchRule(**values)
    if rule.max_tokens and rule.max_tokens < rule.min_tokens:
        raise _fail(origin, f"{path}.max_tokens", f"({rule.max_tokens}) is below min_tokens ({rule.min_tokens})")
    return rule


def dispatch_from_table(table: Any, origin: str, sources: dict[str, object], families: tuple[str, ...]) -> Dispatch:
    """Read and check a profile's [dispatch] table (rules name the profile's own families)."""
    if not isinstance(table, dict):
        raise _fail(origin, "dispatch", "must be a table")
    for key in table:
        if key not in ("source", "rules"):
            raise _fail(origin, f"dispatch.{key}", "is unknown")
    source = table.get("source")
    if source not in sources:
        raise _fail(origin, "dispatch.source", f"names unknown source {source!r} (known: {', '.join(sources) or 'none'})")
    rules = table.get("rules")
    if not isinstance(rules, list) or not rules:
        raise _fail(origin, "dispatch.rules", "must be a non-empty list of rules")
    return Dispatch(tuple(_rule_from_table(rule, f"dispatch.rules[{i}]", origin, families) for i, rule in enumerate(rules)), source)


def dispatch_lines(dispatch: Dispatch) -> list[str]:
    """The [dispatch] table as TOML lines."""
    lines = ["", "[dispatch]", f"source = {json.dumps(dispatch.source)}"]
    for rule in dispatch.rules:
        lines.extend(["", "[[dispatch.rules]]"])
        for key, value in rule.to_table().items():
            lines.append(f"{key} = {json.dumps(value, ensure_ascii=False)}")
    return lines
