"""Every output carries the config that made it (issue 28): rerun from that config, the same bytes.

simulate (a run and a study: OUT/config.toml), sweep (the Parquet's `moesim.run_config`),
predict --json and best-draft --json (their "config"), validate --out (OUT/config.toml); and a
changed input refuses the rerun in one line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import DATA, REPO, DemoRun, assert_one_line_error

import moesim
from moesim.atomic import MANIFEST
from moesim.models import load_preset
from moesim.parsing import load_toml
from moesim.tomlfile import RUN_CONFIG
from moesim.tracegen.formats.builtin import resolve_trace
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Sticky, synthesize

RUN = """
[run]
seed = 3
requests = 6

[workload]
prompt_tokens = 16
output_tokens = 48

[arrivals]
kind = "poisson"
rate_per_s = 40.0

[batching]
max_batch = 4

[trace]
synth = "sticky"
synth_params = { keep_prob = 0.4 }
tokens = 256
seqs = 4

[cost]
kind = "steptime"

[target]
model = "deepseek-v2-lite"
profile = "nvidia-h200"

[drafter]
kind = "preset"
model = "qwen3-0.6b"

[acceptance]
model = "geometric"
alpha = 0.7

[policy]
name = "static"
k = 3
"""

SWEEP = """
[sweep]
workers = 1

[grid]
models = ["deepseek-v2-lite"]
families = ["per_slot", "best"]
drafters = ["ngram", "eagle3,topk=2,tokens=4"]
alpha = [0.5, 0.9]
max_draft = 3
max_pass = 6
batch = [1, 2]
context = [128]

[[routing]]
name = "sticky"
generator = "sticky"
params = { keep_prob = 0.3 }
tokens = 200
seqs = 4
"""


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("written") / "t.arrow"
    write_trace(path, synthesize(load_preset("deepseek-v2-lite"), Sticky(keep_prob=0.3), tokens=300, seqs=4, seed=1))
    return path


def test_a_simulation_reruns_from_its_config_to_the_same_bytes(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "run.toml"
    config.write_text(RUN)
    code, _, err = cli("simulate", config, "--out", tmp_path / "a")
    assert code == 0, err
    written = load_toml((tmp_path / "a" / RUN_CONFIG).read_text(), "config")
    assert written["moesim"]["command"] == "simulate" and written["run"]["duration_s"] == 0.0  # defaults filled
    assert written["drafter"] == {"kind": "preset", "model": "qwen3-0.6b", "argument": "", "tree": "", "device": ""}
    # the built-in profile by its content, named inside the package wherever moesim is installed
    profile = written["moesim"]["files"]["moesim:hw_profiles/profiles/nvidia-h200.toml"]
    assert profile == hashlib.sha256((Path(moesim.__file__).parent / "hw_profiles/profiles/nvidia-h200.toml").read_bytes()).hexdigest()
    assert cli("simulate", tmp_path / "a" / RUN_CONFIG, "--out", tmp_path / "b")[0] == 0
    assert cli("rerun", tmp_path / "a" / RUN_CONFIG, "--out", tmp_path / "c")[0] == 0
    first = _files(tmp_path / "a")
    assert set(first) == {"requests.arrow", "iterations.arrow", "summary.json", RUN_CONFIG}
    assert _files(tmp_path / "b") == first and _files(tmp_path / "c") == first


def test_a_simulation_on_the_builtin_trace_names_it_by_name_and_content(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    synthetic = '[trace]\nsynth = "sticky"\nsynth_params = { keep_prob = 0.4 }\ntokens = 256\nseqs = 4\n'
    assert synthetic in RUN
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "run.toml"
    config.write_text(RUN.replace(synthetic, '[trace]\npath = "esft-vanilla-lite"\n'))
    code, _, err = cli("simulate", config, "--out", tmp_path / "a")
    assert code == 0, err
    written = load_toml((tmp_path / "a" / RUN_CONFIG).read_text(), "config")
    assert written["trace"]["path"] == "esft-vanilla-lite"  # not configs/esft-vanilla-lite: no folder of the run's
    digest = hashlib.sha256(resolve_trace("esft-vanilla-lite").read_bytes()).hexdigest()
    assert written["moesim"]["files"]["moesim:tracegen/data/esft-vanilla-lite/esft-vanilla-lite.trace.arrow"] == digest
    monkeypatch.chdir(tmp_path / "configs")
    assert cli("rerun", tmp_path / "a" / RUN_CONFIG, "--out", tmp_path / "b")[0] == 0
    assert _files(tmp_path / "b") == _files(tmp_path / "a")


def test_a_study_reruns_from_its_config_to_the_same_bytes(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    example = REPO / "examples" / "cascade-table-study.toml"
    assert cli("simulate", example, "--out", tmp_path / "a")[0] == 0
    assert cli("rerun", tmp_path / "a" / RUN_CONFIG, "--out", tmp_path / "b")[0] == 0
    first = _files(tmp_path / "a")
    assert set(first) == {"study.arrow", "study.csv", RUN_CONFIG} and _files(tmp_path / "b") == first


def test_a_sweep_reruns_from_its_results_to_the_same_bytes(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "sweep.toml"
    config.write_text(SWEEP)
    assert cli("sweep", config, "--out", tmp_path / "a.parquet")[0] == 0
    assert cli("rerun", tmp_path / "a.parquet", "--out", tmp_path / "b.parquet")[0] == 0
    assert cli("sweep", tmp_path / "a.parquet", "--out", tmp_path / "c.parquet")[0] == 0
    first = (tmp_path / "a.parquet").read_bytes()
    assert (tmp_path / "b.parquet").read_bytes() == first and (tmp_path / "c.parquet").read_bytes() == first
    assert_one_line_error(*cli("sweep", tmp_path / "a.parquet")[::2], "is an input")  # its default output is itself


@pytest.mark.parametrize(
    "command",
    [
        ["predict", "--max-pass", "5", "--batch", "2"],
        ["best-draft", "--alpha", "0.6", "--alpha", "0.9", "--max-draft", "4", "--drafter", "eagle3,topk=2,tokens=4", "--verdict"],
        ["best-draft", "--alpha", "0.8", "--drafter", "qwen3-0.6b", "--family", "best", "--format", "Q4_0", "--context-tokens", "64"],
    ],
)
def test_json_outputs_rerun_from_their_config_to_the_same_bytes(cli, tmp_path: Path, trace_path: Path, command: list[str]) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli(*command, "--trace", trace_path, "--profile", "nvidia-h200", "--json")
    assert code == 0, err
    written = json.loads(out)["config"]
    assert written["moesim"]["command"] == command[0] and written["options"]["model"] == "deepseek-v2-lite"
    assert written["options"]["family"] in ("per_slot", "best") and str(trace_path) in written["moesim"]["files"]
    saved = tmp_path / "out.json"
    saved.write_text(out)
    code, again, err = cli("rerun", saved)
    assert code == 0, err
    assert again == out


def test_validate_reruns_from_its_config_to_the_same_bytes(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    table = DATA / "h200" / "calibration.parquet"
    assert cli("validate", table, "--profile", "nvidia-h200", "--filter", "model=mixtral-8x7b", "--out", tmp_path / "a")[0] == 0
    assert cli("rerun", tmp_path / "a" / RUN_CONFIG, "--out", tmp_path / "b")[0] == 0
    first = _files(tmp_path / "a")
    assert set(first) == {"predictions.parquet", "plan.toml", RUN_CONFIG} and _files(tmp_path / "b") == first


def test_a_rerun_refuses_a_changed_input_in_one_line(cli, tmp_path: Path, trace_path: Path) -> None:  # type: ignore[no-untyped-def]
    copy = tmp_path / "t.arrow"
    copy.write_bytes(trace_path.read_bytes())
    code, out, _ = cli("predict", "--trace", copy, "--profile", "nvidia-h200", "--max-pass", "3", "--json")
    assert code == 0
    saved = tmp_path / "out.json"
    saved.write_text(out)
    copy.write_bytes(trace_path.read_bytes() + b"\0")
    assert_one_line_error(*cli("rerun", saved)[::2], f"{copy} changed since the run")
    not_written = tmp_path / "plain.json"
    not_written.write_text("{}")
    assert_one_line_error(*cli("rerun", not_written)[::2], "not the JSON output of a command that carries its config")
    for text, fragment in [
        ("x = 1", "key 'moesim.command' must name the command"),
        ('[moesim]\ncommand = "predict"\nfiles = []\n[options]', "key 'moesim' must be a table"),
        ("[moesim]\nfiles = {}", "key 'moesim.command' must name the command"),
        ('[moesim]\ncommand = "nope"\n[options]', "no moesim command 'nope'"),
        ('[moesim]\ncommand = "predict"\n[options]\nnope = 1', "key 'options.nope': not an option of 'predict'"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        assert_one_line_error(*cli("rerun", bad)[::2], str(bad), fragment)


def test_predict_on_the_builtin_trace_names_it_by_its_content(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli("predict", "--trace", "esft-vanilla-lite", "--profile", "nvidia-h200", "--max-pass", "3", "--json")
    assert code == 0, err
    written = json.loads(out)["config"]
    assert written["options"]["trace"] == "esft-vanilla-lite"
    digest = hashlib.sha256(resolve_trace("esft-vanilla-lite").read_bytes()).hexdigest()
    assert written["moesim"]["files"]["moesim:tracegen/data/esft-vanilla-lite/esft-vanilla-lite.trace.arrow"] == digest
    saved = tmp_path / "out.json"
    saved.write_text(out)
    monkeypatch.chdir(tmp_path)  # a built-in by name reruns from any folder
    code, again, err = cli("rerun", saved)
    assert code == 0, err
    assert again == out


def test_two_demo_sweeps_write_the_same_bytes(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_run: DemoRun) -> None:  # type: ignore[no-untyped-def]
    """The demo's sweep.toml, run from another folder than the demo's staging folder, writes the
    demo's sweep.parquet to the byte: its metadata names the built-in trace by name and content
    hash, no folder; and reruns from the parquet to the same bytes."""
    assert demo_run.code == 0, demo_run.err
    demo = demo_run.out_dir / "sweep.parquet"
    metadata = pq.read_schema(demo).metadata
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "sweep.toml").write_bytes((demo_run.out_dir / "sweep.toml").read_bytes())
    assert cli("sweep", folder / "sweep.toml", "--out", folder / "sweep.parquet")[0] == 0
    assert pq.read_schema(folder / "sweep.parquet").metadata == metadata
    assert not any(str(demo_run.out_dir) in v.decode() or ".part" in v.decode() for v in metadata.values())
    assert (folder / "sweep.parquet").read_bytes() == demo.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert cli("rerun", demo, "--out", tmp_path / "again.parquet")[0] == 0
    assert (tmp_path / "again.parquet").read_bytes() == demo.read_bytes()
