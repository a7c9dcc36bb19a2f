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
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Folder to write predictions.parquet and plan.toml (the rows priced from fitted or extrapolated rungs) into."
        ),
        OUT_DIR,
    ] = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Predict every measured row with a profile and compare: errors, dedup savings and crossovers, best draft.

    A benchmark's output (llama-bench, llama-batched-bench, benchmark_moe.py: what `profile fit`
    reads), or the measurement table `profile import` made of it, is priced whole pass by whole
    pass by an engine profile's dispatch."""
    from moesim.cli.rerun import command_config
    from moesim.sim.validate.result import ValidateOptions, check_predictions_dir, validate
    from moesim.tomlfile import toml_document

    if out is not None:
        check_predictions_dir(out, force)
    if _bench_outputs(measured):
        _validate_bench_outputs(measured, profile, model, tuple(filters or ()), out, force, as_json)
        return
    options = ValidateOptions(profile, trace, model, family, context_tokens, tuple(filters or ()))
    result = validate(measured, options)
    path = result.write(out, force, toml_document(command_config("validate", {}))) if out is not None else None
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
        plan = result.plan()
        share = f"{100 * plan.answer_share:.1f} % of the predicted time rests on them"
        console.print(f"wrote {path} and {path.parent / 'plan.toml'} ({len(plan.passes)} passes to measure, {share})", soft_wrap=True)


def _bench_outputs(measured: list[Path]) -> bool:
    """Whether the inputs are benchmark outputs (all of them; a mix with tables or runs is one line)."""
    from moesim.errors import InputError
    from moesim.hw_profiles.fitting.bench_fit import dispatched_table, is_measurement_table

    outputs = [p for p in measured if p.suffix.lower() != ".arrow" and p.is_file() and (not is_measurement_table(p) or dispatched_table(p))]
    if outputs and len(outputs) != len(measured):
        raise InputError(
            f"{outputs[0]}: a benchmark's output (or its imported table) is validated alone or with other outputs, "
            "not with kernel tables or runs"
        )
    return bool(outputs)


def _validate_bench_outputs(
    measured: list[Path], profile: str, model: str | None, filters: tuple[str, ...], out: Path | None, force: bool, as_json: bool
) -> None:
    """Each output's whole passes against the profile: a row per test, the errors' median and p90."""
    import numpy as np
    import polars as pl

    from moesim.atomic import output_dir
    from moesim.cli.render import print_json
    from moesim.cli.rerun import command_config
    from moesim.hw_profiles import load_profile
    from moesim.hw_profiles.families import EXTRAPOLATION_TOLERANCE
    from moesim.hw_profiles.fitting.bench_fit import check_bench_output, check_measurement_table, is_measurement_table
    from moesim.hw_profiles.importers import ImportOptions
    from moesim.tomlfile import RUN_CONFIG, toml_document

    loaded = load_profile(profile)
    checks = [
        check_measurement_table(path, loaded, filters)
        if is_measurement_table(path)
        else check_bench_output(path, loaded, ImportOptions(model=model, filters=filters))
        for path in measured
    ]
    tables = [
        c.table.with_columns(source=pl.lit(path.name)) if len(checks) > 1 else c.table for c, path in zip(checks, measured, strict=True)
    ]
    table = pl.concat(tables)
    errors = np.abs(np.concatenate([c.errors() for c in checks]))
    beyond = table["extrapolated_x"].drop_nulls()
    beyond = beyond.filter(beyond > 1 + EXTRAPOLATION_TOLERANCE)
    summary = {
        "profile": loaded.name,
        "rows": table.height,
        "predicted_rows": int(errors.size),
        "median_abs_pct_error": float(100 * np.median(errors)) if errors.size else None,
        "p90_abs_pct_error": float(100 * np.quantile(errors, 0.9)) if errors.size else None,
        "extrapolated_rows": beyond.len(),
    }
    if out is not None:
        with output_dir(out, force) as staging:
            table.write_parquet(staging / "predictions.parquet")
            (staging / RUN_CONFIG).write_text(toml_document(command_config("validate", {})))
    if as_json:
        print_json({**summary, "notes": [n for c in checks for n in c.notes], "rows_predicted": table.to_dicts()})
        return
    for check in checks:
        for note in check.notes:
            console.print(note, markup=False)
    caption = "whole passes priced by the profile's dispatch; '–' where the family it dispatches was not calibrated"
    render_table(table, title=f"{len(measured)} benchmark output(s) on profile {loaded.name}", caption=caption)
    if errors.size:
        console.print(
            f"{errors.size} of {table.height} rows predicted: median |error| {summary['median_abs_pct_error']:.1f} %, "
            f"p90 {summary['p90_abs_pct_error']:.1f} %",
            markup=False,
        )
        if beyond.len():
            console.print(
                f"{beyond.len()} of them lie beyond the calibrated range of the family they run (up to x{beyond.max():.3g} in "
                "pass size, experts or shape: extrapolated_x): priced by extrapolation",
                markup=False,
            )
    else:
        console.print(f"none of the {table.height} rows is priced: the families they dispatch are not in {loaded.name}", markup=False)
    if out is not None:
        console.print(f"wrote {out / 'predictions.parquet'}")
