"""The `moesim` command line: parses arguments, calls the packages, renders results.

No logic of its own. Every MoesimError becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

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
    console.print(f"report written to {result.out_dir}/ (HTML report: {result.html_report})")


@trace_app.command("synth")
def trace_synth(
    model: Annotated[str, typer.Option(help="Model preset name, or a preset .toml / config.json.")],
    out: Annotated[Path, typer.Option(help="Trace file to write (Arrow IPC).")],
    tokens: Annotated[int, typer.Option(help="Tokens per sequence.")] = 1024,
    seqs: Annotated[int, typer.Option(help="Number of sequences.")] = 1,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    uniform: Annotated[bool, typer.Option("--uniform", help="Independent uniform routing.")] = False,
    sticky: Annotated[float | None, typer.Option(help="Keep each expert of the previous token with this probability.")] = None,
    zipf: Annotated[float, typer.Option(help="Zipf exponent of expert popularity (alone: independent tokens; 0 = uniform).")] = 0.0,
    weight_format: Annotated[str | None, typer.Option("--format", help="Weight format (default: the preset's).")] = None,
    params: Annotated[Path | None, typer.Option(help="Generator parameters (from `trace fit`), mapped onto the preset's layers.")] = None,
) -> None:
    """Write a synthetic routing trace for a model preset."""
    from moesim.models import load_preset
    from moesim.tracegen.synth import RoutingGenerator, Sticky, Uniform, Zipf, synthesize
    from moesim.tracegen.trace import write_trace

    if uniform and sticky is not None:
        raise InputError("--uniform and --sticky exclude each other")
    if uniform and zipf:
        raise InputError("--uniform and --zipf exclude each other")
    generator: RoutingGenerator = Sticky(keep_prob=sticky, zipf_exponent=zipf) if sticky is not None else Uniform()
    if sticky is None and zipf:
        generator = Zipf(exponent=zipf)
    preset = load_preset(model)
    if params is not None:
        from moesim.tracegen.fit import load_params
        from moesim.tracegen.schema import TraceGeometry

        if uniform or sticky is not None or zipf:
            raise InputError("--params excludes --uniform, --sticky and --zipf")
        if preset.kind != "moe":
            raise InputError(f"model preset '{preset.name}' has no experts; synthetic routing needs a MoE model")
        generator = load_params(params, TraceGeometry.from_preset(preset, weight_format))
    trace = synthesize(preset, generator, tokens, seqs, seed, weight_format)
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


# ---- simulate: the SimPy engine (issue 7) ---------------------------------------------------


class _ProgressBar:
    """A transient rich progress bar on stderr, or nothing; `callback` takes the done fraction."""

    def __init__(self, enabled: bool, description: str) -> None:
        self.bar: Any = None
        self.description = description
        self.callback: Any = None
        if enabled:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn())
            self.bar = Progress(*columns, console=err_console, transient=True)

    def __enter__(self) -> Any:
        if self.bar is not None:
            self.bar.__enter__()
            task = self.bar.add_task(self.description, total=1.0)
            self.callback = lambda fraction: self.bar.update(task, completed=fraction)
        return self.callback

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


@app.command()
def simulate(
    config: Annotated[Path, typer.Argument(help="Simulation config (TOML); reference in docs/simulator.md.")],
    out: Annotated[Path | None, typer.Option(help="Output folder (default: the config's name + '-sim', here).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary (a study: its rows) as one JSON object.")] = False,
) -> None:
    """Simulate speculative decoding of a workload: per-request and per-iteration Arrow tables and a summary."""
    from moesim.sim.simconfig import load_config
    from moesim.sim.simout import check_out_dir, summary_rows
    from moesim.sim.simulate import run_study, write_study
    from moesim.sim.simulate import simulate as run_simulation

    sim_config = load_config(config)
    out_dir = out if out is not None else Path(f"{config.stem}-sim")
    check_out_dir(out_dir)
    with _ProgressBar(not as_json and err_console.is_terminal, f"simulating {config.name}") as progress:
        if sim_config.study is not None:
            table = run_study(sim_config, progress)
            write_study(out_dir, table)
        else:
            result = run_simulation(sim_config, progress)
            result.write(out_dir)
    if sim_config.study is not None:
        if as_json:
            print_json({"rows": table.to_dicts(), "out": str(out_dir)})
            return
        caption = "speedup and worst slowdown are against the same workload with speculation off"
        shown = ["model", "workload", "policy", "throughput_tok_s", "speedup", "worst_slowdown", "mean_draft_len"]
        render_table(table.select(shown), title=f"Study {config.name}", caption=caption)
    else:
        if as_json:
            print_json({**result.summary, "out": str(out_dir)})
            return
        render_table(summary_rows(result.summary), title=f"Simulation {config.name}: {result.summary['policy_label']}")
    console.print(f"outputs written to {out_dir}/")


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


# ---- step time and closed-form analysis (issue 6) ---------------------------------------------

TraceOpt = Annotated[Path, typer.Option("--trace", help="Routing trace (Arrow IPC) whose windows the passes replay.")]
ProfileOpt = Annotated[str, typer.Option("--profile", help="Built-in hardware profile name or a profile TOML path.")]
EngineOpt = Annotated[str, typer.Option("--engine", help="per_slot, any dedup family of the profile, or best.")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Target preset (default: the trace's model).")]
DrafterOpt = Annotated[str, typer.Option("--drafter", help="ngram, eagle, fixed:US (µs per draft step), or a dense preset.")]
FormatOpt = Annotated[str | None, typer.Option("--format", help="Weight format (default: the trace's).")]
ContextOpt = Annotated[int, typer.Option("--context", help="KV tokens per sequence at the pass.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def _scenario(trace: Path, profile: str, engine: str, model: str | None, drafter: str, weight_format: str | None, context: int) -> Any:
    from moesim.sim.analysis import load_scenario

    return load_scenario(trace, profile, engine, model, drafter, weight_format, context)


def _warn(warnings: list[str]) -> None:
    for line in warnings:
        err_console.print(f"moesim: warning: {line}", markup=False, highlight=False, soft_wrap=True)


def _emit_json(result: Any, as_json: bool) -> bool:
    """A result's warnings on stderr; with --json its JSON on stdout (True: nothing left to render)."""
    _warn(result.warnings)
    if as_json:
        print_json(result.to_dict())
    return as_json


def _provenance_line(share: dict[str, float]) -> str:
    return ", ".join(f"{100 * v:.0f} % {k}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]))


@app.command("predict")
def predict_command(
    trace: TraceOpt,
    profile: ProfileOpt,
    engine: EngineOpt = "per_slot",
    max_pass: Annotated[int, typer.Option("--max-pass", help="Largest pass size n (1..64).")] = 16,
    model: ModelOpt = None,
    weight_format: FormatOpt = None,
    context: ContextOpt = 512,
    as_json: JsonOpt = False,
) -> None:
    """Pass time T(n) per pass size, expected over the trace's windows, with intervals from held-out error."""
    from moesim.sim.analysis import predict

    result = predict(_scenario(trace, profile, engine, model, "ngram", weight_format, context), max_pass)
    if _emit_json(result, as_json):
        return
    render_table(
        result.table(),
        title=f"Pass time T(n), engine {result.engine}, profile {profile}",
        caption=f"interval = each family's held-out ε (expert ±{100 * result.cost.expert_epsilon:.1f} %, "
        f"dense ±{100 * result.cost.dense_epsilon:.1f} %); time rests on: {_provenance_line(result.cost.provenance_share())}",
    )


@app.command("best-draft")
def best_draft_command(
    trace: TraceOpt,
    profile: ProfileOpt,
    alpha: Annotated[list[float], typer.Option("--alpha", help="Acceptance rate(s) in [0, 1] (repeatable).")],
    max_draft: Annotated[int, typer.Option("--max-draft", help="Largest draft length k.")] = 8,
    engine: EngineOpt = "per_slot",
    drafter: DrafterOpt = "ngram",
    model: ModelOpt = None,
    weight_format: FormatOpt = None,
    context: ContextOpt = 512,
    as_json: JsonOpt = False,
) -> None:
    """Best draft length k*(α) and its speedup, with intervals, the staircase and break-even acceptances."""
    from moesim.sim.analysis import best_draft_analysis

    result = best_draft_analysis(_scenario(trace, profile, engine, model, drafter, weight_format, context), alpha, max_draft)
    if _emit_json(result, as_json):
        return
    render_table(
        result.table(),
        title=f"Best draft length, engine {engine}, drafter {drafter}, profile {profile}",
        caption="best_draft_range: the best k over the corners of the error box (ambiguous when it spans several)",
    )
    steps = ", ".join(f"k={k} from α={a:.3f}" for a, k in result.steps)
    console.print(f"staircase: {steps}")


@app.command("crossover")
def crossover_command(
    trace: TraceOpt,
    profile: ProfileOpt,
    dedup_family: Annotated[str, typer.Option("--dedup-family", help="The deduplicating family compared with per_slot.")] = "dedup",
    max_pass: Annotated[int, typer.Option("--max-pass", help="Largest pass size n (1..64).")] = 32,
    model: ModelOpt = None,
    weight_format: FormatOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Where deduplicating expert reads wins: u(n), r(n), the crossover and the whole win set."""
    from moesim.sim.analysis import crossover_analysis

    result = crossover_analysis(_scenario(trace, profile, "per_slot", model, "ngram", weight_format, 0), dedup_family, max_pass)
    if _emit_json(result, as_json):
        return
    render_table(
        result.table(),
        title=f"per_slot vs {dedup_family} expert time per MoE pass, profile {profile}",
        caption="dedup wins at n iff T_dedup(n) < T_per_slot(n), i.e. u(n) < r(n)",
    )
    console.print(
        f"crossover n = {result.crossover_n} (range over the error box {result.crossover_range}); dedup wins at {result.dedup_wins}; "
        f"uniform routing: crossover {result.uniform_crossover_n}"
    )


@app.command("batch")
def batch_command(
    trace: TraceOpt,
    profile: ProfileOpt,
    alpha: Annotated[float, typer.Option("--alpha", help="Acceptance rate in [0, 1].")],
    draft: Annotated[int, typer.Option("--draft", help="Draft length k (>= 1).")],
    batch: Annotated[str, typer.Option("--batch", help="Batch sizes, comma-separated.")] = "1,2,4,8,16,32",
    engine: EngineOpt = "per_slot",
    drafter: DrafterOpt = "ngram",
    moesd_slots: Annotated[
        bool, typer.Option("--moesd-slots", help="Verify γ = k slots per sequence (MoESD's convention) instead of k + 1.")
    ] = False,
    routing: Annotated[str, typer.Option("--routing", help="trace, or uniform (N(t) of independent uniform routing).")] = "trace",
    model: ModelOpt = None,
    weight_format: FormatOpt = None,
    context: ContextOpt = 512,
    as_json: JsonOpt = False,
) -> None:
    """Speedup and MoESD target efficiency T(B,1)/T(B,k+1) vs batch size."""
    from moesim.sim.analysis import batch_analysis

    try:
        sizes = [int(b) for b in batch.split(",") if b.strip()]
    except ValueError:
        raise InputError(f"--batch must be comma-separated integers, got '{batch}'") from None
    scenario = _scenario(trace, profile, engine, model, drafter, weight_format, context)
    result = batch_analysis(scenario, alpha, draft, sizes, moesd_slots, routing)
    if _emit_json(result, as_json):
        return
    render_table(
        result.table(),
        title=f"Batch effect at α = {alpha}, k = {draft} (verify {result.verify_tokens} tokens per sequence), engine {engine}",
        caption="target_efficiency = T(B,1)/T(B,v) (MoESD); speedup = τ(k,α)·T(B,1)/(T_draft + T(B,k+1))",
    )


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


# ---- routing traces from real engines: tiny models, recording, speculative runs, import, fit ----


def _progress(label: str, unit: str) -> tuple[Any, Any]:
    """A rich progress bar on stderr (transient) and the callback the recorders call."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn(f"[bold]{label}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[count]} " + unit),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,  # nothing at all on a pipe or a log file
    )
    task = progress.add_task(label, total=None, count=0)

    def update(done: int, total: int, count: int) -> None:
        progress.update(task, completed=done, total=total, count=count)

    return progress, update


@trace_app.command("tiny-model")
def trace_tiny_model(
    out: Annotated[Path, typer.Option(help="GGUF file to write.")],
    arch: Annotated[str | None, typer.Option(help="qwen3moe, llama (Mixtral style), qwen2moe, olmoe or deepseek2.")] = None,
    layers: Annotated[int | None, typer.Option(help="Transformer blocks.")] = None,
    experts: Annotated[int | None, typer.Option(help="Routed experts per MoE layer (llama: 0 = dense).")] = None,
    top_k: Annotated[int | None, typer.Option(help="Experts per token.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Embedding width.")] = None,
    expert_ff: Annotated[int | None, typer.Option(help="Intermediate width of one expert.")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="Key/value heads.")] = None,
    vocab: Annotated[int | None, typer.Option(help="Vocabulary size (259..1030; byte-level SentencePiece).")] = None,
    weight_type: Annotated[str | None, typer.Option(help="F32 or F16.")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed of the weights.")] = None,
    leading_dense: Annotated[int | None, typer.Option(help="deepseek2: leading dense layers.")] = None,
    draft_of: Annotated[Path | None, typer.Option(help="Write a noisy copy of this moesim-built GGUF (a draft model).")] = None,
    noise: Annotated[float | None, typer.Option(help="With --draft-of: noise added to every weight (0: identical).")] = None,
) -> None:
    """Write a random MoE model as GGUF (100 KB to several GB), or a noisy draft copy of one."""
    from moesim.tracegen.gguf_builder import TinyModelSpec, build_draft_model, build_tiny_model, expert_weight_bytes
    from moesim.tracegen.gguf_meta import read_tiny_spec

    shape = {
        "arch": arch, "layers": layers, "experts": experts, "top_k": top_k, "hidden": hidden, "expert_ff": expert_ff, "heads": heads,
        "kv_heads": kv_heads, "vocab": vocab, "weight_type": weight_type, "seed": seed, "leading_dense": leading_dense,
    }  # fmt: skip
    given = {k: v for k, v in shape.items() if v is not None}
    if draft_of is not None:
        if given:
            raise InputError(f"--draft-of takes the shape from {draft_of}; drop --{sorted(given)[0].replace('_', '-')}")
        if noise is None:
            raise InputError("--draft-of needs --noise (0 gives an identical copy)")
        spec = read_tiny_spec(draft_of)
        build_draft_model(spec, noise, out)
        spec = read_tiny_spec(out)
    else:
        if noise is not None:
            raise InputError("--noise needs --draft-of TARGET.gguf")
        if "weight_type" in given:
            given["weight_type"] = str(given["weight_type"]).upper()
        spec = TinyModelSpec(**given)
        build_tiny_model(out, spec)
    size_mb = out.stat().st_size / 1e6
    console.print(f"wrote {out}: {spec.model_name}, {size_mb:.2f} MB ({expert_weight_bytes(spec) / 1e6:.2f} MB of routed experts)")


@trace_app.command("record")
def trace_record(
    model: Annotated[Path, typer.Argument(help="GGUF MoE model.")],
    prompts: Annotated[Path, typer.Option(help="Prompts: text, one per line, or .jsonl with a 'prompt' field.")],
    out: Annotated[Path | None, typer.Option(help="Trace to write (default: MODEL.trace.arrow here).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated greedily per prompt.")] = 32,
    threads: Annotated[int, typer.Option(help="CPU threads (0: all this process may use).")] = 0,
    prompt_batch: Annotated[int, typer.Option(help="Prompt tokens per decode (0: whole prompt; 1: token by token).")] = 0,
    weights: Annotated[bool, typer.Option(help="Record gate weights.")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show llama.cpp's log.")] = False,
) -> None:
    """Record per-token, per-layer expert routing from a GGUF model through llama.cpp."""
    from moesim.tracegen.prompts import load_prompts
    from moesim.tracegen.recorder import RecordConfig, record_trace

    target = out or Path(f"{model.stem}.trace.arrow")
    config = RecordConfig(max_tokens=max_tokens, prompt_batch=prompt_batch, n_threads=threads, with_weights=weights, verbose=verbose)
    prompt_set = load_prompts(prompts)
    progress, update = _progress("recording", "positions")
    with progress:
        result = record_trace(model, prompt_set, target, config, update)
    if result.interrupted:
        kept = f"kept {result.prompts_done} completed prompts in {result.path}" if result.path else "no prompt completed, no file written"
        err_console.print(f"moesim: interrupted: {kept}", markup=False, highlight=False)
        raise typer.Exit(130)
    console.print(
        f"wrote {result.path}: {result.prompts_done} prompts, {result.positions} positions ({result.generated} generated) "
        f"in {result.seconds:.2f} s ({result.tokens_per_s:.0f} positions/s with routing capture)"
    )


@trace_app.command("speculate")
def trace_speculate(
    target: Annotated[Path, typer.Argument(help="Target GGUF MoE model.")],
    draft: Annotated[Path, typer.Argument(help="Draft GGUF model (same vocabulary).")],
    prompts: Annotated[Path, typer.Option(help="Prompts: text, one per line, or .jsonl with a 'prompt' field.")],
    draft_len: Annotated[int, typer.Option(help="Tokens drafted per step (k).")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Generate at least this many tokens per prompt.")] = 32,
    out: Annotated[Path | None, typer.Option(help="Run to write (default: TARGET.spec-kK.arrow here).")] = None,
    threads: Annotated[int, typer.Option(help="CPU threads (0: all this process may use).")] = 0,
    baseline: Annotated[bool, typer.Option(help="Also time plain greedy decoding of the target (T(1)).")] = True,
    weights: Annotated[bool, typer.Option(help="Record gate weights.")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show llama.cpp's log.")] = False,
) -> None:
    """Run greedy draft-then-verify decoding through llama.cpp and write a measured speculative run."""
    from moesim.tracegen.prompts import load_prompts
    from moesim.tracegen.specrun import read_spec_run, spec_run_summary
    from moesim.tracegen.speculate import SpeculateConfig, speculative_run

    path = out or Path(f"{target.stem}.spec-k{draft_len}.arrow")
    config = SpeculateConfig(
        draft_len=draft_len, max_tokens=max_tokens, n_threads=threads, with_weights=weights, baseline=baseline, verbose=verbose
    )
    prompt_set = load_prompts(prompts)
    progress, update = _progress("speculating", "steps")
    with progress:
        result = speculative_run(target, draft, prompt_set, path, config, update)
    if result.interrupted:
        kept = f"kept {result.prompts_done} completed prompts in {result.path}" if result.path else "no prompt completed, no file written"
        err_console.print(f"moesim: interrupted: {kept}", markup=False, highlight=False)
        raise typer.Exit(130)
    summary = spec_run_summary(read_spec_run(path))
    console.print(f"wrote {path}: {result.prompts_done} prompts, {result.steps} verify steps")
    caption = "times are wall-clock means per step on contexts without routing capture"
    render_table(pl.DataFrame([summary]), title="Speculative run", caption=caption)


@trace_app.command("import")
def trace_import(
    source_path: Annotated[Path, typer.Argument(help="Table (.csv/.parquet), router logits (.safetensors/.npz) or vLLM step dumps.")],
    model: Annotated[str, typer.Option(help="Model preset name, or a preset .toml / config.json.")],
    out: Annotated[Path, typer.Option(help="Trace file to write (Arrow IPC).")],
    weight_format: Annotated[str | None, typer.Option("--format", help="Weight format (default: the preset's).")] = None,
    source: Annotated[str, typer.Option(help="auto, table, hf-logits or vllm.")] = "auto",
    normalize: Annotated[bool, typer.Option(help="hf-logits: renormalise the top-k probabilities (norm_topk_prob).")] = False,
) -> None:
    """Import routing recorded elsewhere into a moesim trace."""
    from moesim.atomic import check_writable
    from moesim.models import load_preset
    from moesim.tracegen.importers import import_routing
    from moesim.tracegen.schema import TraceGeometry
    from moesim.tracegen.trace import write_trace

    preset = load_preset(model)
    if preset.kind != "moe":
        raise InputError(f"model preset '{preset.name}' has no experts; routing needs a MoE model")
    check_writable(out)
    trace = import_routing(source_path, TraceGeometry.from_preset(preset, weight_format), source, normalize)
    write_trace(out, trace)
    console.print(f"wrote {out}: {trace.n_seqs} sequences, {trace.n_tokens} positions from {source_path} ({trace.meta.engine})")


@trace_app.command("fit")
def trace_fit(
    trace: Annotated[Path, typer.Argument(help="Trace file (Arrow IPC).")],
    out: Annotated[Path, typer.Option(help="Parameter file to write (TOML).")],
    seed: Annotated[int, typer.Option(help="Seed of the simulations.")] = 0,
    max_positions: Annotated[int, typer.Option(help="Fit on at most this many positions (first sequences).")] = 1 << 15,
) -> None:
    """Fit the mixture routing generator per MoE layer (for `trace synth --params`)."""
    from moesim.atomic import check_writable
    from moesim.tracegen.fit import fit_mixture, write_fit
    from moesim.tracegen.trace import read_trace

    check_writable(out)
    source = read_trace(trace)
    result = fit_mixture(source, seed=seed, max_positions=max_positions)
    write_fit(out, result, trace, source.meta.geometry)
    g = result.generator
    table = pl.DataFrame(
        {
            "layer": list(source.meta.geometry.moe_layers),
            "keep_prob": list(g.keep_prob),  # type: ignore[arg-type]
            "keep_prob_2..4": [list(v) for v in zip(g.keep_prob_2, g.keep_prob_3, g.keep_prob_4, strict=True)],  # type: ignore[arg-type]
            "zipf_exponent": list(g.zipf_exponent),  # type: ignore[arg-type]
            "seq_dispersion": list(g.seq_dispersion),  # type: ignore[arg-type]
            "reuse_1_source": result.source.reuse[:, 0],
            "reuse_1_fitted": result.fitted.reuse[:, 0],
            "share_D_source": result.source.share_far,
            "share_D_fitted": result.fitted.share_far,
        }
    )
    title = f"Mixture routing fitted to {trace} ({result.positions} positions, {result.sequences} sequences)"
    caption = f"reuse_1 = mean |S_t ∩ S_t+1| / k; share_D = distinct experts in a window of D = {result.far_distances[1]} tokens / (D·k)"
    render_table(table, title=title, caption=caption)
    console.print(f"wrote {out}")


# ---- validate: predicted vs measured (issue 8) ------------------------------------------------


@app.command("validate")
def validate_command(
    measured: Annotated[list[Path], typer.Argument(help="Measurement tables (.parquet/.csv) and/or speculative runs (.arrow).")],
    profile: ProfileOpt,
    trace: Annotated[Path | None, typer.Option("--trace", help="Trace of window rows without a 'trace' column.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Target preset of whole passes (default: the row's or trace's).")] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="Family of the speculative runs' kernel (default: the only one).")] = None,
    context: Annotated[int, typer.Option("--context", help="KV tokens of whole-pass rows that carry no position.")] = 512,
    filters: Annotated[list[str] | None, typer.Option("--filter", help="COL=VALUE: keep matching rows only (repeatable).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Folder to write predictions.parquet into.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Predict every measured row with a profile and compare: errors, dedup savings and crossovers, best draft."""
    from moesim.sim.validate import ValidateOptions, check_out_dir, validate

    if out is not None:
        check_out_dir(out)
    options = ValidateOptions(profile, trace, model, engine, context, tuple(filters or ()))
    result = validate(measured, options)
    path = result.write(out) if out is not None else None
    if _emit_json(result, as_json):
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


# ---- microbenchmarks (measurement tables, contract 3) ----------------------------------------

microbench_app = typer.Typer(
    help="Microbenchmarks of one MoE layer's expert operation; each writes a measurement table.", no_args_is_help=True
)
app.add_typer(microbench_app, name="microbench")


def _microbench_progress(message: str) -> None:
    err_console.print(message, markup=False, highlight=False)


def _report_table(path: Path, rows: list[dict[str, Any]], provenance: dict[str, Any]) -> None:
    frame = pl.DataFrame(rows)
    n_tokens = pl.col("n_tokens")
    summary = frame.group_by("kernel", "engine").agg(pl.len().alias("rows"), n_tokens.min().alias("n_min"), n_tokens.max().alias("n_max"))
    render_table(summary.sort("kernel", "engine"))
    console.print(f"wrote {path} ({frame.height} rows) and {path.parent / 'provenance.json'}", soft_wrap=True)
    for failure in provenance.get("failures", []):
        err_console.print(f"warning: {failure['engine']} on {failure['model']} dropped: {failure['error']}", markup=False, highlight=False)
    if "stopped_early" in provenance:
        err_console.print(f"warning: time budget used up before n = {provenance['stopped_early']['before_n_tokens']}", markup=False)


@microbench_app.command("torch")
def microbench_torch(
    out: Annotated[Path, typer.Option(help="Output folder (measurements.parquet, provenance.json).")],
    model: Annotated[list[str] | None, typer.Option(help="Model preset whose expert shape is measured (repeatable).")] = None,
    pass_sizes: Annotated[str, typer.Option(help="Tokens per pass, e.g. 1-16,24,32.")] = "1-16,24,32,48,64,96,128",
    routing: Annotated[list[str] | None, typer.Option(help="same, uniform, distinct (repeatable; default all).")] = None,
    engine: Annotated[list[str] | None, typer.Option(help="Engines to time (repeatable; default all).")] = None,
    reps: Annotated[int, typer.Option(help="Timed repetitions per point (median reported).")] = 30,
    warmup: Annotated[int, typer.Option(help="Discarded warm-up repetitions.")] = 5,
    layers: Annotated[int, typer.Option(help="Weight copies rotated so weights come from memory, not cache.")] = 4,
    device: Annotated[str, typer.Option(help="cuda, cuda:N, or cpu (tests the code path; not a calibration).")] = "cuda",
    dtype: Annotated[str, typer.Option(help="Weight dtype: bf16, f16, f32.")] = "bf16",
    max_seconds: Annotated[float, typer.Option(help="Stop before the next pass size after this many seconds.")] = 200.0,
    seed: Annotated[int, typer.Option(help="Random seed (routings, weights).")] = 0,
) -> None:
    """Time per-slot and deduplicating expert kernels through torch (CUDA graphs) and write a table."""
    from moesim.hw_profiles.microbench.routing import ROUTINGS, parse_pass_sizes
    from moesim.hw_profiles.microbench.table import prepare_out_dir, write_measurements
    from moesim.hw_profiles.microbench.torch_cuda import TorchBenchConfig, run_torch_microbench, torch_shapes

    defaults = TorchBenchConfig()
    config = TorchBenchConfig(
        pass_sizes=parse_pass_sizes(pass_sizes),
        routings=tuple(routing or ROUTINGS),
        engines=tuple(engine or defaults.engines),
        reps=reps,
        warmup=warmup,
        layers=layers,
        device=device,
        dtype=dtype,
        max_seconds=max_seconds,
        seed=seed,
    )
    config.validate()
    shapes = torch_shapes(model or ["deepseek-v2-lite", "qwen3-30b-a3b"], dtype)
    prepare_out_dir(out)
    result = run_torch_microbench(config, shapes, progress=_microbench_progress)
    path = write_measurements(result.rows, out, result.provenance, result.device)
    _report_table(path, result.rows, result.provenance)


@microbench_app.command("llama-cpp")
def microbench_llama_cpp(
    out: Annotated[Path, typer.Option(help="Output folder (measurements.parquet, provenance.json).")],
    model: Annotated[list[str] | None, typer.Option(help="Model preset whose expert shape is built (repeatable).")] = None,
    weight_type: Annotated[str, typer.Option(help="Weight type of the built models: F16 or F32.")] = "F16",
    experts: Annotated[int | None, typer.Option(help="Override the preset's routed experts.")] = None,
    top_k: Annotated[int | None, typer.Option(help="Override the preset's top-k.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Override the preset's hidden size.")] = None,
    expert_intermediate: Annotated[int | None, typer.Option(help="Override the preset's expert width.")] = None,
    layers: Annotated[int, typer.Option(help="L: models with L and 2L MoE layers are differenced.")] = 1,
    heads: Annotated[int, typer.Option(help="Attention heads of the built models.")] = 16,
    kv_heads: Annotated[int, typer.Option(help="KV heads of the built models.")] = 1,
    pass_sizes: Annotated[str, typer.Option(help="Tokens per pass, e.g. 1-16,24,32.")] = "1-16,24,32,48,64",
    routing: Annotated[list[str] | None, typer.Option(help="same, uniform, distinct (repeatable; default all).")] = None,
    reps: Annotated[int, typer.Option(help="Timed repetitions per pass and model (medians differenced).")] = 9,
    warmup: Annotated[int, typer.Option(help="Discarded warm-up repetitions.")] = 2,
    prefix: Annotated[int, typer.Option(help="Tokens prefilled before the timed passes.")] = 32,
    threads: Annotated[int, typer.Option(help="Decode threads (0: every CPU this process may use).")] = 0,
    subtract_attention: Annotated[bool, typer.Option(help="Subtract the attention layer time measured on dense twins.")] = True,
    per_slot_max_tokens: Annotated[int | None, typer.Option(help="Largest pass size run per-slot (default: per backend).")] = None,
    models_dir: Annotated[Path | None, typer.Option(help="Keep the built GGUF models here (default: a temporary folder).")] = None,
    statistic: Annotated[str, typer.Option(help="Per-model statistic differenced: median, or min on a shared machine.")] = "median",
    seed: Annotated[int, typer.Option(help="Random seed (weights, routings).")] = 0,
) -> None:
    """Time one MoE layer's expert operation through llama.cpp (L vs 2L layers) and write a table."""
    from moesim.hw_profiles.microbench.llama_cpp import LlamaBenchConfig, run_llamacpp_shapes
    from moesim.hw_profiles.microbench.routing import ROUTINGS, parse_pass_sizes
    from moesim.hw_profiles.microbench.table import MoeShape, prepare_out_dir, write_measurements
    from moesim.models import load_preset

    overrides = {"experts": experts, "top_k": top_k, "hidden": hidden, "expert_intermediate": expert_intermediate}
    shapes = [MoeShape.from_preset(load_preset(m), weight_type).with_overrides(**overrides) for m in model or ["deepseek-v2-lite"]]
    config = LlamaBenchConfig(
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        pass_sizes=parse_pass_sizes(pass_sizes),
        routings=tuple(routing or ROUTINGS),
        reps=reps,
        warmup=warmup,
        prefix=prefix,
        n_threads=threads,
        subtract_attention=subtract_attention,
        per_slot_max_tokens=per_slot_max_tokens,
        statistic=statistic,
        seed=seed,
    )
    prepare_out_dir(out)
    result = run_llamacpp_shapes(config, shapes, models_dir, progress=_microbench_progress)
    path = write_measurements(result.rows, out, result.provenance)
    _report_table(path, result.rows, result.provenance)


@microbench_app.command("import-backend-ops")
def microbench_import_backend_ops(
    log: Annotated[Path, typer.Argument(help="Console output of `test-backend-ops perf -o MUL_MAT_ID`.")],
    out: Annotated[Path, typer.Option(help="Output folder (measurements.parquet, provenance.json).")],
    backend: Annotated[str | None, typer.Option(help="cpu, cuda or metal (default: from the log's backend name).")] = None,
    per_slot_max_tokens: Annotated[
        int | None, typer.Option(help="Largest pass size run by a per-slot kernel (default: per backend, see docs).")
    ] = None,
) -> None:
    """Turn llama.cpp's MUL_MAT_ID perf cases into a measurement table (one expert matrix x 3 per row)."""
    from moesim.hw_profiles.microbench.backend_ops import import_backend_ops
    from moesim.hw_profiles.microbench.table import prepare_out_dir, write_measurements

    prepare_out_dir(out)
    result = import_backend_ops(log, backend, per_slot_max_tokens)
    path = write_measurements(result.rows, out, result.provenance)
    _report_table(path, result.rows, result.provenance)
    for type_name, count in result.provenance["skipped_types"].items():
        err_console.print(f"note: {count} cases of type {type_name} skipped (no byte size known for it)", markup=False)


# ---- sweeps and reports (issue 8) ----------------------------------------------------------------


@app.command("sweep")
def sweep_command(
    config: Annotated[Path, typer.Argument(help="Sweep config (TOML); reference in docs/sweeps.md.")],
    out: Annotated[Path | None, typer.Option(help="Parquet file to write (default: the config's name + .parquet, beside it).")] = None,
    executor: Annotated[str | None, typer.Option(help="local or ray (default: the config's [sweep] executor).")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes / Ray CPUs, 0 = all cores (default: the config's).")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Discard this config's partial results instead of resuming.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Sweep models × profiles × engines × drafters × routing × batch × n × k × α into one Parquet file (resumable)."""
    import contextlib

    from moesim.sim.sweep import partial_dir, run_sweep
    from moesim.sim.sweepconfig import load_config

    sweep_config = load_config(config)
    target = out if out is not None else config.with_suffix(".parquet")
    bar, update = _progress(f"sweeping {config.name}", "units")
    state = {"total": 0}

    def on_unit(done: int, total: int) -> None:
        state["total"] = total
        update(done, total, done)

    try:
        with bar if not as_json else contextlib.nullcontext():
            summary = run_sweep(sweep_config, target, executor, workers, fresh, on_unit)
    except KeyboardInterrupt:
        folder = partial_dir(sweep_config, target)
        kept = len(list(folder.glob("unit-*.parquet")))
        err_console.print(
            f"moesim: interrupted: {kept} of {state['total']} units kept in {folder}; run the same command again to resume",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
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


@app.command("report")
def report_command(
    results: Annotated[list[Path], typer.Argument(help="Sweep results (Parquet) and/or predictions.parquet from `moesim validate`.")],
    out: Annotated[Path, typer.Option(help="Report folder to write (index.html, PNG and SVG plots).")],
    where: Annotated[
        list[str] | None, typer.Option("--where", help="Select sweep rows COLUMN=VALUE (repeatable), e.g. model=qwen3-30b-a3b.")
    ] = None,
    alpha: Annotated[list[float] | None, typer.Option("--alpha", help="Acceptance rates of the batch plot (repeatable).")] = None,
) -> None:
    """Plots (PNG and SVG) and a self-contained HTML page from sweep results and validation predictions."""
    from moesim.sim.report import write_report

    report = write_report(results, out, where or [], alpha or [])
    for line in report.notes:
        err_console.print(f"moesim: note: {line}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"report written to {report.out_dir}/index.html ({len(report.figures)} figures)")


# ---- entry point ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input or usage, 130 interrupted)."""
    try:
        code = app(args=argv, prog_name="moesim", standalone_mode=False)  # a command's typer.Exit(n) returns n here
    except MoesimError as exc:
        return _error_line(str(exc))
    except typer.TyperException as exc:  # usage errors: a missing or malformed option, an unknown command
        if type(exc).__name__ == "NoArgsIsHelpError":  # a group called without a command: its help, already shown
            return 0
        return _error_line(f"{exc.format_message()} (see 'moesim --help')")  # type: ignore[attr-defined]
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("moesim: interrupted")
        return 130
    return code if isinstance(code, int) else 0


def _error_line(message: str) -> int:
    """Bad input or usage: one line on stderr, exit code 2."""
    err_console.print(f"moesim: error: {' '.join(message.split())}", markup=False, highlight=False, soft_wrap=True)
    return 2


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
