"""The llama.cpp recorder on tiny models built here: ids against a numpy forward pass of the GGUF,
batch vs token by token, trace shape, Ctrl-C and crashes, and bad inputs."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import DemoRun, assert_one_line_error

from moesim.tracegen.formats.trace import read_trace
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, build_tiny_model
from moesim.tracegen.llamacpp.prompts import load_prompts
from moesim.tracegen.llamacpp.recorder import RecordConfig, record_trace

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "zq",
]
LLAMA = TinyModelSpec(arch="llama", layers=3, experts=8, top_k=2, hidden=64, heads=4, kv_heads=2, expert_ff=32, seed=5)


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "llama.gguf", LLAMA)


def _prompt_file(tmp_path: Path, prompts: list[str] = PROMPTS) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    return path


def _rms_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def _rope_adjacent_pairs(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """llama's rotary embedding (ggml mode NORM): rotate pairs (2i, 2i+1) by pos·base^(-2i/d)."""
    d = x.shape[-1]
    angles = positions[:, None] * base ** (-np.arange(0, d, 2) / d)  # (T, d/2)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _layer0_router_logits(path: Path, tokens: list[int], spec: TinyModelSpec) -> np.ndarray:
    """Layer 0's router logits for a token sequence, from the GGUF tensors with numpy (float64)."""
    t = {x.name: np.array(x.data, np.float64) for x in gguf.GGUFReader(path).tensors}
    hd, n_tok = spec.head_dim, len(tokens)
    h = t["token_embd.weight"][tokens]
    x = _rms_norm(h) * t["blk.0.attn_norm.weight"]
    q = (x @ t["blk.0.attn_q.weight"].T).reshape(n_tok, spec.heads, hd)
    k = (x @ t["blk.0.attn_k.weight"].T).reshape(n_tok, spec.kv_heads, hd)
    v = (x @ t["blk.0.attn_v.weight"].T).reshape(n_tok, spec.kv_heads, hd)
    pos = np.arange(n_tok, dtype=np.float64)
    q, k = _rope_adjacent_pairs(q, pos), _rope_adjacent_pairs(k, pos)
    group = spec.heads // spec.kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = np.where(np.tril(np.ones((n_tok, n_tok), bool))[None], scores, -np.inf)
    attn = np.exp(scores - scores.max(axis=-1, keepdims=True))
    attn /= attn.sum(axis=-1, keepdims=True)
    out = np.einsum("hts,shd->thd", attn, v).reshape(n_tok, spec.heads * hd)
    h = h + out @ t["blk.0.attn_output.weight"].T
    x = _rms_norm(h) * t["blk.0.ffn_norm.weight"]
    return x @ t["blk.0.ffn_gate_inp.weight"].T


def test_ids_and_weights_match_a_numpy_forward_pass_of_the_gguf(llama_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.arrow"
    record_trace(llama_model, load_prompts(_prompt_file(tmp_path)), out, RecordConfig(max_tokens=12, n_threads=1))
    trace = read_trace(out)
    assert trace.meta.geometry.top_k == LLAMA.top_k and trace.experts.shape[1:] == (LLAMA.layers, LLAMA.top_k)
    compared = total = 0
    for s in range(trace.n_seqs):
        a, b = trace.seq_starts[s], trace.seq_starts[s + 1]
        logits = _layer0_router_logits(llama_model, trace.token[a:b].tolist(), LLAMA)
        order = np.argsort(-logits, axis=1)
        top = np.sort(logits, axis=1)[:, ::-1]
        margin = top[:, LLAMA.top_k - 1] - top[:, LLAMA.top_k]
        decided = margin > 1e-4  # a near-tie may flip in float32
        np.testing.assert_array_equal(trace.experts[a:b, 0][decided], order[decided, : LLAMA.top_k])
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        gate = np.take_along_axis(probs, order[:, : LLAMA.top_k], axis=1)
        gate /= gate.sum(axis=1, keepdims=True)  # Mixtral normalises the top-k weights
        np.testing.assert_allclose(trace.weights[a:b, 0][decided], gate[decided], atol=1e-4)
        compared += int(decided.sum())
        total += b - a
    assert compared >= 0.95 * total


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_one_batch_and_token_by_token_record_identical_ids(arch: str, tmp_path: Path) -> None:
    spec = TinyModelSpec(arch=arch, layers=3, leading_dense=1 if arch == "deepseek2" else 0, hidden=64, expert_ff=32)
    model = build_tiny_model(tmp_path / "m.gguf", spec)
    prompts = load_prompts(_prompt_file(tmp_path))
    batched, stepped = tmp_path / "batch.arrow", tmp_path / "step.arrow"
    record_trace(model, prompts, batched, RecordConfig(max_tokens=10, n_threads=1, n_ubatch=8))  # several ubatches per prompt
    record_trace(model, prompts, stepped, RecordConfig(max_tokens=10, n_threads=1, prompt_batch=1))
    a, b = read_trace(batched), read_trace(stepped)
    np.testing.assert_array_equal(a.experts, b.experts)
    np.testing.assert_array_equal(a.token, b.token)
    np.testing.assert_allclose(a.weights, b.weights, atol=1e-5)
    # rows = tokens x MoE layers; geometry from the GGUF; prompt flags; ids in range
    moe_layers = tuple(range(spec.leading_dense, spec.layers))
    assert a.meta.geometry.moe_layers == moe_layers and a.meta.engine == "llama.cpp"
    import llama_cpp

    llm = llama_cpp.Llama(str(model), verbose=False, n_ctx=256)
    lengths = [len(llm.tokenize(p.encode())) for p in PROMPTS]
    assert a.seq_lengths().tolist() == [n + 10 for n in lengths]
    assert [int(a.is_prompt[a.seq_starts[i] : a.seq_starts[i + 1]].sum()) for i in range(a.n_seqs)] == lengths
    assert a.experts.max() < spec.experts
    import pyarrow as pa
    import pyarrow.ipc as ipc

    assert ipc.open_file(pa.memory_map(str(batched))).read_all().num_rows == a.n_tokens * len(moe_layers)
    np.testing.assert_allclose(a.weights.sum(axis=2), 1.0, atol=1e-5)  # both normalise the top-k weights


def test_ctrl_c_keeps_a_valid_trace_of_completed_prompts(llama_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.arrow"

    def interrupt_after_two(done: int, total: int, positions: int) -> None:
        if done == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, handled between two decodes

    config = RecordConfig(max_tokens=8, n_threads=1)
    result = record_trace(llama_model, load_prompts(_prompt_file(tmp_path)), out, config, interrupt_after_two)
    assert result.interrupted and result.prompts_done == 2 and result.path == out
    trace = read_trace(out)
    assert trace.n_seqs == 2 and trace.n_tokens == result.positions
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


def test_a_crash_keeps_completed_prompts_and_no_partial_file(llama_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.arrow"

    def crash(done: int, total: int, positions: int) -> None:
        if done == 3:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        record_trace(llama_model, load_prompts(_prompt_file(tmp_path)), out, RecordConfig(max_tokens=4, n_threads=1), crash)
    assert read_trace(out).n_seqs == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


def test_recording_cli_and_jsonl_prompts(cli, llama_model: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(PROMPTS[:2])) + "\n\n")
    out = tmp_path / "r.arrow"
    code, stdout, err = cli("trace", "record", llama_model, "--prompts", prompts, "--max-tokens", 5, "--threads", 1, "--out", out)
    assert code == 0, err
    assert "2 prompts" in stdout and read_trace(out).n_seqs == 2


def test_recording_bad_inputs_fail_with_one_line_and_no_file(cli, llama_model: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    good = _prompt_file(tmp_path)
    out = tmp_path / "out" / "t.arrow"
    out.parent.mkdir()
    dense = build_tiny_model(tmp_path / "dense.gguf", TinyModelSpec(arch="llama", experts=0))
    code, _, err = cli("trace", "record", dense, "--prompts", good, "--out", out)
    assert_one_line_error(code, err, "dense.gguf", "no routed experts", "expert_count")
    code, _, err = cli("trace", "record", tmp_path / "missing.gguf", "--prompts", good, "--out", out)
    assert_one_line_error(code, err, "missing.gguf", "no such GGUF file")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "fine"}\n{"prompt": "broken"\n')
    code, _, err = cli("trace", "record", llama_model, "--prompts", bad_jsonl, "--out", out)
    assert_one_line_error(code, err, "bad.jsonl", "line 2", "not valid JSON")
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "hello"}\n')
    code, _, err = cli("trace", "record", llama_model, "--prompts", no_field, "--out", out)
    assert_one_line_error(code, err, "nofield.jsonl", "line 1", "field 'prompt'")
    code, _, err = cli("trace", "record", llama_model, "--prompts", tmp_path / "none.txt", "--out", out)
    assert_one_line_error(code, err, "none.txt", "no such prompt file")
    long_prompt = _prompt_file(tmp_path / "out", ["x" * 5000])
    code, _, err = cli("trace", "record", llama_model, "--prompts", long_prompt, "--out", out)
    assert_one_line_error(code, err, "prompts.txt", "line 1", "context length 4096")
    long_prompt.unlink()
    code, _, err = cli("trace", "record", llama_model, "--prompts", good, "--out", tmp_path / "nodir" / "t.arrow")
    assert_one_line_error(code, err, "does not exist")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root may write anyway
            code, _, err = cli("trace", "record", llama_model, "--prompts", good, "--out", locked / "t.arrow")
            assert_one_line_error(code, err, "not writable")
    finally:
        locked.chmod(0o700)
    assert list(out.parent.iterdir()) == [] and list(locked.iterdir()) == []


def test_demo_records_a_trace_through_llama_cpp(demo_run: DemoRun) -> None:
    import polars as pl

    assert demo_run.code == 0, demo_run.err
    assert "Routing recorded through llama.cpp" in demo_run.out
    table = pl.read_csv(demo_run.out_dir / "recorded.csv")
    assert table["layer"].to_list() == [0, 1, 2, 3]
    assert (table["experts_used"] <= 16).all() and (table["distinct_n8"] >= table["distinct_n4"]).all()
    assert ((table["reuse_d1"] >= 0) & (table["reuse_d1"] <= 1)).all()


def test_ctrl_c_on_the_command_line(llama_model: Path, tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    from processes import cpu_seconds

    prompts = _prompt_file(tmp_path, [f"prompt {i} about mixture of experts" for i in range(5000)])
    out = tmp_path / "t.arrow"
    command = [sys.executable, "-m", "moesim", "trace", "record", str(llama_model), "--prompts", str(prompts)]
    process = subprocess.Popen([*command, "--max-tokens", "16", "--threads", "1", "--out", str(out)], stderr=subprocess.PIPE, text=True)
    while not list(tmp_path.glob(".t.arrow.*.part")) and process.poll() is None:  # the writer is open
        time.sleep(0.05)
    assert process.poll() is None, "the command ended before its writer opened"
    opened = cpu_seconds(process.pid)
    while process.poll() is None and cpu_seconds(process.pid) < opened + 1.0:  # a few dozen prompts complete, however loaded the machine
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted: kept" in lines[0], err
    trace = read_trace(out)
    assert trace.n_seqs >= 1 and not list(tmp_path.glob("*.part"))
