"""The CLI's foundation commands: help, synth, info, demo."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, DemoRun, assert_one_line_error

from moesim.models import load_preset
from moesim.tracegen.formats.trace import read_trace


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


def test_synth_defaults_to_the_routing_fitted_to_the_real_trace(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """Without a routing option the trace is drawn from the parameters fitted to the built-in real
    trace, and the output says so; it re-reads experts far more than uniform routing does."""
    from moesim.kernels.locality import mean_distinct_experts

    fitted, uniform = tmp_path / "f.arrow", tmp_path / "u.arrow"
    code, out, err = cli("trace", "synth", "--model", "deepseek-v2-lite", "--tokens", "1000", "--out", fitted)
    assert code == 0, err
    assert "generator working_set" in out.replace("-", "_") and "fitted to the real trace; --uniform" in " ".join(out.split())
    code, out, _ = cli("trace", "synth", "--model", "deepseek-v2-lite", "--tokens", "1000", "--uniform", "--out", uniform)
    assert code == 0 and "fitted" not in out
    spread = {}
    for name, path in (("fitted", fitted), ("uniform", uniform)):
        trace = read_trace(path)
        spread[name] = float(mean_distinct_experts(trace.experts, trace.seq_starts, 64, 8).mean(axis=0)[-1])
    assert spread["fitted"] < 0.9 * spread["uniform"]


def test_synth_bad_input(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("trace", "synth", "--model", "nope", "--out", tmp_path / "x.arrow")
    assert_one_line_error(code, err, "unknown MoE model preset 'nope'", "deepseek-v2-lite, ")
    assert "qwen3-0.6b" not in err  # the list is of what --model accepts
    code, _, err = cli("trace", "synth", "--model", "qwen3-0.6b", "--out", tmp_path / "x.arrow")
    assert_one_line_error(code, err, "'qwen3-0.6b' is a draft model, not a MoE target", "olmoe-1b-7b")
    code, _, err = cli("trace", "synth", "--model", "olmoe-1b-7b", "--sticky", "1.5", "--out", tmp_path / "x.arrow")
    assert_one_line_error(code, err, "keep_prob")
    code, _, err = cli("trace", "synth", "--model", "olmoe-1b-7b", "--out", tmp_path / "missing" / "x.arrow")
    assert_one_line_error(code, err, "does not exist")
    assert list(tmp_path.iterdir()) == []


def test_demo_writes_report(demo_run: DemoRun) -> None:
    out_dir, out = demo_run.out_dir, demo_run.out
    assert demo_run.code == 0, demo_run.err
    assert (out_dir / "bytes.csv").is_file() and (out_dir / "trace.arrow").is_file()
    assert "Expert bytes per pass" in out
    # the demo ends with a sweep and its HTML report, images embedded
    page = (out_dir / "report" / "index.html").read_text()
    assert page.count('src="data:image/png;base64,') == 5 and (out_dir / "sweep.parquet").is_file()
    # the page names the file the user has, relative to the page, not the folder the demo staged it in
    assert "<li><code>../sweep.parquet: sweep results," in page
    assert ".part" not in page and str(out_dir.parent) not in page
    assert f"report written to {out_dir}/ (HTML report: {out_dir / 'report' / 'index.html'})" in out.splitlines()  # whole, to copy


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


CALIBRATION = REPO / "data" / "h200" / "calibration.parquet"


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("validate", CALIBRATION, "--profile", "nvidia-h200", "--family", "nope"), ("--family 'nope'", "per_slot", "dedup")),
        (("validate", CALIBRATION, "--profile", "nvidia-h200", "--model", "nope"), ("unknown MoE model preset 'nope'", "qwen3-30b-a3b")),
        (("profile", "fit", CALIBRATION, "--out", "x.toml", "--backend", "nope"), ("--backend 'nope'", "cuda, metal, cpu")),
        (("microbench", "import-backend-ops", "log.txt", "--out", "x", "--backend", "nope"), ("--backend 'nope'", "cpu, cuda, metal")),
        (("trace", "tiny-model", "--out", "x.gguf", "--format", "nope"), ("(--format) = 'NOPE'", "F32, F16")),
        (("trace", "tiny-model", "--out", "x.gguf", "--arch", "nope"), ("'arch'", "qwen3moe, llama, qwen2moe, olmoe, deepseek2")),
        (("microbench", "torch", "--out", "x", "--format", "nope"), ("unknown weight format 'nope'", "bf16, f16, f32")),
        (
            ("trace", "import", "t.arrow", "--model", "olmoe-1b-7b", "--out", "u.arrow", "--source", "nope"),
            ("'nope'", "table, moe-trace, vllm"),
        ),
        (("trace", "synth", "--model", "olmoe-1b-7b", "--params", "nope", "--out", "x.arrow"), ("nope", "esft-vanilla-lite-mixture")),
        (
            ("batch", "--trace", "t.arrow", "--profile", "nvidia-h200", "--alpha", "0.8", "--draft-len", "2", "--routing", "nope"),
            ("'nope'",),
        ),
    ],
)
def test_a_wrong_kind_gets_one_line_listing_the_accepted_ones(cli, tmp_path, monkeypatch, args, fragments) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    if "t.arrow" in args:
        assert cli("trace", "synth", "--model", "olmoe-1b-7b", "--tokens", "16", "--out", "t.arrow")[0] == 0
    assert_one_line_error(*cli(*args)[::2], *fragments)


def test_usage_error_through_the_console_script() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "moesim", "predict", "--profile", "nvidia-h200"], capture_output=True, text=True)
    assert_one_line_error(proc.returncode, proc.stderr, "Missing option '--trace'")
    assert proc.stdout == ""


def test_renamed_options_keep_their_old_spelling_with_a_note(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "t.arrow"
    assert cli("trace", "synth", "--model", "olmoe-1b-7b", "--sticky", "0.3", "--tokens", "64", "--seqs", "2", "--out", trace)[0] == 0
    base = ("batch", "--trace", trace, "--profile", "nvidia-h200", "--alpha", "0.8", "--batch", "1,2", "--json")
    code, new_out, new_err = cli(*base, "--draft-len", "2", "--context-tokens", "128")
    assert code == 0 and new_err == "", new_err
    code, old_out, old_err = cli(*base, "--draft", "2", "--context=128")
    assert code == 0 and old_out == new_out
    notes = old_err.splitlines()
    assert len(notes) == 2 and all(n.startswith("moesim: note: ") and "is deprecated" in n for n in notes)
    assert "--draft is deprecated, use --draft-len" in notes[0] and "--context is deprecated, use --context-tokens" in notes[1]
    # the old spellings are hidden from --help
    help_text = cli("batch", "--help")[1]
    assert "--draft-len" in help_text and "--draft " not in help_text and "--context-tokens" in help_text


def test_old_spellings_are_renamed_only_for_their_command() -> None:
    from moesim.cli.options import rename_old_spellings

    assert rename_old_spellings(["report", "r.parquet", "--where=model=x", "--out", "o"]) == [
        "report",
        "r.parquet",
        "--filter=model=x",
        "--out",
        "o",
    ]
    assert rename_old_spellings(["trace", "tiny-model", "--weight-type", "F16"]) == ["trace", "tiny-model", "--format", "F16"]
    assert rename_old_spellings(["microbench", "torch", "--dtype", "f16"]) == ["microbench", "torch", "--format", "f16"]
    assert rename_old_spellings(["predict", "--draft", "3"]) == ["predict", "--draft", "3"]  # not an option of predict


def test_tiny_model_options_come_from_the_spec(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec
    from moesim.tracegen.llamacpp.gguf_reader import read_tiny_spec

    target = tmp_path / "t.gguf"
    code, _, err = cli("trace", "tiny-model", "--out", target, "--hidden", "64", "--expert-intermediate", "24", "--format", "f16")
    assert code == 0, err
    assert read_tiny_spec(target) == TinyModelSpec(hidden=64, expert_ff=24, weight_type="F16")  # every other field: the spec's default
    assert "(default: 4)" in cli("trace", "tiny-model", "--help")[1]  # the help names the spec's default layers
    code, _, err = cli("trace", "tiny-model", "--out", tmp_path / "d.gguf", "--draft-of", target, "--hidden", "32", "--noise", "0.1")
    assert_one_line_error(code, err, "--draft-of takes the shape from", "drop --hidden")
    assert_one_line_error(*cli("trace", "tiny-model", "--out", tmp_path / "d.gguf", "--draft-of", target)[::2], "needs --noise")
    assert_one_line_error(*cli("trace", "tiny-model", "--out", tmp_path / "d.gguf", "--noise", "0.1")[::2], "--noise needs --draft-of")
    code, _, err = cli("trace", "tiny-model", "--out", tmp_path / "d.gguf", "--draft-of", target, "--noise", "0.0")
    assert code == 0, err
    assert read_tiny_spec(tmp_path / "d.gguf").hidden == 64 and not (tmp_path / "x.gguf").exists()
