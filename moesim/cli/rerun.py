"""The config an output carries, and `moesim rerun` (the same command on it, to the same bytes).

A command's written config is `{"options": ..., "moesim": ...}`: every option of the command as
its run resolved it (defaults filled, the family, model and weight format the run chose), paths
as the run named them (a relative one from the run's working folder: a rerun runs there), and
`[moesim]` (`moesim.tomlfile.run_header`: the version, the command, the sha256 of every input:
trace, profile, tables). `predict --json` and
`best-draft --json` put it in their object under "config"; `validate --out` writes it as the
folder's config.toml. `simulate` and `sweep` write their own config resolved (config.toml of the
output folder, the Parquet's `moesim.run_config`), which they read back themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from moesim.cli.options import OUT_DIR, ForceOpt, command_options
from moesim.errors import InputError
from moesim.hw_profiles.builtin import profile_files
from moesim.parsing import load_json
from moesim.tomlfile import check_run_header, read_toml, run_header
from moesim.tracegen.formats.builtin import resolve_trace


def _plain(value: Any) -> Any:
    """An option's value as TOML and JSON hold it (paths as text, tuples as lists)."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def _files(options: dict[str, Any]) -> list[Path]:
    """Every input file the options name (a built-in trace by name: its file, so its content
    hash), and the profile's files."""
    values = [v for value in options.values() for v in (value if isinstance(value, list) else [value])]
    named = [Path(v) for v in values if isinstance(v, str) and v and Path(v).is_file()]
    trace = options.get("trace")
    if isinstance(trace, str) and trace and not Path(trace).exists() and resolve_trace(trace).is_file():
        named.append(resolve_trace(trace))
    return named + (profile_files(options["profile"]) if isinstance(options.get("profile"), str) else [])


def command_config(command: str, resolved: dict[str, Any]) -> dict[str, Any]:
    """The running command's config: its options as parsed, those it left to the run (None) as
    `resolved` gives them, and `[moesim]`."""
    params = command_options()
    params |= {key: value for key, value in resolved.items() if params.get(key) is None}
    options = {key: _plain(value) for key, value in params.items() if value is not None}
    return {"options": options, "moesim": run_header(command, _files(options))}


def _argv(root: Any, command: str, options: dict[str, Any], source: str) -> list[str]:
    """The command line that runs `command` of moesim's command group `root` with `options` (each a parameter of the command)."""
    words = command.split()
    click_command = root
    for word in words:
        commands = getattr(click_command, "commands", {})
        if word not in commands:
            raise InputError(f"{source}: key 'moesim.command': no moesim command '{command}'")
        click_command = commands[word]
    params = {p.name: p for p in click_command.params}
    argv, positional = list(words), []
    for key, value in options.items():
        param = params.get(key)
        if param is None:
            raise InputError(f"{source}: key 'options.{key}': not an option of '{command}'")
        values = value if isinstance(value, list) else [value]
        if param.param_type_name == "argument":
            positional += [str(v) for v in values]
        elif getattr(param, "is_flag", False):
            flag = param.opts[0] if value else (param.secondary_opts or [None])[0]  # type: ignore[attr-defined]
            argv += [flag] if flag else []
        else:
            argv += [word for v in values for word in (param.opts[0], str(v))]
    return [*argv, *positional]


def _read(file: Path) -> dict[str, Any]:
    """A written config: a config.toml, or the "config" of a command's JSON output."""
    if file.suffix == ".json":
        try:
            payload = load_json(file.read_text(), str(file))
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"{file}: cannot read ({exc.__class__.__name__})") from None
        config = payload.get("config") if isinstance(payload, dict) else None
        if not isinstance(config, dict):
            raise InputError(f"{file}: key 'config': not the JSON output of a command that carries its config")
        return config
    return read_toml(file, "written config")


def rerun(
    ctx: typer.Context,
    config: Annotated[
        Path,
        typer.Argument(
            help="What an output carries: OUT/config.toml (simulate, validate --out), a sweep's .parquet, "
            "or the JSON of predict / best-draft --json."
        ),
    ],
    out: Annotated[
        Path | None, typer.Option("--out", help="Where to write (simulate, validate, sweep; default: the command's)."), OUT_DIR
    ] = None,
    force: ForceOpt = False,
) -> None:
    """Run the command an output came from again, from the config it carries (the same bytes)."""
    root = ctx.find_root().command  # moesim's command group (cli/__init__ imports this module)
    written = {"moesim": {"command": "sweep"}} if config.suffix == ".parquet" else _read(config)
    header = written.get("moesim")
    command = header.get("command") if isinstance(header, dict) else None
    if not isinstance(command, str):
        raise InputError(f"{config}: key 'moesim.command' must name the command that wrote the output")
    if command in ("simulate", "sweep"):
        argv = [command, str(config)]  # they check their own [moesim]
    else:
        check_run_header(header, str(config), command)
        if not isinstance(written.get("options"), dict):
            raise InputError(f"{config}: key 'options' must be the table of the command's options")
        argv = _argv(root, command, written["options"], str(config))
    argv += [*(["--out", str(out)] if out is not None else []), *(["--force"] if force else [])]
    root.main(args=argv, prog_name="moesim", standalone_mode=False)
