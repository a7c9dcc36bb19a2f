"""Rendering for every command: tables, JSON, warnings and notes on stderr, one progress bar."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import polars as pl
from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)

Update = Callable[[float, float, int], None]  # (done, total, count)


def format_cell(value: Any) -> str:
    """A table cell: floats to 3 significant places or so, NaN as '-', lists joined."""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, list):
        return ", ".join(format_cell(v) for v in value)
    return str(value)


def render_table(frame: pl.DataFrame, title: str | None = None, caption: str | None = None) -> None:
    """A polars frame as a rich table on stdout."""
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for name in frame.columns:
        table.add_column(name, justify="right" if frame[name].dtype.is_numeric() else "left")
    for row in frame.iter_rows():
        table.add_row(*(format_cell(v) for v in row))
    console.print(table)


def print_json(payload: Any) -> None:
    """One JSON object on stdout (NaN becomes null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    sys.stdout.write(json.dumps(clean(payload)) + "\n")


def say(message: str) -> None:
    """A line on stderr, as is (no markup)."""
    err_console.print(message, markup=False, highlight=False)


def line(message: str) -> None:
    """A long line on stderr, never wrapped (warnings, notes, interruptions)."""
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)


def warn(warnings: list[str]) -> None:
    """Each warning as `moesim: warning: ...` on stderr."""
    for text in warnings:
        line(f"moesim: warning: {text}")


def emit_json(result: Any, as_json: bool) -> bool:
    """A result's warnings on stderr; with --json its JSON on stdout (True: nothing left to render)."""
    warn(result.warnings)
    if as_json:
        print_json(result.to_dict())
    return as_json


@contextlib.contextmanager
def progress(label: str, unit: str = "", enabled: bool = True) -> Iterator[Update]:
    """A transient progress bar on stderr (nothing at all on a pipe or a log file); yields
    `update(done, total, count)` (count: `unit`s so far, shown when `unit` is given)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    shown = unit != ""
    columns = [TextColumn(f"[bold]{label}[/bold]"), BarColumn(), MofNCompleteColumn() if shown else TaskProgressColumn()]
    if shown:
        columns.append(TextColumn("{task.fields[count]} " + unit))
    bar = Progress(*columns, TimeElapsedColumn(), console=err_console, transient=True, disable=not (enabled and err_console.is_terminal))
    task = bar.add_task(label, total=None, count=0)

    def update(done: float, total: float, count: int = 0) -> None:
        bar.update(task, completed=done, total=total, count=count)

    with bar:
        yield update


def interrupted(kept: str) -> None:
    """The line of a command stopped by Ctrl-C, saying what it kept."""
    line(f"moesim: interrupted: {kept}")
