"""`moesim validate`: every measured row predicted with a profile and compared."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.analysis import JsonOpt, ProfileOpt
from moesim.cli.options import OUT_DIR, ForceOpt
from moesim.cli.render import console, emit_json, render_table


def validate_command(
    measured: Annotated[list[Path], typer.Argument(help="Measurement tables (.parquet/.csv) and/or speculative runs (.arrow).")],
    profile: ProfileOpt,
    trace: Annotated[
        Path | None, typer.Option("--trace", help="Trace of window rows without a 'trace' column, or a folder of named traces.")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Target preset of whole passes (default: the row's or trace's).")] = None,
    family: Annotated[str | None, typer.Option("--family", help="Kernel family of the speculative runs (default: the only one).")] = None,
    context_tokens: Annotated[int, typer.Option("--context-tokens", help="KV tokens of whole-pass rows that carry no position.")] = 512,
    filters: Annotated[list[str] | None, typer.Option("--filter", help="COL=VALUE: keep matching rows only (repeatable).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Folder to write predictions.parquet into."), OUT_DIR] = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Predict every measured row with a profile and compare: errors, dedup savings and crossovers, best draft."""
    from moesim.sim.validate.result import ValidateOptions, check_predictions_dir, validate

    if out is not None:
        check_predictions_dir(out, force)
    options = ValidateOptions(profile, trace, model, family, context_tokens, tuple(filters or ()))
    result = validate(measured, options)
    path = result.write(out, force) if out is not None else None
    if emit_json(result, as_json):
        return
    summary = result.to_dict()
    console.print(
        f"[bold]{len(measured)} input(s)[/bold] on profile {result.profile}: {summary['rows']} rows, "
        f"median |error| {summary['median_abs_pct_error']:.1f} %, p90 {summary['p90_abs_pct_error']:.1f} %, "
        f"mean signed {summary['mean_signed_pct_error']:+.1f} %, Pearson r {summary['pearson_r']:.4f}, "
        f"{summary['extrapolated_rows']} extrapolated",
        soft_wrap=True,
    )
    render_table(result.family_table(), title="Time error per family", caption="inside_bound: share of rows within the family's ε")
    if result.dedup:
        caption = "saving = 1 - T_dedup/T_per_slot at equal n and window; bound from both families' ε; width in percentage points"
        render_table(result.dedup_table(), title="Dedup vs per_slot: crossover and win set, measured vs predicted", caption=caption)
    if result.speculative:
        caption = "predicted with the measured acceptance and drafting time; draft_len 0 = plain decoding"
        render_table(result.speculative_table(), title="Speculative decoding: tokens/s per draft length", caption=caption)
        for curve in result.speculative:
            console.print(f"best draft length: measured {curve['best_draft_measured']}, predicted {curve['best_draft_predicted']}")
    if path is not None:
        console.print(f"wrote {path}")
