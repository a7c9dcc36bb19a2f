"""Count the rooms a command walks through (issue 28): which of moesim's simulator modules one
command enters from the CLI on, and how often it comes back to one it left.

    python bench/walk_rooms.py -- best-draft --trace t.arrow --profile nvidia-h200 --alpha 0.8

A Python call from one module into a function of another module of `moesim.sim` is an entry
(calls inside one module are one stay); each distinct entry (caller's function, callee's function)
is counted once, and every entry into a module beyond its first is a return (the walk comes back
to a room it left). Printed: each entry, the entries per module, and the totals. The
command runs in this process (its output is discarded); a trace can be made with `moesim trace synth`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

PREFIX = "moesim.sim."


@dataclass
class Walk:
    """Distinct entries into the simulator's modules: (caller's module and function, callee's module
    and function) for every call that crosses from one module into another."""

    entries: set[tuple[str, str, str, str]] = field(default_factory=set)

    @property
    def modules(self) -> set[str]:
        """Every module entered."""
        return {entry[2] for entry in self.entries}

    @property
    def returns(self) -> int:
        """Entries beyond the first into each module: the walk comes back to a room it left."""
        return len(self.entries) - len(self.modules)


def walk(argv: list[str]) -> Walk:
    """The entries into modules of `moesim.sim` while the CLI runs `argv`."""
    from moesim.cli import app

    seen = Walk()

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(PREFIX) or frame.f_code.co_name.startswith("<"):
            return
        caller = frame.f_back
        while caller is not None and (  # comprehensions, lambdas, the standard library's and numpy's frames: whoever called them
            caller.f_code.co_name.startswith("<") or not caller.f_globals.get("__name__", "").startswith("moesim.")
        ):
            caller = caller.f_back
        source = caller.f_globals.get("__name__", "") if caller is not None else ""
        if source == name:
            return
        where = source if source.startswith(PREFIX) else "cli"
        seen.entries.add((where, caller.f_code.co_name if caller is not None and where != "cli" else "", name, frame.f_code.co_qualname))

    sink = io.StringIO()
    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), contextlib.suppress(SystemExit):
            app(argv, standalone_mode=False)
    finally:
        sys.setprofile(None)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its options, after --")
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    walk(argv)  # once to import and compile: the counted walk sees no first-use imports
    seen = walk(argv)
    short = len(PREFIX)
    per_module: dict[str, int] = {}
    for source, function, target, callee in sorted(seen.entries):
        per_module[target] = per_module.get(target, 0) + 1
        print(f"{source.removeprefix(PREFIX) + '.' + function if function else source:50s} -> {target[short:]}.{callee}")
    for target, count in sorted(per_module.items(), key=lambda item: (-item[1], item[0])):
        print(f"{target[short:]:28s} entered {count:3d} times, returns {count - 1:3d}")
    print(f"modules entered {len(seen.modules)}, entries {len(seen.entries)}, returns {seen.returns}")


if __name__ == "__main__":
    main()
