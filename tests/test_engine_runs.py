"""`moesim profile fit-engine`: a user's own engine outputs read into the shared engine-overheads
rows, and the engine's terms fitted back from outputs written by a formula from stated terms."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line_error

from moesim.hw_profiles import load_profile
from moesim.hw_profiles.engine_runs import RunContext, read_outputs
from moesim.hw_profiles.schema import read_profile
from moesim.hw_profiles.speculative import SPEC_TERMS
from moesim.sim.engine.user_runs import fit_user_engine

EXAMPLES = REPO / "examples" / "engine-runs"
# The shared tables' headers (../shared/data/engine-overheads), as their README documents them.
DECODE_HEADER = (
    "source_url,engine,engine_version,device,tp,cuda_graphs,model,dtype,batch,input_len,output_len,"
    "value,unit,notes,tokens_per_pass,raw_file"
)
SPEC_HEADER = (
    "source_url,engine,device,target_model,draft,draft_len,acceptance,tokens_per_s,baseline_tokens_per_s,batch,notes,"
    "engine_version,tp,input_len,output_len,concurrency,spec_value,baseline_value,metric,raw_file"
)


def _generator():
    spec = importlib.util.spec_from_file_location("make_engine_examples", EXAMPLES / "make_examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


MAKE = _generator()
CASES = {case.folder: case for case in MAKE.CASES}
# What a user says of each folder's files that they do not print themselves.
ANNOTATE = {"bench-serving.jsonl": "@draft_len=3"}


def _arguments(folder: Path) -> list[str]:
    return [str(p) + ANNOTATE.get(p.name, "") for p in sorted(folder.iterdir())]


def _fit(folder: Path, case, drafter: str | None = "opt-350m"):
    rows = read_outputs(
        _arguments(folder), RunContext(model="opt-30b", engine_version=case.engine_version if case.folder == "vllm" else None)
    )
    paths = sorted(folder.iterdir())
    return rows, fit_user_engine(rows, paths, load_profile(case.profile), "opt-30b", case.weight_format, drafter)


def _terms(fitted) -> dict[str, float]:
    return {t: getattr(fitted.fit.spec, t) for t in SPEC_TERMS}


def test_committed_examples_are_the_generators_output(tmp_path: Path) -> None:
    """The example files are exactly what the formula writes (rerun make_examples.py after a kernel change)."""
    MAKE.main(tmp_path)
    for case in MAKE.CASES:
        for written in sorted((tmp_path / case.folder).iterdir()):
            committed = EXAMPLES / case.folder / written.name
            assert committed.read_text() == written.read_text(), f"{committed} is stale: python examples/engine-runs/make_examples.py"


@pytest.mark.parametrize("folder", sorted(CASES))
def test_fit_recovers_the_stated_terms(folder: str, tmp_path: Path) -> None:
    """The host time per forward comes back, and so does what a speculative iteration spends beyond its
    kernels and its 1 + k host times (one run cannot tell the iteration, draft-step and launch terms
    apart: their sum is what it fixes); every row and speculative speedup is reproduced."""
    case = CASES[folder]
    MAKE.main(tmp_path)
    rows, fitted = _fit(tmp_path / folder, case)
    spec, terms = fitted.profile.speculative, _terms(fitted)
    assert spec is not None and spec.pass_us == terms["pass_us"] and spec.provenance.kind == "calibrated"
    assert terms["pass_us"] == pytest.approx(case.pass_us, rel=0.01)
    iterations = [e for e in fitted.fit.equations if e.table == "speculative run"]
    assert len(iterations) == len(rows.runs) == len(fitted.fit.runs) and not fitted.left_out
    for equation, run in zip(iterations, rows.runs, strict=True):
        hosts = 1 + run.draft_len
        beyond = equation.predicted_us(terms) - equation.kernel_us - hosts * terms["pass_us"]
        carried = hosts * abs(terms["pass_us"] - case.pass_us)  # an error in pass_us (the tools' rounding) moves it k + 1 times
        assert beyond == pytest.approx(case.iteration_us, rel=0.02, abs=10.0 + carried)
    for equation in fitted.fit.equations:
        assert equation.predicted_us(terms) == pytest.approx(equation.measured_us, rel=0.002), equation
    for run in fitted.fit.runs:
        assert run.speedup(terms) == pytest.approx(run.measured_speedup, rel=0.005)


def test_fit_sees_a_different_host_time(tmp_path: Path) -> None:
    """Terms written at twice the host time come back at twice it: the fit reads the files, not the case."""
    case = CASES["vllm"]
    MAKE.write_vllm(MAKE.Engine(dataclasses.replace(case, pass_us=2 * case.pass_us)), tmp_path)
    _, fitted = _fit(tmp_path, case)
    assert fitted.fit.spec.pass_us == pytest.approx(2 * case.pass_us, rel=0.01)


def test_each_example_is_read_by_its_format() -> None:
    from moesim.hw_profiles.engine_runs import detect_format, read_text

    expected = {
        "vllm/latency-b8.pytorch.json": "vllm-bench-latency", "vllm/serve-c1.json": "vllm-bench-serve",
        "vllm/serve-c4-spec.json": "vllm-bench-serve", "sglang/bench-one-batch.log": "sglang-bench-one-batch",
        "sglang/bench-serving.jsonl": "sglang-bench-serving", "llamacpp/llama-bench.md": "llama-bench",
        "llamacpp/llama-speculative.log": "llama-speculative", "mlx/benchmark.log": "mlx-lm-benchmark",
        "mlx/generate.log": "mlx-lm-generate",
    }  # fmt: skip
    for name, fmt in expected.items():
        path = EXAMPLES / name
        assert detect_format(path, read_text(path)) == fmt, name


def test_vllm_serve_rows_keep_the_printed_numbers() -> None:
    plain = json.loads((EXAMPLES / "vllm" / "serve-c16.json").read_text())
    rows = read_outputs([str(EXAMPLES / "vllm" / "serve-c16.json")])
    (step,) = rows.steps
    assert (step.batch, step.value, step.unit) == (plain["max_concurrency"], plain["mean_tpot_ms"], "TPOT ms")
    assert step.forward_us() == pytest.approx(1000 * plain["mean_tpot_ms"])
    spec = json.loads((EXAMPLES / "vllm" / "serve-c4-spec.json").read_text())
    (run,) = read_outputs([str(EXAMPLES / "vllm" / "serve-c4-spec.json")]).runs
    assert run.draft_len == spec["spec_decode_draft_tokens"] // spec["spec_decode_num_drafts"]
    assert run.tokens_per_iteration() == spec["spec_decode_acceptance_length"]
    assert run.accepted_per_drafted == pytest.approx(spec["spec_decode_acceptance_rate"] / 100)


def test_speculative_run_pairs_with_the_plain_run_of_its_batch() -> None:
    rows = read_outputs([str(EXAMPLES / "vllm" / "serve-c4-spec.json"), str(EXAMPLES / "vllm" / "serve-c4.json")])
    (run,) = rows.runs
    plain = json.loads((EXAMPLES / "vllm" / "serve-c4.json").read_text())
    assert run.baseline_value == pytest.approx(plain["mean_tpot_ms"])
    assert run.speedup() == pytest.approx(plain["mean_tpot_ms"] / run.spec_value)


def test_sglang_console_skips_the_warmup_block() -> None:
    rows = read_outputs([str(EXAMPLES / "sglang" / "bench-one-batch.log")])
    assert [s.batch for s in rows.steps] == [1, 8, 32]
    assert all(s.unit == "ms per step" and s.input_len == 256 and s.output_len == 128 for s in rows.steps)
    assert 300.0 not in [s.value for s in rows.steps]  # the warmup's 0.30000 s


def test_sglang_console_without_printed_batch_reads_it_from_throughput() -> None:
    text = "Prefill. latency: 0.01788 s, throughput:   3355.60 token/s\n"
    text += "Decode.  median latency: 0.00689 s, median throughput:    145.10 token/s\n"
    text += "Total. latency:  0.080 s, throughput:    877.74 token/s\n"
    from moesim.hw_profiles.engine_runs.sglang import parse_one_batch

    (step,) = parse_one_batch(text, "x.log", RunContext()).steps
    assert (step.batch, step.value, step.input_len, step.output_len) == (1, pytest.approx(6.89), 60, 10)


def test_llama_timing_lines_and_server_log() -> None:
    from moesim.hw_profiles.engine_runs.llamacpp import parse_timings

    text = (
        "llama_perf_context_print: prompt eval time =     120.93 ms /    11 tokens (   10.99 ms per token,    90.96 tokens per second)\n"
        "llama_perf_context_print:        eval time =    3979.58 ms /   127 runs   (   31.34 ms per token,    31.91 tokens per second)\n"
        "slot print_timing: id  0 | task 0 | \n"
        "prompt eval time =      58.52 ms /    12 tokens (    4.88 ms per token,   205.05 tokens per second)\n"
        "       eval time =    2367.37 ms /   128 tokens (   18.50 ms per token,    54.07 tokens per second)\n"
        "      total time =    2425.89 ms /   140 tokens\n"
        "draft acceptance rate = 0.57576 (   19 accepted /    33 generated)\n"
    )
    rows = parse_timings(text, "server.log", RunContext(draft_len=4))
    (step,) = rows.steps
    (run,) = rows.runs
    assert (step.value, step.input_len, step.output_len, step.forward_us()) == (31.91, 11, 127, pytest.approx(1e6 / 31.91))
    assert (run.spec_value, run.accepted_per_drafted, run.draft_len, run.input_len) == (54.07, pytest.approx(19 / 33), 4, 12)


def test_llama_server_json_timings() -> None:
    from moesim.hw_profiles.engine_runs.llamacpp import parse_server_json

    response = {
        "model": "Qwen3.5-9B-Q4_K_M.gguf", "system_fingerprint": "b9251-e2b129e1b",
        "timings": {"prompt_n": 4, "prompt_ms": 128.3, "predicted_n": 665, "predicted_ms": 20629.2,
                    "predicted_per_second": 32.2358, "draft_n": 604, "draft_n_accepted": 515},
    }  # fmt: skip
    (run,) = parse_server_json(json.dumps(response), "r.json", RunContext()).runs
    assert (run.engine_version, run.target_model, run.spec_value) == ("b9251-e2b129e1b", "Qwen3.5-9B-Q4_K_M.gguf", 32.2358)
    assert run.accepted_per_drafted == pytest.approx(515 / 604)
    plain = dict(response, timings={k: v for k, v in response["timings"].items() if not k.startswith("draft")})
    lines = json.dumps(plain) + "\n" + json.dumps(plain) + "\n"
    assert len(parse_server_json(lines, "r.jsonl", RunContext()).steps) == 2


def test_llama_bench_rows_and_build_normalised_across_tools() -> None:
    files = [str(EXAMPLES / "llamacpp" / "llama-bench.md"), str(EXAMPLES / "llamacpp" / "llama-speculative.log")]
    assert read_outputs(files).runs[0].baseline_value is None  # llama-bench names the model, llama-speculative does not
    rows = read_outputs(files, RunContext(model="opt-30b"))
    assert [(s.input_len, s.output_len, s.tokens_per_pass) for s in rows.steps] == [(32, 320, 1), (2048, 128, 1)]  # tgN @ dD
    assert rows.runs[0].baseline_value == pytest.approx(rows.steps[0].value)  # the plain run nearest its context
    assert {s.engine_version for s in rows.steps} == {rows.runs[0].engine_version} == {"1a2b3c4 (b6800)"}
    assert rows.runs[0].tokens_per_iteration() == pytest.approx(1 + 256 / 512 * 8)


def test_vllm_latency_plain_json_needs_the_batch(cli, tmp_path: Path) -> None:
    path = tmp_path / "lat.json"
    path.write_text(json.dumps({"avg_latency": 2.0, "std_latency": 0.01, "latencies": [2.0], "percentiles": {"50": 2.0}}))
    out = tmp_path / "p.toml"
    code, _, err = cli("profile", "fit-engine", path, "--profile", "nvidia-h200-vllm", "--model", "opt-30b", "--out", out)
    assert_one_line_error(code, err, "lat.json", "batch_size", "--batch")
    assert not out.exists()
    (step,) = read_outputs([f"{path}@batch=8,input_len=32,output_len=128"]).steps
    assert (step.batch, step.input_len, step.output_len, step.value) == (8, 32, 128, 2.0)
    (step,) = read_outputs([str(path)], RunContext(batch=4, input_len=16, output_len=64)).steps
    assert (step.batch, step.input_len, step.output_len) == (4, 16, 64)
    (step,) = read_outputs([f"{path}@batch=2"], RunContext(batch=4, input_len=16, output_len=64)).steps
    assert step.batch == 2  # the file's annotation wins over the command's option


def test_fit_engine_command_writes_profile_and_rows(cli, tmp_path: Path) -> None:
    out, rows = tmp_path / "mine.toml", tmp_path / "rows"
    files = sorted((EXAMPLES / "vllm").iterdir())
    code, stdout, err = cli(
        "profile", "fit-engine", *files, "--profile", "nvidia-h200-vllm", "--model", "opt-30b", "--drafter", "opt-350m",
        "--engine-version", "0.11.0", "--device", "H200", "--tp", "1", "--cuda-graphs", "yes", "--out", out, "--rows", rows,
    )  # fmt: skip
    assert code == 0, err
    assert "pass_us" in stdout and "held out" in stdout and "measured_speedup" in stdout
    profile = read_profile(out)
    assert profile.speculative.pass_us == pytest.approx(CASES["vllm"].pass_us, rel=0.01)
    spent = profile.speculative.iteration_us + 4 * profile.speculative.draft_step_us  # the one run's 4 draft steps
    assert spent == pytest.approx(CASES["vllm"].iteration_us, rel=0.02)
    assert profile.speculative.engine == "vLLM V1" and profile.speculative.uncertainty["pass_us"] > 0
    assert profile.name == "mine" and profile.device.name == load_profile("nvidia-h200-vllm").device.name
    steps = (rows / "decode_steps.csv").read_text().splitlines()
    assert steps[0] == DECODE_HEADER
    runs = (rows / "speculative_runs.csv").read_text().splitlines()
    assert runs[0] == SPEC_HEADER
    records = list(csv.DictReader(steps))
    assert {r["engine_version"] for r in records} == {"0.11.0"} and {r["device"] for r in records} == {"H200"}
    latency = next(r for r in records if r["raw_file"] == "latency-b8.pytorch.json")
    printed = ("s (batch latency)", "yes", "8")  # the file's enforce_eager wins over --cuda-graphs
    assert (latency["unit"], latency["cuda_graphs"], latency["batch"]) == printed
    again = ("profile", "fit-engine", *files, "--profile", "nvidia-h200-vllm", "--model", "opt-30b", "--engine-version", "0.11.0")
    code, _, err = cli(*again, "--out", out, "--rows", rows)
    assert code == 0, err  # its own rows folder is written again


def test_fit_engine_run_format_and_refusals(cli, tmp_path: Path) -> None:
    out = tmp_path / "p.toml"
    serve = EXAMPLES / "vllm" / "serve-c1.json"
    base = ("profile", "fit-engine", serve, "--profile", "nvidia-h200-vllm", "--model", "opt-30b", "--engine-version", "0.11.0")
    code, _, err = cli(*base, "--run-format", "mlx-lm-generate", "--out", out)
    assert_one_line_error(code, err, "serve-c1.json", "no run")
    code, _, err = cli(*base, "--run-format", "nope", "--out", out)
    assert_one_line_error(code, err, "unknown engine output format 'nope'")
    code, _, err = cli(*base[:-4], "--model", "qwen3-30b-a3b", "--engine-version", "0.11.0", "--out", out)
    assert_one_line_error(code, err, "qwen3-30b-a3b", "dense")
    mixed = [serve, EXAMPLES / "sglang" / "bench-one-batch.log"]
    code, _, err = cli(
        "profile", "fit-engine", *mixed, "--profile", "nvidia-h200-vllm", "--model", "opt-30b", "--engine-version", "0.11.0", "--out", out
    )
    assert_one_line_error(code, err, "several engines")
    code, _, err = cli(*base, "--out", serve)
    assert code == 2 and "Traceback" not in err
    assert json.loads(serve.read_text())["mean_tpot_ms"] > 0  # the input is untouched
    assert not out.exists()


def test_spec_run_without_a_drafter_is_left_out_and_says_why() -> None:
    _, fitted = _fit(EXAMPLES / "vllm", CASES["vllm"], drafter=None)
    assert not fitted.fit.runs and fitted.fit.spec.iteration_us == 0.0
    assert [reason for _, reason in fitted.left_out] == ["no --drafter: the run's drafting cannot be priced"]


def test_kernels_are_those_of_the_profiles_device_or_the_one_named() -> None:
    """The profile's device prices the kernels; --device another one prices them there (a slower device: less host time left)."""
    case = CASES["mlx"]
    rows = read_outputs([str(EXAMPLES / "mlx" / "benchmark.log")], RunContext(model="opt-30b"))
    paths = [EXAMPLES / "mlx" / "benchmark.log"]
    own = fit_user_engine(rows, paths, load_profile(case.profile), "opt-30b", case.weight_format)
    assert own.device_key == "apple-m3-ultra"
    other = fit_user_engine(rows, paths, load_profile(case.profile), "opt-30b", case.weight_format, device="apple-m3-max")
    assert other.device_key == "apple-m3-max" and other.fit.spec.pass_us < own.fit.spec.pass_us


def test_weight_format_defaults_to_the_one_the_rows_print() -> None:
    """llama-bench names Q4_0 with the model: without --format the kernels are Q4_0's, as with it."""
    case = CASES["llamacpp"]
    rows, given = _fit(EXAMPLES / "llamacpp", case)
    printed = fit_user_engine(rows, sorted((EXAMPLES / "llamacpp").iterdir()), load_profile(case.profile), "opt-30b", None, "opt-350m")
    assert printed.fit.spec.pass_us == pytest.approx(given.fit.spec.pass_us)
    rows = read_outputs([str(EXAMPLES / "mlx" / "benchmark.log")], RunContext(model="opt-30b"))
    bf16 = fit_user_engine(rows, [EXAMPLES / "mlx" / "benchmark.log"], load_profile("apple-m3-ultra-mlx"), "opt-30b")
    q4 = fit_user_engine(rows, [EXAMPLES / "mlx" / "benchmark.log"], load_profile("apple-m3-ultra-mlx"), "opt-30b", "Q4_0")
    assert q4.fit.spec.pass_us > bf16.fit.spec.pass_us  # lighter weights, less of the measured time is kernels


def test_unknown_engine_version_is_one_line(cli, tmp_path: Path) -> None:
    code, _, err = cli(
        "profile", "fit-engine", EXAMPLES / "vllm" / "serve-c1.json", "--profile", "nvidia-h200-vllm", "--model", "opt-30b",
        "--out", tmp_path / "p.toml",
    )  # fmt: skip
    assert_one_line_error(code, err, "serve-c1.json", "vLLM", "--engine-version")


def test_fit_engine_remaining_options_together(cli, tmp_path: Path) -> None:
    """--batch/--input-len/--output-len (and per-file annotations), --draft, --draft-len, --format, --name,
    --rows into a folder holding a user's file with --force: each shows in what is written."""
    latencies = []
    for batch, seconds in ((1, 1.9), (8, 2.1)):
        path = tmp_path / f"lat{batch}.json"
        path.write_text(json.dumps({"avg_latency": seconds, "std_latency": 0.0, "latencies": [seconds], "percentiles": {}}))
        latencies.append(f"{path}@batch={batch}" if batch > 1 else str(path))
    spec = tmp_path / "spec.jsonl"
    serving = (EXAMPLES / "sglang" / "bench-serving.jsonl").read_text().splitlines()
    spec.write_text(serving[0] + "\n" + serving[2] + "\n")  # the plain run at batch 2, then the speculative one
    rows = tmp_path / "rows"
    rows.mkdir()
    (rows / "notes.txt").write_text("mine")
    out = tmp_path / "x.toml"
    code, _, err = cli(
        "profile", "fit-engine", *latencies, "--profile", "nvidia-h200-vllm", "--model", "opt-30b", "--engine-version", "0.11.0",
        "--batch", "1", "--input-len", "32", "--output-len", "128", "--format", "BF16", "--name", "my-h200", "--out", out,
        "--rows", rows, "--force",
    )  # fmt: skip
    assert code == 0, err
    assert read_profile(out).name == "my-h200" and (rows / "notes.txt").read_text() == "mine"
    records = list(csv.DictReader((rows / "decode_steps.csv").read_text().splitlines()))
    assert [(r["batch"], r["input_len"], r["output_len"]) for r in records] == [("1", "32", "128"), ("8", "32", "128")]
    code, _, err = cli(
        "profile", "fit-engine", EXAMPLES / "sglang" / "bench-one-batch.log", spec, "--profile", "nvidia-h200-vllm", "--model",
        "opt-30b", "--drafter", "opt-350m", "--draft", "OPT-350M", "--draft-len", "3", "--out", out, "--rows", tmp_path / "r2",
    )  # fmt: skip
    assert code == 0, err
    (run,) = csv.DictReader((tmp_path / "r2" / "speculative_runs.csv").read_text().splitlines())
    assert (run["draft"], run["draft_len"], run["acceptance"]) == ("OPT-350M", "3", "AL 2.5")
    assert read_profile(out).speculative.draft_step_us > 0


def test_real_llama_cpp_timing_lines_are_read(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """llama.cpp (through llama-cpp-python) decodes a tiny dense model built here; its own timing
    lines on stderr are read as plain decoding at batch 1, the numbers as it printed them."""
    import llama_cpp

    from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, build_tiny_model
    from moesim.tracegen.llamacpp.runtime import runtime

    model = build_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(arch="llama", experts=0, layers=2))
    # llama.cpp's log is process-wide: moesim's runtime (which other tests may have loaded) routes it
    # to stderr only when verbose, so ask for it here whatever ran before
    logs = runtime(verbose=True)
    try:
        capfd.readouterr()
        llm = llama_cpp.Llama(str(model), n_ctx=256, n_threads=1, verbose=True)
        llm.create_completion("hello world", max_tokens=24, temperature=0.0)
        del llm
    finally:
        logs.verbose = False
    captured = capfd.readouterr()
    log = tmp_path / "llama-cli.log"
    log.write_text(captured.out + captured.err)
    text = log.read_text()
    printed = re.search(r"(?<!prompt )eval time =\s*([0-9.]+) ms /\s*(\d+) runs.*?([0-9.]+) tokens per second", text)
    assert printed is not None, text[-2000:]
    (step,) = read_outputs([str(log)]).steps
    assert (step.engine, step.batch, step.output_len, step.value) == ("llama.cpp", 1, int(printed[2]), float(printed[3]))
    runs = int(printed[2])
    # eval time is printed to 0.01 ms (up to 5 µs / runs of rounding per forward), tokens per second
    # to 0.01 (relative 1e-6 here): the bound is their sum, whatever the forward took
    rounding_us = 5.0 / runs + 1e-5 * step.forward_us()
    assert abs(step.forward_us() - 1000 * float(printed[1]) / runs) <= rounding_us


def _tiny_mlx_model(folder: Path) -> Path:
    """A random 2-layer llama in MLX's layout (config.json, safetensors) with a word-level tokenizer: nothing downloaded."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    vocab = {f"t{i}": i for i in range(256)} | {"<unk>": 256}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    config = {
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 257, "tie_word_embeddings": False,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return folder


def test_real_mlx_lm_statistics_are_read(tmp_path: Path) -> None:
    """mlx_lm (CPU backend) runs its own benchmark at batch 2 and its generate on a tiny random model;
    their printed statistics are read as they printed them."""
    import os
    import subprocess

    model = _tiny_mlx_model(tmp_path / "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    runs = {
        "benchmark.log": ["-m", "mlx_lm.benchmark", "--model", str(model), "-p", "16", "-g", "16", "-b", "2", "-n", "1"],
        "generate.log": ["-m", "mlx_lm", "generate", "--model", str(model), "--prompt", "t1 t2 t3", "--max-tokens", "12"],
    }
    for name, args in runs.items():
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        (tmp_path / name).write_text(done.stdout)
    bench = (tmp_path / "benchmark.log").read_text()
    rate = float(re.search(r"Averages: .*generation_tps=([0-9.]+)", bench)[1])
    (step,) = read_outputs([str(tmp_path / "benchmark.log")]).steps
    assert (step.engine, step.batch, step.unit, step.value, step.input_len, step.output_len) == (
        "MLX-LM",
        2,
        "t/s (batch total)",
        rate,
        16,
        16,
    )
    generated = re.search(r"Generation: (\d+) tokens, ([0-9.]+) tokens-per-sec", (tmp_path / "generate.log").read_text())
    (step,) = read_outputs([str(tmp_path / "generate.log")]).steps
    assert (step.batch, step.output_len, step.value, step.input_len) == (1, int(generated[1]), float(generated[2]), 3)


def test_noisy_runs_widen_the_uncertainty_and_the_held_out_error(tmp_path: Path) -> None:
    """The same runs with their TPOTs moved ±3 % in turn: the fit says so (held-out error and the
    host time's uncertainty grow from ~0 to the scale of the noise), its interval still holding the stated."""
    case = CASES["vllm"]
    MAKE.write_vllm(MAKE.Engine(case), tmp_path)
    (tmp_path / "serve-c4-spec.json").unlink()
    (tmp_path / "latency-b8.pytorch.json").unlink()
    _, exact = _fit(tmp_path, case)
    for i, path in enumerate(sorted(tmp_path.glob("serve-c*.json"))):
        record = json.loads(path.read_text())
        record["mean_tpot_ms"] *= 1.03 if i % 2 else 0.97
        path.write_text(json.dumps(record))
    _, noisy = _fit(tmp_path, case)
    assert exact.fit.spec.heldout_error < 1e-4 < 0.005 < noisy.fit.spec.heldout_error
    assert noisy.fit.spec.uncertainty["pass_us"] > exact.fit.spec.uncertainty["pass_us"]
    spec = noisy.fit.spec  # the stated host time lies within the fitted one's interval
    assert abs(spec.pass_us - case.pass_us) <= spec.pass_us * spec.uncertainty["pass_us"]
