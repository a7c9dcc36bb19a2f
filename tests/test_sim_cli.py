"""`moesim simulate`: outputs, determinism, the examples, and one-line errors naming the key."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import polars as pl
import pyarrow.ipc as ipc
import pytest
from conftest import REPO, DemoRun, assert_one_line_error

EXAMPLES = REPO / "examples"
SELFCHECK = EXAMPLES / "sim-selfcheck.toml"

BASE = """
[run]
seed = 2
requests = 3

[workload]
prompt_tokens = 16
output_tokens = 120

[batching]
max_batch = 2

[cost]
kind = "table"
target_us = [1000, 1100, 1200, 1300, 1400, 1500, 1600, 1700]

[acceptance]
model = "geometric"
alpha = 0.7

[policy]
name = "cascade"
k_max = 3
"""


def write_config(tmp_path: Path, text: str = BASE, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_simulate_writes_tables_and_summary(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    code, stdout, err = cli("simulate", write_config(tmp_path), "--out", out, "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["requests_completed"] == 3 and summary["policy"]["name"] == "cascade"
    for key in ("throughput_tok_s", "tpot_mean_us", "tpot_p50_us", "tpot_p99_us", "speedup", "worst_slowdown"):
        assert isinstance(summary[key], float)
    requests = pl.read_ipc(out / "requests.arrow")
    iterations = ipc.open_file(str(out / "iterations.arrow")).read_all()
    assert requests.height == 3 and requests["completed"].all()
    assert requests["iterations"].to_list() == [len(ks) for ks in requests["draft_lens"].to_list()]
    assert (requests["output_tokens"] == 120).all()
    assert set(iterations.column_names) >= {"batch", "draft_lens", "accepted", "verify_us", "distinct_experts", "requests"}
    assert json.loads((out / "summary.json").read_text())["speedup"] == pytest.approx(summary["speedup"])
    # tokens per iteration add up to every request's output
    assert sum(iterations.column("tokens").to_pylist()) == 3 * 120
    code, stdout, err = cli("simulate", write_config(tmp_path), "--out", out)
    assert code == 0 and "speedup vs speculation off" in stdout


def test_same_config_and_seed_give_identical_bytes(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = write_config(tmp_path, BASE.replace('kind = "table"', 'kind = "table"\nprefill_us_per_token = 2.0'))
    for out in ("a", "b"):
        assert cli("simulate", config, "--out", tmp_path / out)[0] == 0
    for name in ("requests.arrow", "iterations.arrow", "summary.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    other = write_config(tmp_path, BASE.replace("seed = 2", "seed = 3"), "other.toml")
    assert cli("simulate", other, "--out", tmp_path / "c")[0] == 0
    assert (tmp_path / "a" / "iterations.arrow").read_bytes() != (tmp_path / "c" / "iterations.arrow").read_bytes()


BAD = [
    (('name = "cascade"', 'name = "greedy"'), "policy.name", "unknown policy 'greedy'"),
    (("alpha = 0.7", "alpha = 1.3"), "acceptance.alpha", "1.3"),
    (("max_batch = 2", "max_batch = 0"), "batching.max_batch", "got 0"),
    (("seed = 2", "sed = 2"), "run.sed", "unknown key"),
    (("k_max = 3", "k_max = 3\nk_init = 5"), "policy.k_init", "got 5"),
    (("output_tokens = 120", "output_tokens = 0"), "workload.output_tokens", "got 0"),
    (('kind = "table"', 'kind = "steptime"'), "target.model", "required"),
    (
        ("[acceptance]", '[target]\nmodel = "olmoe-1b-7b"\nprofile = "nvidia-h200"\nfamily = "dedup9"\n\n[acceptance]'),
        "target.family",
        "dedup9",
    ),
    (("[acceptance]", '[target]\nmodel = "olmoe-1b-7b"\nprofile = "no-such-gpu"\n\n[acceptance]'), "target.profile", "no-such-gpu"),
    (("[acceptance]", '[target]\nmodel = "mixtral-9x9b"\n\n[acceptance]'), "target.model", "mixtral-9x9b"),
    (("alpha = 0.7", "alpha = 0.7\nbeta = [2.0, 3.0]"), "acceptance.alpha", "exactly one"),
    (("requests = 3", 'requests = "3"'), "run.requests", "must be an integer"),
    (("[acceptance]", "[acceptance]\nmodel2 = 1"), "acceptance.model2", "unknown key"),
]


SERVING = """
[run]
seed = 4
requests = 12

[workload]
prompt_tokens = 90
output_tokens = 70

[arrivals]
concurrency = 6

[batching]
max_batch = 6
chunked_prefill = true
token_budget = 64

[memory]
block_tokens = 8
pages = 60

[parallel]
tensor_parallel = 2

[trace]
synth = "sticky"
synth_params = { keep_prob = 0.4 }
tokens = 256
seqs = 4

[target]
model = "olmoe-1b-7b"
profile = "nvidia-h100-sxm-vllm"
family = "best"

[drafter]
kind = "preset"
model = "qwen3-0.6b"

[cost]
kind = "steptime"

[acceptance]
model = "geometric"
alpha = 0.7

[policy]
name = "static"
k = 3
"""


SERVING_BAD = [
    (("tensor_parallel = 2", "tensor_parallel = 1\nexpert_parallel = true"), "parallel.expert_parallel", "tensor_parallel > 1"),
    (("tensor_parallel = 2", "tensor_parallel = 3\nexpert_parallel = true"), "parallel.expert_parallel", "do not split over 3"),
    (("tensor_parallel = 2", 'tensor_parallel = 2\nlink = "warp-drive"'), "parallel.link", "unknown link 'warp-drive'"),
    (("token_budget = 64", "token_budget = 4"), "batching.token_budget", "must be >= max_batch"),
    (("pages = 60", "pages = -1"), "memory.pages", "got -1"),
    (("pages = 60", 'pages = 60\npreemption = "swap"\nutilization = 1.5'), "memory.utilization", "got 1.5"),
    (('family = "best"', 'family = "best"\ndevice = "tpu-v9"'), "target.device", "unknown device 'tpu-v9'"),
]


CASES = [(BASE, *case) for case in BAD] + [(SERVING, *case) for case in SERVING_BAD]


@pytest.mark.parametrize(("base", "change", "key", "fragment"), CASES, ids=[case[2] for case in CASES])
def test_invalid_config_exits_2_naming_the_key(cli, tmp_path: Path, base: str, change: tuple[str, str], key: str, fragment: str) -> None:  # type: ignore[no-untyped-def]
    assert change[0] in base
    config = write_config(tmp_path, base.replace(*change))
    out = tmp_path / "never"
    code, _, err = cli("simulate", config, "--out", out)
    assert_one_line_error(code, err, f"'{key}'", fragment, str(config))
    assert not out.exists()


def test_the_old_target_engine_key_still_runs_with_a_note(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """target.engine is target.family's old name: the same outputs, one note on stderr; both at once is one line."""
    target = '[target]\nmodel = "olmoe-1b-7b"\nprofile = "nvidia-h200"\n{}\n\n[acceptance]'
    outputs = {}
    for key in ("engine", "family"):
        config = write_config(tmp_path, BASE.replace("[acceptance]", target.format(f'{key} = "dedup"')), f"{key}.toml")
        code, _, err = cli("simulate", config, "--out", tmp_path / key)
        assert code == 0, err
        noted = [line for line in err.splitlines() if "target.engine is now target.family" in line]
        assert len(noted) == (key == "engine"), err
        outputs[key] = [(tmp_path / key / name).read_bytes() for name in ("requests.arrow", "iterations.arrow", "summary.json")]
    assert outputs["engine"] == outputs["family"]
    both = write_config(tmp_path, BASE.replace("[acceptance]", target.format('engine = "dedup"\nfamily = "dedup"')), "both.toml")
    code, _, err = cli("simulate", both, "--out", tmp_path / "both")
    assert_one_line_error(code, err, "'target.engine'", "give 'target.family' only")
    assert not (tmp_path / "both").exists()


def test_weights_that_do_not_fit_exit_2(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Qwen2-57B-A14B's BF16 weights on one A800 with KV pages from the device's memory: one line
    on stderr naming the model, the format and the device, exit 2, no output."""
    text = (
        SERVING.replace("pages = 60\n", "")
        .replace("tensor_parallel = 2", "tensor_parallel = 1")
        .replace('model = "olmoe-1b-7b"\nprofile = "nvidia-h100-sxm-vllm"', 'model = "qwen2-57b-a14b"\nprofile = "nvidia-a800-80gb-vllm"')
    )
    assert "qwen2-57b-a14b" in text and "pages = 60" not in text
    out = tmp_path / "never"
    code, _, err = cli("simulate", write_config(tmp_path, text), "--out", out)
    assert_one_line_error(code, err, "'memory'", "qwen2-57b-a14b", "BF16", "NVIDIA A800 80GB SXM", "leave no room")
    assert not out.exists()


def test_missing_trace_and_short_trace(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    missing = write_config(tmp_path, BASE + '\n[trace]\npath = "nope.arrow"\n')
    code, _, err = cli("simulate", missing, "--out", tmp_path / "x")
    assert_one_line_error(code, err, "'trace.path'", "nope.arrow")
    short = BASE + '\n[target]\nmodel = "olmoe-1b-7b"\n\n[trace]\nsynth = "uniform"\ntokens = 3\nseqs = 1\n'
    code, _, err = cli("simulate", write_config(tmp_path, short), "--out", tmp_path / "x")
    assert_one_line_error(code, err, "'trace.tokens'", "largest verify window")
    bad_param = BASE + '\n[target]\nmodel = "olmoe-1b-7b"\n\n[trace]\nsynth = "sticky"\nsynth_params = { keep = 0.1 }\n'
    code, _, err = cli("simulate", write_config(tmp_path, bad_param), "--out", tmp_path / "x")
    assert_one_line_error(code, err, "'trace.synth_params.keep'", "unknown key")
    assert not (tmp_path / "x").exists()


def test_recorded_acceptance_cannot_answer_longer_drafts(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    text = BASE.replace('model = "geometric"\nalpha = 0.7', 'model = "recorded"\naccepted = [1, 2, 0]\ndraft_len = 2')
    code, _, err = cli("simulate", write_config(tmp_path, text), "--out", tmp_path / "x")
    assert_one_line_error(code, err, "'acceptance.draft_len'", "drafted 2 tokens")


def test_bad_toml_and_request_file(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("simulate", write_config(tmp_path, "[run\nseed = 1"), "--out", tmp_path / "x")
    assert_one_line_error(code, err, "not valid TOML")
    (tmp_path / "req.csv").write_text("prompt_tokens,output_tokens\n10,20\n5,-1\n")
    text = BASE.replace("prompt_tokens = 16\noutput_tokens = 120", 'file = "req.csv"')
    code, _, err = cli("simulate", write_config(tmp_path, text), "--out", tmp_path / "x")
    assert_one_line_error(code, err, "'workload.file'", "row 1", "output_tokens")


def test_request_file_lengths(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "req.jsonl").write_text('{"prompt_tokens": 10, "output_tokens": 30}\n{"prompt_tokens": 4, "output_tokens": 7}\n')
    text = BASE.replace("prompt_tokens = 16\noutput_tokens = 120", 'file = "req.jsonl"')
    assert cli("simulate", write_config(tmp_path, text), "--out", tmp_path / "o")[0] == 0
    requests = pl.read_ipc(tmp_path / "o" / "requests.arrow")
    assert requests["output_tokens"].to_list() == [30, 7, 30]
    assert requests["prompt_tokens"].to_list() == [10, 4, 10]


def _examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.toml"))


def test_examples_are_named_and_load() -> None:
    from moesim.sim.serving.config import load_config

    names = [p.name for p in _examples()]
    assert len(names) >= 5 and all("sim" in n or "reproduction" in n or "cascade" in n for n in names)
    for path in _examples():
        load_config(path)


def _table_examples() -> list[Path]:
    return [p for p in _examples() if tomllib.loads(p.read_text()).get("cost", {}).get("kind") == "table"]


@pytest.mark.parametrize("path", _table_examples(), ids=lambda p: p.stem)
def test_table_examples_run(cli, tmp_path: Path, path: Path) -> None:  # type: ignore[no-untyped-def]
    code, stdout, err = cli("simulate", path, "--out", tmp_path / "o", "--json")
    assert code == 0, err
    payload = json.loads(stdout)
    rows = payload.get("rows")
    if rows is not None:  # a study: every workload x policy, off rows exactly 1
        assert all(r["speedup"] == pytest.approx(1.0) for r in rows if r["policy"] == "off")
        assert (tmp_path / "o" / "study.csv").is_file()
    else:
        assert payload["requests_completed"] > 0


def test_demo_ends_with_static_vs_cascade(demo_run: DemoRun) -> None:
    assert demo_run.code == 0, demo_run.err
    assert "static k vs Cascade" in demo_run.out
    speculation = pl.read_csv(demo_run.out_dir / "speculation.csv")
    assert set(speculation["policy"]) == {"static k=1", "static k=2", "static k=3", "cascade"}
    assert set(speculation["workload"]) == {"low", "high"}
    # low acceptance: Cascade's worst request slows down least (its point); high: speculation pays
    low = speculation.filter(pl.col("workload") == "low")
    cascade_worst = low.filter(pl.col("policy") == "cascade")["worst_slowdown"].item()
    assert cascade_worst < low.filter(pl.col("policy") != "cascade")["worst_slowdown"].min()
    assert speculation.filter(pl.col("workload") == "high")["speedup"].min() > 1.0


@pytest.mark.parametrize("extra", ["", "expert_parallel = true"], ids=["tp", "ep"])
def test_serving_run_same_bytes(cli, tmp_path: Path, extra: str) -> None:  # type: ignore[no-untyped-def]
    """KV pages (tight: preemptions), chunked prefill and two devices through `moesim simulate`:
    the new columns and summary figures, and the same bytes from the same seed."""
    config = write_config(tmp_path, SERVING.replace("tensor_parallel = 2", f"tensor_parallel = 2\n{extra}"))
    for out in ("a", "b"):
        code, stdout, err = cli("simulate", config, "--out", tmp_path / out, "--json")
        assert code == 0, err
    for name in ("requests.arrow", "iterations.arrow", "summary.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    summary = json.loads(stdout)
    assert summary["parallel"].startswith("EP 2" if extra else "TP 2") and summary["token_budget"] == 64
    assert summary["memory"]["pages"] == 60 and summary["preemptions"] == summary["memory"]["preemptions"] > 0
    assert summary["requests_completed"] == 12
    iterations = pl.read_ipc(tmp_path / "a" / "iterations.arrow")
    assert set(iterations.columns) >= {"prefill_tokens", "preempted", "kv_pages_used", "kv_pages_free", "swap_us"}
    assert (iterations["kv_pages_used"] + iterations["kv_pages_free"] == 60).all()
    assert iterations["prefill_tokens"].sum() >= 12 * 90
    assert pl.read_ipc(tmp_path / "a" / "requests.arrow")["preemptions"].sum() == summary["preemptions"]


STUDY = (
    SERVING.replace("[parallel]\ntensor_parallel = 2\n", "").replace("pages = 60", "")
    + """
[study]
models = ["olmoe-1b-7b", "opt-350m"]
batches = [1, 3]

[study.drafters.opt-350m]
kind = "ngram"

[[study.devices]]
name = "one H100"
profile = "nvidia-h100-sxm-vllm"

[[study.devices]]
name = "2xL40"
profile = "nvidia-l40-vllm"
tensor_parallel = 2

[study.workloads.high]
model = "geometric"
alpha = 0.9

[[study.policies]]
name = "static"
k = 2
"""
)


def test_serving_study_same_bytes(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A study over a MoE and a dense target (no trace), two devices and two batch sizes: every
    cell once, with its device, batch and target efficiency; the same bytes twice."""
    config = write_config(tmp_path, STUDY)
    for out in ("a", "b"):
        code, _, err = cli("simulate", config, "--out", tmp_path / out)
        assert code == 0, err
    for name in ("study.arrow", "study.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    table = pl.read_csv(tmp_path / "a" / "study.csv")
    assert table.height == 2 * 2 * 2 and set(table["device"]) == {"one H100", "2xL40"} and set(table["batch"]) == {1, 3}
    assert (table["target_efficiency"] > 0).all() and (table["target_efficiency"] <= 1.0 + 1e-9).all()


def test_replayed_and_bursty_arrivals_from_the_config(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`[arrivals]` replay: the file beside the config, its times in requests.arrow; gamma with a
    cv; a bad file or cv: one line naming the key, exit 2."""
    (tmp_path / "times.csv").write_text("arrival_us\n0\n250.5\n90000\n")
    static = BASE.replace('name = "cascade"\nk_max = 3', 'name = "static"\nk = 3')
    replay = static + '\n[arrivals]\nkind = "replay"\nfile = "times.csv"\n'
    assert cli("simulate", write_config(tmp_path, replay), "--out", tmp_path / "r")[0] == 0
    assert pl.read_ipc(tmp_path / "r" / "requests.arrow")["arrival_us"].to_list() == [0.0, 250.5, 90000.0]
    bursty = static + '\n[arrivals]\nkind = "gamma"\nrate_per_s = 40.0\ncv = 3.0\n'
    assert cli("simulate", write_config(tmp_path, bursty), "--out", tmp_path / "g")[0] == 0
    assert pl.read_ipc(tmp_path / "g" / "requests.arrow").height == 3
    (tmp_path / "times.csv").write_text("arrival_us\n10\n5\n")
    code, _, err = cli("simulate", write_config(tmp_path, replay), "--out", tmp_path / "x")
    assert_one_line_error(code, err, "'arrivals.file'", "times.csv", "row 1")
    code, _, err = cli("simulate", write_config(tmp_path, bursty.replace("cv = 3.0", "cv = 0.0")), "--out", tmp_path / "x")
    assert_one_line_error(code, err, "'arrivals.cv'", "got 0.0")
    assert not (tmp_path / "x").exists()
