"""Tables at the terminal's width: column names broken after '_', tables split with their key
columns repeated, nothing cut; checked against rich's own measure, a brute-force search over name
breaks, and the demo's tables at 80 columns against the CSV files it writes."""

from __future__ import annotations

import io
import itertools

import polars as pl
import pytest
from conftest import DEMO_COLUMNS, DemoRun
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from moesim.cli import render
from moesim.cli.render import MAX_HEADER_LINES, format_cell, key_columns, render_table, table_width, wrap_name

NAMES = st.from_regex(r"[a-z0-9α*=.]{1,6}(_[a-z0-9α*=.]{1,6}){0,5}", fullmatch=True)


def shown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every rich table in `text`: its column names (broken lines joined) and its rows' cells."""
    tables: list[tuple[list[str], list[list[str]]]] = []
    header: list[list[str]] | None = None
    for line in text.splitlines():
        line = line.rstrip()
        if line.startswith("┏"):
            header = []
        elif line.startswith("┡") and header is not None:
            tables.append((["".join(parts) for parts in zip(*header, strict=True)], []))
            header = None
        elif line.startswith("┃") and header is not None:
            header.append([cell.strip() for cell in line.strip("┃").split("┃")])
        elif line.startswith("│") and tables:
            tables[-1][1].append([cell.strip() for cell in line.strip("│").split("│")])
    return tables


def rendered(frame: pl.DataFrame, width: int, monkeypatch: pytest.MonkeyPatch) -> str:
    out = io.StringIO()
    monkeypatch.setattr(render, "console", Console(file=out, width=width, color_system=None, highlight=False))
    render_table(frame, title="A title", caption="a caption")
    return out.getvalue()


@settings(max_examples=200, deadline=None)
@given(NAMES, st.integers(1, 4))
def test_wrap_name_is_the_narrowest_break_into_so_many_lines(name: str, lines: int) -> None:
    wrapped = wrap_name(name, lines).split("\n")
    assert "".join(wrapped) == name and len(wrapped) <= lines
    assert all(part.endswith("_") for part in wrapped[:-1])
    # brute force: every way to break after '_' into at most `lines` lines
    ends = [i + 1 for i, c in enumerate(name) if c == "_"]
    best = min(
        max(cell_len(name[a:b]) for a, b in itertools.pairwise([0, *cuts, len(name)]))
        for count in range(min(lines, len(ends) + 1))
        for cuts in itertools.combinations(ends, count)
    )
    assert max(cell_len(part) for part in wrapped) == best


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(NAMES, st.lists(st.text("ab1.-_α", min_size=0, max_size=9), min_size=2, max_size=2)), min_size=1, max_size=8))
def test_table_width_is_what_rich_measures(columns: list[tuple[str, list[str]]]) -> None:
    table = Table()
    for name, _ in columns:
        table.add_column(name)
    for row in zip(*(cells for _, cells in columns), strict=True):
        table.add_row(*row)
    widths = [max(cell_len(c) for c in [name, *cells]) for name, cells in columns]
    console = Console(width=1000)
    assert console.measure(table).maximum == table_width(widths)


def test_key_columns_tell_the_rows_apart() -> None:
    assert key_columns(pl.DataFrame({"n": [1, 2, 3], "x": [1.0, 1.0, 2.0]})) == 1
    assert key_columns(pl.DataFrame({"engine": ["a", "a", "b"], "batch": [1, 2, 1], "x": [0.1, 0.2, 0.3]})) == 2
    assert key_columns(pl.DataFrame({"a": [1, 1], "b": [2, 2], "c": [3, 3]})) == 1  # none do: the first


WIDE = pl.DataFrame(
    {
        "engine": ["per_slot", "per_slot", "dedup_grouped_gemm"],
        "batch": [1, 4, 1],
        **{f"mean_distinct_experts_{i}": [1.5 * i, 2.25, 1e6] for i in range(5)},
        **{f"fastest_family_at_n{i}": ["dedup_grouped_gemm", "per_slot", "dedup"] for i in range(3)},
    }
)


@pytest.mark.parametrize("width", [60, 80, 120])
def test_a_wide_table_is_split_and_nothing_is_cut(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    text = rendered(WIDE, width, monkeypatch)
    assert "…" not in text
    assert max(cell_len(line.rstrip()) for line in text.splitlines()) <= width
    tables = shown_tables(text)
    assert len(tables) > 1
    seen: list[str] = []
    for names, rows in tables:
        assert names[:2] == ["engine", "batch"]  # the key columns lead every part
        expected = [[format_cell(v) for v in row] for row in WIDE.select(names).iter_rows()]
        assert rows == expected
        seen += [n for n in names[2:] if n not in seen]
    assert seen == WIDE.columns[2:]
    assert text.startswith("A title") and text.rstrip().endswith("a caption")


def test_a_table_that_fits_is_one_table_with_whole_names(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = WIDE.select("engine", "batch", "mean_distinct_experts_0")
    text = rendered(frame, 80, monkeypatch)
    ((names, rows),) = shown_tables(text)
    assert names == frame.columns and len(rows) == frame.height
    assert sum(line.startswith("┃") for line in text.splitlines()) == 1  # one header line


def test_names_break_before_a_table_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = pl.DataFrame({f"tokens_per_expert_at_batch_{b}": [0.5] for b in (1, 4, 16, 64)})
    text = rendered(frame, 80, monkeypatch)
    ((names, _),) = shown_tables(text)  # too wide whole (4 x 26 characters), one table with names on 2-3 lines
    assert names == frame.columns
    assert 1 < sum(line.startswith("┃") for line in text.splitlines()) <= MAX_HEADER_LINES


def test_demo_tables_read_at_80_columns(demo_run: DemoRun) -> None:
    """Every column of every table the demo writes is shown whole in an 80-column terminal."""
    assert demo_run.code == 0, demo_run.err
    text = demo_run.out
    assert "…" not in text
    lines = [line for line in text.splitlines() if not line.startswith("report written to ")]  # paths stay whole, to copy
    assert max(cell_len(line.rstrip()) for line in lines) <= DEMO_COLUMNS
    shown = {name for names, _ in shown_tables(text) for name in names}
    written = {path.stem: pl.read_csv(path).columns for path in sorted(demo_run.out_dir.glob("*.csv"))}
    assert len(written) >= 6
    for section, columns in written.items():
        assert set(columns) <= shown, (section, set(columns) - shown)
    assert shown <= {name for columns in written.values() for name in columns}
