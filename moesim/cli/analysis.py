"""The closed-form commands: `bytes`, `predict`, `best-draft`, `crossover`, `batch`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.markup import escape

from moesim.cli.options import OUT_DIR, ForceOpt, config_options, from_options
from moesim.cli.render import console, emit_json, print_json, render_table
from moesim.errors import InputError
from moesim.models import builtin_names
from moesim.parsing import parse_int
from moesim.sim.cost.parallel import Devices

TraceOpt = Annotated[Path, typer.Option("--trace", help="Routing trace (Arrow IPC) whose windows the passes replay.")]
ProfileOpt = Annotated[str, typer.Option("--profile", help="Built-in hardware profile name or a profile TOML path.")]
FamilyOpt = Annotated[
    str | None,
    typer.Option(
        "--family",
        help="Kernel family: dispatch (the engine's own kernel per pass size), per_slot, any dedup family of the profile, or best "
        "(the cheapest). Default: dispatch on an engine profile, per_slot otherwise.",
    ),
]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Target MoE preset, or its .toml / config.json (default: the trace's).")]
DRAFTER_HELP = (
    "ngram[:US], suffix[:US], eagle-head (or eagle), eagle3[:VOCAB], mtp, medusa, dflash[:LAYERS], fixed:US (µs per draft step), "
    f"a dense preset ({', '.join(builtin_names('dense'))}) or a dense preset .toml / config.json, preset:NAME (a MoE draft model); "
    "options ,topk=K,tokens=N or ,paths=[[0],[0,0],...] (a draft tree) and ,device=PROFILE (a separate draft model)."
)
DrafterOpt = Annotated[str, typer.Option("--drafter", help=DRAFTER_HELP)]
FormatOpt = Annotated[str | None, typer.Option("--format", help="Weight format (default: the trace's).")]
ContextOpt = Annotated[int, typer.Option("--context-tokens", help="KV tokens per sequence at the pass.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
MaxPassOpt = Annotated[
    int, typer.Option("--max-pass", help="Largest pass size n (1..4096): every n up to 64, then 96, 128, 192, 256, ... and n itself.")
]
SizesOpt = Annotated[str | None, typer.Option("--pass-sizes", help="Pass sizes, comma-separated (1..4096; overrides --max-pass).")]


def parse_batch_sizes(text: str, option: str = "--batch") -> list[int]:
    """'1,2,4' -> [1, 2, 4]; an empty item, a non-integer or a size below 1 is one line."""
    if len(text) > 1 << 16:
        raise InputError(f"{option}: {len(text)} characters, more than any list of sizes needs")
    sizes = [parse_int(b, f"{option} '{text[:60]}' (comma-separated integers)") for b in text.split(",")]
    if min(sizes) < 1:
        raise InputError(f"{option} sizes must be >= 1, got {min(sizes)}")
    return sizes


def _sizes(text: str | None) -> list[int] | None:
    return parse_batch_sizes(text, "--pass-sizes") if text else None


def _scenario(
    trace: Path,
    profile: str,
    family: str | None,
    model: str | None,
    drafter: str,
    weight_format: str | None,
    context: int,
    options: dict[str, Any],
) -> Any:
    from moesim.sim.analysis.scenario import load_scenario

    devices = Devices(**from_options(Devices, options))
    return load_scenario(trace, profile, family, model, drafter, weight_format, context, devices)


def _written(command: str, scenario: Any) -> Callable[[], dict[str, Any]]:
    """The run's config (`moesim.cli.rerun`), the family, model and weight format it chose filled in."""
    from moesim.cli.rerun import command_config

    resolved = {"family": scenario.model.family, "model": scenario.trace.meta.geometry.model, "weight_format": scenario.model.weight_format}
    return lambda: command_config(command, resolved)


def _where(scenario: Any, profile: str) -> str:
    """'profile P' and, over several devices, how the target is split."""
    parallel = scenario.model.parallel
    return f"profile {profile}" + ("" if parallel.devices == 1 else f", {parallel.describe()}")


def _provenance_line(share: dict[str, float]) -> str:
    return ", ".join(f"{100 * v:.0f} % {k}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]))


def bytes_command(
    trace: Annotated[Path, typer.Argument(help="Trace file (Arrow IPC).")],
    max_pass: Annotated[int, typer.Option("--max-pass", help="Largest pass size n, 1..64.")] = 16,
    batch: Annotated[int, typer.Option(help="Sequences verified together: union of B·n slots (B > 1 reads the whole trace).")] = 1,
    weight_format: Annotated[str | None, typer.Option("--format", help="Weight format of the byte figures (default: the trace's).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Distinct experts, tokens per expert and expert bytes per pass of n tokens: per-slot vs dedup."""
    from moesim.sim.cost.passbytes import bytes_report

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


@config_options(Devices)
def predict_command(
    trace: TraceOpt,
    profile: ProfileOpt,
    family: FamilyOpt = None,
    max_pass: MaxPassOpt = 16,
    sizes: SizesOpt = None,
    model: ModelOpt = None,
    weight_format: FormatOpt = None,
    context_tokens: ContextOpt = 512,
    batch: Annotated[int, typer.Option("--batch", help="Requests in each pass, n tokens each (B > 1: the union of their windows).")] = 1,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Folder to write plan.toml into: the passes priced from fitted or extrapolated rungs (microbench torch --plan)."
        ),
        OUT_DIR,
    ] = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
    **options: Any,
) -> None:
    """Pass time T(n) per pass size, expected over the trace's windows, with intervals from held-out error."""
    from moesim.atomic import check_out_dir
    from moesim.hw_profiles.microbench.plan import write_plan_dir
    from moesim.sim.analysis.gaps import check_plannable, prediction_plan
    from moesim.sim.analysis.predict import predict

    if out is not None:
        check_out_dir(out, force)
    scenario = _scenario(trace, profile, family, model, "ngram", weight_format, context_tokens, options)
    if out is not None:
        check_plannable(scenario.model, batch)
    result = predict(scenario, max_pass, _sizes(sizes), batch)
    plan = None
    if out is not None:
        plan = prediction_plan(scenario, result, f"predict --trace {trace.name} --profile {Path(profile).name} --family {result.family}")
        write_plan_dir(out, plan, force)
    if emit_json(result, as_json, _written("predict", scenario)):
        return
    render_table(
        result.table(),
        title=f"Pass time T(n){'' if batch == 1 else f' of {batch} requests'}, family {result.family}, {_where(scenario, profile)}",
        caption=f"interval = each rung's held-out ε (expert up to ±{100 * float(np.max(result.cost.expert_epsilon)):.1f} %, "
        f"dense ±{100 * result.cost.dense_epsilon:.1f} %; {result.cost.bound_basis}); time rests on: "
        f"{_provenance_line(result.cost.provenance_share())}; expert time by rung: {_provenance_line(result.cost.rung_share())}",
    )
    if out is not None and plan is not None:
        share = f"{100 * plan.answer_share:.1f} % of the answer rests on them"
        console.print(f"wrote {out / 'plan.toml'}: {len(plan.passes)} passes to measure, {share}")


@config_options(Devices)
def best_draft_command(
    trace: TraceOpt,
    profile: ProfileOpt,
    alpha: Annotated[
        list[float] | None,
        typer.Option("--alpha", help="Drafter's top-1 acceptance rate(s) in [0, 1], the same at every depth (repeatable)."),
    ] = None,
    max_draft: Annotated[
        int | None, typer.Option("--max-draft", help="Largest draft length k (default 8, or a static tree's depth when shallower).")
    ] = None,
    family: FamilyOpt = None,
    drafter: DrafterOpt = "ngram",
    model: ModelOpt = None,
    weight_format: FormatOpt = None,
    context_tokens: ContextOpt = 512,
    accept_len: Annotated[
        list[str] | None,
        typer.Option(
            "--accept-len",
            help="Measured mean acceptance length L@k: tokens per verify pass, bonus included, at draft length k (repeatable).",
        ),
    ] = None,
    depth_rates: Annotated[
        list[str] | None, typer.Option("--depth-rates", help="Top-1 acceptance per depth, comma-separated; the last repeats (repeatable).")
    ] = None,
    accept_run: Annotated[
        list[str] | None,
        typer.Option("--accept-run", help="A recorded run's accepted counts (speculative run, or a table with 'accepted')."),
    ] = None,
    batch: Annotated[int, typer.Option("--batch", help="Requests drafting and verified together (B > 1: the union of their windows).")] = 1,
    verdict: Annotated[
        bool, typer.Option("--verdict", help="Does speculation pay: best k >= 1, interval, break-even length and the deciding term.")
    ] = False,
    as_json: JsonOpt = False,
    **options: Any,
) -> None:
    """Best draft length k*(α) and its speedup, with intervals, the staircase and break-even acceptances."""
    from moesim.sim.analysis.speculation import best_draft_analysis

    scenario = _scenario(trace, profile, family, model, drafter, weight_format, context_tokens, options)
    result = best_draft_analysis(
        scenario, alpha or [], max_draft, accept_lengths=accept_len, depth_rates=depth_rates, runs=accept_run, batch=batch, verdict=verdict
    )
    if emit_json(result, as_json, _written("best-draft", scenario)):
        return
    render_table(
        result.table(),
        title=f"Best draft length, family {scenario.model.family}, drafter {drafter}, {_where(scenario, profile)}",
        caption="best_draft_range: the best k over the corners of the error box (ambiguous when it spans several)",
    )
    steps = ", ".join(f"k={k} from α={a:.3f}" for a, k in result.steps)
    console.print(f"staircase: {steps}")
    if result.verdicts:
        render_table(
            _verdict_table(result.verdicts),
            title=f"Does speculation pay? batch {result.batch}",
            caption="k: the best draft length >= 1, verify: its verify width, tau: tokens per pass; break_even = C(k), the "
            "tokens per pass at which S = 1; decided_by: the largest term of C(k) - 1 (verify bytes, draft cost, spec overhead: --json); "
            "uncertain_by: the uncertain part that alone moves the speedup most (expert or dense kernels, an engine term)",
        )
        for v in result.verdicts:  # each uncertain verdict: the part that decides it and what would pin it down
            if v.verdict == "uncertain":
                console.print(escape(f"calibrate: {v.acceptance}: uncertain, decided by {v.uncertain_by}: {v.calibrate}"))


def _verdict_table(verdicts: Any) -> Any:
    """One row per acceptance point: does speculation pay, at which k, and why (the terms in --json)."""
    import polars as pl

    return pl.DataFrame(
        [
            {
                "acceptance": v.acceptance,
                "verdict": v.verdict,
                "k": v.draft_len,
                "verify": v.verify_tokens,
                "tau": v.tokens_per_pass,
                "speedup": f"{v.speedup:.3f} ({v.speedup_low:.3f}-{v.speedup_high:.3f})",
                "break_even": v.break_even_tokens,
                "decided_by": v.decided_by,
                "uncertain_by": v.uncertain_by if v.verdict == "uncertain" else "",
            }
            for v in verdicts
        ]
    )


@config_options(Devices)
def crossover_command(
    trace: TraceOpt,
    profile: ProfileOpt,
    dedup_family: Annotated[
        str | None,
        typer.Option(
            "--dedup-family", help="The deduplicating family compared with per_slot (default: dedup, or an engine's mat-mat kernel)."
        ),
    ] = None,
    max_pass: MaxPassOpt = 32,
    sizes: SizesOpt = None,
    model: ModelOpt = None,
    weight_format: FormatOpt = None,
    batch: Annotated[int, typer.Option("--batch", help="Requests in each pass, n tokens each (u = U / (B·n·K)).")] = 1,
    as_json: JsonOpt = False,
    **options: Any,
) -> None:
    """Where deduplicating expert reads wins: u(n), r(n), the crossover and the whole win set."""
    from moesim.sim.analysis.crossover import crossover_analysis

    scenario = _scenario(trace, profile, "per_slot", model, "ngram", weight_format, 0, options)
    result = crossover_analysis(scenario, dedup_family, max_pass, _sizes(sizes), batch)
    if emit_json(result, as_json):
        return
    render_table(
        result.table(),
        title=f"per_slot vs {result.dedup_family} expert time per MoE pass, {_where(scenario, profile)}",
        caption="dedup wins at n iff T_dedup(n) < T_per_slot(n), i.e. u(n) < r(n)",
    )
    console.print(
        f"crossover n = {result.crossover_n} (range over the error box {result.crossover_range}); dedup wins at {result.dedup_wins}; "
        f"uniform routing: crossover {result.uniform_crossover_n}"
    )


@config_options(Devices)
def batch_command(
    trace: TraceOpt,
    profile: ProfileOpt,
    alpha: Annotated[float, typer.Option("--alpha", help="Acceptance rate in [0, 1].")],
    draft_len: Annotated[int, typer.Option("--draft-len", help="Draft length k (>= 1).")],
    batch: Annotated[str, typer.Option("--batch", help="Batch sizes, comma-separated.")] = "1,2,4,8,16,32",
    family: FamilyOpt = None,
    drafter: DrafterOpt = "ngram",
    moesd_slots: Annotated[
        bool, typer.Option("--moesd-slots", help="Verify γ = k slots per sequence (MoESD's convention) instead of k + 1.")
    ] = False,
    routing: Annotated[str, typer.Option("--routing", help="trace, or uniform (N(t) of independent uniform routing).")] = "trace",
    model: ModelOpt = None,
    weight_format: FormatOpt = None,
    context_tokens: ContextOpt = 512,
    as_json: JsonOpt = False,
    **options: Any,
) -> None:
    """Speedup and MoESD target efficiency T(B,1)/T(B,k+1) vs batch size."""
    from moesim.sim.analysis.batch import batch_analysis

    sizes = parse_batch_sizes(batch)
    scenario = _scenario(trace, profile, family, model, drafter, weight_format, context_tokens, options)
    result = batch_analysis(scenario, alpha, draft_len, sizes, moesd_slots, routing)
    if emit_json(result, as_json):
        return
    render_table(
        result.table(),
        title=f"Batch effect at α = {alpha}, k = {draft_len} (verify {result.verify_tokens} tokens per sequence), "
        f"family {scenario.model.family}, {_where(scenario, profile)}",
        caption="target_efficiency = T(B,1)/T(B,v) (MoESD); speedup = τ(k,α)·T(B,1)/(T_draft + T(B,k+1))",
    )
