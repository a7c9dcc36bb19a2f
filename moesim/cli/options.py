"""Command-line options generated from config dataclasses, and the old spellings of renamed options.

A command that mirrors a config (`microbench llama-cpp`, `microbench torch`, `trace tiny-model`,
`trace record`, `trace speculate`) takes its options from the dataclass's fields: one default and
one help text, both in the field (`moesim.fields.option`). `@config_options(Config)` adds them to
the command's signature; the command receives them in `**options` and builds the config with
`from_options(Config, options)`.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from moesim.cli.render import line
from moesim.fields import option_name

F = TypeVar("F", bound=Callable[..., Any])

ForceOpt = Annotated[
    bool,
    typer.Option("--force", help="Write into a non-empty output folder moesim did not write (only moesim's own files are ever replaced)."),
]

# Renamed options: command path -> {old spelling: new spelling}. The old one still works for one
# release (hidden from --help) and prints a one-line note on stderr.
RENAMED: dict[tuple[str, ...], dict[str, str]] = {
    ("batch",): {"--draft": "--draft-len", "--context": "--context-tokens", "--engine": "--family"},
    ("predict",): {"--context": "--context-tokens", "--engine": "--family"},
    ("best-draft",): {"--context": "--context-tokens", "--engine": "--family"},
    ("validate",): {"--context": "--context-tokens", "--engine": "--family"},
    ("report",): {"--where": "--filter"},
    ("trace", "tiny-model"): {"--weight-type": "--format", "--expert-ff": "--expert-intermediate"},
    ("microbench", "llama-cpp"): {"--weight-type": "--format"},
    ("microbench", "torch"): {"--dtype": "--format"},
}
GROUPS = ("trace", "profile", "microbench")


def rename_old_spellings(argv: list[str]) -> list[str]:
    """argv with renamed options in their new spelling, a deprecation note on stderr for each (and
    for a profile named by the name it had before it became an engine profile)."""
    from moesim.hw_profiles.builtin import RENAMED_PROFILES

    path = tuple(argv[:2]) if argv and argv[0] in GROUPS else tuple(argv[:1])
    renamed = RENAMED.get(path, {})
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in renamed:
            line(f"moesim: note: {name} is deprecated, use {renamed[name]} (the old spelling goes in the next release)")
            arg = renamed[name] + eq + value
        elif arg in RENAMED_PROFILES:
            line(f"moesim: note: profile {arg} is now {RENAMED_PROFILES[arg]}, an engine profile (the old name goes in the next release)")
        out.append(arg)
    return out


def _annotation(cls: type, field: dataclasses.Field[Any], hint: Any, overrides: bool) -> tuple[Any, Any]:
    """(annotation with its typer.Option, default) of one field on the command line."""
    meta = field.metadata
    name = option_name(cls, field.name)
    help_text = meta["help"]
    if meta.get("repeat"):
        item = typing.get_args(hint)[0]
        return Annotated[list[item] | None, typer.Option(meta.get("repeat"), help=help_text)], None  # type: ignore[valid-type]
    if "parse" in meta:
        if overrides:
            return Annotated[str | None, typer.Option(name, help=f"{help_text} (default: {meta['show'](field.default)})")], None
        return Annotated[str, typer.Option(name, help=help_text)], meta["show"](field.default)
    if hint is bool:
        decls = (meta["flag"],) if "flag" in meta else (f"{name}/--no-{name[2:]}",)
        return Annotated[bool, typer.Option(*decls, help=help_text)], field.default
    base = _without_none(hint)
    if overrides:
        return Annotated[base | None, typer.Option(name, help=f"{help_text} (default: {field.default})")], None
    return Annotated[hint, typer.Option(name, help=help_text)], field.default


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _fields(cls: type, include: tuple[str, ...] | None) -> list[dataclasses.Field[Any]]:
    fields = [f for f in dataclasses.fields(cls) if f.init and "help" in f.metadata]
    if include is not None:
        by_name = {f.name: f for f in fields}
        fields = [by_name[name] for name in include]
    return fields


def config_options(cls: type, include: tuple[str, ...] | None = None, overrides: bool = False) -> Callable[[F], F]:
    """Add the config's fields (those with a help text, or `include`) as options of the command.

    `overrides`: every option defaults to None (not given), its help naming the config's default:
    the command then sees which were given (e.g. a model shape to override).
    """

    def decorate(func: F) -> F:
        signature = inspect.signature(func, eval_str=True)
        params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        hints = typing.get_type_hints(cls)
        annotations = {p.name: p.annotation for p in params}
        for field in _fields(cls, include):
            annotation, default = _annotation(cls, field, hints[field.name], overrides)
            params.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
            annotations[field.name] = annotation
        func.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        func.__annotations__ = {**annotations, "return": signature.return_annotation}
        return func

    return decorate


def from_options(cls: type, options: dict[str, Any], include: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The config's keyword arguments from the generated options: text parsed, lists as tuples,
    options not given (None) left to the config's default."""
    kwargs: dict[str, Any] = {}
    for field in _fields(cls, include):
        value = options[field.name]
        if value is None:
            continue
        if "parse" in field.metadata:
            value = field.metadata["parse"](value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[field.name] = value
    return kwargs
