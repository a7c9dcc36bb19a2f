"""`moesim bytes`, the byte reports behind it and the demo's tokens-per-expert section, on real
Arrow traces written by the package, checked against the numpy reference and the preset's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import DemoRun, assert_one_line_error

from moesim.kernels.reference import union_features_reference, window_features_reference
from moesim.kernels.unions import batch_lanes, batch_windows
from moesim.models import load_preset
from moesim.sim.cost.passbytes import window_bytes_report
from moesim.tracegen.formats.schema import TraceGeometry, TraceMeta
from moesim.tracegen.formats.trace import Trace, read_trace, write_trace
from moesim.tracegen.routing.synth import Sticky, synthesize

REQUIRED = {"n", "mean_distinct_experts", "byte_share", "p10", "p90", "mean_max_tokens_per_expert"}


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bytes") / "olmoe.arrow"
    trace = synthesize(load_preset("olmoe-1b-7b"), Sticky(keep_prob=0.4, zipf_exponent=0.5), 300, 3, seed=2)
    write_trace(path, trace)
    return path


def test_json_matches_reference_and_preset_bytes(cli, trace_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli("bytes", trace_path, "--max-pass", 12, "--json")
    assert code == 0, err
    report = json.loads(out)
    preset = load_preset("olmoe-1b-7b")
    assert report["top_k"] == 8 and report["moe_layers"] == list(range(16)) and report["batch"] == 1
    assert report["expert_bytes"] == preset.expert_bytes("BF16")
    passes = report["passes"]
    assert [p["n"] for p in passes] == list(range(1, 13)) and all(set(p) >= REQUIRED for p in passes)
    assert passes[0]["byte_share"] == 1.0 and passes[0]["mean_distinct_experts"] == 8.0  # u(1) = 1 exactly
    trace = read_trace(trace_path)
    u, m = window_features_reference(trace.experts, trace.seq_starts, 64, 12)
    for p in passes:
        n = p["n"]
        values = u[:, :, n - 1][u[:, 0, n - 1] > 0]
        assert p["windows"] == values.shape[0] == 3 * (300 - n + 1)
        assert p["mean_distinct_experts"] == pytest.approx(values.mean(), rel=1e-12)
        assert p["byte_share"] == pytest.approx(values.mean() / (8 * n), rel=1e-12)
        assert [p["p10"], p["p50"], p["p90"]] == np.percentile(values, [10, 50, 90], method="inverted_cdf").tolist()
        assert p["mean_max_tokens_per_expert"] == pytest.approx(m[:, :, n - 1][u[:, 0, n - 1] > 0].mean(), rel=1e-12)
        assert p["per_slot_bytes"] == pytest.approx(n * 8 * preset.expert_bytes("BF16") * 16)
        assert p["dedup_bytes"] == pytest.approx(p["mean_distinct_experts"] * preset.expert_bytes("BF16") * 16)
        assert p["byte_share_per_layer"] == pytest.approx((u[:, :, n - 1][u[:, 0, n - 1] > 0].mean(axis=0) / (8 * n)).tolist())
    # sequences of equal length: the mean over windows of U is non-decreasing in n (docs/math.md)
    assert np.all(np.diff([p["mean_distinct_experts"] for p in passes]) >= 0)
    code, out, _ = cli("bytes", trace_path, "--max-pass", 3, "--format", "Q4_K", "--json")
    quantized = json.loads(out)
    assert quantized["expert_bytes"] == preset.expert_bytes("Q4_K") and quantized["weight_format"] == "Q4_K"
    assert quantized["passes"][2]["mean_distinct_experts"] == passes[2]["mean_distinct_experts"]


def test_streamed_chunks_equal_one_read(trace_path: Path) -> None:
    whole = window_bytes_report(trace_path, 10)
    streamed = window_bytes_report(trace_path, 10, chunk_positions=37)  # chunks overlap by 9 positions
    assert whole.table.equals(streamed.table) and np.array_equal(whole.per_layer_byte_share, streamed.per_layer_byte_share)


def test_batch_json(cli, trace_path: Path) -> None:  # type: ignore[no-untyped-def]
    trace = read_trace(trace_path)
    for batch, source in ((2, "different sequences"), (5, "fewer than 5 sequences")):
        code, out, err = cli("bytes", trace_path, "--max-pass", 4, "--batch", batch, "--json")
        assert code == 0, err
        report = json.loads(out)
        assert report["batch"] == batch and source in report["windows"]
        lanes = batch_lanes(trace.seq_starts, batch)
        for p in report["passes"]:
            offsets, starts, lengths = batch_windows(lanes, p["n"], 2048)
            u, m, counts = union_features_reference(trace.experts, offsets, starts, lengths, 64)
            assert p["windows"] == offsets.size - 1
            assert p["mean_distinct_experts"] == pytest.approx(u.mean(), rel=1e-12)
            assert p["byte_share"] == pytest.approx(u.mean() / (batch * p["n"] * 8), rel=1e-12)
            assert p["mean_max_tokens_per_expert"] == pytest.approx(m.mean(), rel=1e-12)
            assert p["per_slot_bytes"] == pytest.approx(batch * p["n"] * 8 * report["expert_bytes"] * 16)
            by_tokens = np.array(p["mean_experts_by_tokens"])
            assert by_tokens @ np.arange(by_tokens.size) == pytest.approx(batch * p["n"] * 8)  # every slot lands on an expert
            assert by_tokens[1:].sum() == pytest.approx(u.mean())
            assert by_tokens[counts.max()] > 0 and not by_tokens[counts.max() + 1 :].any()


def test_human_output(cli, trace_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli("bytes", trace_path, "--max-pass", 5)
    assert code == 0, err
    assert "Per pass of n tokens" in out and "Byte share u(n) per MoE layer" in out and "olmoe-1b-7b" in out


def write_custom(path: Path, model: str, top_k: int, tokens: int) -> Path:
    geometry = TraceGeometry(model, 4, (1, 2, 3), 16, top_k, 64, 32, "F16")
    rng = np.random.default_rng(0)
    experts = np.stack([np.stack([rng.permutation(16)[:top_k] for _ in range(3)]) for _ in range(tokens)]).astype(np.uint8)
    meta = TraceMeta(geometry, engine="test", backend="test")
    trace = Trace(meta, np.zeros(tokens, np.uint32), np.arange(tokens, dtype=np.uint32), np.zeros(tokens, bool), experts)
    write_trace(path, trace)
    return path


def test_geometry_bytes_for_a_model_without_preset(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = write_custom(tmp_path / "custom.arrow", "my-moe", 2, 40)
    code, out, err = cli("bytes", path, "--max-pass", 4, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["expert_bytes"] == 3 * 64 * 32 * 2 and "trace geometry" in report["expert_bytes_source"]


def test_bad_input(cli, trace_path: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cases = [
        (("bytes", trace_path, "--max-pass", 0), "--max-pass must be an integer in 1..64, got 0"),
        (("bytes", trace_path, "--max-pass", 65), "got 65"),
        (("bytes", trace_path, "--batch", 0), "--batch must be >= 1"),
        (("bytes", trace_path, "--batch", 5, "--max-pass", 64), "too short for a batch of 5 sequences of 61 tokens each"),
        (("bytes", trace_path, "--format", "Q9"), "unknown weight format 'Q9'"),
        (("bytes", tmp_path / "missing.arrow"), "no such trace file"),
    ]
    mismatched = write_custom(tmp_path / "k4.arrow", "olmoe-1b-7b", 4, 10)
    cases.append((("bytes", mismatched), "'geometry.top_k' is 4, but the trace names preset 'olmoe-1b-7b' whose top_k is 8"))
    short = write_custom(tmp_path / "short.arrow", "my-moe", 2, 5)
    cases.append((("bytes", short, "--max-pass", 8), "no sequence has 8 positions (the longest has 5)"))
    for args, fragment in cases:
        code, out, err = cli(*args)
        assert_one_line_error(code, err, fragment)
        assert out == ""


def test_demo_shows_tokens_per_expert(demo_run: DemoRun) -> None:
    assert demo_run.code == 0, demo_run.err
    assert "Tokens per expert per pass: one sequence vs a batch of 4 sequences" in demo_run.out
    table = pl.read_csv(demo_run.out_dir / "tokens_per_expert.csv")
    assert table["n"].to_list() == list(range(1, 17)) and table["byte_share"][0] == 1.0
    assert table["max_tokens_per_expert"][0] == 1.0 and (table["max_tokens_per_expert"] <= table["n"]).all()
    assert (table["byte_share_B4"] <= table["byte_share"]).all()  # a batch's union shares more experts per slot
