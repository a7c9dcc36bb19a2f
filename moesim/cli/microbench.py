"""`moesim microbench ...`: measurement tables (contract 3) through torch, llama.cpp, MLX (mlx_lm), or
llama.cpp's own `test-backend-ops` output."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from moesim.atomic import check_out_dir
from moesim.cli.options import OUT_DIR, ForceOpt, config_options, from_options
from moesim.cli.render import console, render_table, say
from moesim.hw_profiles.microbench.llama_cpp import LlamaBenchConfig
from moesim.hw_profiles.microbench.mlx_switch import MlxBenchConfig
from moesim.hw_profiles.microbench.plan import Plan
from moesim.hw_profiles.microbench.torch_cuda import TorchBenchConfig

app = typer.Typer(help="Microbenchmarks of one MoE layer's expert operation; each writes a measurement table.", no_args_is_help=True)

OutOpt = Annotated[Path, typer.Option(help="Output folder (measurements.parquet, provenance.json)."), OUT_DIR]


def _report_table(path: Path, rows: list[dict[str, Any]], provenance: dict[str, Any]) -> None:
    from moesim.hw_profiles.microbench.table import rows_summary

    summary = rows_summary(rows)
    render_table(summary)
    console.print(f"wrote {path} ({sum(summary['rows'])} rows) and {path.parent / 'provenance.json'}", soft_wrap=True)
    for failure in provenance.get("failures", []):
        say(f"warning: {failure['engine']} on {failure['model']} dropped: {failure['error']}")
    if "stopped_early" in provenance:
        say(f"warning: time budget used up before n = {provenance['stopped_early']['before_n_tokens']}")


PlanOpt = Annotated[
    Path | None,
    typer.Option("--plan", help="A measurement plan (plan.toml of predict --out or validate --out): measure exactly its passes."),
]


@app.command("torch")
@config_options(TorchBenchConfig)
def microbench_torch(
    out: Annotated[Path | None, typer.Option(help="Output folder (measurements.parquet, provenance.json)."), OUT_DIR] = None,
    model: Annotated[list[str] | None, typer.Option(help="Model preset whose expert shape is measured (repeatable).")] = None,
    plan: PlanOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the rows the run would measure and stop (no device needed).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: print the rows as one JSON object.")] = False,
    force: ForceOpt = False,
    **options: Any,
) -> None:
    """Time per-slot and deduplicating expert kernels through torch (CUDA graphs) and write a table."""
    from moesim.errors import InputError
    from moesim.hw_profiles.microbench.plan import read_plan
    from moesim.hw_profiles.microbench.table import write_measurements
    from moesim.hw_profiles.microbench.torch_cuda import (
        DEFAULT_MODELS,
        run_torch_microbench,
        torch_grid_rows,
        torch_plan_rows,
        torch_shapes,
    )

    config = TorchBenchConfig(**from_options(TorchBenchConfig, options))
    config.validate()
    planned = read_plan(plan) if plan is not None else None
    if planned is not None and model:
        raise InputError("--plan excludes --model (the plan names the shapes it measures)")
    if dry_run:
        listed = torch_plan_rows(config, planned) if planned is not None else torch_grid_rows(config, model or list(DEFAULT_MODELS))
        _dry_run(listed, as_json)
        return
    if out is None:
        raise InputError("--out is required (the folder the measurement table is written into), unless --dry-run")
    shapes = torch_shapes(model or list(DEFAULT_MODELS), config.dtype) if planned is None else []
    check_out_dir(out, force)
    result = run_torch_microbench(config, shapes, progress=say, plan=planned)
    path = write_measurements(result.rows, out, result.provenance, result.device, force)
    _report_table(path, result.rows, result.provenance)


def _dry_run(listed: tuple[list[dict[str, Any]], list[str]], as_json: bool) -> None:
    """The rows a run would measure: a table (or one JSON object) and the plan's notes."""
    import polars as pl

    from moesim.cli.render import print_json

    rows, notes = listed
    if as_json:
        print_json({"rows": rows, "notes": notes})
        return
    render_table(pl.DataFrame(rows), title=f"Dry run: {len(rows)} rows would be measured")
    for note in notes:
        say(f"note: {note}")


def _checked_plan(
    plan: Path | None, model: list[str] | None, overrides: dict[str, int | None], dry_run: bool, out: Path | None
) -> Plan | None:
    """The --plan of a shape-overriding microbench, checked against --model, the overrides, --dry-run and --out."""
    from moesim.errors import InputError
    from moesim.hw_profiles.microbench.plan import read_plan

    planned = read_plan(plan) if plan is not None else None
    if planned is not None and (model or any(v is not None for v in overrides.values())):
        raise InputError("--plan excludes --model and the shape overrides (the plan names the shapes it measures)")
    if dry_run and planned is None:
        raise InputError("--dry-run lists a plan's rows: give --plan")
    if not dry_run and out is None:
        raise InputError("--out is required (the folder the measurement table is written into), unless --dry-run")
    return planned


@app.command("llama-cpp")
@config_options(LlamaBenchConfig)
def microbench_llama_cpp(
    out: Annotated[Path | None, typer.Option(help="Output folder (measurements.parquet, provenance.json)."), OUT_DIR] = None,
    model: Annotated[list[str] | None, typer.Option(help="Model preset whose expert shape is built (repeatable).")] = None,
    weight_format: Annotated[str, typer.Option("--format", help="Weight format of the built models: F16 or F32.")] = "F16",
    experts: Annotated[int | None, typer.Option(help="Override the preset's routed experts.")] = None,
    top_k: Annotated[int | None, typer.Option(help="Override the preset's top-k.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Override the preset's hidden size.")] = None,
    expert_intermediate: Annotated[int | None, typer.Option(help="Override the preset's expert width.")] = None,
    models_dir: Annotated[Path | None, typer.Option(help="Keep the built GGUF models here (default: a temporary folder)."), OUT_DIR] = None,
    plan: PlanOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --plan: list the rows the run would measure and stop.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: print the rows as one JSON object.")] = False,
    force: ForceOpt = False,
    **options: Any,
) -> None:
    """Time one MoE layer's expert operation through llama.cpp (L vs 2L layers) and write a table."""
    from moesim.errors import InputError
    from moesim.hw_profiles.microbench.llama_cpp import llamacpp_plan_configs, llamacpp_plan_rows, preset_shapes, run_llamacpp_configs
    from moesim.hw_profiles.microbench.table import write_measurements

    overrides = {"experts": experts, "top_k": top_k, "hidden": hidden, "expert_intermediate": expert_intermediate}
    config = LlamaBenchConfig(**from_options(LlamaBenchConfig, options))
    planned = _checked_plan(plan, model, overrides, dry_run, out)
    if dry_run:
        _dry_run(llamacpp_plan_rows(config, planned), as_json)
        return
    if planned is None:
        configs = [dataclasses.replace(config, shape=shape) for shape in preset_shapes(model, weight_format, overrides)]
    else:
        configs = llamacpp_plan_configs(config, planned)
        if not configs:
            raise InputError(f"{plan}: llama.cpp runs none of the plan's passes in its family (microbench llama-cpp --plan --dry-run)")
    check_out_dir(out, force)
    result = run_llamacpp_configs(configs, models_dir, progress=say)
    path = write_measurements(result.rows, out, result.provenance, force=force)
    _report_table(path, result.rows, result.provenance)


@app.command("mlx")
@config_options(MlxBenchConfig)
def microbench_mlx(
    out: Annotated[Path | None, typer.Option(help="Output folder (measurements.parquet, provenance.json)."), OUT_DIR] = None,
    model: Annotated[
        list[str] | None, typer.Option(help="Model preset whose expert shape is measured (repeatable; default: two small shapes).")
    ] = None,
    experts: Annotated[int | None, typer.Option(help="Override the shapes' routed experts.")] = None,
    top_k: Annotated[int | None, typer.Option(help="Override the shapes' top-k.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Override the shapes' hidden size.")] = None,
    expert_intermediate: Annotated[int | None, typer.Option(help="Override the shapes' expert width.")] = None,
    plan: PlanOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --plan: list the rows the run would measure and stop.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: print the rows as one JSON object.")] = False,
    force: ForceOpt = False,
    **options: Any,
) -> None:
    """Time one MoE layer's expert operation through mlx_lm's SwitchGLU (gather_mm / gather_qmm, rows sorted or not) and write a table."""
    from moesim.hw_profiles.microbench.mlx_switch import mlx_plan_rows, mlx_shapes, run_mlx_microbench
    from moesim.hw_profiles.microbench.table import write_measurements
    from moesim.tracegen.mlx.runtime import import_mlx

    import_mlx()
    config = MlxBenchConfig(**from_options(MlxBenchConfig, options))
    config.validate()
    overrides = {"experts": experts, "top_k": top_k, "hidden": hidden, "expert_intermediate": expert_intermediate}
    planned = _checked_plan(plan, model, overrides, dry_run, out)
    if dry_run:
        _dry_run(mlx_plan_rows(config, planned), as_json)
        return
    shapes = mlx_shapes(model, overrides) if planned is None else []
    check_out_dir(out, force)
    result = run_mlx_microbench(config, shapes, progress=say, plan=planned)
    path = write_measurements(result.rows, out, result.provenance, force=force)
    _report_table(path, result.rows, result.provenance)


@app.command("import-backend-ops")
def microbench_import_backend_ops(
    log: Annotated[Path, typer.Argument(help="Console output of `test-backend-ops perf -o MUL_MAT_ID`.")],
    out: OutOpt,
    backend: Annotated[str | None, typer.Option(help="cpu, cuda, metal or vulkan (default: from the log's backend name).")] = None,
    per_slot_max_tokens: Annotated[
        int | None, typer.Option(help="Largest pass size run by a per-slot kernel (default: per backend, see docs).")
    ] = None,
    force: ForceOpt = False,
) -> None:
    """Turn llama.cpp's MUL_MAT_ID perf cases into a measurement table (one expert matrix x 3 per row)."""
    from moesim.hw_profiles.microbench.backend_ops import import_backend_ops
    from moesim.hw_profiles.microbench.table import write_measurements

    check_out_dir(out, force)
    result = import_backend_ops(log, backend, per_slot_max_tokens)
    path = write_measurements(result.rows, out, result.provenance, force=force)
    _report_table(path, result.rows, result.provenance)
    for type_name, count in result.provenance["skipped_types"].items():
        say(f"note: {count} cases of type {type_name} skipped (no byte size known for it)")
