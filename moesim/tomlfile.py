"""Reading TOML files (presets, profiles, generator parameters, configs) with one-line errors, and
writing TOML values and tables (profiles, spec-path files) and whole documents (the configs that
outputs carry: `run_header` names moesim's version, the command and the sha256 of every input)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moesim import __version__
from moesim.atomic import file_digest, protect
from moesim.errors import ConfigError, InputError, first_line
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


RUN_CONFIG = "config.toml"  # the resolved config an output folder carries
BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(key: str) -> str:
    """A key as TOML writes it: bare, or quoted."""
    return key if BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _is_tables(value: Any) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(v, dict) for v in value)


def toml_document(doc: dict[str, Any], prefix: str = "") -> str:
    """A nested dict as a TOML document: values first, then sub-tables ([a.b]) and arrays of tables
    ([[a.b]]); None values left out."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items() if v is not None and not isinstance(v, dict) and not _is_tables(v)]
    for key, value in doc.items():
        header = f"{prefix}{toml_key(key)}"
        tables = [(f"[{header}]", value)] if isinstance(value, dict) else [(f"[[{header}]]", v) for v in value] if _is_tables(value) else []
        for head, table in tables:
            lines.extend(["", head, *([body] if (body := toml_document(table, header + ".")) else [])])
    text = "\n".join(lines).strip("\n")
    return text if prefix else text + "\n"


PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGE_PREFIX = "moesim:"


def input_name(path: str | Path) -> str:
    """An input's name in a written config: a file of moesim's own (a built-in profile, trace or
    table) as `moesim:RELATIVE/PATH`, whatever folder moesim is installed in; any other as the run named it."""
    resolved = Path(path).resolve()
    if resolved.is_relative_to(PACKAGE_DIR):
        return PACKAGE_PREFIX + resolved.relative_to(PACKAGE_DIR).as_posix()
    return str(path)


def input_path(name: str) -> Path:
    """The file an input's name in a written config stands for (`input_name` undone)."""
    return PACKAGE_DIR / name.removeprefix(PACKAGE_PREFIX) if name.startswith(PACKAGE_PREFIX) else Path(name)


def run_header(command: str, files: Iterable[str | Path]) -> dict[str, Any]:
    """The `[moesim]` table of a written config: moesim's version, the command that wrote the
    output, and the sha256 of every input file (by its path as the run named it: a relative one
    from the run's working folder, where a rerun runs; moesim's own files by `input_name`)."""
    paths = sorted({input_name(p): Path(p) for p in files}.items())
    return {"version": __version__, "command": command, "files": {name: file_digest(p) for name, p in paths}}


def check_run_header(header: Any, source: str, command: str) -> None:
    """A written config's `[moesim]` table checked: it names `command` and every file it names is
    there (from this working folder) with the same sha256 (else one line naming the file). A config
    another version wrote reruns with this one."""
    if not isinstance(header, dict) or not isinstance(header.get("files", {}), dict):
        raise ConfigError(f"{source}: key 'moesim' must be a table (version, command, files)")
    if header.get("command") != command:
        raise ConfigError(f"{source}: key 'moesim.command': written by '{header.get('command')}', not by '{command}'")
    for path, digest in header.get("files", {}).items():
        if not input_path(path).is_file():
            raise ConfigError(f"{source}: key 'moesim.files': input {path} is not there (rerun from the run's working folder)")
        if file_digest(input_path(path)) != digest:
            raise ConfigError(f"{source}: key 'moesim.files': input {path} changed since the run (its sha256 differs)")
