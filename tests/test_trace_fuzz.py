"""Corrupt trace files never crash moesim: each is read in a process of its own (native Arrow code
can abort a process; forked from one that imported moesim, tests/processes.py) and must end with
exit code 0 or 2 and at most a one-line message."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import run_moesim

from moesim.models import load_preset
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Uniform, synthesize


def _valid_trace_bytes(tmp: Path) -> bytes:
    trace = synthesize(load_preset("olmoe-1b-7b"), Uniform(), tokens=12, seqs=2, seed=3)
    path = tmp / "valid.arrow"
    write_trace(path, trace)
    return path.read_bytes()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    data=st.data(),
    mode=st.sampled_from(["flip", "truncate", "splice"]),
)
def test_corrupt_trace_exits_0_or_2(tmp_path: Path, data: st.DataObject, mode: str) -> None:
    original = bytearray(_valid_trace_bytes(tmp_path))
    if mode == "flip":
        positions = data.draw(st.lists(st.integers(0, len(original) - 1), min_size=1, max_size=8))
        values = data.draw(st.lists(st.integers(0, 255), min_size=len(positions), max_size=len(positions)))
        for p, v in zip(positions, values, strict=True):
            original[p] = v
        corrupt = bytes(original)
    elif mode == "truncate":
        corrupt = bytes(original[: data.draw(st.integers(0, len(original) - 1))])
    else:
        start = data.draw(st.integers(0, len(original) - 1))
        junk = data.draw(st.binary(min_size=1, max_size=64))
        corrupt = bytes(original[:start] + junk + original[start + len(junk) :])
    path = tmp_path / "corrupt.arrow"
    path.write_bytes(corrupt)
    proc = run_moesim(["trace", "info", path, "--json"], timeout=120)
    assert proc.returncode in (0, 2), (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    if proc.returncode == 2:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and str(path) in lines[0], proc.stderr
    else:
        assert json.loads(proc.stdout)["tokens"] > 0
