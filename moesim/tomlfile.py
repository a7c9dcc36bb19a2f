"""Reading TOML files (presets, profiles, generator parameters, configs) with one-line errors, and
writing TOML values and tables (profiles, spec-path files)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moesim.atomic import protect
from moesim.errors import InputError, first_line
from moesim.parsing import load_toml


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The parsed file; a missing, unreadable or malformed file is one InputError line naming it."""
    if not path.is_file():
        raise InputError(f"{path}: no such {what} file")
    protect(path)
    try:
        text = path.read_text()
    except (UnicodeDecodeError, OSError) as exc:
        raise InputError(f"{path}: not valid TOML ({first_line(exc)})") from None
    return load_toml(text, str(path))


def toml_value(value: Any) -> str:
    """A value as TOML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def toml_section(lines: list[str], header: str | None, table: dict[str, Any]) -> None:
    """A table's lines (None values left out), under `[header]` unless None."""
    if header is not None:
        lines.extend(["", f"[{header}]"])
    lines.extend(f"{key} = {toml_value(value)}" for key, value in table.items() if value is not None)
