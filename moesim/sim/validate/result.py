"""The result of `moesim validate`: every row's prediction, the time errors, dedup savings and
crossovers, best draft lengths; `validate` runs it all."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from moesim.atomic import check_out_dir, output_dir
from moesim.errors import InputError
from moesim.filters import apply_filters, parse_filters
from moesim.hw_profiles.measurements.table import load_measurements
from moesim.hw_profiles.microbench.plan import PLAN_NAME, Plan, write_plan
from moesim.kernels.features import consecutive_runs
from moesim.sim.analysis.gaps import gap_plan, table_gaps
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.validate.metrics import (
    DedupValidation,
    curve_label,
    dedup_families,
    dedup_validation,
    errors_by,
    time_errors,
)
from moesim.sim.validate.predictions import (
    RUN_SUFFIXES,
    Context,
    ValidateOptions,
)
from moesim.sim.validate.rows import Table, predict_table, spec_rows
from moesim.sim.validate.runs import predict_run, speculative_curves_of
from moesim.tomlfile import RUN_CONFIG
from moesim.tracegen.formats.specrun import read_spec_run

# ---- the result -----------------------------------------------------------------------------------


@dataclass
class Validation:
    """Predictions of every measured row and what they say about the profile's decisions."""

    profile: str
    predictions: pl.DataFrame
    dedup: list[DedupValidation]
    speculative: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    source: str = ""  # the inputs and profile, as the measurement plan names them

    def to_dict(self) -> dict[str, Any]:
        """The `--json` object."""
        frame = self.predictions
        out: dict[str, Any] = {"profile": self.profile, **time_errors(frame).to_dict()}
        out["extrapolated_rows"] = int(frame["extrapolated"].sum())
        out["per_family"] = errors_by(frame, "kernel")
        pairs = [d.pairs for d in self.dedup if d.pairs.height]
        pooled = pl.concat(pairs, how="diagonal_relaxed") if pairs else None
        out["saving_inside_bound_fraction"] = float(pooled["inside"].mean()) if pooled is not None else None  # type: ignore[arg-type]
        out["mean_bound_width_pct"] = float(pooled["bound_width_pct"].mean()) if pooled is not None else None  # type: ignore[arg-type]
        if len(self.dedup) == 1:
            one = self.dedup[0].to_dict()
            out["dedup_family"] = self.dedup[0].family
            for key in ("crossover_measured", "crossover_predicted", "dedup_wins_measured", "dedup_wins_predicted", "curves"):
                out[key] = one[key]
        out["families"] = {d.family: d.to_dict() for d in self.dedup}
        out["speculative"] = self.speculative
        if len(self.speculative) == 1:
            out["best_draft_measured"] = self.speculative[0]["best_draft_measured"]
            out["best_draft_predicted"] = self.speculative[0]["best_draft_predicted"]
        out["warnings"] = self.warnings
        return out

    def family_table(self) -> pl.DataFrame:
        """Time errors per family (%)."""
        rows = []
        for family, stats in errors_by(self.predictions, "kernel").items():
            part = self.predictions.filter(pl.col("kernel") == family)
            rows.append(
                {
                    "family": family,
                    "rows": stats["rows"],
                    "median_abs_%": stats["median_abs_pct_error"],
                    "p90_abs_%": stats["p90_abs_pct_error"],
                    "mean_signed_%": stats["mean_signed_pct_error"],
                    "pearson_r": stats["pearson_r"],
                    "inside_bound": stats["time_inside_bound_fraction"],
                    "extrapolated": int(part["extrapolated"].sum()),
                }
            )
        return pl.DataFrame(rows)

    def dedup_table(self) -> pl.DataFrame:
        """Per dedup family and curve: crossover and win set, measured and predicted; savings inside the bound."""
        rows = [
            {
                "family": d.family,
                "curve": curve_label(c["curve"]),
                "crossover_measured": c["crossover_measured"],
                "crossover_predicted": c["crossover_predicted"],
                "wins_measured": _ranges(c["dedup_wins_measured"]),
                "wins_predicted": _ranges(c["dedup_wins_predicted"]),
                "saving_inside_bound": c["saving_inside_bound_fraction"],
                "bound_width_pp": c["mean_bound_width_pct"],
            }
            for d in self.dedup
            for c in d.curves
        ]
        return pl.DataFrame(rows)

    def speculative_table(self) -> pl.DataFrame:
        """Per speculative curve and draft length: tokens per pass and tokens/s, measured and predicted."""
        rows = [
            {
                "curve": curve_label(c["curve"]),
                "draft_len": k,
                "tokens_per_pass": tau,
                "tokens_per_s_measured": measured,
                "tokens_per_s_predicted": predicted,
                "error_%": error,
            }
            for c in self.speculative
            for k, tau, measured, predicted, error in zip(
                c["draft_lens"],
                c["tokens_per_pass"],
                c["tokens_per_s_measured"],
                c["tokens_per_s_predicted"],
                c["tokens_per_s_pct_error"],
                strict=True,
            )
        ]
        return pl.DataFrame(rows)

    def plan(self) -> Plan:
        """The measurement plan of the rows priced from fitted or extrapolated rungs (`moesim.sim.analysis.gaps`)."""
        gaps, share, notes = table_gaps(self.predictions)
        return gap_plan(gaps, share, self.source, self.profile, notes)

    def write(self, out_dir: Path, force: bool = False, config: str = "") -> Path:
        """Write `out_dir`/predictions.parquet, plan.toml and, when given, the run's `config` as
        config.toml (each atomically; the folder is made if missing)."""
        check_predictions_dir(out_dir, force)
        with output_dir(out_dir, force) as staging:
            self.predictions.write_parquet(staging / "predictions.parquet")
            write_plan(staging / PLAN_NAME, self.plan())
            if config:
                (staging / RUN_CONFIG).write_text(config)
        return out_dir / "predictions.parquet"


def check_predictions_dir(out_dir: Path, force: bool = False) -> None:
    """Fail before any work when `out_dir` cannot hold predictions.parquet."""
    check_out_dir(out_dir, force)
    if (out_dir / "predictions.parquet").is_dir():
        raise InputError(f"{out_dir / 'predictions.parquet'}: output path is a directory")


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in consecutive_runs(values)) or "-"


def validate(measured: list[Path], options: ValidateOptions) -> Validation:
    """Predict every row of the measured inputs with the profile and compare."""
    if not measured:
        raise InputError("give at least one measurement table or speculative run")
    if options.context_tokens < 0:
        raise InputError(f"--context-tokens must be >= 0, got {options.context_tokens}")
    ctx = Context(options)
    filters = parse_filters(list(options.filters))
    frames: list[pl.DataFrame] = []
    spec_tables: list[pl.DataFrame] = []
    runs: list[tuple[pl.DataFrame, StepTimeModel]] = []
    for path in measured:
        if path.suffix.lower() in RUN_SUFFIXES:
            steps, model = predict_run(read_spec_run(path), path, ctx)
            steps = apply_filters(steps, filters, str(path)) if filters else steps
            runs.append((steps, model))
            frames.append(steps.with_columns(pl.lit(path.name).alias("_source")))
            continue
        frame = load_measurements(path)
        frame = apply_filters(frame, filters, str(path)) if filters else frame
        table = Table(frame, path)
        predicted = predict_table(table, ctx)
        scopes = [table.scope(r) for r in range(frame.height)]
        frame = frame.with_columns(predicted.columns()).with_columns(pl.Series("_scope", scopes), pl.lit(path.name).alias("_source"))
        spec_tables.append(spec_rows(frame.with_row_index("_row"), path))
        frames.append(frame)
    predictions = pl.concat(frames, how="diagonal_relaxed")
    dedup = [dedup_validation(predictions, family) for family in dedup_families(predictions)]
    speculative = speculative_curves_of(spec_tables, runs)
    factor = predictions["_extrapolation"]
    if predictions["extrapolated"].any():
        ctx.warnings.append(
            f"{int(predictions['extrapolated'].sum())} of {predictions.height} rows lie beyond their family's calibrated range "
            f"(extrapolation factor up to {float(factor.max()):.2f}; column 'extrapolated'); the roofline bounds them from below"  # type: ignore[arg-type]
        )
    predictions = predictions.drop("_scope", "_extrapolation")
    predictions = predictions.drop("_source") if len(measured) == 1 else predictions.rename({"_source": "source"})
    source = f"validate {' '.join(p.name for p in measured)} --profile {Path(options.profile).name}"
    return Validation(ctx.profile.name, predictions, dedup, speculative, ctx.warnings, source)
