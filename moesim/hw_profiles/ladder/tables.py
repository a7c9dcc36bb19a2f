"""The ladder's TOML tables in a profile (contract 4, optional), parsed through `moesim.fields.build`:

    [families.<name>.grid]                   the knots (`grid.GridTable`), `source` = a source id
    [families.<name>.rung_error.<rung>]      note, source + one_layer = {median, p90, max, rows},
                                             whole_pass_source + whole_pass = {…}
    [families.<name>.pass_transfer]          `transfer.PassTransfer`, identity / candidate = {median, p90, max, rows}

Errors are one line naming the file and the key (`fields.build`'s format).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moesim.errors import ConfigError
from moesim.fields import build
from moesim.hw_profiles.ladder.grid import CalibrationGrid, GridTable
from moesim.hw_profiles.ladder.rungs import RUNGS, RungError, RungErrors, Stats
from moesim.hw_profiles.ladder.transfer import PassTransfer

_HERE = Path(".")


def read_grid(table: Any, section: str, origin: str) -> tuple[CalibrationGrid, str]:
    """The knots and their source id."""
    parsed = build(GridTable, table, section, origin, _HERE)
    return CalibrationGrid.from_table(parsed), parsed.source


def read_stats(table: Any, section: str, origin: str) -> Stats:
    """{median, p90, max, rows}."""
    return build(Stats, table, section, origin, _HERE)


def read_rung_errors(table: Any, section: str, origin: str) -> RungErrors:
    """Each rung's note and held-out errors."""
    if not isinstance(table, dict):
        raise ConfigError(f"{origin}: key '{section}' must be a table")
    one_layer, whole_pass, notes, sources = {}, {}, {}, {"one_layer": "table", "whole_pass": ""}
    for rung, entry in table.items():
        if rung not in RUNGS:
            raise ConfigError(f"{origin}: key '{section}.{rung}': unknown rung (known: {', '.join(RUNGS)})")
        parsed = build(RungError, entry, f"{section}.{rung}", origin, _HERE)
        notes[rung] = parsed.note
        if parsed.one_layer:
            one_layer[rung] = read_stats(parsed.one_layer, f"{section}.{rung}.one_layer", origin)
            sources["one_layer"] = parsed.source or sources["one_layer"]
        if parsed.whole_pass is not None:
            whole_pass[rung] = read_stats(parsed.whole_pass, f"{section}.{rung}.whole_pass", origin)
            sources["whole_pass"] = parsed.whole_pass_source
    return RungErrors(one_layer, whole_pass, notes, sources["one_layer"], sources["whole_pass"])


def read_transfer(table: Any, section: str, origin: str) -> PassTransfer:
    """The pass-level terms with their evidence (checked)."""
    parsed = build(PassTransfer, table, section, origin, _HERE)
    for key in ("identity", "candidate"):
        read_stats(getattr(parsed, key), f"{section}.{key}", origin)
    return parsed


def stats_table(stats: Stats) -> dict[str, Any]:
    """Plain-data form of Stats."""
    return {"median": stats.median, "p90": stats.p90, "max": stats.max, "rows": stats.rows}


def rung_error_tables(errors: RungErrors) -> dict[str, dict[str, Any]]:
    """Per rung, its TOML table."""
    out = {}
    for rung in RUNGS:
        table: dict[str, Any] = {"note": errors.notes.get(rung, "")}
        if rung in errors.one_layer:
            table["source"] = errors.one_layer_source
            table["one_layer"] = stats_table(errors.one_layer[rung])
        if rung in errors.whole_pass:
            table["whole_pass_source"] = errors.whole_pass_source
            table["whole_pass"] = stats_table(errors.whole_pass[rung])
        out[rung] = table
    return out


def transfer_table(transfer: PassTransfer) -> dict[str, Any]:
    """The TOML table of pass-level terms."""
    return {
        "source": transfer.source,
        "a": transfer.a,
        "b_us": transfer.b_us,
        "applied": transfer.applied,
        "kind": transfer.kind,
        "models": list(transfer.models),
        "note": transfer.note,
        "identity": dict(transfer.identity),
        "candidate": dict(transfer.candidate),
    }
