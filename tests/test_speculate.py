"""Measured speculative runs through llama.cpp and the speculative-run format (contract 2)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from conftest import assert_one_line_error

from moesim.errors import InputError
from moesim.tracegen.formats.specrun import read_spec_run, spec_run_summary
from moesim.tracegen.formats.trace import read_trace
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, build_draft_model, build_tiny_model
from moesim.tracegen.llamacpp.prompts import load_prompts
from moesim.tracegen.llamacpp.recorder import RecordConfig, record_trace, run_prompt
from moesim.tracegen.llamacpp.runtime import LlamaContext, LlamaModel, RoutingCapture
from moesim.tracegen.llamacpp.speculate import SpeculateConfig, SpeculativeSession, speculative_run

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Mixture of experts route tokens.", "abc"]
SPEC = TinyModelSpec(layers=3, experts=8, top_k=2, hidden=64, expert_ff=32, seed=2)
SPEC_LAYERS = range(SPEC.layers)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("spec")
    paths = {"target": build_tiny_model(folder / "target.gguf", SPEC)}
    for noise in (0.0, 0.05, 0.5):
        paths[f"draft{noise}"] = build_draft_model(SPEC, noise, folder / f"draft{noise}.gguf")
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    paths["prompts"] = folder / "prompts.txt"
    return paths


def test_speculative_output_equals_plain_greedy_decoding(models: dict[str, Path]) -> None:
    max_tokens = 40
    with LlamaModel(models["target"]) as model, LlamaContext(model, 256, n_threads=1) as ctx:
        plain = [run_prompt(ctx, model.tokenize(p), max_tokens) for p in PROMPTS]
    with SpeculativeSession(models["target"], models["draft0.05"], 256, n_threads=1) as session:
        checked = total = 0
        for prompt, reference in zip(PROMPTS, plain, strict=True):
            result = session.run_prompt(session.target.tokenize(prompt), draft_len=4, max_tokens=max_tokens, baseline=False)
            greedy = reference.tokens[reference.n_prompt :]
            # compare up to the first near-tie of plain decoding (batched and one-token passes may break it differently)
            ties = np.flatnonzero(reference.top2_gap <= 1e-3)
            upto = int(ties[0]) + 1 if ties.size else greedy.shape[0]
            np.testing.assert_array_equal(result.generated[:upto], greedy[:upto])
            checked += upto
            total += greedy.shape[0]
            assert result.generated.shape[0] >= max_tokens
    assert checked >= 0.9 * total  # the comparison is not vacuous


def test_run_file_holds_every_verify_pass_and_matches_recorded_routing(models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run.arrow"
    prompts = load_prompts(models["prompts"])
    result = speculative_run(models["target"], models["draft0.05"], prompts, out, SpeculateConfig(draft_len=4, max_tokens=30, n_threads=1))
    run = read_spec_run(out)
    steps = run.steps
    assert result.steps == steps.height and (steps["drafted"] == 4).all()
    assert 0 < steps["accepted"].mean() < 4  # type: ignore[operator]
    assert (steps["verify_us"] > 0).all() and (steps["draft_us"] > 0).all()
    for info in run.meta.sequences:
        assert info.plain_match_tokens == info.generated_tokens  # the run reproduced plain greedy decoding
        assert info.plain_decode_us > 0
    # greedy acceptance: accepted drafts equal the target's choices, the first rejected one does not
    for i, row in enumerate(steps.iter_rows(named=True)):
        a, b = run.slot_start[i], run.slot_start[i + 1]
        drafts, choices = run.token[a + 1 : b], run.target_token[a : b - 1]
        accepted = row["accepted"]
        np.testing.assert_array_equal(drafts[:accepted], choices[:accepted])
        if accepted < row["drafted"]:
            assert drafts[accepted] != choices[accepted]
        if i + 1 < steps.height and steps["seq"][i + 1] == row["seq"]:
            assert run.token[b] == run.target_token[a + accepted]  # the bonus token opens the next step
    # the routing of accepted positions equals the recorder's routing of plain greedy decoding
    trace_path = tmp_path / "plain.arrow"
    record_trace(models["target"], prompts, trace_path, RecordConfig(max_tokens=40, n_threads=1))
    trace = read_trace(trace_path)
    matched = 0
    for i, row in enumerate(steps.iter_rows(named=True)):
        a = run.slot_start[i]
        seq_start = trace.seq_starts[row["seq"]]
        for slot in range(row["accepted"] + 1):
            pos = row["pos0"] + slot
            if pos < trace.seq_lengths()[row["seq"]]:
                assert trace.token[seq_start + pos] == run.token[a + slot]
                np.testing.assert_array_equal(run.experts[a + slot], trace.experts[seq_start + pos])
                matched += 1
    assert matched > 60
    # rejected drafts are routed too: the passes hold more slots than accepted positions
    assert run.experts.shape[0] > int((steps["accepted"].cast(pl.Int64) + 1).sum())
    # readable without moesim
    frame = pl.read_ipc(out)
    assert frame.height == run.experts.shape[0] * len(SPEC_LAYERS)
    con = duckdb.connect()
    table = ipc.open_file(pa.memory_map(str(out))).read_all()
    con.register("run", table)
    assert con.execute("select count(distinct (seq, step)) from run").fetchone()[0] == steps.height


def test_acceptance_follows_the_draft_noise(models: dict[str, Path]) -> None:
    means = {}
    with LlamaModel(models["target"]) as target:
        tokens = [target.tokenize(p) for p in PROMPTS]
    for noise in (0.0, 0.05, 0.5):
        with SpeculativeSession(models["target"], models[f"draft{noise}"], 256, n_threads=1) as session:
            steps = [s for t in tokens for s in session.run_prompt(t, draft_len=4, max_tokens=24, baseline=False).steps]
        means[noise] = np.mean([s.accepted for s in steps])
    assert means[0.0] == 4.0  # an identical draft is always accepted
    assert means[0.0] > means[0.05] > means[0.5]


def test_verify_pass_prefix_routes_like_a_shorter_pass(models: dict[str, Path]) -> None:
    """A k = 8 pass truncated to its first j + 1 slots is a pass of j drafts (attention is causal)."""
    with SpeculativeSession(models["target"], models["draft0.05"], 256, n_threads=1) as session:
        tokens = session.target.tokenize(PROMPTS[0])
        step = session.run_prompt(tokens, draft_len=8, max_tokens=9, baseline=False).steps[0]
    with LlamaModel(models["target"]) as model:
        capture = RoutingCapture(tuple(SPEC_LAYERS), SPEC.top_k)
        with LlamaContext(model, 256, n_threads=1, capture=capture) as ctx:
            ctx.decode(tokens, 0)
            capture.discard()
            ctx.decode(step.tokens[:3].tolist(), step.pos0)
            prefix, _ = capture.take(3)
    np.testing.assert_array_equal(prefix, step.experts[:3])


def _rewrite(path: Path, out: Path, column: str, change: object) -> None:
    table = ipc.open_file(pa.memory_map(str(path))).read_all()
    values = table.column(column).to_pylist()
    values = change(values)  # type: ignore[operator]
    field = table.schema.field(column)
    table = table.set_column(table.schema.get_field_index(column), field, pa.array(values, field.type))
    with pa.OSFile(str(out), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def test_reader_rejects_inconsistent_runs(models: dict[str, Path], tmp_path: Path) -> None:
    good = tmp_path / "good.arrow"
    speculative_run(models["target"], models["draft0.5"], load_prompts(models["prompts"]), good, SpeculateConfig(max_tokens=8, n_threads=1))
    assert spec_run_summary(read_spec_run(good))["steps"] > 0
    cases = {
        "accepted": (lambda v: [5] * len(v), "more than drafted"),
        "pos": (lambda v: [p + 1 for p in v], "pos"),
        "step": (lambda v: [0] * len(v), "step"),
        "verify_us": (lambda v: [-1.0] * len(v), "verify_us"),
        "layer": (lambda v: v[::-1], "layer"),
    }
    for column, (change, fragment) in cases.items():
        bad = tmp_path / f"bad_{column}.arrow"
        _rewrite(good, bad, column, change)
        with pytest.raises(InputError, match=fragment):
            read_spec_run(bad)
    with pytest.raises(InputError, match="not a moesim speculative run"):
        read_spec_run(_trace_file(models, tmp_path))


def _trace_file(models: dict[str, Path], tmp_path: Path) -> Path:
    out = tmp_path / "trace.arrow"
    record_trace(models["target"], load_prompts(models["prompts"]), out, RecordConfig(max_tokens=2, n_threads=1))
    return out


def test_speculate_cli_and_bad_inputs(cli, models: dict[str, Path], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run.arrow"
    args = ("--prompts", models["prompts"], "--draft-len", 3, "--max-tokens", 10, "--threads", 1, "--out", out)
    code, stdout, err = cli("trace", "speculate", models["target"], models["draft0.05"], *args)
    assert code == 0, err
    assert "verify steps" in stdout and read_spec_run(out).meta.draft_len == 3
    other_vocab = build_tiny_model(tmp_path / "v.gguf", TinyModelSpec(vocab=300))
    code, _, err = cli("trace", "speculate", models["target"], other_vocab, *args[:-1], tmp_path / "x.arrow")
    assert_one_line_error(code, err, "v.gguf", "vocabulary")
    code, _, err = cli("trace", "speculate", models["target"], tmp_path / "nodraft.gguf", *args[:-1], tmp_path / "x.arrow")
    assert_one_line_error(code, err, "nodraft.gguf", "no such GGUF file")
    code, _, err = cli("trace", "speculate", models["target"], models["draft0.05"], *args[:-1], tmp_path / "no" / "x.arrow")
    assert_one_line_error(code, err, "does not exist")
    assert not (tmp_path / "x.arrow").exists()
