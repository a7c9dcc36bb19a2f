"""`moesim ARGS...` in a process of its own without paying Python's and moesim's imports each time.

A fuzz case that must survive native code aborting (Arrow reading a corrupt file) runs in a child
process; spawning `python -m moesim` costs ~2 s of imports per case. Here the children are forked
from one server process that imported `moesim.cli` once (multiprocessing's forkserver, one per
test process): each child is still a process of its own (its own exit code, a signal that kills
it kills only it, its own stdout and stderr file descriptors, its exit handlers run) doing what
`python -m moesim ARGS` does, `sys.exit(main(ARGS))`, from the given folder and environment.
Tests of the console script itself, of signals sent to a real command, or of imports (a read-only
install, a blocked package) keep spawning a fresh interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["moesim.cli", "typer._adapters", "rich._emoji_codes"])  # what a first command imports late


def _child(args: list[str], cwd: str, env: dict[str, str], out_path: str, err_path: str) -> None:
    """The child: stdout and stderr at the descriptor level to files, then `python -m moesim ARGS`."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the process's own stdout, closed by its end)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    from moesim.cli import main

    try:
        code = main(args)
    finally:
        atexit._run_exitfuncs()  # a real interpreter's exit handlers (multiprocessing's children skip them)
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def run_moesim(
    args: list[object], cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python -m moesim ARGS` in a forked child: its exit code (negative: killed by that signal), stdout and stderr."""
    with tempfile.TemporaryDirectory(prefix="moesim-child-") as folder:
        out_path, err_path = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        Path(out_path).touch()
        Path(err_path).touch()
        environment = dict(os.environ if env is None else env)
        child = _CONTEXT.Process(target=_child, args=([str(a) for a in args], str(cwd or os.getcwd()), environment, out_path, err_path))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["moesim", *map(str, args)], timeout)
        out, err = Path(out_path).read_text(errors="replace"), Path(err_path).read_text(errors="replace")
    return subprocess.CompletedProcess(["moesim", *map(str, args)], child.exitcode, out, err)


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) the process `pid` has worked: how far a command got, whatever the machine's load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
