"""Rendering for every command: tables, JSON, warnings and notes on stderr, one progress bar."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import polars as pl
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

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
    """A polars frame as a rich table on stdout, every name and value whole at the terminal's width.

    A table wider than the terminal breaks its longest column names after '_' (up to three lines);
    if it is still too wide, its columns go into several tables one under the other, each
    repeating the key columns (the fewest leading columns that tell the rows apart).
    """
    columns = [TableColumn(name, [format_cell(v) for v in frame[name].to_list()], frame[name].dtype.is_numeric()) for name in frame.columns]
    width = console.width
    whole = header_lines(columns, width)
    if whole is not None:
        console.print(_table(columns, whole, title=title, caption=caption))
        return
    groups = column_groups(columns, key_columns(frame), width)
    if not groups:  # not even the keys and one more column fit: the keys stay whole, the other cells wrap
        keys = key_columns(frame)
        console.print(_table(columns, [MAX_HEADER_LINES] * len(columns), keys=keys, title=title, caption=caption))
        return
    if title:
        console.print(Text(title, style="table.title"))
    for group in groups:
        console.print(_table(group, header_lines(group, width) or []))
    if caption:
        console.print(Text(caption, style="table.caption"))


MAX_HEADER_LINES = 3


@dataclass(frozen=True)
class TableColumn:
    """One column as shown: its name, its cells as text, right-aligned when numeric."""

    name: str
    cells: list[str]
    numeric: bool

    def width(self, lines: int) -> int:
        """Its width with the name on at most `lines` lines."""
        header = max(cell_len(part) for part in wrap_name(self.name, lines).split("\n"))
        return max([header, *(cell_len(c) for c in self.cells)])


def wrap_name(name: str, lines: int) -> str:
    """A column name broken after '_' onto at most `lines` lines, as narrow as that allows."""
    pieces = [p + "_" for p in name.split("_")[:-1]] + [name.split("_")[-1]]
    for limit in range(max(cell_len(p) for p in pieces), cell_len(name) + 1):
        wrapped = [""]
        for piece in pieces:
            if wrapped[-1] and cell_len(wrapped[-1] + piece) > limit:
                wrapped.append("")
            wrapped[-1] += piece
        if len(wrapped) <= lines:
            return "\n".join(wrapped)
    return name


def table_width(widths: list[int]) -> int:
    """Width of a rich table (default box and padding) whose columns are `widths` wide."""
    return sum(widths) + 3 * len(widths) + 1


def header_lines(columns: list[TableColumn], width: int) -> list[int] | None:
    """Lines per column name that make the table fit `width`: names are broken one line more at a
    time where that narrows the table most; None if it cannot fit."""
    lines = [1] * len(columns)
    widths = [c.width(1) for c in columns]
    while table_width(widths) > width:
        savings = [w - c.width(n + 1) if n < MAX_HEADER_LINES else 0 for c, n, w in zip(columns, lines, widths, strict=True)]
        best = max(range(len(columns)), key=savings.__getitem__)
        if savings[best] <= 0:
            return None
        lines[best] += 1
        widths[best] = columns[best].width(lines[best])
    return lines


def key_columns(frame: pl.DataFrame) -> int:
    """How many leading columns a split table repeats: the fewest that tell the rows apart (1 if none do)."""
    for count in range(1, frame.width):
        if frame.select(frame.columns[:count]).is_unique().all():
            return count
    return 1


def column_groups(columns: list[TableColumn], keys: int, width: int) -> list[list[TableColumn]]:
    """The columns after the first `keys` in as few consecutive groups as fit `width` with the keys
    in front, as even in width as that allows ([] if a single column does not fit)."""

    def fill(limit: int) -> list[list[TableColumn]]:
        groups: list[list[TableColumn]] = []
        for column in columns[keys:]:
            if groups and header_lines([*groups[-1], column], limit) is not None:
                groups[-1].append(column)
            elif header_lines([*columns[:keys], column], limit) is not None:
                groups.append([*columns[:keys], column])
            else:
                return []
        return groups

    fewest = fill(width)
    narrower = (fill(limit) for limit in range(table_width([c.width(MAX_HEADER_LINES) for c in columns[:keys]]), width))
    return next((groups for groups in narrower if groups and len(groups) == len(fewest)), fewest)


def _table(columns: list[TableColumn], lines: list[int], keys: int = 0, **text: str | None) -> Table:
    """A rich table of the columns; the first `keys` never narrower than their longest cell (the others wrap)."""
    table = Table(title_justify="left", caption_justify="left", **text)  # type: ignore[arg-type]
    for i, (column, n) in enumerate(zip(columns, lines, strict=True)):
        whole = {"min_width": column.width(n), "no_wrap": True} if i < keys else {}
        table.add_column(Text(wrap_name(column.name, n)), justify="right" if column.numeric else "left", **whole)  # type: ignore[arg-type]
    for row in zip(*(c.cells for c in columns), strict=True):
        table.add_row(*(Text(cell, overflow="fold") for cell in row))
    return table


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


def note(notes: Iterable[str]) -> None:
    """Each note as `moesim: note: ...` on stderr."""
    for text in notes:
        line(f"moesim: note: {text}")


def warn(warnings: list[str]) -> None:
    """Each warning as `moesim: warning: ...` on stderr."""
    for text in warnings:
        line(f"moesim: warning: {text}")


def emit_json(result: Any, as_json: bool, config: Callable[[], dict[str, Any]] | None = None) -> bool:
    """A result's warnings on stderr; with --json its JSON on stdout, with the run's `config` under
    "config" when given (True: nothing left to render)."""
    warn(result.warnings)
    if as_json:
        print_json({**result.to_dict(), **({"config": config()} if config is not None else {})})
    return as_json


@contextlib.contextmanager
def progress(label: str, unit: str = "", enabled: bool = True) -> Iterator[Update]:
    """A transient progress bar on stderr with the time spent and an estimate of the time left
    (nothing at all on a pipe or a log file); yields `update(done, total, count)` (count: `unit`s
    so far, shown when `unit` is given)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    shown = unit != ""
    columns = [TextColumn(f"[bold]{label}[/bold]"), BarColumn(), MofNCompleteColumn() if shown else TaskProgressColumn()]
    if shown:
        columns.append(TextColumn("{task.fields[count]} " + unit))
    bar = Progress(
        *columns,
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=not (enabled and err_console.is_terminal),
    )
    task = bar.add_task(label, total=None, count=0)

    def update(done: float, total: float, count: int = 0) -> None:
        bar.update(task, completed=done, total=total, count=count)

    with bar:
        yield update


def interrupted(kept: str, code: int = 130) -> None:
    """The line of a command stopped by Ctrl-C (exit code 130) or SIGTERM (143), saying what it kept."""
    line(f"moesim: {'terminated' if code == 143 else 'interrupted'}: {kept}")
