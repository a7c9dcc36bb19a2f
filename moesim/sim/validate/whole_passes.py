"""Whole passes predicted two ways, against their measurements (`bench/validate_whole_passes.py`).

- **moesim, leave one model out**: every pass is the sum of its MoE layers through the profile's
  lookup ladder (the layer model never sees passes; the one-layer calibration of every shape is
  used, as the shipped profile does), then the pass-level terms fitted on the *other* models'
  passes only (`hw_profiles.fitting.ladder_fit.fit_transfer`, applied where it helped there).
- **naive same-shape interpolation** (the baseline of issue 13): the one-layer times of the same
  model shape, n and family, linear in distinct experts per layer between its calibration
  routings at the pass's mean U per layer (clamped to the end ones), times the layers.

Decisions per (trace, dedup family) curve: at each n the mean over the windows both families
measured of the measured and of the predicted times; the crossover is the first n where dedup
is faster, the win set every such n. "Within one pass size": the predicted crossover is at most
one step of the curve's n grid from the measured one (both absent agrees). Win sets are compared
strictly, and with a tie band: n where the measured saving |1 − T_dedup/T_per_slot| lies within
the pair's combined bound (the two predictions' relative bounds added; each rung's bound is its
whole-pass error on the other models' passes) count as right either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from moesim.hw_profiles.families import ExpertFamily
from moesim.hw_profiles.fitting.ladder_fit import WholePasses, fit_transfer, whole_pass_errors
from moesim.hw_profiles.heldout import ErrorStats
from moesim.hw_profiles.ladder.rungs import RungErrors, Stats
from moesim.sim.cost.steptime import finite_or_zero

PER_SLOT = "per_slot"


def naive_same_shape(passes: pl.DataFrame, calibration: pl.DataFrame) -> np.ndarray:
    """The naive baseline (module docstring) of every pass; NaN where the table has no such shape, n and family."""
    predicted = np.full(passes.height, np.nan)
    indexed = passes.with_row_index("_i")
    for (model, kernel, n), part in indexed.group_by("model", "kernel", "n_tokens", maintain_order=True):
        rows = calibration.filter((pl.col("model") == model) & (pl.col("kernel") == kernel) & (pl.col("n_tokens") == n))
        if rows.height == 0:
            continue
        knots = rows.group_by("distinct_experts").agg(pl.col("time_us").mean()).sort("distinct_experts")
        u, t = knots["distinct_experts"].to_numpy().astype(np.float64), knots["time_us"].to_numpy()
        mean_u = part["distinct_experts"].to_numpy() / part["layers"].to_numpy()
        predicted[part["_i"].to_numpy()] = np.interp(mean_u, u, t) * part["layers"].to_numpy()
    return predicted


def lomo_predictions(passes: WholePasses, families: dict[str, ExpertFamily]) -> tuple[np.ndarray, np.ndarray]:
    """(time, relative bound) of every pass, its pass-level terms fitted without its own model's passes;
    the bound from each rung's whole-pass errors on the other models' passes (else its one-layer error)."""
    frame = passes.frame
    models = frame["model"].to_numpy().astype(str)
    kernels = frame["kernel"].to_numpy().astype(str)
    predicted, bound = passes.layers_us.copy(), np.zeros(frame.height)
    for model in dict.fromkeys(models.tolist()):
        held = models == model
        train = WholePasses(frame.filter(pl.Series(~held)), passes.layers_us[~held], passes.rung_us[~held], passes.layers[~held])
        for kernel in dict.fromkeys(kernels[held].tolist()):
            rows = held & (kernels == kernel)
            family = families[kernel]
            one_layer = family.rung_errors or RungErrors({}, {}, {})
            whole_pass: dict[str, Stats] = {}
            if (train.frame["kernel"] == kernel).any():
                fit = fit_transfer(train, kernel, "passes")
                predicted[rows] = fit.transfer.pass_us(passes.layers_us[rows], passes.layers[rows])
                whole_pass = whole_pass_errors(fit)
            epsilon = RungErrors(one_layer.one_layer, whole_pass, {}).epsilon(True, finite_or_zero(family.heldout_error.epsilon))
            share = passes.rung_us[rows] / np.maximum(passes.rung_us[rows].sum(axis=1, keepdims=True), 1e-300)
            bound[rows] = share @ epsilon
    return predicted, bound


def family_errors(frame: pl.DataFrame, columns: list[str], by: tuple[str, ...] = ()) -> pl.DataFrame:
    """Median and p90 absolute error (%) of each prediction column per family (and `by`)."""
    rows = []
    for key, part in frame.group_by(["kernel", *by], maintain_order=True):
        row: dict[str, Any] = dict(zip(["family", *by], key, strict=True)) | {"passes": part.height}
        for column in columns:
            stats = ErrorStats.from_errors(part[column].to_numpy() / part["time_us"].to_numpy() - 1.0)
            row[f"{column}_median_%"] = 100 * stats.median
            row[f"{column}_p90_%"] = 100 * stats.p90
        rows.append(row)
    return pl.DataFrame(rows).sort(["family", *by])


@dataclass(frozen=True)
class Curve:
    """Crossover and win set of one (trace, dedup family) curve over n, measured and predicted."""

    trace: str
    family: str
    n: list[int]
    crossover_measured: int | None
    crossover_predicted: int | None
    wins_measured: list[int]
    wins_predicted: list[int]
    ties: list[int]  # n inside the tie band

    @property
    def crossover_within_one(self) -> bool:
        """Within one step of the n grid (both absent agrees)."""
        if self.crossover_measured is None or self.crossover_predicted is None:
            return self.crossover_measured == self.crossover_predicted
        return abs(self.n.index(self.crossover_measured) - self.n.index(self.crossover_predicted)) <= 1

    @property
    def win_set_equal(self) -> bool:
        """The whole win set right."""
        return self.wins_measured == self.wins_predicted

    @property
    def win_set_equal_outside_ties(self) -> bool:
        """The win set right at every n outside the tie band."""
        return [n for n in self.wins_measured if n not in self.ties] == [n for n in self.wins_predicted if n not in self.ties]


def curves(frame: pl.DataFrame, predicted: str, bound: str | None = None) -> list[Curve]:
    """Every (trace, dedup family) curve of a predictions frame (columns kernel, trace, window_start,
    n_tokens, time_us, `predicted` and optionally its relative `bound`)."""
    out = []
    extra = [bound] if bound else []
    for trace in sorted(frame["trace"].unique().to_list()):
        part = frame.filter(pl.col("trace") == trace)
        base = part.filter(pl.col("kernel") == PER_SLOT).select("window_start", "n_tokens", "time_us", predicted, *extra)
        for family in sorted(set(part["kernel"].to_list()) - {PER_SLOT}):
            dedup = part.filter(pl.col("kernel") == family).select("window_start", "n_tokens", "time_us", predicted, *extra)
            joined = dedup.join(base, on=["window_start", "n_tokens"], suffix="_ps")
            means = joined.group_by("n_tokens").agg(pl.all().exclude("window_start").mean()).sort("n_tokens")
            n = means["n_tokens"].to_list()
            measured_saving = 1.0 - means["time_us"].to_numpy() / means["time_us_ps"].to_numpy()
            band = (means[bound].to_numpy() + means[f"{bound}_ps"].to_numpy()) if bound else np.zeros(len(n))
            wins_measured = [k for k, s in zip(n, measured_saving, strict=True) if s > 0]
            wins_predicted = [k for k, a, b in zip(n, means[predicted], means[f"{predicted}_ps"], strict=True) if a < b]
            ties = [k for k, s, w in zip(n, measured_saving, band, strict=True) if abs(s) <= w]
            out.append(
                Curve(
                    trace, family, n, next(iter(wins_measured), None), next(iter(wins_predicted), None), wins_measured, wins_predicted, ties
                )
            )
    return out


def curve_table(found: list[Curve]) -> pl.DataFrame:
    """One row per curve."""
    return pl.DataFrame(
        [
            {
                "trace": c.trace,
                "family": c.family,
                "crossover_measured": c.crossover_measured,
                "crossover_predicted": c.crossover_predicted,
                "within_one": c.crossover_within_one,
                "win_set_equal": c.win_set_equal,
                "equal_outside_ties": c.win_set_equal_outside_ties,
                "ties": len(c.ties),
            }
            for c in found
        ]
    )
