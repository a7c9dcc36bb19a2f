"""`moesim simulate`: the SimPy server on a simulation config (a run, or a study grid)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.options import OUT_DIR, ForceOpt
from moesim.cli.render import console, err_console, note, print_json, progress, render_table


def simulate(
    config: Annotated[Path, typer.Argument(help="Simulation config (TOML); reference in docs/simulator.md.")],
    out: Annotated[Path | None, typer.Option(help="Output folder (default: the config's name + '-sim', here)."), OUT_DIR] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary (a study: its rows) as one JSON object.")] = False,
    force: ForceOpt = False,
) -> None:
    """Simulate speculative decoding of a workload: per-request and per-iteration Arrow tables and a summary."""
    from moesim.sim.serving.config import load_config
    from moesim.sim.serving.outputs import summary_rows
    from moesim.sim.serving.run import simulate_to

    sim_config = load_config(config)
    note(sim_config.notes)
    with progress(f"simulating {config.name}", enabled=not as_json and err_console.is_terminal) as update:
        outcome = simulate_to(sim_config, out, lambda fraction: update(fraction, 1.0), force)
    if outcome.study is not None:
        if as_json:
            print_json({"rows": outcome.study.to_dicts(), "out": str(outcome.out_dir)})
            return
        caption = "speedup and worst slowdown are against the same workload with speculation off"
        columns = outcome.study.columns
        axes = [c for c in ("model", "device", "batch", "workload", "policy") if c in columns]
        figures = [c for c in ("throughput_tok_s", "speedup", "target_efficiency", "worst_slowdown", "mean_draft_len") if c in columns]
        shown = axes + figures
        render_table(outcome.study.select(shown), title=f"Study {config.name}", caption=caption)
    else:
        result = outcome.result
        if as_json:
            print_json({**result.summary, "out": str(outcome.out_dir)})
            return
        render_table(summary_rows(result.summary), title=f"Simulation {config.name}: {result.summary['policy_label']}")
    console.print(f"outputs written to {outcome.out_dir}/")
