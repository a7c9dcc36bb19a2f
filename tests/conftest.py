"""Shared fixtures: the CLI run in-process, one demo run per test run (shared by xdist's workers),
the repository's data folder, and the one way tests build a `Server` (`make_server`)."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import HealthCheck, settings

# rich fixes a console's width to COLUMNS when the console is made (moesim.cli.render makes its
# own at import): moesim is imported without it, so that its consoles follow the variable the tests
# set; an xdist worker inherits the COLUMNS this file set in the process that started it
COLUMNS = os.environ.pop("COLUMNS", None) or "200"

from moesim.cli import main  # noqa: E402
from moesim.sim.serving.server import Server  # noqa: E402
from moesim.sim.serving.workload import Arrivals  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"

os.environ["COLUMNS"] = COLUMNS
os.environ["MOESIM_CACHE_DIR"] = tempfile.mkdtemp(prefix="moesim-test-cache-")  # never the user's cache (moesim.cache)
atexit.register(shutil.rmtree, os.environ["MOESIM_CACHE_DIR"], True)

# No property test may pass or fail with the machine's load: no deadline per example, no health
# check on how long examples take to draw (a test that lists its own suppressed checks names too_slow)
settings.register_profile("moesim", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("moesim")


@pytest.fixture(autouse=True)
def _own_layer_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts as a new process without the disk cache: no layer tables held or cached
    (`moesim.sim.cost.layer_tables`), so a test of the paths before a size's tables sees them
    whatever ran before it; tests/test_cache.py turns the cache on in a folder of its own."""
    from moesim.sim.cost import layer_tables

    monkeypatch.setenv("MOESIM_CACHE", "off")
    monkeypatch.setattr(layer_tables, "_MEMORY", {})
    monkeypatch.setattr(layer_tables, "_HELD", {"bytes": 0})
    monkeypatch.setattr(layer_tables, "_PRICED", {})


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `moesim ARGS...` in-process; returns (exit code, stdout, stderr)."""

    def run(*args: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@dataclass(frozen=True)
class DemoRun:
    """`moesim demo --out OUT_DIR` run once: its exit code, stdout, stderr and folder."""

    code: int
    out: str
    err: str
    out_dir: Path


DEMO_COLUMNS = 80  # the demo runs in a newcomer's 80-column terminal


def _run_demo(out_dir: Path) -> DemoRun:
    """`moesim demo --out OUT_DIR` through the CLI in-process at 80 columns."""
    stdout, stderr = io.StringIO(), io.StringIO()
    columns = os.environ["COLUMNS"]
    os.environ["COLUMNS"] = str(DEMO_COLUMNS)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["demo", "--out", str(out_dir)])
    finally:
        os.environ["COLUMNS"] = columns
    return DemoRun(code, stdout.getvalue(), stderr.getvalue(), out_dir)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The demo, run once per test run and shared by every test reading its outputs: under xdist the
    first worker to need it runs it in the run's own temporary folder (above each worker's), holding
    a file lock, and writes what it printed beside it; the others wait on the lock and read that."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nothing to share
        return _run_demo(tmp_path_factory.mktemp("demo") / "report")
    root = tmp_path_factory.getbasetemp().parent
    printed = root / "demo.json"
    with FileLock(root / "demo.lock"):
        if not printed.is_file():
            (root / "demo").mkdir()
            run = _run_demo(root / "demo" / "report")
            printed.write_text(json.dumps({"code": run.code, "out": run.out, "err": run.err}))
        shown = json.loads(printed.read_text())
    return DemoRun(shown["code"], shown["out"], shown["err"], root / "demo" / "report")


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    """Exit code 2, a single line on stderr, naming every fragment, and no traceback."""
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def make_server(cost: object, policy: object, acceptance: object, workload: object, **options: object) -> Server:
    """The server of a test: a closed loop of one request at a time, one request, no duration
    limit, seed 0, unless `options` say otherwise (any `Server` argument: arrivals, max_batch,
    requests, duration_us, seed, windows, scheduling, lane, progress)."""
    defaults: dict[str, object] = {"arrivals": Arrivals(), "max_batch": 1, "requests": 1, "duration_us": 0.0, "seed": 0}
    return Server(cost=cost, policy=policy, acceptance=acceptance, workload=workload, **(defaults | options))  # type: ignore[arg-type]
