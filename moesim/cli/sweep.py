"""`moesim sweep` (grids of the closed forms and SimPy cells, one Parquet file) and `moesim report`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.atomic import check_out_dir
from moesim.cli.analysis import JsonOpt
from moesim.cli.options import OUT_DIR, OUT_FILE, ForceOpt
from moesim.cli.render import console, interrupted, note, print_json, progress
from moesim.errors import interrupt_code


def sweep_command(
    config: Annotated[Path, typer.Argument(help="Sweep config (TOML); reference in docs/sweeps.md.")],
    out: Annotated[
        Path | None, typer.Option(help="Parquet file to write (default: the config's name + .parquet, beside it)."), OUT_FILE
    ] = None,
    executor: Annotated[str | None, typer.Option(help="local or ray (default: the config's [sweep] executor).")] = None,
    workers: Annotated[
        int | None, typer.Option(help="Worker processes / Ray CPUs, 0 = all cores (default: the config's).", min=0, max=1 << 16)
    ] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Discard this config's partial results instead of resuming.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Sweep models × profiles × engines × drafters × routing × batch × n × k × α into one Parquet file (resumable)."""
    from moesim.sim.sweep.config import load_config
    from moesim.sim.sweep.run import default_out, kept_units, run_sweep

    sweep_config = load_config(config)
    note(sweep_config.notes)
    target = out if out is not None else default_out(config)
    total = [0]

    def on_unit(done: int, units: int) -> None:
        total[0] = units
        update(done, units, done)

    try:
        with progress(f"sweeping {config.name}", "units", enabled=not as_json) as update:
            summary = run_sweep(sweep_config, target, executor, workers, fresh, on_unit)
    except KeyboardInterrupt as exc:
        folder, kept = kept_units(sweep_config, target)
        interrupted(f"{kept} of {total[0]} units kept in {folder}; run the same command again to resume", interrupt_code(exc))
        raise typer.Exit(interrupt_code(exc)) from None
    if as_json:
        print_json(summary.to_dict())
        return
    console.print(
        f"wrote {summary.out}: {summary.rows:,} rows, {summary.points:,} (α, k) points from {summary.units} units "
        f"({summary.resumed} resumed) in {summary.elapsed_s:.1f} s ({summary.points_per_s:,.0f} points/s)"
    )
    sim = summary.simulation
    if sim.cells:
        console.print(
            f"SimPy cells: {sim.cells:,} policy runs, {sim.iterations:,} engine iterations simulated in {sim.seconds:.1f} s "
            f"({summary.simulated_iterations_per_s:,.0f} iterations/s, {sim.cells / sim.seconds:.2f} cells/s)"
        )


def report_command(
    results: Annotated[list[Path], typer.Argument(help="Sweep results (Parquet) and/or predictions.parquet from `moesim validate`.")],
    out: Annotated[Path, typer.Option(help="Report folder to write (index.html, PNG and SVG plots)."), OUT_DIR],
    filters: Annotated[
        list[str] | None, typer.Option("--filter", help="Select sweep rows COLUMN=VALUE (repeatable), e.g. model=qwen3-30b-a3b.")
    ] = None,
    alpha: Annotated[list[float] | None, typer.Option("--alpha", help="Acceptance rates of the batch plot (repeatable).")] = None,
    force: ForceOpt = False,
) -> None:
    """Plots (PNG and SVG) and a self-contained HTML page from sweep results and validation predictions."""
    from moesim.sim.report.page import write_report

    check_out_dir(out, force)
    report = write_report(results, out, filters or [], alpha or [], force)
    note(report.notes)
    console.print(f"report written to {report.out_dir}/index.html ({len(report.figures)} figures)")
