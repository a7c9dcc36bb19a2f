"""`--filter COLUMN=VALUE`: the one row selection of every command that reads a table
(`profile fit`, `validate`, `report`). All filters must hold; the value is read in the column's
type (a number column compares numbers, so 1.5 and 1.50 select the same rows)."""

from __future__ import annotations

import polars as pl

from moesim.errors import InputError

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def parse_filters(texts: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """COLUMN=VALUE strings as (column, value) pairs."""
    pairs = []
    for text in texts:
        column, sep, value = text.partition("=")
        if not sep or not column.strip():
            raise InputError(f"--filter '{text}': expected COLUMN=VALUE")
        pairs.append((column.strip(), value.strip()))
    return pairs


def _typed(frame: pl.DataFrame, column: str, value: str, source: str) -> object:
    dtype = frame.schema[column]
    if dtype == pl.String:
        return value
    if dtype == pl.Boolean:
        if value.lower() not in TRUE + FALSE:
            raise InputError(f"{source}: --filter {column}={value}: '{value}' is not a {dtype} value (true or false)")
        return value.lower() in TRUE
    try:
        return pl.Series([value]).cast(dtype, strict=True)[0]
    except pl.exceptions.PolarsError:
        raise InputError(f"{source}: --filter {column}={value}: '{value}' is not a {dtype} value") from None


def apply_filters(frame: pl.DataFrame, filters: list[tuple[str, str]], source: str) -> pl.DataFrame:
    """The rows where every filtered column equals its value; a filter that leaves no row is one
    line naming the values the column holds."""
    for column, value in filters:
        if column not in frame.columns:
            raise InputError(f"{source}: --filter column '{column}' is not in the table (columns: {', '.join(frame.columns)})")
        selected = frame.filter(pl.col(column) == _typed(frame, column, value, source))
        if selected.is_empty():
            known = frame[column].drop_nulls().unique(maintain_order=True).head(10).to_list()
            raise InputError(f"{source}: no rows left after --filter {column}={value} (values of '{column}': {', '.join(map(str, known))})")
        frame = selected
    return frame
