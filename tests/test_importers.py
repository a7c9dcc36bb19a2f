"""Importers into contract 1: tables, Hugging Face router logits, vLLM topk_ids dumps, on data made here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import assert_one_line_error
from safetensors.numpy import save_file

from moesim.errors import InputError
from moesim.models import load_preset
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import read_trace
from moesim.tracegen.importers import import_routing
from moesim.tracegen.routing.synth import Sticky, synthesize

PRESET = load_preset("deepseek-v2-lite")  # MoE layers 1..26: layer 0 is dense
GEOMETRY = TraceGeometry.from_preset(PRESET)


def _known_trace(seqs: int = 3, tokens: int = 17):  # type: ignore[no-untyped-def]
    return synthesize(PRESET, Sticky(keep_prob=0.4), tokens, seqs, seed=11)


def _as_table(trace) -> pl.DataFrame:  # type: ignore[no-untyped-def]
    """Long format written the plain way (loops), independently of the importer."""
    rows: dict[str, list[float]] = {"seq": [], "token": [], "layer": [], "slot": [], "expert": [], "weight": []}
    rng = np.random.default_rng(0)
    for t in range(trace.n_tokens):
        for li, layer in enumerate(GEOMETRY.moe_layers):
            for slot in range(GEOMETRY.top_k):
                rows["seq"].append(int(trace.seq[t]) * 7 + 3)  # any increasing ids
                rows["token"].append(int(trace.pos[t]) + 5)  # a dump that starts at position 5
                rows["layer"].append(layer)
                rows["slot"].append(slot)
                rows["expert"].append(int(trace.experts[t, li, slot]))
                rows["weight"].append(float(rng.random()))
    return pl.DataFrame(rows).sample(fraction=1.0, shuffle=True, seed=3)  # row order must not matter


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_table_import_round_trip(suffix: str, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    trace = _known_trace()
    frame = _as_table(trace)
    path = tmp_path / f"routing.{suffix}"
    frame.write_csv(path) if suffix == "csv" else frame.write_parquet(path)
    out = tmp_path / "t.arrow"
    code, _, err = cli("trace", "import", path, "--model", "deepseek-v2-lite", "--format", "Q4_K", "--out", out)
    assert code == 0, err
    back = read_trace(out)
    np.testing.assert_array_equal(back.experts, trace.experts)
    np.testing.assert_array_equal(back.pos, trace.pos)  # renumbered from 0 per sequence
    assert back.n_seqs == 3 and back.meta.geometry.weight_format == "Q4_K" and back.meta.engine == "table"
    sorted_frame = frame.sort("seq", "token", "layer", "slot")
    np.testing.assert_allclose(back.weights.reshape(-1), sorted_frame["weight"].to_numpy(), rtol=1e-6)


def test_table_import_rejects_bad_rows(tmp_path: Path) -> None:
    frame = _as_table(_known_trace(seqs=1, tokens=3))
    cases = [
        (frame.drop("slot"), "column 'slot' is missing"),
        (frame.with_columns(pl.when(pl.col("layer") == 5).then(0).otherwise(pl.col("layer")).alias("layer")), "'layer' is 0, not a MoE"),
        (frame.with_columns(pl.lit(64).alias("expert")), "field 'expert' is 64"),
        (frame.with_columns(pl.col("slot") * 2), "field 'slot'"),
        (pl.concat([frame, frame.head(1)]), "appears twice"),
        (frame.filter(~((pl.col("token") == 6) & (pl.col("layer") == 3) & (pl.col("slot") == 0))), "expected 156"),
        (frame.filter(pl.col("token") != 6), "no rows for token 6"),
        (frame.with_columns(pl.col("token").cast(pl.Float64) + 0.5), "must hold integers"),
    ]
    for i, (bad, fragment) in enumerate(cases):
        path = tmp_path / f"bad{i}.csv"
        bad.write_csv(path)
        with pytest.raises(InputError, match=fragment):
            import_routing(path, GEOMETRY)


def _brute_force_top_k(logits: np.ndarray, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Plain Python: sort (−logit, id), take k; softmax probabilities of those ids."""
    ids, weights = [], []
    for row in logits:
        order = sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]
        total = sum(np.exp(v - max(row)) for v in row)
        ids.append(order)
        weights.append([float(np.exp(row[e] - max(row)) / total) for e in order])
    return ids, weights


@pytest.mark.parametrize("suffix", ["safetensors", "npz"])
def test_hf_router_logits_with_batch_and_padding(suffix: str, tmp_path: Path) -> None:
    preset = load_preset("qwen1.5-moe-a2.7b")  # 24 MoE layers, 60 experts, top-4
    geometry = TraceGeometry.from_preset(preset)
    rng = np.random.default_rng(4)
    batch, seq = 2, 9
    mask = np.ones((batch, seq), np.int64)
    mask[1, :3] = 0  # left padding of the second prompt
    logits = {f"router_logits.{j}": rng.normal(size=(batch * seq, 60)).astype(np.float32) for j in range(24)}
    logits["router_logits.5"][4, [7, 9]] = 5.0  # an exact tie: the lower id goes first
    arrays = {**logits, "input_ids": rng.integers(0, 1000, (batch, seq)), "attention_mask": mask}
    path = tmp_path / f"router.{suffix}"
    save_file(arrays, str(path)) if suffix == "safetensors" else np.savez(path, **arrays)
    trace = import_routing(path, geometry)
    assert trace.seq_lengths().tolist() == [9, 6] and trace.meta.engine == "transformers"
    for j in range(24):
        rows = logits[f"router_logits.{j}"].astype(np.float64).reshape(batch, seq, 60)[mask.astype(bool)]
        ids, weights = _brute_force_top_k(rows, 4)
        np.testing.assert_array_equal(trace.experts[:, j], ids)
        np.testing.assert_allclose(trace.weights[:, j], weights, rtol=1e-5)
    assert trace.experts[4, 5, :2].tolist() == [7, 9]
    np.testing.assert_array_equal(trace.token, arrays["input_ids"][mask.astype(bool)])
    normalized = import_routing(path, geometry, normalize=True)
    np.testing.assert_allclose(normalized.weights.sum(axis=2), 1.0, rtol=1e-5)


def test_hf_logits_bad_files(tmp_path: Path) -> None:
    geometry = TraceGeometry.from_preset(load_preset("mixtral-8x7b"))
    path = tmp_path / "few.npz"
    np.savez(path, **{f"router_logits.{j}": np.zeros((3, 8), np.float32) for j in range(5)})
    with pytest.raises(InputError, match=r"router_logits.0 .. router_logits.31"):
        import_routing(path, geometry)
    path = tmp_path / "wide.npz"
    np.savez(path, **{f"router_logits.{j}": np.zeros((3, 9), np.float32) for j in range(32)})
    with pytest.raises(InputError, match="has shape"):
        import_routing(path, geometry)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 30)
    with pytest.raises(InputError, match="not a readable safetensors file"):
        import_routing(junk, geometry)


def test_vllm_step_dumps(tmp_path: Path) -> None:
    """Steps as the documented hook writes them: a prefill step per request, then one token per step,
    requests interleaved (continuous batching), each step's tokens tagged with seq and pos."""
    trace = _known_trace(seqs=2, tokens=12)
    steps = tmp_path / "steps"
    steps.mkdir()
    step = 0
    prefill = 5
    for s in range(2):  # prefills
        rows = np.flatnonzero(trace.seq == s)[:prefill]
        np.savez(
            steps / f"step_{step:06d}.npz",
            topk_ids=trace.experts[rows].transpose(1, 0, 2).astype(np.int32),
            seq=np.full(prefill, s),
            pos=np.arange(prefill),
            is_prompt=np.ones(prefill, bool),
        )
        step += 1
    for pos in range(prefill, 12):  # decode steps hold one token of each request
        rows = np.flatnonzero(trace.pos == pos)
        np.savez(steps / f"step_{step:06d}.npz", topk_ids=trace.experts[rows].transpose(1, 0, 2), seq=trace.seq[rows], pos=np.full(2, pos))
        step += 1
    back = import_routing(steps, GEOMETRY)
    np.testing.assert_array_equal(back.experts, trace.experts)
    assert back.is_prompt.tolist() == ([True] * 5 + [False] * 7) * 2 and back.meta.engine == "vllm"
    (steps / "step_000003.npz").unlink()  # a lost step leaves a hole
    with pytest.raises(InputError, match="position"):
        import_routing(steps, GEOMETRY)


def test_import_cli_errors(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("trace", "import", tmp_path / "nothing.csv", "--model", "olmoe-1b-7b", "--out", tmp_path / "t.arrow")
    assert_one_line_error(code, err, "nothing.csv", "no such file")
    odd = tmp_path / "routing.txt"
    odd.write_text("x")
    code, _, err = cli("trace", "import", odd, "--model", "olmoe-1b-7b", "--out", tmp_path / "t.arrow")
    assert_one_line_error(code, err, "routing.txt", "suffix")
    code, _, err = cli("trace", "import", odd, "--model", "qwen3-0.6b", "--out", tmp_path / "t.arrow")
    assert_one_line_error(code, err, "not a MoE target")
    assert not (tmp_path / "t.arrow").exists()


def test_malformed_extras_are_one_line_errors(tmp_path: Path) -> None:
    frame = _as_table(_known_trace(seqs=1, tokens=2)).with_columns(pl.lit("maybe").alias("is_prompt"))
    path = tmp_path / "t.csv"
    frame.write_csv(path)
    with pytest.raises(InputError, match="column 'is_prompt' does not convert"):
        import_routing(path, GEOMETRY)
    geometry = TraceGeometry.from_preset(load_preset("mixtral-8x7b"))
    logits = {f"router_logits.{j}": np.zeros((6, 8), np.float32) for j in range(32)}
    npz = tmp_path / "l.npz"
    np.savez(npz, **logits, input_ids=np.zeros((2, 4), np.int64))
    with pytest.raises(InputError, match="tensor 'input_ids' has shape"):
        import_routing(npz, geometry)
    step = tmp_path / "step.npz"
    np.savez(step, topk_ids=np.zeros((26, 3, 6), np.int32), topk_weights=np.zeros((26, 2, 6), np.float32))
    with pytest.raises(InputError, match="'topk_weights' has shape"):
        import_routing(step, GEOMETRY)
