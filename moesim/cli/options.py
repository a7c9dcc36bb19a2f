"""Command-line options generated from config dataclasses, and the old spellings of renamed options.

A command that mirrors a config (`microbench llama-cpp`, `microbench torch`, `trace tiny-model`,
`trace record`, `trace speculate`) takes its options from the dataclass's fields: one default and
one help text, both in the field (`moesim.fields.option`). `@config_options(Config)` adds them to
the command's signature; the command receives them in `**options` and builds the config with
`from_options(Config, options)`.

Every command declares its inputs by its signature (`guarded`): a parameter marked `OUT_FILE` or
`OUT_DIR` in its annotation is a path the command writes; every other path or string parameter
that names an existing file or folder is an input, protected before the command runs, and each
output is checked against them before any work (not an input, not a link to one, not a folder
holding one, not inside an input folder).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from moesim.atomic import check_not_input, protect
from moesim.cli.render import line
from moesim.errors import interrupt_code
from moesim.fields import option_name

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Output:
    """Marks a command parameter as a path the command writes: a file, or a folder (`folder`)."""

    folder: bool = False


OUT_FILE, OUT_DIR = Output(folder=False), Output(folder=True)


class Stopped(Exception):
    """A command stopped by Ctrl-C or SIGTERM after its cleanup ran; `code` is 130 or 143. Not a
    KeyboardInterrupt, so that click neither prints nor turns it into its own exit."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _base(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    """(the type under Annotated, Optional and list, the Annotated metadata)."""
    metadata: tuple[Any, ...] = ()
    if typing.get_origin(annotation) is Annotated:
        annotation, *rest = typing.get_args(annotation)
        metadata = tuple(rest)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = _without_none(annotation)
    if typing.get_origin(annotation) is list:
        annotation = typing.get_args(annotation)[0]
    return annotation, metadata


def command_paths(func: Callable[..., Any]) -> tuple[list[str], dict[str, Output]]:
    """(input parameters, output parameters with their kind) of a command, from its signature: an
    output is marked OUT_FILE or OUT_DIR; an input is every other path or string parameter."""
    inputs, outputs = [], {}
    for name, param in inspect.signature(func, eval_str=True).parameters.items():
        base, metadata = _base(param.annotation)
        marks = [m for m in metadata if isinstance(m, Output)]
        if marks:
            outputs[name] = marks[0]
        elif base in (Path, str):
            inputs.append(name)
    return inputs, outputs


COMMAND_OPTIONS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("command_options", default=None)


def command_options() -> dict[str, Any]:
    """The running command's parameters as parsed, its outputs and --force left out (what it computes from)."""
    return dict(COMMAND_OPTIONS.get() or {})


def guarded(func: F) -> F:
    """The command with its inputs protected and its outputs checked against them before it runs,
    its parameters kept for `command_options`, and Ctrl-C / SIGTERM (after the command's own
    cleanup) raised as `Stopped`."""
    inputs, outputs = command_paths(func)

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        COMMAND_OPTIONS.set({k: v for k, v in kwargs.items() if k not in outputs and k != "force"})
        for name in inputs:
            value = kwargs.get(name)
            protect(*(value if isinstance(value, list | tuple) else [value]))
        for name, kind in outputs.items():
            if kwargs.get(name) is not None:
                check_not_input(kwargs[name], kind.folder)
        try:
            return func(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise Stopped(interrupt_code(exc)) from None

    return run  # type: ignore[return-value]


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
