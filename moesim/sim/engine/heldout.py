"""The engine terms judged leaving one source out (issue 24): every described speculative run's
speedup and every described decode step predicted from a fit on its engine's *other* sources
(`fit_engine_terms`), with the interval its terms' uncertainty gives; where no other source of its
engine is left, from the other engines' rows pooled (marked `transferred`).

The interval of a speedup: its extremes over every corner of the box each fitted term spans,
value · (1 ± uncertainty), times (1 ± heldout_error) on the engine's whole time, and the kernels
times (1 ± KERNEL_ERROR) (the datasheet dense family's assumed bound: it moves a run's baseline
and its iteration alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from moesim.hw_profiles.speculative import SPEC_TERMS, SpecPath
from moesim.sim.engine.fit import Equation, RunParts, fit_engine_terms, run_parts, step_equations
from moesim.sim.engine.rows import Described, describe

KERNEL_ERROR = 0.2  # the assumed bound of a dense family read off a datasheet (engine_builtins' _assumed_dense)


def term_values(spec: SpecPath, scale: dict[str, float] | None = None) -> dict[str, float]:
    """The terms as a dict, each times scale[term]."""
    s = scale or {}
    return {t: getattr(spec, t) * s.get(t, 1.0) for t in SPEC_TERMS}


def speedup_interval(run: RunParts, spec: SpecPath) -> tuple[float, float, float]:
    """(nominal, low, high) speedup of a run under the terms, over the terms' box and the kernels' bound."""
    nominal = run.speedup(term_values(spec))
    values = [run.speedup(term_values(spec, scale), k) for scale in spec.corner_scales() for k in (1 - KERNEL_ERROR, 1 + KERNEL_ERROR)]
    return nominal, min(values), max(values)


@dataclass(frozen=True)
class HeldOut:
    """Held-out speedups of the runs and times of the decode steps, and the fits behind them."""

    runs: pl.DataFrame
    steps: pl.DataFrame
    fits: pl.DataFrame

    def summary(self) -> pl.DataFrame:
        """Per engine: runs, median |speedup error|, right verdicts, coverage, median interval width; decode steps' median |error|."""
        runs = self.runs.group_by("engine").agg(
            pl.len().alias("runs"),
            pl.col("error").abs().median().alias("median_abs_speedup_error"),
            pl.col("verdict_right").mean().alias("right_verdicts"),
            pl.col("covered").mean().alias("coverage"),
            pl.col("width").median().alias("median_width"),
        )
        steps = self.steps.group_by("engine").agg(pl.len().alias("steps"), pl.col("error").abs().median().alias("median_abs_step_error"))
        return runs.join(steps, on="engine", how="full", coalesce=True).sort("engine")


def _rows_without(described: Described, source: str, engine: str | None) -> tuple[pl.DataFrame, pl.DataFrame]:
    steps, runs = described.steps, described.runs
    keep_steps = pl.col("source_url") != source
    if engine is not None:
        return steps.filter(keep_steps & (pl.col("engine_key") == engine)), runs.filter(keep_steps & (pl.col("engine_key") == engine))
    return steps.filter(keep_steps), runs.filter(keep_steps)


def _fit_without(described: Described, source: str, engine: str) -> tuple[SpecPath, str]:
    """The engine's terms without `source`: from its other rows, else the other engines' pooled."""
    steps, runs = _rows_without(described, source, engine)
    if steps.height + runs.height:
        return fit_engine_terms(steps, runs, engine, source_file="held out").spec, "own engine"
    steps, runs = _rows_without(described, source, None)
    return fit_engine_terms(steps, runs, engine, source_file="held out").spec, "transferred"


def _predicted_step(equation: Equation, spec: SpecPath) -> float:
    return equation.predicted_us(term_values(spec))


def leave_one_source_out(described: Described | None = None) -> HeldOut:
    """Every described run and decode step predicted from its engine's other sources."""
    described = described or describe()
    run_records, step_records, fit_records = [], [], []
    runs = run_parts(described.runs)
    steps = step_equations(described.steps)
    step_engine = dict(zip(described.steps["row"], described.steps["engine_key"], strict=True))
    keys = [(r.engine_key, r.source) for r in runs] + [(step_engine[e.row], e.source) for e in steps]
    for engine, source in dict.fromkeys(keys):
        spec, basis = _fit_without(described, source, engine)
        fit_records.append({"engine": engine, "held_out": source, "basis": basis, **term_values(spec), "heldout_error": spec.heldout_error})
        for run in (r for r in runs if (r.engine_key, r.source) == (engine, source)):
            nominal, low, high = speedup_interval(run, spec)
            run_records.append(
                {
                    "engine": engine, "row": run.row, "source": source, "basis": basis, "tau": run.tau, "measured": run.measured_speedup,
                    "predicted": nominal, "low": low, "high": high, "error": nominal / run.measured_speedup - 1.0,
                    "verdict_right": (nominal > 1.0) == (run.measured_speedup > 1.0),
                    "covered": low <= run.measured_speedup <= high, "width": (high - low) / nominal,
                }
            )  # fmt: skip
        for equation in (e for e in steps if (step_engine[e.row], e.source) == (engine, source)):
            predicted = _predicted_step(equation, spec)
            step_records.append(
                {
                    "engine": engine, "row": equation.row, "source": source, "basis": basis, "tokens": equation.tokens,
                    "measured_us": equation.measured_us, "predicted_us": predicted, "error": predicted / equation.measured_us - 1.0,
                }
            )  # fmt: skip
    return HeldOut(pl.DataFrame(run_records), pl.DataFrame(step_records), pl.DataFrame(fit_records))


def overall(held: HeldOut) -> dict[str, float]:
    """Over every engine: runs, median |speedup error|, right verdicts, coverage, median width; decode steps' median |error|."""
    r, s = held.runs, held.steps
    return {
        "runs": float(r.height),
        "median_abs_speedup_error": float(np.median(np.abs(r["error"]))),
        "right_verdicts": float(r["verdict_right"].mean()),  # type: ignore[arg-type]
        "coverage": float(r["covered"].mean()),  # type: ignore[arg-type]
        "median_width": float(r["width"].median()),  # type: ignore[arg-type]
        "steps": float(s.height),
        "median_abs_step_error": float(np.median(np.abs(s["error"]))),
    }
