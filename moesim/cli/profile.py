"""`moesim profile fit | list | show | derive`: hardware profiles (contract 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import polars as pl
import typer

from moesim.cli.options import OUT_DIR, OUT_FILE, ForceOpt, config_options
from moesim.cli.render import console, print_json, render_table
from moesim.errors import InputError
from moesim.hw_profiles.engine_runs.rows import RunContext

app = typer.Typer(help="Hardware profiles: fit from measurements, list, show, derive what-if hardware.", no_args_is_help=True)


ModelOpt = Annotated[str | None, typer.Option("--model", help="Model preset, where the output does not name one (or to override it).")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="Device name (a catalog device), where the output does not name it.")]
FormatOpt = Annotated[str | None, typer.Option("--format", help="Weight format, where the output does not name it (e.g. Q4_K_M, BF16).")]
TableFormatOpt = Annotated[str | None, typer.Option("--table-format", help="The output's format (default: detected from its content).")]
FiltersOpt = Annotated[list[str] | None, typer.Option("--filter", help="Keep rows where COLUMN=VALUE (repeatable, all must hold).")]
RUN_OPTIONS = ("engine_version", "device", "tp", "cuda_graphs", "batch", "input_len", "output_len", "draft", "draft_len")


@app.command("fit")
def profile_fit(
    table: Annotated[
        Path,
        typer.Argument(help="Measurement table (Parquet or CSV, contract 3), or a benchmark's output (llama-bench and others)."),
    ],
    out: Annotated[Path, typer.Option(help="Profile TOML to write."), OUT_FILE],
    name: Annotated[str | None, typer.Option(help="Profile name (default: the output file's stem).")] = None,
    filters: FiltersOpt = None,
    device_json: Annotated[Path | None, typer.Option(help="Device facts (default: device.json beside the table, if any).")] = None,
    backend: Annotated[str | None, typer.Option(help="cuda, metal or cpu, for a device not in the catalog.")] = None,
    tokens_per_read: Annotated[
        list[str] | None, typer.Option("--tokens-per-read", help="FAMILY=T: fix a family's tokens per weight read (0, 1, 2^k).")
    ] = None,
    model: ModelOpt = None,
    device: DeviceOpt = None,
    weight_format: FormatOpt = None,
    table_format: TableFormatOpt = None,
    engine: Annotated[str | None, typer.Option(help="Engine of a benchmark's output (default: from its backend).")] = None,
    passes: Annotated[
        Path | None, typer.Option("--passes", help="Whole-pass table with its traces: pass-level terms and whole-pass bounds.")
    ] = None,
    routed_share: Annotated[
        float | None,
        typer.Option(
            help=(
                "Share of the experts a benchmark's random tokens route to, in (0, 1] (default: chosen among 1, 0.7, 0.5, 0.4 "
                "by the run's own held-out error, every expert unless a smaller share clearly fits better; 1: all)."
            )
        ),
    ] = None,
) -> None:
    """Fit a profile: every kernel family of a measurement table, or the engine a benchmark's output ran; held-out errors; write it."""
    from moesim.atomic import check_writable
    from moesim.hw_profiles.fitting.bench_fit import is_measurement_table
    from moesim.hw_profiles.schema import write_profile

    check_writable(out)
    if not is_measurement_table(table):
        from moesim.hw_profiles.fitting.bench_fit import fit_bench_output
        from moesim.hw_profiles.importers import ImportOptions

        options = ImportOptions(model, device, weight_format, tuple(filters or ()))
        result = fit_bench_output(table, name or out.stem, options, table_format, engine, routed_share)
        profile = result.fit.profile
        for note in result.notes:
            console.print(note, markup=False)
        caption = (
            "held_out: each pass size predicted by a fit without it; '–' where its kernel family ran at no other size "
            "(nothing left to fit that family on)"
        )
        render_table(result.fit.table(), title=f"{profile.name}: {profile.device.engine} on the {profile.device.name}", caption=caption)
        console.print(result.choice.sentence(), markup=False)
        for note in profile.notes:
            console.print(f"note: {note}", markup=False)
        write_profile(out, profile)
        console.print(f"wrote {out}")
        return
    if routed_share is not None:
        raise InputError(f"--routed-share: {table} is a measurement table; the share applies to a benchmark's output")
    from moesim.hw_profiles.fitting.calibrate import fit_profile, parse_tokens_per_read

    fixed = parse_tokens_per_read(tokens_per_read or [])
    report = fit_profile(table, name or out.stem, filters or [], device_json, backend, fixed, passes)
    caption = "absolute relative time error in %; shape_out / routing_out = held out; epsilon = default bound (p90 coverage)"
    render_table(report.summary(), title=f"{report.profile.name}: fitted families ({report.rows} rows)", caption=caption)
    render_table(report.groups(), title="Held-out error per left-out group")
    if report.transfers:
        caption = "whole passes, leave one model out: the sum of the layers vs the best T = a·Σt + b·L; applied only if clearly better"
        render_table(report.transfer_summary(), title="Pass-level terms (whole passes)", caption=caption)
    for fit in report.fits:
        console.print(f"{fit.family.name}: {fit.family.note}", markup=False)
    for note in report.notes:
        console.print(f"note: {note}")
    write_profile(out, report.profile)
    console.print(f"wrote {out}")


@app.command("import")
def profile_import(
    output: Annotated[Path, typer.Argument(help="A benchmark's output, or the shared public table.")],
    out: Annotated[Path, typer.Option(help="Measurement table to write (.csv or .parquet, contract 3)."), OUT_FILE],
    model: ModelOpt = None,
    device: DeviceOpt = None,
    weight_format: FormatOpt = None,
    table_format: TableFormatOpt = None,
    filters: FiltersOpt = None,
    rows: Annotated[str | None, typer.Option(help="Row numbers of the public table, e.g. 31-49,51.")] = None,
) -> None:
    """Read a benchmark's output into a measurement table with each row's scope (one op, or a whole pass)."""
    from moesim.atomic import check_writable
    from moesim.hw_profiles.importers import ImportOptions, choose_variant, import_table, parse_rows, write_table

    check_writable(out)
    options = ImportOptions(model, device, weight_format, tuple(filters or ()), parse_rows(rows) if rows else None)
    options, note = choose_variant(output, table_format, options)
    if note:
        console.print(note, markup=False)
    fmt, frame = import_table(output, table_format, options)
    write_table(frame, out)
    console.print(f"wrote {out}: {frame.height} rows of {fmt} output ({', '.join(sorted(set(frame['scope'].to_list())))} scope)")


@app.command("list")
def profile_list(as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list of objects with a 'name'.")] = False) -> None:
    """List the built-in profiles."""
    from moesim.hw_profiles.report import builtin_entries

    entries = builtin_entries()
    if as_json:
        print_json(entries)
        return
    caption = (
        "calibrated = fitted from the H200 lab measurements; published-calibrated = an engine fitted on the shared public tables "
        "(partial: few rows); datasheet-scaled = a calibration of the same engine scaled to the device (uncertain)"
    )
    frame = pl.DataFrame(entries).drop("engine_version").with_columns(pl.col("families").list.join(" "))
    render_table(frame, title="Built-in hardware profiles", caption=caption)


@app.command("show")
def profile_show(
    profile: Annotated[str, typer.Argument(help="Built-in profile name or profile TOML path.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    model: Annotated[str, typer.Option(help="Model preset whose expert shape and routing r(n) uses.")] = "deepseek-v2-lite",
    weight_format: Annotated[str | None, typer.Option("--format", help="Weight format of the experts (default: the preset's).")] = None,
) -> None:
    """Show a profile: device, roofline, families with fit errors, sources, and r(n) for uniform routing."""
    from moesim.hw_profiles import load_profile
    from moesim.hw_profiles.report import dedup_comparison, describe_profile
    from moesim.models import load_target

    loaded = load_profile(profile)
    preset = load_target(model)
    shape = preset.expert_shape(weight_format)
    comparison = dedup_comparison(loaded, shape, preset.experts, preset.top_k)
    description = describe_profile(loaded)
    if as_json:
        print_json({**description, "r_of_n": {"model": preset.name, "routing": "uniform", "rows": comparison.to_dicts()}})
        return
    console.print(f"[bold]{loaded.name}[/bold] ({loaded.status}): {loaded.description}")
    console.print(description["device_line"], markup=False)
    caption = "errors in %: shape_out / routing_out = held-out median (p90); epsilon = default relative bound"
    render_table(pl.DataFrame(description["family_rows"]), title="Families", caption=caption)
    if description["dispatch"]:
        render_table(pl.DataFrame(description["dispatch"]), title="Dispatch (first rule that holds)", caption="n = tokens per pass")
    caption = "bound of each rung = its held-out p90 error, one layer / whole passes (% ; - = not measured); shape fits: rows weighted"
    render_table(pl.DataFrame(description["ladder_rows"]), title="Lookup ladder", caption=caption)
    if "speculative" in description:
        spec = loaded.speculative
        render_table(
            pl.DataFrame(description["speculative"]),
            title=f"Engine terms ({spec.covers or spec.engine})",
            caption=f"E = pass_us + launch_us_per_layer·layers (eager: beyond {spec.graph_max_tokens} tokens per forward"
            f"{', or any verify' if spec.verify_eager else ''}) on every forward; O = iteration + (draft_step + a draft model's E)·steps "
            f"+ verified_token·tokens per speculative iteration; bound ±{100 * spec.heldout_error:.0f} % beyond each term's",
        )
    render_table(pl.DataFrame(description["source_rows"]), title="Sources")
    for note in loaded.all_notes():
        console.print(f"note: {note}", markup=False)
    title = f"Per-slot vs dedup, {preset.name} experts ({shape.weight_format}), uniform routing"
    caption = "r = BW_dedup / BW_per_slot = u·T_per_slot / T_dedup; dedup is faster where u < r; extrapolated = family x beyond its range"
    render_table(comparison, title=title, caption=caption)


@app.command("derive")
def profile_derive(
    base: Annotated[str, typer.Argument(help="Built-in profile name or profile TOML path.")],
    bandwidth_scale: Annotated[float, typer.Option(help="Multiply every bandwidth by X.")],
    out: Annotated[Path, typer.Option(help="Profile TOML to write."), OUT_FILE],
    compute_scale: Annotated[float, typer.Option(help="Multiply every FLOP rate by Y.")] = 1.0,
    fixed_us: Annotated[float | None, typer.Option(help="Fixed time per pass in µs (default: the base's).")] = None,
    name: Annotated[str | None, typer.Option(help="Profile name (default: the output file's stem).")] = None,
) -> None:
    """Write a what-if profile: a base profile with scaled bandwidth and compute."""
    from moesim.atomic import check_writable
    from moesim.hw_profiles import load_profile
    from moesim.hw_profiles.fitting.derive import derive_profile
    from moesim.hw_profiles.schema import write_profile

    check_writable(out)
    derived = derive_profile(load_profile(base), name or out.stem, bandwidth_scale, compute_scale, fixed_us)
    write_profile(out, derived)
    console.print(f"wrote {out}: {derived.description}")


@app.command("fit-engine")
@config_options(RunContext, include=RUN_OPTIONS)
def profile_fit_engine(
    outputs: Annotated[
        list[str],
        typer.Argument(help="The engine's benchmark outputs (FILE, or FILE@batch=8,output_len=128 for what a file does not say)."),
    ],
    profile: Annotated[str, typer.Option(help="Profile of the device (built-in name or TOML): the kernels the engine's time adds to.")],
    model: Annotated[str, typer.Option(help="The target's dense preset (name, .toml or config.json).")],
    out: Annotated[
        Path, typer.Option(help="Profile TOML to write: the profile with the engine's fitted terms as its speculative table."), OUT_FILE
    ],
    weight_format: FormatOpt = None,
    drafter: Annotated[
        str | None, typer.Option(help="Drafter of the speculative runs (a drafter spec, e.g. a draft preset): prices their drafting.")
    ] = None,
    run_format: Annotated[str | None, typer.Option(help="The outputs' format (default: detected from each file's content).")] = None,
    rows: Annotated[
        Path | None, typer.Option(help="Also write the rows read (decode_steps.csv, speculative_runs.csv) here."), OUT_DIR
    ] = None,
    force: ForceOpt = False,
    name: Annotated[str | None, typer.Option(help="Profile name (default: the output file's stem).")] = None,
    **options: Any,
) -> None:
    """Fit a serving engine's own time on a device from your runs (plain decoding at a few batch sizes, a speculative run); write it."""
    from moesim.atomic import check_out_dir, check_writable, output_dir, protect
    from moesim.cli.options import from_options
    from moesim.hw_profiles import load_profile
    from moesim.hw_profiles.engine_runs import context_of_options, read_outputs, split_annotation, write_rows
    from moesim.hw_profiles.schema import write_profile
    from moesim.sim.engine.user_runs import fit_user_engine

    paths = [split_annotation(argument)[0] for argument in outputs]
    protect(*paths)
    check_writable(out)
    if rows is not None:
        check_out_dir(rows, force)
    context = context_of_options(from_options(RunContext, options, RUN_OPTIONS), model=model)
    base = load_profile(profile)
    read = read_outputs(outputs, context, run_format)
    result = fit_user_engine(read, paths, base, model, weight_format, drafter, context.device, name or out.stem)
    spec = result.fit.spec
    title = f"{spec.engine} on {result.device_key}: {len(read.steps)} plain-decoding rows, {len(read.runs)} speculative"
    render_table(result.rows_table(), title=title, caption="µs; predicted = kernels (the device's datasheet dense family) + the terms")
    caption = f"held out (each row's source left out, predicted): median {100 * spec.heldout_error:.1f} %"
    render_table(result.terms_table(), title=f"Engine terms of {spec.engine} on {result.device_key}", caption=caption)
    if result.fit.runs:
        render_table(result.runs_table(), title="Speculative runs: measured and fitted speedup")
    for source, reason in result.left_out:
        console.print(f"left out: {source}: {reason}", markup=False)
    if rows is not None:
        with output_dir(rows, force) as staging:
            write_rows(read, staging)
        console.print(f"wrote {rows}: the rows read, in the shared engine-overheads columns")
    write_profile(out, result.profile)
    console.print(f"wrote {out}")
