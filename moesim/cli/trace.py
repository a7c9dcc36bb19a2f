"""`moesim trace ...`: synthesise, inspect, build tiny models, record, speculate, import, fit."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import polars as pl
import typer

from moesim.atomic import check_writable
from moesim.cli.options import OUT_FILE, config_options, from_options
from moesim.cli.render import console, interrupted, print_json, progress, render_table
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec
from moesim.tracegen.llamacpp.recorder import RecordConfig
from moesim.tracegen.llamacpp.speculate import SpeculateConfig
from moesim.tracegen.mlx import is_mlx_model
from moesim.tracegen.routing.synth import MAX_POSITIONS, MAX_SEED

app = typer.Typer(help="Routing traces: synthesise, inspect, record, import.", no_args_is_help=True)

PromptsOpt = Annotated[Path, typer.Option(help="Prompts: text, one per line, or .jsonl with a 'prompt' field.")]
TINY_SHAPE = (
    "arch",
    "layers",
    "experts",
    "top_k",
    "hidden",
    "expert_ff",
    "heads",
    "kv_heads",
    "vocab",
    "weight_type",
    "seed",
    "leading_dense",
)


SYNTH_TOKENS, SYNTH_SEQS = 1024, 1


@app.command("synth")
def trace_synth(
    model: Annotated[str, typer.Option(help="Model preset name, or a preset .toml / config.json.")],
    out: Annotated[Path, typer.Option(help="Trace file to write (Arrow IPC)."), OUT_FILE],
    tokens: Annotated[int, typer.Option(help="Tokens per sequence.", min=1, max=MAX_POSITIONS)] = SYNTH_TOKENS,
    seqs: Annotated[int, typer.Option(help="Number of sequences.", min=1, max=MAX_POSITIONS)] = SYNTH_SEQS,
    like: Annotated[Path | None, typer.Option(help="Sequences of the same lengths as this trace (a file or a built-in name).")] = None,
    seed: Annotated[int, typer.Option(help="Random seed.", min=0, max=MAX_SEED)] = 0,
    uniform: Annotated[
        bool, typer.Option("--uniform", help="Independent uniform routing (default: the generator fitted to the built-in real trace).")
    ] = False,
    sticky: Annotated[float | None, typer.Option(help="Keep each expert of the previous token with this probability.")] = None,
    zipf: Annotated[float, typer.Option(help="Zipf exponent of expert popularity (alone: independent tokens; 0 = uniform).")] = 0.0,
    weight_format: Annotated[str | None, typer.Option("--format", help="Weight format (default: the preset's).")] = None,
    params: Annotated[
        Path | None, typer.Option(help="Generator parameters (from `trace fit`, or a built-in name), mapped onto the preset's layers.")
    ] = None,
) -> None:
    """Write a synthetic routing trace for a model preset."""
    from moesim.errors import InputError
    from moesim.models import load_target
    from moesim.tracegen.formats.schema import TraceGeometry
    from moesim.tracegen.formats.trace import read_trace
    from moesim.tracegen.routing.params import DEFAULT_PARAMS, generator_from_options, is_default_routing
    from moesim.tracegen.routing.synth import equal_lengths, synthesize_to

    if like is not None and (tokens, seqs) != (SYNTH_TOKENS, SYNTH_SEQS):
        raise InputError("--like excludes --tokens and --seqs (it takes the trace's sequence lengths)")
    check_writable(out)
    preset = load_target(model)
    generator = generator_from_options(preset, uniform, sticky, zipf, params, weight_format)
    geometry = TraceGeometry.from_preset(preset, weight_format, "synthetic routing")
    lengths = equal_lengths(tokens, seqs) if like is None else read_trace(like).seq_lengths()
    with progress("synthesising", "positions") as update:
        synthesize_to(out, geometry, generator, lengths, seed, lambda done, total: update(done, total, done))
    fitted = f" (parameters {DEFAULT_PARAMS}: fitted to the real trace; --uniform for independent routing)"
    described = fitted if is_default_routing(uniform, sticky, zipf, params) else ""
    console.print(f"wrote {out}: {lengths.size} sequences, {int(lengths.sum())} tokens, generator {generator.name}{described}")


@app.command("info")
def trace_info(
    trace: Annotated[Path, typer.Argument(help="Trace file (Arrow IPC).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Summarise a trace: model, sequences, tokens, layers, k, experts used and reuse per layer."""
    from moesim.tracegen.formats.summary import summarize_trace
    from moesim.tracegen.formats.trace import read_trace

    summary = summarize_trace(read_trace(trace))
    if as_json:
        print_json(summary.to_dict())
        return
    console.print(
        f"[bold]{trace}[/bold]: model {summary.model}, engine {summary.engine} ({summary.backend}), "
        f"{summary.sequences} sequences, {summary.tokens} tokens ({summary.prompt_tokens} prompt), "
        f"{len(summary.moe_layers)} MoE layers of {summary.layers}, top-{summary.top_k} of {summary.experts} experts"
    )
    if summary.groups:
        console.print("groups: " + ", ".join(f"{name} ({seqs} sequences)" for name, seqs in summary.groups.items()))
    for key, value in summary.provenance.items():
        console.print(f"provenance {key}: {value}", soft_wrap=True)
    render_table(summary.per_layer_table(), title="Per MoE layer", caption="reuse = mean |S_t ∩ S_t+1| / k over consecutive positions")


@app.command("tiny-model")
@config_options(TinyModelSpec, include=TINY_SHAPE, overrides=True)
def trace_tiny_model(
    out: Annotated[Path, typer.Option(help="GGUF file to write (a folder with --format mlx)."), OUT_FILE],
    draft_of: Annotated[Path | None, typer.Option(help="Write a noisy copy of this moesim-built GGUF (a draft model).")] = None,
    noise: Annotated[float | None, typer.Option(help="With --draft-of: noise added to every weight (0: identical).")] = None,
    **shape: Any,
) -> None:
    """Write a random MoE model as GGUF (100 KB to several GB) or an MLX model folder (--format mlx), or a noisy draft copy."""
    from moesim.tracegen.llamacpp.gguf_builder import expert_weight_bytes
    from moesim.tracegen.llamacpp.gguf_reader import write_tiny_model

    if (shape.get("weight_type") or "").upper() == "MLX":
        from moesim.tracegen.mlx.builder import mlx_folder_bytes, mlx_model_name, write_tiny_mlx_model

        shape["weight_type"] = None
        spec = write_tiny_mlx_model(out, from_options(TinyModelSpec, shape, TINY_SHAPE), draft_of, noise)
        console.print(f"wrote {out}/: {mlx_model_name(spec)}, an MLX model folder, {mlx_folder_bytes(out) / 1e6:.2f} MB of F32 weights")
        return
    spec = write_tiny_model(out, from_options(TinyModelSpec, shape, TINY_SHAPE), draft_of, noise)
    size_mb = out.stat().st_size / 1e6
    console.print(f"wrote {out}: {spec.model_name}, {size_mb:.2f} MB ({expert_weight_bytes(spec) / 1e6:.2f} MB of routed experts)")


@app.command("record")
@config_options(RecordConfig)
def trace_record(
    model: Annotated[Path, typer.Argument(help="GGUF MoE model, or an MLX model folder (needs moesim[mlx]).")],
    prompts: PromptsOpt,
    out: Annotated[Path | None, typer.Option(help="Trace to write (default: MODEL.trace.arrow here)."), OUT_FILE] = None,
    **options: Any,
) -> None:
    """Record per-token, per-layer expert routing from a GGUF model through llama.cpp, or from an MLX model folder through mlx_lm."""
    from moesim.tracegen.llamacpp.prompts import load_prompts
    from moesim.tracegen.llamacpp.recorder import default_trace_path, kept_after_interrupt, record_trace

    config = RecordConfig(**from_options(RecordConfig, options))
    prompt_set = load_prompts(prompts)
    if is_mlx_model(model):
        from moesim.tracegen.mlx.recorder import record_trace
    with progress("recording", "positions") as update:
        result = record_trace(model, prompt_set, out or default_trace_path(model), config, update)
    if result.interrupted:
        interrupted(kept_after_interrupt(result.path, result.prompts_done), result.interrupted)
        raise typer.Exit(result.interrupted)
    console.print(
        f"wrote {result.path}: {result.prompts_done} prompts, {result.positions} positions ({result.generated} generated) "
        f"in {result.seconds:.2f} s ({result.tokens_per_s:.0f} positions/s with routing capture)"
    )


@app.command("speculate")
@config_options(SpeculateConfig)
def trace_speculate(
    target: Annotated[Path, typer.Argument(help="Target GGUF MoE model, or an MLX model folder (needs moesim[mlx]).")],
    draft: Annotated[Path, typer.Argument(help="Draft model of the same kind (same vocabulary).")],
    prompts: PromptsOpt,
    out: Annotated[Path | None, typer.Option(help="Run to write (default: TARGET.spec-kK.arrow here)."), OUT_FILE] = None,
    **options: Any,
) -> None:
    """Run greedy draft-then-verify decoding through llama.cpp (GGUF) or mlx_lm (MLX folders) and write a measured speculative run."""
    from moesim.tracegen.formats.specrun import read_spec_run, spec_run_summary
    from moesim.tracegen.llamacpp.prompts import load_prompts
    from moesim.tracegen.llamacpp.recorder import kept_after_interrupt
    from moesim.tracegen.llamacpp.speculate import default_run_path, speculative_run

    config = SpeculateConfig(**from_options(SpeculateConfig, options))
    path = out or default_run_path(target, config.draft_len)
    prompt_set = load_prompts(prompts)
    if is_mlx_model(target):
        from moesim.tracegen.mlx.speculate import speculative_run
    with progress("speculating", "steps") as update:
        result = speculative_run(target, draft, prompt_set, path, config, update)
    if result.interrupted:
        interrupted(kept_after_interrupt(result.path, result.prompts_done), result.interrupted)
        raise typer.Exit(result.interrupted)
    summary = spec_run_summary(read_spec_run(path))
    console.print(f"wrote {path}: {result.prompts_done} prompts, {result.steps} verify steps")
    caption = "times are wall-clock means per step on contexts without routing capture"
    render_table(pl.DataFrame([summary]), title="Speculative run", caption=caption)


@app.command("import")
def trace_import(
    source_path: Annotated[
        Path, typer.Argument(help="Table (.csv/.csv.gz/.parquet), router logits (.safetensors/.npz) or vLLM step dumps.")
    ],
    model: Annotated[str, typer.Option(help="Model preset name, or a preset .toml / config.json.")],
    out: Annotated[Path, typer.Option(help="Trace file to write (Arrow IPC)."), OUT_FILE],
    weight_format: Annotated[str | None, typer.Option("--format", help="Weight format (default: the preset's).")] = None,
    source: Annotated[str, typer.Option(help="auto, table, moe-trace, hf-logits or vllm.")] = "auto",
    normalize: Annotated[bool, typer.Option(help="hf-logits: renormalise the top-k probabilities (norm_topk_prob).")] = False,
    provenance: Annotated[
        Path | None, typer.Option(help="JSON object saying where the routing came from (kept in the trace's metadata).")
    ] = None,
    compress: Annotated[str | None, typer.Option(help="Compress the trace's record batches: zstd.")] = None,
) -> None:
    """Import routing recorded elsewhere into a moesim trace."""
    from moesim.models import load_target
    from moesim.tracegen.formats.schema import TraceGeometry
    from moesim.tracegen.formats.trace import write_trace
    from moesim.tracegen.importers import import_routing
    from moesim.tracegen.importers.common import read_provenance

    geometry = TraceGeometry.from_preset(load_target(model), weight_format)
    check_writable(out)
    record = None if provenance is None else read_provenance(provenance)
    trace = import_routing(source_path, geometry, source, normalize, record)
    write_trace(out, trace, compress)
    console.print(f"wrote {out}: {trace.n_seqs} sequences, {trace.n_tokens} positions from {source_path} ({trace.meta.engine})")


@app.command("fit")
def trace_fit(
    trace: Annotated[Path, typer.Argument(help="Trace file (Arrow IPC) or a built-in trace name.")],
    out: Annotated[Path, typer.Option(help="Parameter file to write (TOML)."), OUT_FILE],
    generator: Annotated[str, typer.Option(help="Generator family to fit: mixture or working-set.")] = "mixture",
    sequences: Annotated[
        str, typer.Option(help="Sequences to fit: all, a sequence group of the trace (e.g. law), optionally :even or :odd.")
    ] = "all",
    seed: Annotated[int, typer.Option(help="Seed of the simulations.", min=0, max=MAX_SEED)] = 0,
    max_positions: Annotated[int, typer.Option(help="Fit on at most this many positions (first sequences).", min=1)] = 1 << 15,
) -> None:
    """Fit a routing generator per MoE layer by simulated moments (for `trace synth --params`)."""
    from moesim.tracegen.formats.select import select
    from moesim.tracegen.formats.trace import read_trace
    from moesim.tracegen.routing.fit import fit_generator
    from moesim.tracegen.routing.params import write_fit

    check_writable(out)
    source = select(read_trace(trace), sequences)
    result = fit_generator(source, generator, seed=seed, max_positions=max_positions)
    write_fit(out, result, trace, source.meta.geometry, sequences)
    title = f"{generator} routing fitted to {trace} ({sequences}: {result.positions} positions, {result.sequences} sequences)"
    caption = (
        f"{result.method()}; popularity = overlap of tokens of different sequences, reuse_d = mean |S_t ∩ S_t+d| / k, "
        "share_n = distinct experts in a window of n tokens / (n·k); worst_gap = the largest |fitted − source| of a layer's moments"
    )
    render_table(result.table(source.meta.geometry), title=title, caption=caption)
    console.print(f"wrote {out}")
