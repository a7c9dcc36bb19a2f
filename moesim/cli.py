"""The `moesim` command line: parses arguments, calls the packages, renders results.

No logic of its own. Every MoesimError becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import click
import polars as pl
import typer
from rich.console import Console
from rich.table import Table

from moesim.errors import InputError, MoesimError

app = typer.Typer(
    name="moesim",
    help="Trace-driven simulation of speculative decoding on Mixture-of-Experts LLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
trace_app = typer.Typer(help="Routing traces: synthesise, inspect, record, import.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")

console = Console()
err_console = Console(stderr=True)


# ---- rendering helpers ----------------------------------------------------------------------


def _format_cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, list):
        return ", ".join(_format_cell(v) for v in value)
    return str(value)


def render_table(frame: pl.DataFrame, title: str | None = None, caption: str | None = None) -> None:
    """A polars frame as a rich table on stdout."""
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for name in frame.columns:
        table.add_column(name, justify="right" if frame[name].dtype.is_numeric() else "left")
    for row in frame.iter_rows():
        table.add_row(*(_format_cell(v) for v in row))
    console.print(table)


def print_json(payload: Any) -> None:
    """One JSON object on stdout (NaN becomes null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    sys.stdout.write(json.dumps(clean(payload)) + "\n")


# ---- commands ---------------------------------------------------------------------------------


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Report folder to write.")] = Path("moesim-demo"),
) -> None:
    """Run the main job on embedded defaults and write a report folder."""
    from moesim.sim.demo import run_demo

    result = run_demo(out)
    for section in result.sections:
        render_table(section.table, section.title, section.caption)
    console.print(f"report written to {result.out_dir}/")


@trace_app.command("synth")
def trace_synth(
    model: Annotated[str, typer.Option(help="Model preset name, or a preset .toml / config.json.")],
    out: Annotated[Path, typer.Option(help="Trace file to write (Arrow IPC).")],
    tokens: Annotated[int, typer.Option(help="Tokens per sequence.")] = 1024,
    seqs: Annotated[int, typer.Option(help="Number of sequences.")] = 1,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    uniform: Annotated[bool, typer.Option("--uniform", help="Independent uniform routing.")] = False,
    sticky: Annotated[float | None, typer.Option(help="Keep each expert of the previous token with this probability.")] = None,
    zipf: Annotated[float, typer.Option(help="Zipf exponent of expert popularity (sticky; 0 = uniform).")] = 0.0,
    weight_format: Annotated[str | None, typer.Option("--format", help="Weight format (default: the preset's).")] = None,
) -> None:
    """Write a synthetic routing trace for a model preset."""
    from moesim.models import load_preset
    from moesim.tracegen.synth import Sticky, Uniform, synthesize
    from moesim.tracegen.trace import write_trace

    if uniform and sticky is not None:
        raise InputError("--uniform and --sticky exclude each other")
    generator = Sticky(keep_prob=sticky, zipf_exponent=zipf) if sticky is not None else Uniform()
    trace = synthesize(load_preset(model), generator, tokens, seqs, seed, weight_format)
    write_trace(out, trace)
    console.print(f"wrote {out}: {trace.n_seqs} sequences, {trace.n_tokens} tokens, generator {generator.name}")


@trace_app.command("info")
def trace_info(
    trace: Annotated[Path, typer.Argument(help="Trace file (Arrow IPC).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Summarise a trace: model, sequences, tokens, layers, k, experts used and reuse per layer."""
    from moesim.tracegen.summary import summarize_trace
    from moesim.tracegen.trace import read_trace

    summary = summarize_trace(read_trace(trace))
    if as_json:
        print_json(summary.to_dict())
        return
    console.print(
        f"[bold]{trace}[/bold]: model {summary.model}, engine {summary.engine} ({summary.backend}), "
        f"{summary.sequences} sequences, {summary.tokens} tokens ({summary.prompt_tokens} prompt), "
        f"{len(summary.moe_layers)} MoE layers of {summary.layers}, top-{summary.top_k} of {summary.experts} experts"
    )
    render_table(summary.per_layer_table(), title="Per MoE layer", caption="reuse = mean |S_t ∩ S_t+1| / k over consecutive positions")


# ---- moesim bytes: routing features and expert bytes per pass (issue 4) -------------------------


@app.command("bytes")
def bytes_command(
    trace: Annotated[Path, typer.Argument(help="Trace file (Arrow IPC).")],
    max_pass: Annotated[int, typer.Option("--max-pass", help="Largest pass size n, 1..64.")] = 16,
    batch: Annotated[int, typer.Option(help="Sequences verified together: union of B·n slots (B > 1 reads the whole trace).")] = 1,
    weight_format: Annotated[str | None, typer.Option("--format", help="Weight format of the byte figures (default: the trace's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Distinct experts, tokens per expert and expert bytes per pass of n tokens: per-slot vs dedup."""
    from moesim.sim.passbytes import bytes_report

    report = bytes_report(trace, max_pass, batch, weight_format)
    if as_json:
        print_json(report.to_dict())
        return
    console.print(
        f"[bold]{trace}[/bold]: model {report.model}, {len(report.moe_layers)} MoE layers, top-{report.top_k} of {report.experts} experts; "
        f"one expert = {report.bytes.expert_bytes / 1e6:.2f} MB ({report.bytes.source}); batch {report.batch}"
    )
    render_table(
        report.display_table(),
        title=f"Per pass of n tokens{'' if report.batch == 1 else f' per sequence, {report.batch} sequences'}",
        caption=f"{report.windows}. Distinct experts U per MoE layer (mean, p10/p50/p90 over windows and layers; "
        "uniform = E(1-(1-k/E)^(B·n))); byte_share u = U/(B·n·k); max tokens per expert M; bytes per pass summed over MoE layers",
    )
    render_table(report.per_layer_table(), title="Byte share u(n) per MoE layer")


# ---- hardware profiles (issue 5) ----------------------------------------------------------------

profile_app = typer.Typer(help="Hardware profiles: fit from measurements, list, show, derive what-if hardware.", no_args_is_help=True)
app.add_typer(profile_app, name="profile")


@profile_app.command("fit")
def profile_fit(
    table: Annotated[Path, typer.Argument(help="Measurement table (Parquet or CSV, contract 3).")],
    out: Annotated[Path, typer.Option(help="Profile TOML to write.")],
    name: Annotated[str | None, typer.Option(help="Profile name (default: the output file's stem).")] = None,
    filters: Annotated[list[str] | None, typer.Option("--filter", help="Keep rows where COLUMN=VALUE (repeatable, all must hold).")] = None,
    device_json: Annotated[Path | None, typer.Option(help="Device facts (default: device.json beside the table, if any).")] = None,
    backend: Annotated[str | None, typer.Option(help="cuda, metal or cpu, for a device not in the catalog.")] = None,
    tokens_per_read: Annotated[
        list[str] | None, typer.Option("--tokens-per-read", help="FAMILY=T: fix a family's tokens per weight read (0, 1, 2^k).")
    ] = None,
) -> None:
    """Fit every kernel family of a measurement table; print held-out errors; write the profile."""
    from moesim.atomic import check_writable
    from moesim.hw_profiles.calibrate import fit_profile
    from moesim.hw_profiles.schema import write_profile

    check_writable(out)
    fixed = {}
    for text in tokens_per_read or []:
        family, _, value = text.partition("=")
        if not value.strip().isdigit():
            raise InputError(f"--tokens-per-read '{text}': expected FAMILY=T with T an integer >= 0")
        fixed[family.strip()] = int(value)
    report = fit_profile(table, name or out.stem, filters or [], device_json, backend, fixed)
    caption = "absolute relative time error in %; shape_out / routing_out = held out; epsilon = default bound (p90 coverage)"
    render_table(report.summary(), title=f"{report.profile.name}: fitted families ({report.rows} rows)", caption=caption)
    render_table(report.groups(), title="Held-out error per left-out group")
    for fit in report.fits:
        console.print(f"{fit.family.name}: {fit.family.note}", markup=False)
    for note in report.notes:
        console.print(f"note: {note}")
    write_profile(out, report.profile)
    console.print(f"wrote {out}")


@profile_app.command("list")
def profile_list(as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list of objects with a 'name'.")] = False) -> None:
    """List the built-in profiles."""
    from moesim.hw_profiles import builtin_names, load_profile

    entries = []
    for profile_name in builtin_names():
        profile = load_profile(profile_name)
        entries.append(
            {
                "name": profile.name,
                "device": profile.device.name,
                "backend": profile.device.backend,
                "status": profile.status,
                "peak_bandwidth_gbps": profile.roofline.peak_bandwidth_gbps,
                "families": list(profile.families),
            }
        )
    if as_json:
        print_json(entries)
        return
    caption = "calibrated = fitted from measurements; datasheet-scaled = the calibrated H200 scaled (uncertain)"
    render_table(pl.DataFrame(entries).with_columns(pl.col("families").list.join(" ")), title="Built-in hardware profiles", caption=caption)


@profile_app.command("show")
def profile_show(
    profile: Annotated[str, typer.Argument(help="Built-in profile name or profile TOML path.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    model: Annotated[str, typer.Option(help="Model preset whose expert shape and routing r(n) uses.")] = "deepseek-v2-lite",
) -> None:
    """Show a profile: device, roofline, families with fit errors, sources, and r(n) for uniform routing."""
    from moesim.hw_profiles import load_profile
    from moesim.hw_profiles.compare import dedup_comparison
    from moesim.hw_profiles.report import describe_profile
    from moesim.models import load_preset

    loaded = load_profile(profile)
    preset = load_preset(model)
    comparison = dedup_comparison(loaded, preset.expert_shape(), preset.experts, preset.top_k)
    description = describe_profile(loaded)
    if as_json:
        print_json({**description, "r_of_n": {"model": preset.name, "routing": "uniform", "rows": comparison.to_dicts()}})
        return
    console.print(f"[bold]{loaded.name}[/bold] ({loaded.status}): {loaded.description}")
    console.print(description["device_line"], markup=False)
    caption = "errors in %: shape_out / routing_out = held-out median (p90); epsilon = default relative bound"
    render_table(pl.DataFrame(description["family_rows"]), title="Families", caption=caption)
    render_table(pl.DataFrame(description["source_rows"]), title="Sources")
    for note in loaded.all_notes():
        console.print(f"note: {note}", markup=False)
    title = f"Per-slot vs dedup, {preset.name} experts ({preset.expert_shape().weight_format}), uniform routing"
    caption = "r = BW_dedup / BW_per_slot = u·T_per_slot / T_dedup; dedup is faster where u < r; extrapolated = family x beyond its range"
    render_table(comparison, title=title, caption=caption)


@profile_app.command("derive")
def profile_derive(
    base: Annotated[str, typer.Argument(help="Built-in profile name or profile TOML path.")],
    bandwidth_scale: Annotated[float, typer.Option(help="Multiply every bandwidth by X.")],
    out: Annotated[Path, typer.Option(help="Profile TOML to write.")],
    compute_scale: Annotated[float, typer.Option(help="Multiply every FLOP rate by Y.")] = 1.0,
    fixed_us: Annotated[float | None, typer.Option(help="Fixed time per pass in µs (default: the base's).")] = None,
    name: Annotated[str | None, typer.Option(help="Profile name (default: the output file's stem).")] = None,
) -> None:
    """Write a what-if profile: a base profile with scaled bandwidth and compute."""
    from moesim.atomic import check_writable
    from moesim.hw_profiles import load_profile
    from moesim.hw_profiles.derive import derive_profile
    from moesim.hw_profiles.schema import write_profile

    check_writable(out)
    derived = derive_profile(load_profile(base), name or out.stem, bandwidth_scale, compute_scale, fixed_us)
    write_profile(out, derived)
    console.print(f"wrote {out}: {derived.description}")


# ---- entry point ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input or usage)."""
    try:
        app(args=argv, prog_name="moesim", standalone_mode=False)
    except MoesimError as exc:
        err_console.print(f"moesim: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except click.exceptions.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        err_console.print("moesim: interrupted")
        return 130
    return 0


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
