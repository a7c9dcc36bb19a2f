"""Shared fixtures: the CLI run in-process, the repository's data folder, small traces."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from moesim.cli import main

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"

os.environ.setdefault("COLUMNS", "200")


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `moesim ARGS...` in-process; returns (exit code, stdout, stderr)."""

    def run(*args: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    """Exit code 2, a single line on stderr, naming every fragment, and no traceback."""
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
