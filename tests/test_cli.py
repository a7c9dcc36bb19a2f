"""The CLI's foundation commands: help, synth, info, demo."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error

from moesim.models import load_preset
from moesim.tracegen.trace import read_trace


def test_help_lists_commands(cli) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = cli("--help")
    assert code == 0
    for command in ("demo", "trace"):
        assert command in out
    code, out, _ = cli("trace", "--help")
    assert code == 0 and "synth" in out and "info" in out


def test_synth_then_info_json(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.arrow"
    args = ("--model", "olmoe-1b-7b", "--sticky", "0.5", "--tokens", "300", "--seqs", "2", "--seed", "4", "--out", path)
    code, _, err = cli("trace", "synth", *args)
    assert code == 0, err
    code, out, err = cli("trace", "info", path, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["model"] == "olmoe-1b-7b" and info["sequences"] == 2 and info["tokens"] == 600
    assert info["top_k"] == 8 and info["moe_layers"] == list(range(16))
    assert len(info["reuse_per_layer"]) == 16 and all(u <= 64 for u in info["experts_used_per_layer"])
    # sticky q = 0.5 with uniform popularity: overlap = E[kept + (K - kept)^2 / (E - kept)] / K
    k, e, q = 8, 64, 0.5
    kept = np.arange(k + 1)
    from math import comb

    prob = np.array([comb(k, i) * q**i * (1 - q) ** (k - i) for i in kept])
    expected = float(np.sum(prob * (kept + (k - kept) ** 2 / (e - kept))) / k)
    assert info["mean_reuse"] == pytest.approx(expected, abs=0.02)


def test_uniform_synth_matches_formula(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    from moesim.kernels.locality import mean_distinct_experts

    path = tmp_path / "u.arrow"
    assert cli("trace", "synth", "--model", "deepseek-v2-lite", "--uniform", "--tokens", "2000", "--seqs", "2", "--out", path)[0] == 0
    trace = read_trace(path)
    preset = load_preset("deepseek-v2-lite")
    u = mean_distinct_experts(trace.experts, trace.seq_starts, 64, 16).mean(axis=0)
    n = np.arange(1, 17)
    # 26 layers x ~4000 windows: the mean's relative standard error is well under 0.5%
    np.testing.assert_allclose(u, 64 * (1 - (1 - preset.top_k / 64) ** n), rtol=0.01)


def test_synth_bad_input(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("trace", "synth", "--model", "nope", "--out", tmp_path / "x.arrow")
    assert_one_line_error(code, err, "unknown model preset 'nope'")
    code, _, err = cli("trace", "synth", "--model", "qwen3-0.6b", "--out", tmp_path / "x.arrow")
    assert_one_line_error(code, err, "has no experts")
    code, _, err = cli("trace", "synth", "--model", "olmoe-1b-7b", "--sticky", "1.5", "--out", tmp_path / "x.arrow")
    assert_one_line_error(code, err, "keep_prob")
    code, _, err = cli("trace", "synth", "--model", "olmoe-1b-7b", "--out", tmp_path / "missing" / "x.arrow")
    assert_one_line_error(code, err, "does not exist")
    assert list(tmp_path.iterdir()) == []


def test_demo_writes_report(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out_dir = tmp_path / "report"
    code, out, err = cli("demo", "--out", out_dir)
    assert code == 0, err
    assert (out_dir / "bytes.csv").is_file() and (out_dir / "trace.arrow").is_file()
    assert "Expert bytes per pass" in out
    # the demo ends with a sweep and its HTML report, images embedded
    page = (out_dir / "report" / "index.html").read_text()
    assert page.count('src="data:image/png;base64,') == 5 and (out_dir / "sweep.parquet").is_file()
    assert f"HTML report: {out_dir / 'report' / 'index.html'}" in out.replace("\n", "")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("predict", "--profile", "nvidia-h200"), "Missing option '--trace'"),
        (("best-draft", "--trace", "t.arrow", "--profile", "nvidia-h200", "--alpha", "abc"), "Invalid value for '--alpha'"),
        (("no-such-command",), "No such command 'no-such-command'"),
        (("trace", "info", "t.arrow", "--bogus"), "No such option: --bogus"),
    ],
)
def test_usage_errors_are_one_line(cli, args: tuple[str, ...], fragment: str) -> None:  # type: ignore[no-untyped-def]
    assert_one_line_error(*cli(*args)[::2], fragment)


def test_usage_error_through_the_console_script() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "moesim", "predict", "--profile", "nvidia-h200"], capture_output=True, text=True)
    assert_one_line_error(proc.returncode, proc.stderr, "Missing option '--trace'")
    assert proc.stdout == ""
