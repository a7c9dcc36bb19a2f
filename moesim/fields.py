"""Typed TOML tables → frozen dataclasses, with one-line errors naming the file and the key.

A config section is a frozen dataclass whose fields are the section's keys. `build` checks
unknown keys, missing required keys and every value's type against the field's annotation,
then constructs the class; a class validates its values in `__post_init__` by raising
`FieldError(field, message)`, which `build` turns into `FILE: key 'section.field': message`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
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


def _type_name(annotation: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", Path: "a path (string)", dict: "a table"}
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin is tuple:
        return f"a list of which each item is {_type_name(typing.get_args(annotation)[0])}"
    return names.get(origin or annotation, str(annotation))


_NO = object()


def _convert(annotation: Any, value: Any, base_dir: Path) -> Any:
    """The value converted to the annotation's type, or _NO when it does not fit."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            if option is type(None):
                continue
            converted = _convert(option, value, base_dir)
            if converted is not _NO:
                return converted
        return _NO
    if origin is tuple:
        if not isinstance(value, list):
            return _NO
        item_type = typing.get_args(annotation)[0]
        items = [_convert(item_type, v, base_dir) for v in value]
        return _NO if any(i is _NO for i in items) else tuple(items)
    if annotation is bool:
        return value if isinstance(value, bool) else _NO
    if annotation is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if annotation is float:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else _NO
    if annotation is str:
        return value if isinstance(value, str) else _NO
    if annotation is Path:
        return (base_dir / value) if isinstance(value, str) and value else _NO
    if origin is dict or annotation is dict:
        return dict(value) if isinstance(value, dict) else _NO
    raise TypeError(f"unsupported config annotation {annotation}")


def build(cls: type, table: Any, section: str, source: str, base_dir: Path, skip: tuple[str, ...] = ()) -> Any:
    """Construct dataclass `cls` from TOML table `table` of `section` (keys in `skip` are ignored)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: key '{section}' must be a table")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in table:
        if key not in fields and key not in skip:
            known = ", ".join(sorted(fields)) or "none"
            raise ConfigError(f"{source}: key '{section}.{key}': unknown key (known: {known})")
    kwargs = {}
    for name, field in fields.items():
        if name not in table:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{source}: key '{section}.{name}' is required")
            continue
        converted = _convert(hints[name], table[name], base_dir)
        if converted is _NO:
            raise ConfigError(f"{source}: key '{section}.{name}' must be {_type_name(hints[name])}, got {table[name]!r}")
        kwargs[name] = converted
    try:
        return cls(**kwargs)
    except FieldError as exc:
        raise ConfigError(f"{source}: key '{section}.{exc.field}': {exc.detail}") from None


def build_entry(registry: Registry[Any], selector: str, table: Any, section: str, source: str, base_dir: Path) -> Any:
    """An instance of the registry's class that key `selector` of the table names, its other keys its fields."""
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: key '{section}' must be a table")
    if selector not in table:
        raise ConfigError(f"{source}: key '{section}.{selector}' is required (known: {', '.join(registry)})")
    name = table[selector]
    if name not in registry:
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
    """A config field with its help text, and how a command line spells it: `flag` (a bool that is
    only switched on, e.g. "--verbose"), `name` (an option name other than the field's), `parse` and
    `show` (a value given as text, e.g. pass sizes "1-16,24", and the default written so),
    `repeat` (a tuple given by repeating a singular option; none given: the default)."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


def option_name(cls: type, field_name: str) -> str:
    """How a command line spells a config field: its `name`, else --field-name."""
    field = {f.name: f for f in dataclasses.fields(cls)}[field_name]
    return field.metadata.get("name", "--" + field_name.replace("_", "-"))
