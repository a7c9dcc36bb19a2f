"""The `moesim` command line: parses arguments, calls the packages, renders results.

No logic of its own: one module per command group (`trace`, `analysis`, `profile`, `microbench`,
`simulate`, `validate`, `sweep`, `demo`, `rerun`), rendering in `render`, options generated from config
dataclasses and the old spellings of renamed options in `options`. Every MoesimError becomes one
line on stderr and exit code 2; an operating-system error (a file that cannot be written) one
line naming the file; Ctrl-C exit code 130 and SIGTERM 143, after the same cleanup, with one
line. Each command runs in an inputs scope (`moesim.atomic`) and is `guarded` (`options`): its
inputs, read from its signature, are protected and its outputs checked against them before it runs.
"""

from __future__ import annotations

import signal
import sys
import warnings
from types import FrameType

import typer

from moesim.atomic import inputs_scope
from moesim.cache import check_settings
from moesim.cli import analysis, demo, microbench, profile, rerun, simulate, sweep, trace, validate
from moesim.cli.options import Stopped, guarded, rename_old_spellings
from moesim.cli.render import line
from moesim.errors import MoesimError, Terminated, interrupt_code

app = typer.Typer(
    name="moesim",
    help="Trace-driven simulation of speculative decoding on Mixture-of-Experts LLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(demo.demo)
app.command()(simulate.simulate)
app.command("bytes")(analysis.bytes_command)
app.command("predict")(analysis.predict_command)
app.command("best-draft")(analysis.best_draft_command)
app.command("crossover")(analysis.crossover_command)
app.command("batch")(analysis.batch_command)
app.command("validate")(validate.validate_command)
app.command("sweep")(sweep.sweep_command)
app.command("report")(sweep.report_command)
app.command("rerun")(rerun.rerun)
app.add_typer(trace.app, name="trace")
app.add_typer(profile.app, name="profile")
app.add_typer(microbench.app, name="microbench")


def _guard_commands(group: typer.Typer) -> None:
    """Every command of the group (and its sub-groups) guarded: inputs from its signature protected."""
    for info in group.registered_commands:
        info.callback = guarded(info.callback)  # type: ignore[arg-type]
    for sub in group.registered_groups:
        _guard_commands(sub.typer_instance)  # type: ignore[arg-type]


_guard_commands(app)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input or usage, 130 interrupted, 143 terminated)."""
    args = rename_old_spellings(sys.argv[1:] if argv is None else list(argv))
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread
        previous = None
    try:
        check_settings()
        with inputs_scope(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy's; a result's own warnings are printed by the command
            code = app(args=args, prog_name="moesim", standalone_mode=False)  # a command's typer.Exit(n) returns n here
    except MoesimError as exc:
        return _error_line(str(exc))
    except OSError as exc:  # a file the checks could not foresee (a full disk, a vanished folder)
        where = f"{exc.filename}: " if exc.filename else ""
        return _error_line(f"{where}{exc.strerror or exc.__class__.__name__}")
    except typer.TyperException as exc:  # usage errors: a missing or malformed option, an unknown command
        if type(exc).__name__ == "NoArgsIsHelpError":  # a group called without a command: its help, already shown
            return 0
        return _error_line(f"{exc.format_message()} (see 'moesim --help')")  # type: ignore[attr-defined]
    except typer.Exit as exc:
        return exc.exit_code
    except (Stopped, typer.Abort, KeyboardInterrupt) as exc:  # click turns an interruption outside a command into Abort
        code = (
            exc.code if isinstance(exc, Stopped) else interrupt_code(exc if isinstance(exc, KeyboardInterrupt) else exc.__context__ or exc)
        )
        line("moesim: terminated" if code == 143 else "moesim: interrupted")
        return code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return code if isinstance(code, int) else 0


def _error_line(message: str) -> int:
    """Bad input or usage: one line on stderr, exit code 2."""
    line(f"moesim: error: {' '.join(message.split())}")
    return 2


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
