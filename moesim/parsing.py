"""Values from text at the boundary, one checked parser per kind (issue 26): integers and floats
from text (ASCII digits only, bounded length, finite, in range), JSON and TOML documents (nesting
depth bounded before parsing, integers bounded as they are read; the schema that reads a
document's values checks each field's range and finiteness). Each refusal is one
InputError line naming where the value was (`what`: a file and field, an option, a spec)."""

from __future__ import annotations

import json
import math
import re
import tomllib
from typing import Any

from moesim.errors import InputError, first_line

MAX_DIGITS = 30  # digits of an integer from text (2^63 has 19; more is never a count moesim can use)
MAX_NUMBER_CHARS = 64  # characters of a number from text
MAX_DEPTH = 32  # nesting of JSON and TOML documents (moesim's own need 4)
INT64 = 2**63
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_TOML_TOKENS = re.compile(r"'''.*?'''|\"\"\"(?:[^\\]|\\.)*?\"\"\"|\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*'|#[^\n]*|[\[\]{}]", re.DOTALL)


def _shown(text: object) -> str:
    shown = repr(text)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f" in {_number(low)}..{_number(high)}"
    if low is not None:
        return f" >= {_number(low)}"
    return f" <= {_number(high)}" if high is not None else ""


def check_range(value: float, what: str, low: float | None = None, high: float | None = None, noun: str = "a number") -> None:
    """Refuse a number outside [low, high] (or not finite) in one line."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{what}: must be a finite number{_range(low, high)}, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise InputError(f"{what}: must be {noun}{_range(low, high)}, got {_shown(value)}")


def parse_int(text: object, what: str, low: int | None = None, high: int | None = None) -> int:
    """An integer written in ASCII digits (at most MAX_DIGITS), or one already parsed (JSON, a
    table's cell), in [low, high]."""
    if isinstance(text, int) and not isinstance(text, bool):
        check_range(text, what, low, high, "an integer")
        return text
    value = text.strip() if isinstance(text, str) else text
    if not isinstance(value, str) or len(value) > MAX_DIGITS + 1 or not _INT.fullmatch(value):
        raise InputError(f"{what}: must be an integer{_range(low, high)}, got {_shown(text)}")
    number = int(value)
    check_range(number, what, low, high, "an integer")
    return number


def parse_float(text: object, what: str, low: float | None = None, high: float | None = None) -> float:
    """A finite decimal number written in ASCII (at most MAX_NUMBER_CHARS characters), or one
    already parsed (JSON, a table's cell), in [low, high]."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        number = float(text) if abs(text) < 1e308 else math.inf
        check_range(number, what, low, high)
        return number
    value = text.strip() if isinstance(text, str) else text
    if not isinstance(value, str) or len(value) > MAX_NUMBER_CHARS or not _FLOAT.fullmatch(value):
        raise InputError(f"{what}: must be a number{_range(low, high)}, got {_shown(text)}")
    number = float(value)
    if not math.isfinite(number):
        raise InputError(f"{what}: must be a finite number{_range(low, high)}, got {_shown(text)}")
    check_range(number, what, low, high)
    return number


def parse_int_ranges(text: str, what: str, low: int, high: int, max_count: int) -> tuple[int, ...]:
    """'1-16,24,32' -> (1, ..., 16, 24, 32): sorted and unique, each in [low, high], at most
    `max_count` of them (counted before any is listed: '1-100000000000' is one line)."""
    spans = []
    for part in (p.strip() for p in str(text).split(",")):
        first, dash, last = part.partition("-")
        start = parse_int(first, f"{what} '{_shown(text)[1:-1]}'", low, high)
        end = parse_int(last, f"{what} '{_shown(text)[1:-1]}'", low, high) if dash else start
        if end < start:
            raise InputError(f"{what} '{part}': a range runs upwards (e.g. 1-16), got {start}-{end}")
        spans.append((start, end))
    count = sum(end - start + 1 for start, end in spans)
    if count > max_count:
        raise InputError(f"{what} '{_shown(text)[1:-1]}': names {count:,} values, more than {max_count:,} (each is work: give fewer)")
    return tuple(sorted({v for start, end in spans for v in range(start, end + 1)}))


def _check_depth(tokens: re.Pattern[str], text: str, where: str, max_depth: int) -> None:
    depth = 0
    for char in tokens.findall(text):  # the tokens' text (the patterns hold no groups)
        if char in "[{":
            depth += 1
            if depth > max_depth:
                raise InputError(f"{where}: nested more than {max_depth} levels deep")
        elif char in "]}":
            depth -= 1


class _BadNumber(ValueError):
    pass


def _json_int(text: str) -> int:
    if len(text) > MAX_DIGITS + 1:
        raise _BadNumber(f"integer of {len(text)} digits")
    return int(text)


def _json_constant(text: str) -> float:
    return float(text.replace("Infinity", "inf"))


def load_json(text: str | bytes, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """A JSON document: nesting bounded before parsing, integers of at most MAX_DIGITS digits;
    anything else is one line naming `where`. A number that is not finite (NaN, Infinity, 1e999)
    is read as a float for the schema to refuse, naming its field (`parse_float`, `Checked`)."""
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError:
            raise InputError(f"{where}: not valid JSON (not UTF-8 text)") from None
    _check_depth(_JSON_TOKENS, text, where, max_depth)
    try:
        return json.loads(text, parse_int=_json_int, parse_constant=_json_constant)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{where}: not valid JSON ({first_line(exc)[:80]})") from None


def load_toml(text: str, where: str, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """A TOML document: nesting bounded before parsing, integers within 64 bits (TOML's own range)."""
    _check_depth(_TOML_TOKENS, text, where, max_depth)
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError, and int() of thousands of digits
        raise InputError(f"{where}: not valid TOML ({first_line(exc)[:80]})") from None
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        node, key, depth = stack.pop()
        if depth > max_depth:
            raise InputError(f"{where}: key '{key}' nested more than {max_depth} levels deep")
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for name, value in items:
            wide = isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64
            if not wide and not isinstance(value, dict | list):
                continue  # a value within range: no key path to spell
            path = f"{key}.{name}" if isinstance(name, str) and key else str(name) if not key else f"{key}[{name}]"
            if wide:
                raise InputError(f"{where}: key '{path}': integer out of range (more than 64 bits)")
            stack.append((value, path, depth + 1))
    return data
