"""The calibration grid a profile carries: the knots of a family's lookup ladder.

One knot per (expert shape, n, routing features) of the calibration rows of the family (rows
with equal features merged: mean time, `repeats` rows). A knot keeps what the family's model needs
to be evaluated there again (slots, distinct experts, busiest expert, the tile reads and cached
re-reads the rows' routing implied), so the residual the ladder interpolates is always the
current model's. Knots live inside the profile TOML as columns of `[families.<name>.grid]`
(docs/profiles.md says why: one self-contained file), parsed through `moesim.fields.build`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moesim.fields import require

INTERPOLATION_FEATURES = ("distinct_experts", "max_tokens_per_expert")
COLUMNS = ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert", "chunk_reads", "cached_rereads", "time_us", "repeats")


def shape_label(hidden: float, intermediate: float, expert_bytes: float, top_k: float) -> str:
    """'HIDDENxINTERMEDIATE:BYTES:kK', the key of a calibrated model shape in a grid: its experts'
    shape and its experts per token (two models with equal experts but another top-k route differently)."""
    return f"{int(hidden)}x{int(intermediate)}:{int(expert_bytes)}:k{int(top_k)}"


def shape_groups(
    n_tokens: np.ndarray, slots: np.ndarray, hidden: np.ndarray, intermediate: np.ndarray, expert_bytes: np.ndarray
) -> list[tuple[str | None, np.ndarray]]:
    """(grid shape label, mask) of every distinct expert shape and top-k among a family's inputs."""
    top_k = np.round(slots / np.maximum(n_tokens, 1.0))
    columns = [np.broadcast_to(a, top_k.shape).ravel() for a in (hidden, intermediate, expert_bytes, top_k)]
    if all(column.size == 0 or (column == column[0]).all() for column in columns):  # one shape: no masks
        return [(shape_label(*(float(c[0]) if c.size else 0.0 for c in columns)), np.ones(top_k.shape, bool))]
    unique, inverse = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)
    inverse = inverse.reshape(top_k.shape)
    return [(shape_label(*row), inverse == i) for i, row in enumerate(unique)]


def _is_label(label: str) -> bool:
    parts = label.split(":")
    sizes = parts[0].split("x")
    return (
        len(parts) == 3
        and len(sizes) == 2
        and all(p.isdigit() for p in (*sizes, parts[1]))
        and parts[2][:1] == "k"
        and parts[2][1:].isdigit()
    )


@dataclass(frozen=True)
class GridTable:
    """`[families.<name>.grid]`: the knots as columns of equal length (TOML arrays)."""

    source: str
    interpolate: tuple[str, ...]
    shape: tuple[str, ...]
    n_tokens: tuple[int, ...]
    slots: tuple[int, ...]
    distinct_experts: tuple[int, ...]
    max_tokens_per_expert: tuple[int, ...]
    chunk_reads: tuple[float, ...]
    cached_rereads: tuple[float, ...]
    time_us: tuple[float, ...]
    repeats: tuple[int, ...]

    def __post_init__(self) -> None:
        require(bool(self.interpolate) and set(self.interpolate) <= set(INTERPOLATION_FEATURES), "interpolate",
                f"must list features among {', '.join(INTERPOLATION_FEATURES)}, got {list(self.interpolate)}")  # fmt: skip
        require(len(self.interpolate) <= 2, "interpolate", "interpolates in at most two features")
        rows = len(self.shape)
        for name in COLUMNS:
            values = getattr(self, name)
            require(len(values) == rows, name, f"holds {len(values)} values, but 'shape' holds {rows}: one per knot")
            require(all(math.isfinite(v) and v >= 0 for v in values), name, "must hold finite numbers >= 0")
        for name in ("n_tokens", "slots", "time_us", "repeats"):
            require(all(v > 0 for v in getattr(self, name)), name, "must hold numbers > 0")
        for label in set(self.shape):
            require(_is_label(label), "shape", f"'{label}' is not HIDDENxINTERMEDIATE:BYTES:kTOPK")


@dataclass(frozen=True)
class CalibrationGrid:
    """The knots of one family as arrays (see `GridTable`), with lookups per (shape, n)."""

    interpolate: tuple[str, ...]
    shape: np.ndarray  # (k,) str labels
    n_tokens: np.ndarray
    slots: np.ndarray
    distinct_experts: np.ndarray
    max_tokens_per_expert: np.ndarray
    chunk_reads: np.ndarray
    cached_rereads: np.ndarray
    time_us: np.ndarray
    repeats: np.ndarray

    @classmethod
    def from_table(cls, table: GridTable) -> CalibrationGrid:
        """Arrays of a parsed grid table."""
        arrays = {name: np.asarray(getattr(table, name), np.float64) for name in COLUMNS}
        return cls(table.interpolate, np.asarray(table.shape, dtype=object), **arrays)

    def to_table(self, source: str) -> dict[str, object]:
        """The TOML table (integers where the column counts)."""
        out: dict[str, object] = {"source": source, "interpolate": list(self.interpolate), "shape": [str(s) for s in self.shape]}
        for name in COLUMNS:
            values = getattr(self, name)
            integer = name in ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert", "repeats")
            out[name] = [int(v) for v in values] if integer else [float(v) for v in values]
        return out

    @property
    def shapes(self) -> tuple[str, ...]:
        """The expert shapes the grid holds, in first-seen order."""
        return tuple(dict.fromkeys(self.shape.tolist()))

    def knots(self, label: str, n_tokens: float) -> np.ndarray:
        """Indices of the knots of one shape and pass size."""
        return np.flatnonzero((self.shape == label) & (self.n_tokens == n_tokens))

    def features(self, index: np.ndarray) -> np.ndarray:
        """(len(index), d) interpolation features of knots."""
        return np.column_stack([getattr(self, name)[index] for name in self.interpolate])


def merged_knots(columns: dict[str, np.ndarray], shape: np.ndarray, interpolate: tuple[str, ...]) -> CalibrationGrid:
    """Knots from calibration rows: rows of one shape and n with equal interpolation features are
    one knot (mean of every column, `repeats` rows)."""
    keys = np.column_stack([shape.astype(str), *(columns[name].astype(np.float64).astype(str) for name in ("n_tokens", *interpolate))])
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(first, kind="stable")  # knots in the rows' order
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    group = rank[inverse]
    repeats = np.bincount(group).astype(np.float64)
    means = {name: np.bincount(group, columns[name].astype(np.float64)) / repeats for name in COLUMNS if name != "repeats"}
    return CalibrationGrid(interpolate, shape[first[order]], repeats=repeats, **means)
