"""Speculation as engines run it, judged (issue 19): run from the repository root,

    .venv/bin/python bench/validate_spec_runs.py            # about 10 s

1. Which shared speculative runs moesim can describe (data/public-bench/speculative_runs_moesim.toml),
   and why the others cannot be.
2. Leave one run out and leave one engine out over the describable runs: predicted speedup against
   measured, median |error| and the share of right verdicts (speedup above or below 1), with the
   spec-path terms fitted on the held-in runs and without any.
3. How far the reading of DFlash's accept rate moves it (share of output tokens vs accepted / drafted).
4. Published runs outside the shared file, judging only: SGLang's tree acceptance lengths predicted
   from each source's smallest tree, and the verdicts on one H100 with the overhead they imply.

Prints markdown tables (docs/validation.md quotes them).
"""

from __future__ import annotations

import polars as pl

from moesim.sim.validate.spec_runs import (
    described_costs,
    judge_tree_acceptance,
    judge_verdicts,
    read_descriptions,
    read_published,
    sensitivity,
    splits,
)


def markdown(frame: pl.DataFrame, digits: int = 3) -> str:
    """A frame as a markdown table (floats rounded)."""
    cells = [[f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in row] for row in frame.iter_rows()]
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def main() -> None:
    descriptions = read_descriptions()
    describable = [d for d in descriptions if d.describable]
    print(f"## Shared runs: {len(describable)} of {len(descriptions)} describable\n")
    print(markdown(pl.DataFrame([{"row": d.row, "why not": d.reason} for d in descriptions if not d.describable])))
    runs = described_costs()
    print()
    print(
        markdown(
            pl.DataFrame(
                [
                    {
                        "row": r.row,
                        "engine": r.engine,
                        "drafter": r.drafter,
                        "verify": r.verify_tokens,
                        "tau": r.tau,
                        "T(1) us": r.single_us,
                        "baseline us": r.baseline_us,
                        "T(verify) us": r.verify_us,
                        "draft us": r.draft_us,
                        "measured": r.measured_speedup,
                    }
                    for r in runs
                ]
            ),
            2,
        )
    )
    for reading, label in (("share_of_output", "as described"), ("per_drafted", "DFlash accept rate read as accepted / drafted")):
        chosen = runs if reading == "share_of_output" else sensitivity(runs, reading, descriptions)
        for name, result in splits(chosen).items():
            print(f"\n## {name} ({label})\n")
            columns = ["row", "engine", "drafter", "tokens_per_pass", "measured", "predicted", "error", "verdict_right"]
            print(
                markdown(
                    result.frame.select([*columns, "predicted_without_terms", "fit_pass_us", "fit_iteration_us", "fit_verified_token_us"])
                )
            )
            summary = result.summary()
            print(
                f"\nmedian |error| {100 * summary['median_abs_error']:.1f} %, right verdicts {100 * summary['right_verdicts']:.0f} % "
                f"of {summary['runs']:.0f}; without spec-path terms {100 * summary['median_abs_error_without_terms']:.1f} %, "
                f"{100 * summary['right_verdicts_without_terms']:.0f} %"
            )
    published = read_published()
    print("\n## Judging only: SGLang tree acceptance lengths from each source's smallest tree\n")
    trees = judge_tree_acceptance(published)
    print(markdown(trees))
    others = trees.filter(~pl.col("anchor"))
    print(f"\nmedian |error| {100 * float(others['error'].abs().median()):.1f} % over {others.height} trees")  # type: ignore[arg-type]
    print("\n## Judging only: the verdicts on one H100 (vLLM fused-MoE profile; the runs are TP2 / TP4 under SGLang)\n")
    verdicts = judge_verdicts(published).with_columns(pl.col("verdict_right").cast(pl.Boolean))
    print(markdown(verdicts))
    print(f"\nright verdicts {int(verdicts['verdict_right'].sum())} of {verdicts.height}")


if __name__ == "__main__":
    main()
