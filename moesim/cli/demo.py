"""`moesim demo`: the main job on embedded defaults, written as a report folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.options import OUT_DIR, ForceOpt
from moesim.cli.render import console, render_table


def demo(
    out: Annotated[Path, typer.Option(help="Report folder to write."), OUT_DIR] = Path("moesim-demo"),
    force: ForceOpt = False,
) -> None:
    """Run the main job on embedded defaults and write a report folder."""
    from moesim.sim.demo import run_demo

    result = run_demo(out, force=force)
    for section in result.sections:
        render_table(section.table, section.title, section.caption)
    console.print(f"report written to {result.out_dir}/ (HTML report: {result.html_report})", soft_wrap=True)  # paths whole, to copy
