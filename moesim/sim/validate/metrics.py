"""Metrics of `moesim validate`: how far predictions lie from measurements, and whether the
decisions they imply (deduplicate or not, which draft length) would have been right.

Every function takes a predictions frame: the measured rows plus `predicted_us`,
`predicted_low_us`, `predicted_high_us` (the family's held-out bound ε around the prediction)
and `extrapolated`. Percentages are of the measured value; signed errors are
(predicted − measured) / measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from moesim.hw_profiles.heldout import ErrorStats, relative_errors
from moesim.hw_profiles.measurements.table import is_dedup_family
from moesim.sim.analysis.crossover import win_window
from moesim.sim.analysis.speculation import TIE_RTOL

# Columns that say which pass a row measured (present ones only). Two rows of different families
# with equal values here measured the same pass: "equal n and window".
PASS_COLUMNS = (
    "_source", "model", "device", "routing", "hidden", "expert_intermediate", "experts", "top_k", "dtype", "expert_bytes",
    "_scope", "layers", "trace", "seq", "window_start", "n_tokens", "distinct_experts", "slots", "max_tokens_per_expert",
)  # fmt: skip
# Columns that vary along one curve over n (dropped from the pass key to name the curve).
ALONG_CURVE = ("n_tokens", "distinct_experts", "slots", "max_tokens_per_expert")
PER_SLOT = "per_slot"


@dataclass(frozen=True)
class TimeErrors:
    """Absolute and signed relative errors of predicted times, and their correlation."""

    rows: int
    median_abs_pct: float
    p90_abs_pct: float
    max_abs_pct: float
    mean_signed_pct: float
    pearson_r: float
    inside_bound_fraction: float

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form."""
        return {
            "rows": self.rows,
            "median_abs_pct_error": self.median_abs_pct,
            "p90_abs_pct_error": self.p90_abs_pct,
            "max_abs_pct_error": self.max_abs_pct,
            "mean_signed_pct_error": self.mean_signed_pct,
            "pearson_r": self.pearson_r,
            "time_inside_bound_fraction": self.inside_bound_fraction,
        }


def pearson_r(x: np.ndarray, y: np.ndarray) -> float:
    """r = cov(x, y) / (σ_x σ_y); NaN with fewer than two rows or a constant side."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def time_errors(frame: pl.DataFrame) -> TimeErrors:
    """Errors of `predicted_us` against `time_us` over the frame's rows."""
    measured = frame["time_us"].to_numpy().astype(np.float64)
    predicted = frame["predicted_us"].to_numpy().astype(np.float64)
    signed = relative_errors(predicted, measured)
    stats = ErrorStats.from_errors(signed)
    inside = (frame["predicted_low_us"] <= frame["time_us"]) & (frame["time_us"] <= frame["predicted_high_us"])
    return TimeErrors(
        rows=stats.rows,
        median_abs_pct=100 * stats.median,
        p90_abs_pct=100 * stats.p90,
        max_abs_pct=100 * stats.max,
        mean_signed_pct=100 * float(np.mean(signed)),
        pearson_r=pearson_r(measured, predicted),
        inside_bound_fraction=float(inside.mean()),  # type: ignore[arg-type]
    )


def errors_by(frame: pl.DataFrame, column: str) -> dict[str, dict[str, Any]]:
    """Time errors per value of a column (e.g. per family)."""
    return {str(key[0]): time_errors(part).to_dict() for key, part in sorted(frame.group_by(column), key=lambda kv: str(kv[0][0]))}


def _present(frame: pl.DataFrame, columns: tuple[str, ...]) -> list[str]:
    return [c for c in columns if c in frame.columns]


def pass_key(frame: pl.DataFrame) -> list[str]:
    """The columns naming a measured pass in this frame."""
    return _present(frame, PASS_COLUMNS)


def curve_key(frame: pl.DataFrame) -> list[str]:
    """The columns naming a curve over n in this frame."""
    return [c for c in pass_key(frame) if c not in ALONG_CURVE]


# ---- dedup vs per-slot ------------------------------------------------------------------------


def paired_passes(frame: pl.DataFrame, dedup_family: str) -> pl.DataFrame:
    """Per pass measured by both `dedup_family` and per_slot (means over repeated rows): measured
    and predicted times of both, with the predicted bounds."""
    key = pass_key(frame)
    values = ("time_us", "predicted_us", "predicted_low_us", "predicted_high_us")

    def side(family: str, suffix: str) -> pl.DataFrame:
        rows = frame.filter(pl.col("kernel") == family)
        return rows.group_by(key, maintain_order=True).agg(pl.col(v).mean().alias(f"{v}_{suffix}") for v in values)

    return side(dedup_family, "dedup").join(side(PER_SLOT, "per_slot"), on=key, how="inner", nulls_equal=True)


def saving(per_slot_us: np.ndarray, dedup_us: np.ndarray) -> np.ndarray:
    """Share of the per-slot time dedup saves, %: 100·(1 − T_dedup / T_per_slot) (negative: dedup is slower)."""
    return 100.0 * (1.0 - np.asarray(dedup_us, np.float64) / np.asarray(per_slot_us, np.float64))


@dataclass(frozen=True)
class DedupValidation:
    """One dedup family against per_slot: savings with their bounds, crossovers and win sets per curve."""

    family: str
    pairs: pl.DataFrame  # per pass: n, measured and predicted saving, bound, inside
    curves: list[dict[str, Any]]

    @property
    def inside_fraction(self) -> float | None:
        """Share of passes whose measured saving lies inside the predicted bound."""
        return float(self.pairs["inside"].mean()) if self.pairs.height else None  # type: ignore[arg-type]

    @property
    def mean_bound_width_pct(self) -> float | None:
        """Mean width of the saving's bound, percentage points."""
        return float(self.pairs["bound_width_pct"].mean()) if self.pairs.height else None  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        """JSON form; crossover keys at the top when the table holds one curve."""
        one = self.curves[0] if len(self.curves) == 1 else None
        return {
            "passes": self.pairs.height,
            "saving_inside_bound_fraction": self.inside_fraction,
            "mean_bound_width_pct": self.mean_bound_width_pct,
            "saving_measured_pct_mean": _mean(self.pairs, "saving_measured_pct"),
            "saving_predicted_pct_mean": _mean(self.pairs, "saving_predicted_pct"),
            "crossover_measured": one["crossover_measured"] if one else None,
            "crossover_predicted": one["crossover_predicted"] if one else None,
            "dedup_wins_measured": one["dedup_wins_measured"] if one else [],
            "dedup_wins_predicted": one["dedup_wins_predicted"] if one else [],
            "curves": self.curves,
            "crossover_within_one_fraction": _fraction([c["crossover_within_one"] for c in self.curves]),
            "win_set_equal_fraction": _fraction([c["dedup_wins_measured"] == c["dedup_wins_predicted"] for c in self.curves]),
        }


def _mean(frame: pl.DataFrame, column: str) -> float | None:
    return float(frame[column].mean()) if frame.height else None  # type: ignore[arg-type]


def _fraction(flags: list[bool]) -> float | None:
    return float(np.mean(flags)) if flags else None


def _within_one(measured: int | None, predicted: int | None) -> bool:
    """Crossovers agree within one pass size (both absent counts as agreement)."""
    if measured is None or predicted is None:
        return measured is None and predicted is None
    return abs(measured - predicted) <= 1


def dedup_validation(frame: pl.DataFrame, dedup_family: str) -> DedupValidation:
    """Savings, bounds, crossovers and win sets of one dedup family against per_slot."""
    paired = paired_passes(frame, dedup_family)
    ps, dd = paired["time_us_per_slot"].to_numpy(), paired["time_us_dedup"].to_numpy()
    ps_hat, dd_hat = paired["predicted_us_per_slot"].to_numpy(), paired["predicted_us_dedup"].to_numpy()
    # the saving falls with dedup time and rises with per-slot time: its bound takes opposite ends
    low = saving(paired["predicted_low_us_per_slot"].to_numpy(), paired["predicted_high_us_dedup"].to_numpy())
    high = saving(paired["predicted_high_us_per_slot"].to_numpy(), paired["predicted_low_us_dedup"].to_numpy())
    measured = saving(ps, dd)
    pairs = paired.with_columns(
        pl.Series("saving_measured_pct", measured),
        pl.Series("saving_predicted_pct", saving(ps_hat, dd_hat)),
        pl.Series("saving_low_pct", low),
        pl.Series("saving_high_pct", high),
        pl.Series("bound_width_pct", high - low),
        pl.Series("inside", (low <= measured) & (measured <= high)),
    )
    columns = [c for c in curve_key(frame) if c in pairs.columns]
    curves = []
    for labels, part in pairs.group_by(columns, maintain_order=True) if columns else [((), pairs)]:
        part = part.sort("n_tokens")
        n = part["n_tokens"].to_numpy()
        measured_window = win_window(n, part["time_us_per_slot"].to_numpy(), part["time_us_dedup"].to_numpy())
        predicted_window = win_window(n, part["predicted_us_per_slot"].to_numpy(), part["predicted_us_dedup"].to_numpy())
        curves.append(
            {
                "curve": {c: _plain(v) for c, v in zip(columns, labels, strict=True) if not c.startswith("_")},
                "n": [int(v) for v in n],
                "saving_inside_bound_fraction": float(part["inside"].mean()),  # type: ignore[arg-type]
                "mean_bound_width_pct": float(part["bound_width_pct"].mean()),  # type: ignore[arg-type]
                "crossover_measured": measured_window.crossover_n,
                "crossover_predicted": predicted_window.crossover_n,
                "dedup_wins_measured": measured_window.dedup_wins,
                "dedup_wins_predicted": predicted_window.dedup_wins,
                "crossover_within_one": _within_one(measured_window.crossover_n, predicted_window.crossover_n),
            }
        )
    return DedupValidation(dedup_family, pairs, curves)


LABEL_COLUMNS = ("model", "draft_model", "routing", "trace", "seq", "window_start")


def curve_label(curve: dict[str, Any]) -> str:
    """A short name for a curve: its model, routing or window, device."""
    return ", ".join(f"{c}={curve[c]}" for c in LABEL_COLUMNS if curve.get(c) is not None) or "all rows"


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def dedup_families(frame: pl.DataFrame) -> list[str]:
    """Dedup families measured alongside per_slot in the frame."""
    kernels = set(frame["kernel"].to_list())
    return sorted(k for k in kernels if is_dedup_family(k)) if PER_SLOT in kernels else []


# ---- speculative decoding ----------------------------------------------------------------------


def best_draft_length(draft_lens: np.ndarray, tokens_per_s: np.ndarray) -> int:
    """argmax_k tokens/s, ties toward the larger k (the convention of `speculation.best_draft`)."""
    k = np.asarray(draft_lens)
    rate = np.asarray(tokens_per_s, np.float64)
    top = np.flatnonzero(rate >= rate.max() * (1.0 - TIE_RTOL))
    return int(k[top].max())


def rank_agreement(measured: np.ndarray, predicted: np.ndarray) -> float:
    """Spearman's ρ of two curves over the same draft lengths (Pearson r of their ranks)."""
    return pearson_r(np.argsort(np.argsort(measured)), np.argsort(np.argsort(predicted)))


def speculative_curves(per_draft: pl.DataFrame, curve_columns: list[str]) -> list[dict[str, Any]]:
    """Best draft length measured vs predicted per curve, from one row per (curve, draft_len) with
    `tokens_per_s_measured`, `tokens_per_s_predicted` and `tokens_per_pass`."""
    out = []
    groups = per_draft.group_by(curve_columns, maintain_order=True) if curve_columns else [((), per_draft)]
    for labels, part in groups:
        part = part.sort("draft_len")
        k = part["draft_len"].to_numpy()
        measured = part["tokens_per_s_measured"].to_numpy()
        predicted = part["tokens_per_s_predicted"].to_numpy()
        best_measured, best_predicted = best_draft_length(k, measured), best_draft_length(k, predicted)
        out.append(
            {
                "curve": {c: _plain(v) for c, v in zip(curve_columns, labels, strict=True) if not c.startswith("_")},
                "draft_lens": [int(v) for v in k],
                "tokens_per_pass": part["tokens_per_pass"].to_list(),
                "tokens_per_s_measured": measured.tolist(),
                "tokens_per_s_predicted": predicted.tolist(),
                "tokens_per_s_pct_error": (100 * relative_errors(predicted, measured)).tolist(),
                "best_draft_measured": best_measured,
                "best_draft_predicted": best_predicted,
                "tokens_per_s_at_predicted_best_pct_of_best": float(100 * measured[k == best_predicted][0] / measured.max()),
                "rank_agreement": rank_agreement(measured, predicted),
            }
        )
    return out
