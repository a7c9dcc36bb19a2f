"""Routing-trace contract: round trips through pyarrow, polars and duckdb; chunked reading;
the validator's one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from conftest import assert_one_line_error

from moesim.errors import InputError
from moesim.models import load_preset
from moesim.tracegen.formats.schema import META_JSON_KEY, META_VERSION_KEY, TraceGeometry, TraceMeta
from moesim.tracegen.formats.trace import Trace, TraceWriter, iter_chunks, read_meta, read_trace, write_trace
from moesim.tracegen.routing.synth import Sticky, synthesize


def small_trace(seqs: int = 3, tokens: int = 40, weights: bool = True) -> Trace:
    trace = synthesize(load_preset("deepseek-v2-lite"), Sticky(keep_prob=0.4), tokens, seqs, seed=7)
    if not weights:
        return trace
    rng = np.random.default_rng(1)
    w = rng.random(trace.experts.shape, dtype=np.float32)
    is_prompt = trace.pos < 5
    token = rng.integers(0, 1000, trace.n_tokens).astype(np.int32)
    return Trace(trace.meta, trace.seq, trace.pos, is_prompt, trace.experts, w, token)


def test_round_trip_pyarrow_polars_duckdb(tmp_path: Path) -> None:
    trace = small_trace()
    path = tmp_path / "t.arrow"
    write_trace(path, trace)
    back = read_trace(path)
    for name in ("seq", "pos", "is_prompt", "experts", "weights", "token"):
        np.testing.assert_array_equal(getattr(back, name), getattr(trace, name))
    assert back.meta == trace.meta
    assert back.experts.dtype == np.uint8  # smallest unsigned type holding 64 experts

    table = ipc.open_file(pa.memory_map(str(path))).read_all()
    n_layers, k = len(trace.meta.geometry.moe_layers), trace.meta.geometry.top_k
    assert table.num_rows == trace.n_tokens * n_layers
    assert json.loads(table.schema.metadata[META_JSON_KEY])["geometry"]["model"] == "deepseek-v2-lite"
    expected_rows = {
        "seq": np.repeat(trace.seq, n_layers),
        "pos": np.repeat(trace.pos, n_layers),
        "layer": np.tile(np.arange(1, 27), trace.n_tokens),
        "is_prompt": np.repeat(trace.is_prompt, n_layers),
        "token": np.repeat(trace.token, n_layers),
    }
    experts_rows = trace.experts.reshape(-1, k)
    weights_rows = trace.weights.reshape(-1, k)

    frame = pl.read_ipc(path)
    con = duckdb.connect()
    con.register("trace_rows", table)
    via_duckdb = con.sql("SELECT * FROM trace_rows ORDER BY seq, pos, layer").to_arrow_table()
    for reader_name, got in (("pyarrow", table), ("polars", frame.to_arrow()), ("duckdb", via_duckdb)):
        for col, values in expected_rows.items():
            np.testing.assert_array_equal(np.asarray(got.column(col).to_pylist()), values, err_msg=f"{reader_name} {col}")
        np.testing.assert_array_equal(np.asarray(got.column("experts").to_pylist()), experts_rows, err_msg=reader_name)
        np.testing.assert_array_equal(np.asarray(got.column("weights").to_pylist(), np.float32), weights_rows, err_msg=reader_name)


def test_same_inputs_same_bytes(tmp_path: Path) -> None:
    write_trace(tmp_path / "a.arrow", small_trace())
    write_trace(tmp_path / "b.arrow", small_trace())
    assert (tmp_path / "a.arrow").read_bytes() == (tmp_path / "b.arrow").read_bytes()


@pytest.mark.parametrize("max_pass", [1, 4, 16])
def test_chunked_reader_overlaps_and_covers_every_window(tmp_path: Path, max_pass: int) -> None:
    trace = small_trace(seqs=4, tokens=37)
    path = tmp_path / "t.arrow"
    write_trace(path, trace)
    seen_windows: list[tuple[int, int]] = []
    for chunk in iter_chunks(path, max_pass=max_pass, chunk_positions=10):
        c = chunk.trace
        assert chunk.new_from <= max(max_pass - 1, 0)
        starts = c.seq_starts
        for i in range(c.n_seqs):
            a, b = int(starts[i]), int(starts[i + 1])
            for end in range(max(a + max_pass - 1, chunk.new_from), b):
                seen_windows.append((int(c.seq[end]), int(c.pos[end])))
                # the window's rows equal the full trace's rows
                row = int(np.flatnonzero((trace.seq == c.seq[end]) & (trace.pos == c.pos[end]))[0])
                np.testing.assert_array_equal(c.experts[end - max_pass + 1 : end + 1], trace.experts[row - max_pass + 1 : row + 1])
    expected = [(int(s), int(p)) for s, p in zip(trace.seq, trace.pos, strict=True) if p >= max_pass - 1]
    assert seen_windows == expected


def test_writer_leaves_no_partial_file_on_error(tmp_path: Path) -> None:
    trace = small_trace()
    path = tmp_path / "t.arrow"
    with pytest.raises(RuntimeError), TraceWriter(path, trace.meta) as writer:
        writer.append(0, 0, trace.experts[:10], False)
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    # keep_on_error keeps the completed sequences as a valid trace
    with pytest.raises(RuntimeError), TraceWriter(path, trace.meta, keep_on_error=True) as writer:
        writer.append(0, 0, trace.experts[:10], False)
        writer.end_sequence()
        writer.append(1, 0, trace.experts[10:15], False)
        raise RuntimeError("boom")
    kept = read_trace(path)
    assert kept.n_tokens == 10 and list(tmp_path.iterdir()) == [path]


# ---- malformed traces ----------------------------------------------------------------------


def _write_rows(path: Path, meta: TraceMeta, columns: dict[str, pa.Array], metadata: dict[bytes, bytes] | None = None) -> None:
    from moesim.tracegen.formats.schema import trace_schema

    schema = trace_schema(meta, False, False)
    if metadata is not None:
        schema = schema.with_metadata({**schema.metadata, **metadata})
    arrays = [columns[f.name] for f in schema]
    with ipc.new_file(str(path), schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))


def _rows_of(trace: Trace) -> dict[str, np.ndarray]:
    n_layers, k = len(trace.meta.geometry.moe_layers), trace.meta.geometry.top_k
    return {
        "seq": np.repeat(trace.seq, n_layers),
        "pos": np.repeat(trace.pos, n_layers),
        "layer": np.tile(np.asarray(trace.meta.geometry.moe_layers, np.uint16), trace.n_tokens),
        "is_prompt": np.repeat(trace.is_prompt, n_layers),
        "experts": trace.experts.reshape(-1, k).copy(),
    }


def _to_arrays(rows: dict[str, np.ndarray], k: int) -> dict[str, pa.Array]:
    out = {name: pa.array(values) for name, values in rows.items() if name != "experts"}
    out["experts"] = pa.FixedSizeListArray.from_arrays(pa.array(rows["experts"].reshape(-1)), k)
    return out


def tiny_meta() -> TraceMeta:
    geometry = TraceGeometry("tiny", 4, (1, 2, 3), 8, 2, 64, 32, "F32")
    return TraceMeta(geometry=geometry)


def tiny_trace() -> Trace:
    meta = tiny_meta()
    rng = np.random.default_rng(0)
    experts = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)]) for _ in range(6)]).astype(np.uint8)
    return Trace(meta, np.array([0, 0, 0, 1, 1, 1], np.uint32), np.array([0, 1, 2, 0, 1, 2], np.uint32), np.zeros(6, bool), experts)


MALFORMED = {
    "id_out_of_range": ("experts", "has id 8, but the model has 8 experts"),
    "repeated_expert": ("experts", "repeats an expert"),
    "missing_layer": ("layer", "missing MoE layer"),
    "unsorted": ("pos", "not sorted"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_trace_rejected_with_one_line(tmp_path: Path, case: str, cli) -> None:  # type: ignore[no-untyped-def]
    trace = tiny_trace()
    rows = _rows_of(trace)
    if case == "id_out_of_range":
        rows["experts"][7, 1] = 8
    elif case == "repeated_expert":
        rows["experts"][4, 1] = rows["experts"][4, 0]
    elif case == "missing_layer":
        keep = np.ones(len(rows["seq"]), bool)
        keep[5] = False  # position 1 of seq 0 loses layer 3
        rows = {k: v[keep] for k, v in rows.items()}
    elif case == "unsorted":
        order = np.arange(len(rows["seq"]))
        order[3:6], order[6:9] = np.arange(6, 9), np.arange(3, 6)  # swap positions 1 and 2
        rows = {k: v[order] for k, v in rows.items()}
    path = tmp_path / f"{case}.arrow"
    _write_rows(path, trace.meta, _to_arrays(rows, 2))
    field, message = MALFORMED[case]
    with pytest.raises(InputError, match="row"):
        read_trace(path)
    code, _, err = cli("trace", "info", path)
    assert_one_line_error(code, err, str(path), "row", f"'{field}'" if case != "missing_layer" else "'layer'", message)


def test_wrong_k_and_unknown_version(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    trace = tiny_trace()
    rows = _rows_of(trace)
    # experts lists of 3 ids while the metadata says top_k = 2
    arrays = _to_arrays(rows, 2)
    arrays["experts"] = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(len(rows["seq"]) * 3, np.uint8)), 3)
    schema = pa.schema(
        [pa.field(n, arrays[n].type) for n in ("seq", "pos", "layer", "is_prompt", "experts")],
        metadata={b"moesim.format": b"routing-trace", META_VERSION_KEY: b"1", META_JSON_KEY: trace.meta.to_json().encode()},
    )
    path = tmp_path / "wrong_k.arrow"
    with ipc.new_file(str(path), schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays([arrays[n] for n in schema.names], schema=schema))
    code, _, err = cli("trace", "info", path)
    assert_one_line_error(code, err, str(path), "'experts'", "3 ids", "top_k = 2")

    path = tmp_path / "v9.arrow"
    _write_rows(path, trace.meta, _to_arrays(_rows_of(trace), 2), {META_VERSION_KEY: b"9"})
    code, _, err = cli("trace", "info", path)
    assert_one_line_error(code, err, str(path), "unknown trace format version '9'")


def test_not_a_trace(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "x.arrow"
    path.write_bytes(b"hello")
    assert_one_line_error(*cli("trace", "info", path)[::2], str(path), "not a readable Arrow IPC file")
    assert_one_line_error(*cli("trace", "info", tmp_path / "missing.arrow")[::2], "no such trace file")
    plain = tmp_path / "plain.arrow"
    with ipc.new_file(str(plain), pa.schema([("a", pa.int32())])) as writer:
        writer.write_batch(pa.record_batch([pa.array([1], pa.int32())], names=["a"]))
    assert_one_line_error(*cli("trace", "info", plain)[::2], "not a moesim routing trace")


def test_read_meta_is_cheap_and_equal(tmp_path: Path) -> None:
    trace = small_trace()
    write_trace(tmp_path / "t.arrow", trace)
    assert read_meta(tmp_path / "t.arrow") == trace.meta
