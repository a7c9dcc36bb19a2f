"""The fuzz suite of issue 15: hypothesis corrupts every input kind (presets, Hugging Face
config.json, trace and speculative-run metadata, generator parameters, profiles, measurement
tables, simulation and sweep configs). Most cases go through each kind's boundary in-process;
a sample runs through the CLI in-process and a smaller one in subprocesses (the exit code, stderr
and the files a real process leaves). Each must succeed, or exit 2 with one line naming the file;
never a traceback; no file changed but the declared output; no temporary left. The counts are
deterministic (derandomised: CI replays the same cases); bench/fuzz_inputs.py runs more, at random."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from fuzzing import Kind, check_boundary, corrupted, corrupted_table, kinds, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.cli import main

# cases per kind through the boundary in-process (11,000 in all), through the CLI in-process, in subprocesses
QUOTA = {
    "preset": 1800,
    "hf-config": 1800,
    "trace-meta": 1000,
    "specrun-meta": 1000,
    "generator-params": 1200,
    "profile": 1400,
    "measurements": 400,
    "simulation": 1400,
    "sweep": 1000,
}
CLI_QUOTA, SUBPROCESS_QUOTA = 8, 1
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def _strategy(kind: Kind) -> st.SearchStrategy[object]:
    return corrupted_table(kind.doc) if kind.name == "measurements" else corrupted(kind.doc, kind.json_like)


@pytest.mark.parametrize("name", sorted(QUOTA))
def test_corrupted_inputs_are_read_or_refused_in_one_line(tmp_path: Path, name: str) -> None:
    kind = kinds(tmp_path)[name]
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=QUOTA[name])
    @given(doc=_strategy(kind))
    def case(doc: object) -> None:
        outcomes[check_boundary(kind, tmp_path / kind.file, doc)] += 1

    case()
    assert sum(outcomes.values()) >= QUOTA[name]
    assert outcomes["refused"] > QUOTA[name] // 4  # the corruptions reach the checks, not only harmless keys


def _command(kind: Kind, folder: Path) -> list[str]:
    return [part.replace("{file}", str(folder / kind.file)).replace("{out}", str(folder / "out")) for part in kind.command]


def _inputs(files: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {k: v for k, v in files.items() if not k.startswith("out")}


def _check_run(kind: Kind, folder: Path, code: int, err: str, before: dict[str, tuple[int, int]]) -> None:
    assert "Traceback" not in err, err
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip() and "warning" not in line]
        assert len(lines) == 1 and kind.file in lines[0], err
    after, before = _inputs(snapshot(folder)), _inputs(before)
    assert after == before, (kind.name, set(after) ^ set(before))  # only the declared output changed
    assert not list(folder.rglob("*.part")), kind.name


@pytest.mark.parametrize("name", sorted(QUOTA))
def test_corrupted_inputs_through_the_cli(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    kind = kinds(tmp_path)[name]

    @settings(FUZZ, max_examples=CLI_QUOTA)
    @given(doc=_strategy(kind))
    def case(doc: object) -> None:
        kind.write(tmp_path / kind.file, doc)
        before = snapshot(tmp_path)
        capsys.readouterr()
        code = main(_command(kind, tmp_path))
        _check_run(kind, tmp_path, code, capsys.readouterr().err, before)

    case()


@pytest.mark.parametrize("name", sorted(QUOTA))
def test_corrupted_inputs_in_a_subprocess(tmp_path: Path, name: str) -> None:
    kind = kinds(tmp_path)[name]
    env = {**os.environ, "COLUMNS": "200"}

    @settings(FUZZ, max_examples=SUBPROCESS_QUOTA)
    @given(doc=_strategy(kind))
    def case(doc: object) -> None:
        kind.write(tmp_path / kind.file, doc)
        before = snapshot(tmp_path)
        run = subprocess.run(
            [sys.executable, "-m", "moesim", *_command(kind, tmp_path)], capture_output=True, text=True, env=env, timeout=300
        )
        _check_run(kind, tmp_path, run.returncode, run.stderr, before)

    case()
