"""One exception family: every user-facing failure is a MoesimError with a one-line message.

The CLI turns a MoesimError into that line on stderr and exit code 2; notebooks catch it.
"""

from __future__ import annotations


class MoesimError(Exception):
    """Base of moesim's errors; str(error) is a single line meant for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class InputError(MoesimError):
    """A file, field or value given by the user is malformed or inconsistent."""


class ConfigError(MoesimError):
    """A configuration (preset, profile, simulation config) is invalid."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that the same cleanup runs (temporaries
    removed, resumable state kept); the CLI exits with 143 instead of 130."""


def interrupt_code(exc: BaseException) -> int:
    """The exit code of an interruption: 143 for SIGTERM, 130 for Ctrl-C (SIGINT)."""
    return 143 if isinstance(exc, Terminated) else 130


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its class name when the message is empty), for
    one-line errors about a library's failure."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


def where(path: object, field: str | None = None, row: int | None = None) -> str:
    """Prefix naming the file, the row and the field of a bad value."""
    parts = [str(path)]
    if row is not None:
        parts.append(f"row {row}")
    if field is not None:
        parts.append(f"field '{field}'")
    return ": ".join(parts)
