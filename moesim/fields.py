"""Typed tables (TOML, JSON metadata) → frozen dataclasses, checked at the boundary, with
one-line errors naming the file, the key and the value.

A config section is a frozen dataclass whose fields are the section's keys; a class that
derives from `Checked` declares each field's bounds in the field's metadata:

    @dataclass(frozen=True)
    class Batching(Checked):
        max_batch: int = checked(1, ge=1, le=1 << 20)
        alpha: tuple[float, ...] = checked((0.5,), ge=0.0, le=1.0)   # bounds hold for every item

`checked` (and `option`, which adds a command line's help text) take `ge`, `gt`, `le`, `lt`,
`choices` and `finite`; every float of a `Checked` class is finite unless `finite=False`.
Constructing the class checks them all (from a file, from command-line options, from code),
then runs the class's own `__post_init__` for cross-field rules, which raise
`FieldError(field, message)` (or call `require`). `build` checks unknown keys, missing
required keys and every value's type against the annotation (a nested dataclass is a
sub-table, a tuple of them a list of tables), then constructs the class; a `FieldError`
becomes `FILE: key 'section.field': message`. `construct` does the same without a file (a
FieldError naming the key path), for tables that come from elsewhere (generator parameters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moesim.errors import ConfigError
from moesim.registry import Registry


class FieldError(ConfigError):
    """A bad value of one field of a config dataclass; `build` prefixes the file and section."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"key '{field}': {message}")
        self.field = field
        self.detail = message


def require(condition: bool, field: str, message: str) -> None:
    """Raise FieldError(field, message) unless `condition` holds."""
    if not condition:
        raise FieldError(field, message)


@contextlib.contextmanager
def field_checked(field: str) -> Iterator[None]:
    """A ConfigError raised inside the block raised again as the FieldError of `field`."""
    try:
        yield
    except ConfigError as exc:
        raise FieldError(field, str(exc)) from None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class Bounds:
    """What a field's values must satisfy: ge <= v <= le, gt < v < lt, finite, one of `choices`."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = True
    choices: tuple[Any, ...] | None = None

    def problem(self, value: Any) -> str | None:
        """Why `value` breaks the bounds ('must be >= 1, got 0'), or None when it keeps them."""
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(map(repr, self.choices))}, got {value!r}"
        if not _number(value):
            return None
        if isinstance(value, float) and self.finite and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)):  # fmt: skip
            return None  # within every bound (a NaN fails each comparison and is judged below)
        for limit, ok, sign in (
            (self.ge, lambda v, b: v >= b, ">="),
            (self.gt, lambda v, b: v > b, ">"),
            (self.le, lambda v, b: v <= b, "<="),
            (self.lt, lambda v, b: v < b, "<"),
        ):
            if limit is not None and not (math.isnan(value) or ok(value, limit)):
                return f"must be {self.describe(isinstance(value, int)) or f'{sign} {_show(limit)}'}, got {_show(value)}"
        return None

    def describe(self, integer: bool = True) -> str:
        """The bounds in words: '>= 1', 'in 1..64' (integers), 'in [0, 1]'."""
        low = (self.ge, "[") if self.ge is not None else (self.gt, "(")
        high = (self.le, "]") if self.le is not None else (self.lt, ")")
        if low[0] is not None and high[0] is not None:
            if integer:
                low_int = self.ge if self.ge is not None else self.gt + 1  # type: ignore[operator]
                high_int = self.le if self.le is not None else self.lt - 1  # type: ignore[operator]
                return f"in {low_int}..{high_int}"
            return f"in {low[1]}{_show(low[0])}, {_show(high[0])}{high[1]}"
        parts = [f"{s} {_show(b)}" for b, s in ((self.ge, ">="), (self.gt, ">"), (self.le, "<="), (self.lt, "<")) if b is not None]
        return " and ".join(parts)

    def bad_rows(self, column: Any) -> Any:
        """A boolean mask of the values of a numeric column (numpy array or polars Series) out of bounds."""
        bad = column.is_nan() if hasattr(column, "is_nan") else column != column
        if self.finite:
            bad = bad | (abs(column) == math.inf)
        if self.ge is not None:
            bad = bad | (column < self.ge)
        if self.gt is not None:
            bad = bad | (column <= self.gt)
        if self.le is not None:
            bad = bad | (column > self.le)
        if self.lt is not None:
            bad = bad | (column >= self.lt)
        return bad


def _show(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_BOUND_KEYS = ("ge", "gt", "le", "lt", "finite", "choices")


def _split_bounds(kwargs: dict[str, Any]) -> tuple[dict[str, Any], Bounds | None]:
    given = {k: kwargs.pop(k) for k in _BOUND_KEYS if k in kwargs}
    if "choices" in given:
        given["choices"] = tuple(given["choices"])
    return kwargs, (Bounds(**given) if given else None)


def checked(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **bounds: Any) -> Any:
    """A field of a `Checked` dataclass with its bounds (ge, gt, le, lt, finite, choices)."""
    _, found = _split_bounds(bounds)
    metadata = {"bounds": found} if found else {}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def field_bounds(field: dataclasses.Field[Any]) -> Bounds:
    """A field's bounds (floats are finite unless said otherwise)."""
    return field.metadata.get("bounds") or Bounds()


def _values(value: Any) -> list[Any]:
    return list(value) if isinstance(value, tuple | list) else [value]


def _check_value(field: dataclasses.Field[Any], value: Any) -> None:
    bounds = field_bounds(field)
    for item in _values(value):
        problem = bounds.problem(item) if item is not None else None
        if problem:
            raise FieldError(field.name, problem)


def check_fields(instance: Any) -> None:
    """Raise FieldError for the first field of `instance` outside its bounds (every item of a tuple)."""
    for field in dataclasses.fields(instance):
        if field.init:
            _check_value(field, getattr(instance, field.name))


class Checked:
    """Base of checked dataclasses: constructing one checks every field against its bounds, then
    runs the class's own `__post_init__` (cross-field rules)."""

    _own_checks: Callable[[Any], None] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None and getattr(own, "_checks_fields", False):
            return
        cls._own_checks = own if own is not None else cls._own_checks

        def __post_init__(self: Any) -> None:
            check_fields(self)
            if type(self)._own_checks is not None:
                type(self)._own_checks(self)

        __post_init__._checks_fields = True  # type: ignore[attr-defined]
        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]


def _type_name(annotation: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", Path: "a path (string)", dict: "a table"}
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin is tuple:
        return f"a list of which each item is {_type_name(typing.get_args(annotation)[0])}"
    if dataclasses.is_dataclass(annotation):
        return "a table"
    return names.get(origin or annotation, str(annotation))


_NO = object()


_SCALARS: dict[Any, Callable[[Any], Any]] = {  # `_convert` of each scalar annotation, as one call
    bool: lambda v: v if isinstance(v, bool) else _NO,
    int: lambda v: v if isinstance(v, int) and not isinstance(v, bool) else _NO,
    float: lambda v: float(v) if _number(v) else _NO,
    str: lambda v: v if isinstance(v, str) else _NO,
}


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints` of a class, evaluated once (its annotations are strings)."""
    return typing.get_type_hints(cls)


def _convert(annotation: Any, value: Any, base_dir: Path, key: str) -> Any:
    """The value converted to the annotation's type, or _NO when it does not fit (a nested table's
    own problem is a FieldError naming its key path)."""
    scalar = _SCALARS.get(annotation)
    if scalar is not None:
        return scalar(value)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            if option is type(None):
                continue
            converted = _convert(option, value, base_dir, key)
            if converted is not _NO:
                return converted
        return _NO
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return _NO
        item_type = typing.get_args(annotation)[0]
        scalar = _SCALARS.get(item_type)
        if scalar is not None:  # a column of numbers or strings, item by item without the dispatch below
            items = [scalar(v) for v in value]
            return _NO if _NO in items else tuple(items)
        items = [_convert(item_type, v, base_dir, f"{key}[{i}]") for i, v in enumerate(value)]
        return _NO if any(i is _NO for i in items) else tuple(items)
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        if not isinstance(value, dict):
            return _NO
        try:
            return construct(annotation, value, base_dir)
        except FieldError as exc:
            raise FieldError(f"{key}.{exc.field}", exc.detail) from None
    if annotation is Path:
        return (base_dir / value) if isinstance(value, str) and value else _NO
    if origin is dict or annotation is dict:
        return dict(value) if isinstance(value, dict) else _NO
    if annotation is Any:
        return value
    raise TypeError(f"unsupported config annotation {annotation}")


def construct(cls: type, table: Any, base_dir: Path = Path("."), skip: tuple[str, ...] = ()) -> Any:
    """Dataclass `cls` from a table of keys (those in `skip` ignored): unknown keys, missing required
    keys, each value's type and every field's bounds checked; any problem is a FieldError of its key path."""
    if not isinstance(table, dict):
        raise FieldError("", f"must be a table, got {_shown(table)}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in table:
        if key not in fields and key not in skip:
            raise FieldError(str(key), f"unknown key (known: {', '.join(sorted(fields)) or 'none'})")
    kwargs = {}
    for name, field in fields.items():
        if name not in table:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise FieldError(name, "is required")
            continue
        converted = _convert(hints[name], table[name], base_dir, name)
        if converted is _NO:
            raise FieldError(name, f"must be {_type_name(hints[name])}, got {_shown(table[name])}")
        _check_value(field, converted)  # in the order of the fields, before the class's own checks
        kwargs[name] = converted
    return cls(**kwargs)


def build(cls: type, table: Any, section: str, source: str, base_dir: Path, skip: tuple[str, ...] = (), noun: str = "key") -> Any:
    """`construct` of table `table` of `section` in file `source`; errors read `SOURCE: NOUN
    'section.key': ...` (noun: 'key' in TOML, 'metadata key' in a file's metadata)."""
    try:
        return construct(cls, table, base_dir, skip)
    except FieldError as exc:
        path = ".".join(p for p in (section, exc.field) if p)
        raise ConfigError(f"{source}: {noun} '{path}': {exc.detail}") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def build_entry(registry: Registry[Any], selector: str, table: Any, section: str, source: str, base_dir: Path) -> Any:
    """An instance of the registry's class that key `selector` of the table names, its other keys its fields."""
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: key '{section}' must be a table")
    if selector not in table:
        raise ConfigError(f"{source}: key '{section}.{selector}' is required (known: {', '.join(registry)})")
    name = table[selector]
    if not isinstance(name, str) or name not in registry:
        raise ConfigError(f"{source}: key '{section}.{selector}': {registry.unknown(name)}")
    return build(registry.get(name), table, section, source, base_dir, skip=(selector,))


def dump(instance: Any) -> dict[str, Any]:
    """A config dataclass back as a TOML-like dict (paths as strings, tuples as lists, None dropped)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(instance):
        if not field.init:
            continue
        value = getattr(instance, field.name)
        if value is None:
            continue
        if isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[field.name] = value
    return out


def option(default: Any, help: str, **cli: Any) -> Any:
    """A config field with its help text, its bounds (as `checked`: ge, gt, le, lt, finite, choices),
    and how a command line spells it: `flag` (a bool that is only switched on, e.g. "--verbose"),
    `name` (an option name other than the field's), `parse` and `show` (a value given as text,
    e.g. pass sizes "1-16,24", and the default written so), `repeat` (a tuple given by repeating
    a singular option; none given: the default)."""
    cli, found = _split_bounds(cli)
    metadata = {"help": help, **cli, **({"bounds": found} if found else {})}
    return dataclasses.field(default=default, metadata=metadata)


def option_name(cls: type, field_name: str) -> str:
    """How a command line spells a config field: its `name`, else --field-name."""
    field = {f.name: f for f in dataclasses.fields(cls)}[field_name]
    return field.metadata.get("name", "--" + field_name.replace("_", "-"))


def from_table(cls: type, table: Any, source: str, noun: str = "key") -> Any:
    """`build` of a whole file's table (no section), paths relative to the file's folder."""
    return build(cls, table, "", source, Path(source).parent, noun=noun)


def renamed_keys(table: Any, section: str, renamed: dict[str, str], what: str, source: str) -> tuple[Any, tuple[str, ...]]:
    """A section's table with renamed keys (old -> new) in their new spelling, and a note for each
    old one used (`what` the key holds); both spellings at once is one line naming the old key."""
    if not isinstance(table, dict):
        return table, ()
    out, notes = dict(table), []
    for old, new in renamed.items():
        if old in out:
            if new in out:
                raise ConfigError(f"{source}: key '{section}.{old}': give '{section}.{new}' only ('{old}' is its old name)")
            out[new] = out.pop(old)
            notes.append(f"{source}: {section}.{old} is now {section}.{new} ({what}; the old key goes in the next release)")
    return out, tuple(notes)
