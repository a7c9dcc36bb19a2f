"""Reading TOML files (presets, profiles, generator parameters, configs) with one-line errors."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from moesim.atomic import protect
from moesim.errors import InputError, first_line


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The parsed file; a missing, unreadable or malformed file is one InputError line naming it."""
    if not path.is_file():
        raise InputError(f"{path}: no such {what} file")
    protect(path)
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        reason = first_line(exc)
        raise InputError(f"{path}: not valid TOML ({reason})") from None
