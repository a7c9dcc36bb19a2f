"""Routing traces in memory and on disk: streaming writer, validating reader, chunked reader.

In memory a trace is position-major: `experts[t, l, j]` is the j-th selected expert of token
row t at the l-th MoE layer, exactly the on-disk row order, so reading is a zero-copy reshape of
the fixed-size-list values. Sequence boundaries are given by `seq_starts` (offsets into t).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from moesim.atomic import check_writable, protect, temporary_path
from moesim.errors import InputError, first_line
from moesim.kernels.bitsets import MASKS_OK, fill_masks, mask_words, masks_bytes
from moesim.machine import check_fits
from moesim.tracegen.formats.builtin import BUILTIN_TRACES, resolve_trace
from moesim.tracegen.formats.schema import TraceMeta, check_groups, meta_from_schema, trace_schema

DEFAULT_BATCH_ROWS = 1 << 16
COMPRESSION_LEVELS = {"zstd": 19}  # Arrow IPC buffer codecs a writer may use, at this level; readers decompress transparently
MAX_BATCH_ROWS = 1 << 22  # no record batch is larger: every reader streams a file batch by batch


@dataclass(frozen=True)
class Trace:
    """A routing trace: arrays indexed by token row t (positions of all sequences, in order)."""

    meta: TraceMeta
    seq: np.ndarray  # (T,) uint32
    pos: np.ndarray  # (T,) uint32
    is_prompt: np.ndarray  # (T,) bool
    experts: np.ndarray  # (T, L, K) unsigned ids
    weights: np.ndarray | None = None  # (T, L, K) float32
    token: np.ndarray | None = None  # (T,) int32

    @property
    def n_tokens(self) -> int:
        """Token rows (positions) over all sequences."""
        return int(self.experts.shape[0])

    @property
    def seq_starts(self) -> np.ndarray:
        """Offsets of each sequence's first row, plus the total: shape (S + 1,), int64."""
        starts = np.flatnonzero(np.diff(self.seq.astype(np.int64), prepend=-1) != 0)
        return np.append(starts, self.n_tokens).astype(np.int64)

    @property
    def n_seqs(self) -> int:
        """Number of sequences."""
        return len(self.seq_starts) - 1

    def seq_lengths(self) -> np.ndarray:
        """Positions per sequence."""
        return np.diff(self.seq_starts)

    @cached_property
    def expert_masks(self) -> np.ndarray | None:
        """Each token row's experts per MoE layer as bits, (T + 1, L, ceil(E / 64)) uint64 with a zero
        last row (`moesim.kernels.bitsets`), built on first use and kept; None where they would not
        fit in memory or cannot hold the routing (an id >= E, an id twice in one token's layer):
        then unions count ids."""
        n_rows, n_layers, _ = self.experts.shape
        n_experts = self.meta.geometry.experts
        try:
            check_fits("the trace's expert bitmasks", masks_bytes(n_rows, n_layers, n_experts))
        except InputError:
            return None
        masks = np.empty((n_rows + 1, n_layers, mask_words(n_experts)), np.uint64)
        return masks if fill_masks(self.experts, n_experts, masks) == MASKS_OK else None

    def __getstate__(self) -> dict:
        """Pickled without the masks (rebuilt where the trace lands, on first use)."""
        return {name: value for name, value in self.__dict__.items() if name != "expert_masks"}


# ---- writing --------------------------------------------------------------------------------


class TraceWriter:
    """Streams positions into a trace file; the file appears only when the writer closes cleanly.

    Use as a context manager. `append` takes whole positions (all MoE layers of each). Completed
    sequences are written in record batches of at least `batch_rows` rows (whole sequences) and
    at most MAX_BATCH_ROWS (a long sequence is split). On an exception the temporary file is
    removed, unless `keep_on_error` is set, in which case the sequences completed so far
    (`end_sequence`) are kept as a valid trace. `compression` (a key of `COMPRESSION_LEVELS`, or
    None) compresses the record batches' buffers.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: TraceMeta,
        with_weights: bool = False,
        with_tokens: bool = False,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        keep_on_error: bool = False,
        compression: str | None = None,
    ) -> None:
        self.path = Path(path)
        check_writable(self.path)
        if compression is not None and compression not in COMPRESSION_LEVELS:
            raise InputError(f"{self.path}: unknown trace compression '{compression}' (known: {', '.join(COMPRESSION_LEVELS)})")
        self.options = ipc.IpcWriteOptions(compression=pa.Codec(compression, COMPRESSION_LEVELS[compression]) if compression else None)
        self.meta = meta
        self.schema = trace_schema(meta, with_weights, with_tokens)
        self.with_weights = with_weights
        self.with_tokens = with_tokens
        self.batch_positions = max(1, batch_rows // len(meta.geometry.moe_layers))
        self.max_batch_positions = max(self.batch_positions, MAX_BATCH_ROWS // len(meta.geometry.moe_layers))
        self.keep_on_error = keep_on_error
        self._tmp: Path | None = None
        self._sink: pa.OSFile | None = None
        self._writer: ipc.RecordBatchFileWriter | None = None
        self._pending: list[tuple[np.ndarray, ...]] = []
        self._pending_positions = 0
        self._open_seq: list[tuple[np.ndarray, ...]] = []  # positions of the unfinished sequence
        self._last: tuple[int, int] | None = None
        self.positions_written = 0

    def __enter__(self) -> TraceWriter:
        self._tmp = temporary_path(self.path)
        self._sink = pa.OSFile(str(self._tmp), "wb")
        self._writer = ipc.new_file(self._sink, self.schema, options=self.options)
        return self

    def append(
        self,
        seq: int,
        start_pos: int,
        experts: np.ndarray,
        is_prompt: np.ndarray | bool,
        weights: np.ndarray | None = None,
        token: np.ndarray | None = None,
    ) -> None:
        """Append positions start_pos, start_pos+1, ... of sequence `seq`; experts is (T, L, K)."""
        g = self.meta.geometry
        experts = np.asarray(experts)
        t = experts.shape[0]
        if experts.shape[1:] != (len(g.moe_layers), g.top_k):
            raise InputError(f"{self.path}: appended experts have shape {experts.shape[1:]}, expected {(len(g.moe_layers), g.top_k)}")
        continues = self._last is not None and (seq, start_pos) == (self._last[0], self._last[1] + 1)
        starts_new = start_pos == 0 and seq == (0 if self._last is None else self._last[0] + 1)
        if not (continues or starts_new):
            raise InputError(
                f"{self.path}: positions must be appended in order, sequences numbered 0, 1, 2, ..., each from position 0 "
                f"(got seq {seq} pos {start_pos} after {self._last})"
            )
        if starts_new and self._last is not None:
            self.end_sequence()
        if t == 0:
            return
        if (weights is None) == self.with_weights or (token is None) == self.with_tokens:
            raise InputError(f"{self.path}: appended columns do not match the trace schema")
        prompt = np.broadcast_to(np.asarray(is_prompt, dtype=bool), (t,))
        part = (
            np.full(t, seq, np.uint32),
            np.arange(start_pos, start_pos + t, dtype=np.uint32),
            prompt.copy(),
            experts.astype(g.expert_id_type.to_pandas_dtype(), copy=False),
            None if weights is None else np.asarray(weights, np.float32),
            None if token is None else np.asarray(token, np.int32),
        )
        self._open_seq.append(part)
        self._last = (seq, start_pos + t - 1)

    def end_sequence(self) -> None:
        """Mark the current sequence complete (kept even if the writer later fails)."""
        for part in self._open_seq:
            self._pending.append(part)
            self._pending_positions += part[0].shape[0]
        self._open_seq = []
        if self._pending_positions >= self.batch_positions:
            self._flush()

    def _flush(self) -> None:
        """Write the pending positions: one batch, or slices of max_batch_positions when more."""
        if not self._pending or self._writer is None:
            return
        step = self.max_batch_positions
        for start in range(0, self._pending_positions, step):
            cols = [_gather([p[i] for p in self._pending], start, start + step) for i in range(6)]
            self._writer.write_batch(positions_to_batch(self.schema, self.meta, *cols))  # type: ignore[arg-type]
            self.positions_written += cols[0].shape[0]  # type: ignore[union-attr]
        self._pending, self._pending_positions = [], 0

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                self.end_sequence()
            if exc_type is None or self.keep_on_error:
                self._flush()
            if self._writer is not None:
                self._writer.close()
            if self._sink is not None:
                self._sink.close()
            if exc_type is None or (self.keep_on_error and self.positions_written):
                check_writable(self.path)  # still not an input, still writable
                os.replace(self._tmp, self.path)  # type: ignore[arg-type]
        finally:
            if self._tmp is not None and self._tmp.exists():
                self._tmp.unlink()


def _gather(parts: list[np.ndarray | None], start: int, stop: int) -> np.ndarray | None:
    """Rows start..stop of the concatenation of `parts`, copying only those rows."""
    if parts[0] is None:
        return None
    pieces, offset = [], 0
    for part in parts:
        n = part.shape[0]  # type: ignore[union-attr]
        lo, hi = max(start - offset, 0), min(stop - offset, n)
        if lo < hi:
            pieces.append(part[lo:hi])  # type: ignore[index]
        offset += n
    return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def positions_to_batch(
    schema: pa.Schema,
    meta: TraceMeta,
    seq: np.ndarray,
    pos: np.ndarray,
    is_prompt: np.ndarray,
    experts: np.ndarray,
    weights: np.ndarray | None,
    token: np.ndarray | None,
) -> pa.RecordBatch:
    """Expand per-position arrays to one row per (position, MoE layer)."""
    layers = np.asarray(meta.geometry.moe_layers, np.uint16)
    n_layers, k = len(layers), meta.geometry.top_k
    t = seq.shape[0]
    arrays = {
        "seq": pa.array(np.repeat(seq, n_layers)),
        "pos": pa.array(np.repeat(pos, n_layers)),
        "layer": pa.array(np.tile(layers, t)),
        "is_prompt": pa.array(np.repeat(is_prompt, n_layers)),
        "experts": pa.FixedSizeListArray.from_arrays(pa.array(experts.reshape(-1)), k),
    }
    if weights is not None:
        arrays["weights"] = pa.FixedSizeListArray.from_arrays(pa.array(weights.reshape(-1)), k)
    if token is not None:
        arrays["token"] = pa.array(np.repeat(token, n_layers))
    return pa.RecordBatch.from_arrays([arrays[f.name] for f in schema], schema=schema)


def write_trace(path: str | os.PathLike[str], trace: Trace, compression: str | None = None) -> None:
    """Write an in-memory trace, one sequence at a time (its groups checked against its sequences)."""
    check_groups(trace.meta.groups, trace.n_seqs, str(path))
    with TraceWriter(path, trace.meta, trace.weights is not None, trace.token is not None, compression=compression) as writer:
        starts = trace.seq_starts
        for i in range(trace.n_seqs):
            a, b = int(starts[i]), int(starts[i + 1])
            writer.append(
                int(trace.seq[a]),
                int(trace.pos[a]),
                trace.experts[a:b],
                trace.is_prompt[a:b],
                None if trace.weights is None else trace.weights[a:b],
                None if trace.token is None else trace.token[a:b],
            )
            writer.end_sequence()


# ---- reading and validation -----------------------------------------------------------------


def open_ipc_file(path: Path, what: str = "trace") -> ipc.RecordBatchFileReader:
    """Open an Arrow IPC file (memory-mapped) whose schema decodes; any failure is one InputError line."""
    if not path.is_file():
        hint = f" (built-in traces: {', '.join(BUILTIN_TRACES)})" if what == "trace" else ""
        raise InputError(f"{path}: no such {what} file{hint}")
    protect(path)
    try:
        reader = ipc.open_file(pa.memory_map(str(path), "r"))
        _ = reader.schema.names, reader.schema.metadata  # field names and metadata decode (a corrupt file may not)
        return reader
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not a readable Arrow IPC file ({first_line(exc)})") from None


def read_meta(path: str | os.PathLike[str]) -> TraceMeta:
    """Read only a trace's metadata (cheap: the footer and schema); a file or a built-in trace by name."""
    path = resolve_trace(path)
    return meta_from_schema(open_ipc_file(path).schema, str(path))


@dataclass
class _Rows:
    """Columns of a run of rows, as numpy arrays, with the global index of the first row."""

    first_row: int
    seq: np.ndarray
    pos: np.ndarray
    layer: np.ndarray
    is_prompt: np.ndarray
    experts: np.ndarray  # (R, K)
    weights: np.ndarray | None
    token: np.ndarray | None


def _batch_rows(batch: pa.RecordBatch, first_row: int, k: int, source: str) -> _Rows:
    try:
        batch.validate(full=True)
    except (pa.ArrowInvalid, pa.ArrowException) as exc:
        raise InputError(f"{source}: rows from {first_row}: invalid Arrow data ({first_line(exc)})") from None
    for name in batch.schema.names:
        column = batch.column(name)
        if column.null_count:
            bad = first_row + int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise InputError(f"{source}: row {bad}: field '{name}' is null")
        if pa.types.is_fixed_size_list(column.type) and column.values.null_count:
            bad_value = int(np.flatnonzero(column.flatten().is_null().to_numpy(zero_copy_only=False))[0])
            raise InputError(f"{source}: row {first_row + bad_value // k}: field '{name}' holds a null")

    def flat(name: str) -> np.ndarray | None:
        if name not in batch.schema.names:
            return None
        return batch.column(name).flatten().to_numpy(zero_copy_only=False).reshape(-1, k)

    return _Rows(
        first_row,
        batch.column("seq").to_numpy(),
        batch.column("pos").to_numpy(),
        batch.column("layer").to_numpy(),
        batch.column("is_prompt").to_numpy(zero_copy_only=False),
        flat("experts"),  # type: ignore[arg-type]
        flat("weights"),
        None if "token" not in batch.schema.names else batch.column("token").to_numpy(),
    )


def _row_label(rows: _Rows, i: int) -> str:
    return f"row {rows.first_row + i} (seq {rows.seq[i]}, pos {rows.pos[i]}, layer {rows.layer[i]})"


def _validate_rows(rows: _Rows, meta: TraceMeta, prev: tuple[int, int] | None, source: str) -> None:
    """Check a run of whole positions; `prev` is the (seq, pos) of the position before it."""
    g = meta.geometry
    n_layers = len(g.moe_layers)
    n_rows = rows.seq.shape[0]
    # every position holds exactly the MoE layers, in order
    expected_layer = np.tile(np.asarray(g.moe_layers, np.uint16), n_rows // n_layers + 1)[:n_rows]
    bad = np.flatnonzero(rows.layer != expected_layer)
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"{source}: {_row_label(rows, i)}: field 'layer' is {rows.layer[i]}, expected {expected_layer[i]} "
            f"(missing MoE layer for a position, or rows out of (seq, pos, layer) order)"
        )
    if n_rows % n_layers:
        raise InputError(f"{source}: {_row_label(rows, n_rows - 1)}: the last position is missing MoE layers")
    # rows of one position agree on seq, pos and is_prompt
    for name in ("seq", "pos", "is_prompt"):
        values = getattr(rows, name).reshape(-1, n_layers)
        mismatch = np.flatnonzero((values != values[:, :1]).any(axis=1))
        if mismatch.size:
            p = int(mismatch[0])
            j = int(np.flatnonzero(values[p] != values[p, 0])[0])
            raise InputError(
                f"{source}: {_row_label(rows, p * n_layers + j)}: field '{name}' differs within one position (a MoE layer is missing)"
            )
    # positions sorted by (seq, pos), contiguous from 0 within a sequence
    seq = rows.seq[::n_layers].astype(np.int64)
    pos = rows.pos[::n_layers].astype(np.int64)
    prev_seq = np.concatenate([[prev[0] if prev else -1], seq[:-1]])
    prev_pos = np.concatenate([[prev[1] if prev else -1], pos[:-1]])
    new_seq = (seq == prev_seq + 1) & (pos == 0)
    bad = np.flatnonzero(~np.where(seq == prev_seq, pos == prev_pos + 1, new_seq))
    if bad.size:
        i, b = int(bad[0]) * n_layers, int(bad[0])
        if seq[b] != prev_seq[b] and seq[b] != prev_seq[b] + 1:
            raise InputError(
                f"{source}: {_row_label(rows, i)}: field 'seq' is {seq[b]}, expected {prev_seq[b] + 1} "
                "(sequences are numbered 0, 1, 2, ... in order)"
            )
        raise InputError(
            f"{source}: {_row_label(rows, i)}: field 'pos': rows are not sorted by (seq, pos, layer) with positions contiguous from 0 "
            f"(previous position: seq {prev_seq[b]}, pos {prev_pos[b]})"
        )
    # ids in range, no repeated expert in one token's top-k
    experts = rows.experts
    too_big = np.flatnonzero((experts >= g.experts).any(axis=1))
    if too_big.size:
        i = int(too_big[0])
        top = int(experts[i].max())
        raise InputError(f"{source}: {_row_label(rows, i)}: field 'experts' has id {top}, but the model has {g.experts} experts")
    ordered = np.sort(experts, axis=1)
    repeated = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if repeated.size:
        i = int(repeated[0])
        ids = experts[i].tolist()
        raise InputError(f"{source}: {_row_label(rows, i)}: field 'experts' repeats an expert within one token's top-k: {ids}")
    if rows.weights is not None and not np.isfinite(rows.weights).all():
        i = int(np.flatnonzero(~np.isfinite(rows.weights).all(axis=1))[0])
        raise InputError(f"{source}: {_row_label(rows, i)}: field 'weights' is not finite")


def _iter_position_runs(path: Path) -> Iterator[tuple[TraceMeta, _Rows]]:
    """Validated runs of whole positions, in file order (a position never spans two runs)."""
    reader = open_ipc_file(path)
    source = str(path)
    meta = meta_from_schema(reader.schema, source)
    n_layers, k = len(meta.geometry.moe_layers), meta.geometry.top_k
    carry: _Rows | None = None
    prev: tuple[int, int] | None = None
    first_row = 0
    for i in range(reader.num_record_batches):
        try:
            batch = reader.get_batch(i)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError, pa.ArrowException) as exc:
            raise InputError(f"{source}: record batch {i} is unreadable ({first_line(exc)})") from None
        if batch.schema != reader.schema:
            raise InputError(f"{source}: record batch {i} does not match the file schema")
        rows = _batch_rows(batch, first_row, k, source)
        first_row += batch.num_rows
        if carry is not None:
            rows = _concat_rows(carry, rows)
        whole = rows.seq.shape[0] - rows.seq.shape[0] % n_layers
        run, carry = _split_rows(rows, whole)
        if run.seq.shape[0]:
            _validate_rows(run, meta, prev, source)
            prev = (int(run.seq[-1]), int(run.pos[-1]))
            yield meta, run
    if carry is not None and carry.seq.shape[0]:
        _validate_rows(carry, meta, prev, source)  # raises: an incomplete last position
    if prev is None:
        raise InputError(f"{source}: the trace has no rows")


_ROW_FIELDS = ("seq", "pos", "layer", "is_prompt", "experts", "weights", "token")


def _concat_rows(a: _Rows, b: _Rows) -> _Rows:
    parts = [None if getattr(a, f) is None else np.concatenate([getattr(a, f), getattr(b, f)]) for f in _ROW_FIELDS]
    return _Rows(a.first_row, *parts)  # type: ignore[arg-type]


def _split_rows(rows: _Rows, at: int) -> tuple[_Rows, _Rows | None]:
    def part(sl: slice, first: int) -> _Rows:
        return _Rows(first, *(None if getattr(rows, f) is None else getattr(rows, f)[sl] for f in _ROW_FIELDS))  # type: ignore[arg-type]

    tail = part(slice(at, None), rows.first_row + at)
    return part(slice(0, at), rows.first_row), (tail if tail.seq.shape[0] else None)


def _rows_to_positions(meta: TraceMeta, rows: _Rows) -> dict[str, np.ndarray | None]:
    n_layers, k = len(meta.geometry.moe_layers), meta.geometry.top_k
    return {
        "seq": rows.seq[::n_layers],
        "pos": rows.pos[::n_layers],
        "is_prompt": rows.is_prompt[::n_layers],
        "experts": rows.experts.reshape(-1, n_layers, k),
        "weights": None if rows.weights is None else rows.weights.reshape(-1, n_layers, k),
        "token": None if rows.token is None else rows.token[::n_layers],
    }


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and fully validate a whole trace into memory (a file, or a built-in trace by name)."""
    path = resolve_trace(path)
    meta: TraceMeta | None = None
    parts: list[dict[str, np.ndarray | None]] = []
    for meta, rows in _iter_position_runs(path):
        parts.append(_rows_to_positions(meta, rows))
    assert meta is not None
    check_groups(meta.groups, sum(int(np.count_nonzero(p["pos"] == 0)) for p in parts), str(path))  # type: ignore[arg-type]

    def cat(name: str) -> np.ndarray | None:
        if parts[0][name] is None:
            return None
        return np.concatenate([p[name] for p in parts]) if len(parts) > 1 else parts[0][name]  # type: ignore[return-value]

    return Trace(meta, **{name: cat(name) for name in parts[0]})  # type: ignore[arg-type]


@dataclass(frozen=True)
class TraceChunk:
    """A chunk of consecutive positions for streaming; the first `new_from` rows repeat the
    previous chunk's last positions of the same sequence (at most max_pass - 1 of them), so a
    consumer counts exactly the windows whose last position lies at a row >= new_from."""

    trace: Trace
    new_from: int


def iter_chunks(path: str | os.PathLike[str], max_pass: int, chunk_positions: int = 1 << 18) -> Iterator[TraceChunk]:
    """Stream a trace in bounded memory, validating as it goes; chunks overlap by max_pass - 1."""
    if max_pass < 1:
        raise InputError(f"max_pass must be >= 1, got {max_pass}")
    overlap = max_pass - 1
    buffer: list[dict[str, np.ndarray | None]] = []
    buffered = 0
    meta: TraceMeta | None = None
    tail: dict[str, np.ndarray | None] | None = None

    def emit(final: bool) -> Iterator[TraceChunk]:
        nonlocal buffer, buffered, tail
        assert meta is not None
        new = {name: np.concatenate([p[name] for p in buffer]) if buffer[0][name] is not None else None for name in buffer[0]}
        lead = 0 if tail is None else tail["seq"].shape[0]  # type: ignore[union-attr]
        merged = new if tail is None else {n: None if new[n] is None else np.concatenate([tail[n], new[n]]) for n in new}  # type: ignore[list-item]
        chunk = Trace(meta, **merged)  # type: ignore[arg-type]
        yield TraceChunk(chunk, lead)
        buffer, buffered = [], 0
        if not final and overlap:
            seq = merged["seq"]
            last = seq[-1]  # type: ignore[index]
            same = int(np.count_nonzero(seq[-overlap:] == last))  # type: ignore[index]
            tail = {n: None if v is None else v[len(v) - same :].copy() for n, v in merged.items()}
        else:
            tail = None

    for meta, rows in _iter_position_runs(resolve_trace(path)):
        positions = _rows_to_positions(meta, rows)
        buffer.append(positions)
        buffered += positions["seq"].shape[0]  # type: ignore[union-attr]
        if buffered >= chunk_positions:
            yield from emit(final=False)
    if buffer:
        yield from emit(final=True)
