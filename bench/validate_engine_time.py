"""Engine time beyond the kernels, judged (issue 24): run from the repository root,

    .venv/bin/python bench/validate_engine_time.py            # about 30 s

1. The shared engine-overheads rows (data/engine-overheads/): which moesim describes
   (runs_moesim.toml) and why the others cannot be, by reason.
2. Leave one source out per engine: every described speculative run's speedup predicted from a
   fit on its engine's other sources (median |error|, right verdicts, coverage of the interval and
   its median width), every described decode step's time likewise; the terms of each held-out fit
   and their spread.
3. The terms fitted on every row (the built-in profiles' `[speculative]` tables).
4. Judging only (nothing fitted on them): the shared MoE runs moesim describes
   (data/public-bench/) and the published SGLang EAGLE-3 runs, with the built-in profiles' terms.

Prints markdown tables (docs/validation.md quotes them).
"""

from __future__ import annotations

import polars as pl

from moesim.hw_profiles.speculative import SPEC_TERMS
from moesim.sim.engine.builtin import engine_fits
from moesim.sim.engine.heldout import leave_one_source_out, overall
from moesim.sim.engine.rows import describe
from moesim.sim.validate.spec_runs import described_costs, judge_engine_terms, judge_verdicts, read_descriptions, read_published


def markdown(frame: pl.DataFrame, digits: int = 3) -> str:
    """A frame as a markdown table (floats rounded)."""
    cells = [[f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in row] for row in frame.iter_rows()]
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def short(url: str) -> str:
    """owner/repo#N or the page's last part."""
    parts = url.rstrip("/").split("/")
    return f"{parts[3]}/{parts[4]}#{parts[-1]}" if "github.com" in url and len(parts) > 6 else parts[-1]


def main() -> None:
    described = describe()
    left = pl.DataFrame(described.left_out)
    print(f"## Rows: {described.steps.height} decode steps and {described.runs.height} speculative runs described\n")
    print(
        markdown(
            left.group_by("table", "reason").agg(pl.len().alias("rows"), pl.col("engine").unique().str.join("; ")).sort("table", "rows")
        )
    )

    held = leave_one_source_out(described)
    print("\n## Leave one source out, per engine\n")
    print(markdown(held.summary()))
    print(f"\noverall: {overall(held)}\n")
    runs = held.runs.with_columns(pl.col("source").map_elements(short, return_dtype=pl.String))
    print(markdown(runs.select("engine", "row", "source", "basis", "tau", "measured", "predicted", "low", "high", "error", "covered")))
    steps = held.steps.with_columns(pl.col("source").map_elements(short, return_dtype=pl.String))
    print("\n### Decode steps held out by source\n")
    print(
        markdown(
            steps.group_by("engine", "source")
            .agg(pl.len().alias("steps"), pl.col("error").abs().median().alias("median_abs_error"))
            .sort("engine", "source")
        )
    )
    print("\n### The held-out fits: each term's spread over the sources left out\n")
    spread = held.fits.group_by("engine").agg(
        *(pl.concat_str(pl.col(t).min().round(0), pl.lit(" .. "), pl.col(t).max().round(0)).alias(t) for t in SPEC_TERMS)
    )
    print(markdown(spread.sort("engine")))

    print("\n## Terms fitted on every row\n")
    fits = engine_fits(described)
    print(markdown(pl.DataFrame([{"engine": k, **{t: getattr(s, t) for t in SPEC_TERMS}, "heldout_error": s.heldout_error,
                                  **{f"u_{t}": s.uncertainty.get(t, 0.0) for t in SPEC_TERMS}} for k, s in fits.items()]), 2))  # fmt: skip

    print("\n## Judging only: the shared MoE runs (data/public-bench/) with the built-in profiles' terms\n")
    judged = judge_engine_terms(described_costs(), read_descriptions())
    print(markdown(judged))
    print("\n## Judging only: published SGLang EAGLE-3 runs of Qwen3-30B-A3B on one H100 (its built-in vLLM V1 terms)\n")
    print(markdown(judge_verdicts(read_published())))


if __name__ == "__main__":
    main()
