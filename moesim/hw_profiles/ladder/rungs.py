"""The rungs: which one a layer's prediction comes from, and the error bound of each.

`ladder_times` picks, for layers of one expert shape and pass size, the first rung that applies
(see the package docstring) from the knots' measured and fitted times and the layers' fitted times.
A rung's bound is its own held-out error (`RungErrors`, docs/profiles.md): `one_layer` from the
calibration table, `whole_pass` (where the profile was fitted with whole passes) from passes of
models the fit never saw, grouped by the rung that produced most of a pass's time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moesim.fields import require
from moesim.hw_profiles.ladder.interpolate import TOLERANCE, barycentric

RUNGS = ("exact", "interpolated", "fitted", "extrapolated")
EXACT, INTERPOLATED, FITTED, EXTRAPOLATED = range(4)


def ladder_times(
    knot_features: np.ndarray,
    knot_measured_us: np.ndarray,
    knot_fitted_us: np.ndarray,
    features: np.ndarray,
    fitted_us: np.ndarray,
    extrapolated: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(time, rung index) of layers (q,) with interpolation features (q, d), given the knots (k, d)
    of their shape and n. Interpolated: fitted + Σ_k w_k·(measured_k − fitted_k); exact: measured_k."""
    time = np.asarray(fitted_us, np.float64).copy()
    rung = np.where(extrapolated, EXTRAPOLATED, FITTED).astype(np.int8)
    candidates = ~np.asarray(extrapolated, bool)
    if knot_features.shape[0] == 0 or not candidates.any():
        return time, rung
    rows = np.flatnonzero(candidates)
    weights, inside = barycentric(knot_features, features[rows])
    rows, weights = rows[inside], weights[inside]
    time[rows] = fitted_us[rows] + weights @ (knot_measured_us - knot_fitted_us)
    rung[rows] = INTERPOLATED
    exact = weights.max(axis=1, initial=0.0) >= 1.0 - TOLERANCE
    time[rows[exact]] = weights[exact] @ knot_measured_us
    rung[rows[exact]] = EXACT
    return time, rung


@dataclass(frozen=True)
class Stats:
    """Absolute relative errors of a rung: median, p90, max and rows (fractions, not %)."""

    median: float
    p90: float
    max: float
    rows: int

    def __post_init__(self) -> None:
        for name in ("median", "p90", "max"):
            value = getattr(self, name)
            require(np.isfinite(value) and value >= 0, name, f"must be a finite number >= 0, got {value}")
        require(self.rows >= 0, "rows", f"must be >= 0, got {self.rows}")


@dataclass(frozen=True)
class RungError:
    """`[families.<name>.rung_error.<rung>]`: held-out errors of one rung and how they were measured."""

    note: str
    source: str = ""  # the source id of the one-layer errors (the calibration table)
    one_layer: dict = field(default_factory=dict)
    whole_pass: dict | None = None
    whole_pass_source: str = ""  # the source id of the whole-pass errors


@dataclass(frozen=True)
class RungErrors:
    """Each rung's held-out errors (None where nothing measured it)."""

    one_layer: dict[str, Stats]
    whole_pass: dict[str, Stats]
    notes: dict[str, str]
    one_layer_source: str = "table"
    whole_pass_source: str = ""

    def epsilon(self, whole_pass: bool, fallback: float) -> np.ndarray:
        """(4,) relative bound per rung: its whole-pass p90 where asked and measured, else its
        one-layer p90, else `fallback` (the family's ε)."""
        out = np.full(len(RUNGS), fallback)
        for i, rung in enumerate(RUNGS):
            stats = (self.whole_pass.get(rung) if whole_pass else None) or self.one_layer.get(rung)
            if stats is not None:
                out[i] = stats.p90
        return out


def rung_shares(time_us: np.ndarray, rung: np.ndarray, axis: int = -1) -> np.ndarray:
    """Time per rung summed along `axis`: shape (..., 4)."""
    return np.stack([np.where(rung == i, time_us, 0.0).sum(axis=axis) for i in range(len(RUNGS))], axis=-1)


def worst_rung(shares: np.ndarray) -> np.ndarray:
    """Per pass, the name of the lowest rung (highest index) that produced any of its time."""
    used = shares > 0
    index = np.where(used.any(axis=-1), len(RUNGS) - 1 - np.argmax(used[..., ::-1], axis=-1), FITTED)
    return np.asarray(RUNGS, dtype=object)[index]
