"""Count the rooms a command walks through (issue 28): which of moesim's simulator modules one
command enters from the CLI on, and how often it comes back to one it left.

    python bench/walk_rooms.py -- best-draft --trace t.arrow --profile nvidia-h200 --alpha 0.8
    python bench/walk_rooms.py --rooms analysis.verdict,analysis.speculation,cost.tree -- best-draft ...

A Python call from one module into a function of another module of `moesim.sim` is an entry
(calls inside one module are one stay); each distinct entry (caller's function, callee's function)
is counted once, and every entry into a module beyond its first is a return (the walk comes back
to a room it left). The paths to a pass's features: the modules on the stack at every call into
`moesim.kernels`, and the returns along them (a module that stands twice on one path). Printed:
each entry and path (not with --quiet), and the totals. The
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
    to_features: set[tuple[str, ...]] = field(default_factory=set)  # the rooms on the stack at each call into moesim.kernels

    @property
    def modules(self) -> set[str]:
        """Every module entered."""
        return {entry[2] for entry in self.entries}

    @property
    def returns(self) -> int:
        """Entries beyond the first into each module: the walk comes back to a room it left."""
        return len(self.entries) - len(self.modules)


def _rooms(frame: FrameType | None) -> tuple[str, ...]:
    """The modules of `moesim.sim` on the stack, outermost first, a stay in one module once (until a
    frame of the kernels: the counting's own calls are not a path to them)."""
    rooms: list[str] = []
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("moesim.kernels."):
            return ()
        room = name.removeprefix(PREFIX)
        if name.startswith(PREFIX) and (not rooms or rooms[-1] != room):
            rooms.append(room)
        frame = frame.f_back
    return tuple(reversed(rooms))


def walk(argv: list[str]) -> Walk:
    """The entries into modules of `moesim.sim` while the CLI runs `argv`."""
    from moesim.cli import app

    seen = Walk()

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if name.startswith("moesim.kernels."):
            seen.to_features.add(_rooms(frame.f_back))
            return
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


def report(seen: Walk, label: str, rooms: set[str] | None = None) -> str:
    """One line: the modules entered, the entries and the returns (only into `rooms` when given)."""
    entries = {entry for entry in seen.entries if rooms is None or entry[2] in rooms}
    modules = {entry[2] for entry in entries}
    return f"{label}: modules entered {len(modules)}, entries {len(entries)}, returns {len(entries) - len(modules)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rooms",
        action="append",
        default=[],
        help="also count only the entries into these modules (comma-separated, below moesim.sim); repeatable",
    )
    parser.add_argument("--quiet", action="store_true", help="the totals only, not every entry")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its options, after --")
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    walk(argv)  # once to import and compile: the counted walk sees no first-use imports
    seen = walk(argv)
    if not args.quiet:
        for source, function, target, callee in sorted(seen.entries):
            print(f"{source.removeprefix(PREFIX) + '.' + function if function else source:50s} -> {target.removeprefix(PREFIX)}.{callee}")
    print(report(seen, "all of moesim.sim"))
    paths = sorted(path for path in seen.to_features if path)
    if not args.quiet:
        for path in paths:
            print("to features: " + " > ".join(path))
    rooms = {room for path in paths for room in path}
    again = sum(len(path) - len(set(path)) for path in paths)
    print(
        f"to the features: {len(paths)} paths through {len(rooms)} modules, longest {max(map(len, paths), default=0)}, "
        f"returns along them {again}"
    )
    for text in args.rooms:
        print(report(seen, text, {PREFIX + room.strip() for room in text.split(",")}))


if __name__ == "__main__":
    main()
