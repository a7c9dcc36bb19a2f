"""Speculative-run format, contract 2 of docs/architecture.md (version 1): measured draft-then-verify steps.

An Arrow IPC file with one row per (sequence, verify step, pass slot, MoE layer), sorted in that
order. A verify step feeds the target `drafted + 1` tokens (the last accepted token, then the
drafts) at positions `pos0 .. pos0 + drafted`; every slot is routed, rejected drafts included
(they revisit positions, so this does not fit contract 1).

| column         | type                           | meaning                                                  |
|----------------|--------------------------------|----------------------------------------------------------|
| `seq`          | uint32                         | sequence (prompt) index, from 0, increasing              |
| `step`         | uint32                         | verify step of the sequence, 0, 1, 2, ...                |
| `slot`         | uint16                         | slot in the verify pass: 0 = last accepted token, i = draft i |
| `pos`          | uint32                         | position of the slot's token = pos0 + slot               |
| `layer`        | uint16                         | the model's own layer index of a MoE layer               |
| `token`        | int32                          | token fed at this slot                                   |
| `target_token` | int32                          | the target's greedy choice after this slot               |
| `experts`      | fixed_size_list<uint8/16>[k]   | selected expert ids in router order                      |
| `weights`      | fixed_size_list<float32>[k]    | optional: gate weights                                   |
| `drafted`      | uint16                         | drafts in this step (the pass has drafted + 1 slots)     |
| `accepted`     | uint16                         | drafts accepted (0..drafted); the step yields accepted + 1 tokens |
| `draft_us`     | float64                        | wall time of this step's draft decodes                   |
| `verify_us`    | float64                        | wall time of the verify pass (llama_decode + sync)       |

Step columns repeat on every row of the step. Invariants checked by the reader: each step holds
slots 0..drafted, each slot every MoE layer in order; accepted <= drafted; the first step of a
sequence starts right after its prompt and each next step at pos0 + accepted + 1; times finite
and >= 0. Schema metadata: `moesim.format` = "speculative-run", `moesim.format_version` = "1",
`moesim.meta` = JSON of `SpecRunMeta` (target geometry, draft model, draft length, engine,
threads, how passes were timed, per-sequence prompt length, prefill time and plain-decoding
baseline). Readable by pyarrow, polars and duckdb without moesim; `steps` is one group-by away.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc

from moesim.atomic import atomic_path, check_writable
from moesim.errors import InputError, first_line
from moesim.fields import Checked, FieldError, checked
from moesim.tracegen.formats.schema import (
    META_FORMAT_KEY,
    TraceGeometry,
    checked_format,
    format_metadata,
    meta_from_json,
    routing_fields,
)
from moesim.tracegen.formats.trace import open_ipc_file

SPECRUN_FORMAT = "speculative-run"
SPECRUN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class SequenceInfo(Checked):
    """Per-sequence facts of a speculative run."""

    prompt_tokens: int = checked(ge=0, lt=1 << 32)  # positions are uint32
    prefill_us: float = checked(ge=0.0)
    generated_tokens: int = checked(ge=0, lt=1 << 32)
    # mean one-token target decode, plain greedy decoding (baseline T(1)); NaN (null in the file): not run
    plain_decode_us: float = checked(float("nan"), ge=0.0, finite=False)
    # generated tokens equal to plain greedy decoding's, from the start (-1: not run)
    plain_match_tokens: int = checked(-1, ge=-1, lt=1 << 32)


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass(frozen=True)
class SpecRunMeta(Checked):
    """Everything a speculative run says about itself besides the rows."""

    geometry: TraceGeometry
    draft_model: str
    draft_len: int = checked(ge=1, lt=1 << 16)  # the `drafted` column is uint16
    engine: str = "unknown"
    engine_version: str = ""
    backend: str = "unknown"
    prompts: str = ""
    n_threads: int = checked(0, ge=0, lt=1 << 31)
    timing: str = ""
    sequences: tuple[SequenceInfo, ...] = ()
    format_version: int = SPECRUN_FORMAT_VERSION

    def to_json(self) -> str:
        """Canonical JSON (sorted keys; NaN as null)."""
        data = dataclasses.asdict(self)
        data["sequences"] = [{k: _finite_or_none(v) for k, v in s.items()} for s in data["sequences"]]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> SpecRunMeta:
        """Parse and check the `moesim.meta` JSON (a null sequence time: not measured, NaN)."""
        return meta_from_json(cls, text, source, _nulls_to_nan)


def _nulls_to_nan(data: Any) -> Any:
    """to_json writes a time not measured (NaN) as null; read it back as NaN."""
    if isinstance(data, dict) and isinstance(data.get("sequences"), list):
        nan = float("nan")
        data["sequences"] = [{k: nan if v is None else v for k, v in s.items()} if isinstance(s, dict) else s for s in data["sequences"]]
    return data


def specrun_schema(meta: SpecRunMeta, with_weights: bool) -> pa.Schema:
    """The Arrow schema of a version-1 speculative run, metadata included."""
    fields = [
        pa.field("seq", pa.uint32(), nullable=False),
        pa.field("step", pa.uint32(), nullable=False),
        pa.field("slot", pa.uint16(), nullable=False),
        pa.field("pos", pa.uint32(), nullable=False),
        pa.field("layer", pa.uint16(), nullable=False),
        pa.field("token", pa.int32(), nullable=False),
        pa.field("target_token", pa.int32(), nullable=False),
        *routing_fields(meta.geometry, with_weights),
        pa.field("drafted", pa.uint16(), nullable=False),
        pa.field("accepted", pa.uint16(), nullable=False),
        pa.field("draft_us", pa.float64(), nullable=False),
        pa.field("verify_us", pa.float64(), nullable=False),
    ]
    return pa.schema(fields, metadata=format_metadata(SPECRUN_FORMAT, meta.format_version, meta.to_json()))


@dataclass(frozen=True)
class VerifyStep:
    """One measured draft-then-verify step of one sequence."""

    pos0: int
    tokens: np.ndarray  # (drafted + 1,) fed tokens
    target_tokens: np.ndarray  # (drafted + 1,) the target's greedy choices
    experts: np.ndarray  # (drafted + 1, L, K)
    weights: np.ndarray | None
    accepted: int
    draft_us: float
    verify_us: float

    @property
    def drafted(self) -> int:
        """Drafts verified in this step."""
        return int(self.tokens.shape[0]) - 1


@dataclass
class SpecRun:
    """A speculative run in memory: one row per verify-pass slot (position-major like a trace)."""

    meta: SpecRunMeta
    steps: pl.DataFrame  # seq, step, pos0, drafted, accepted, draft_us, verify_us
    slot_start: np.ndarray  # (steps + 1,) offsets of each step's first slot row
    token: np.ndarray  # (P,) int32
    target_token: np.ndarray  # (P,) int32
    experts: np.ndarray  # (P, L, K)
    weights: np.ndarray | None = None

    def step_experts(self, i: int) -> np.ndarray:
        """Routing of verify step i: (drafted + 1, L, K)."""
        return self.experts[self.slot_start[i] : self.slot_start[i + 1]]


# ---- writing --------------------------------------------------------------------------------


class SpecRunWriter:
    """Streams verify steps into a speculative-run file; it appears only when closed cleanly, or
    with `keep_on_error`, holding the sequences completed (`end_sequence`) before a failure.

    The sequence infos of the metadata are known only at the end, so rows are buffered per
    completed sequence and the file is written on close (runs are small: steps × slots × layers).
    """

    def __init__(self, path: str | os.PathLike[str], meta: SpecRunMeta, with_weights: bool, keep_on_error: bool = False) -> None:
        self.path = Path(path)
        check_writable(self.path)
        self.meta = meta
        self.with_weights = with_weights
        self.keep_on_error = keep_on_error
        self._done: list[tuple[int, list[VerifyStep], SequenceInfo]] = []
        self._open: list[VerifyStep] = []

    def __enter__(self) -> SpecRunWriter:
        return self

    def append_step(self, step: VerifyStep) -> None:
        """Add the next verify step of the current sequence."""
        if (step.weights is None) == self.with_weights:
            raise InputError(f"{self.path}: appended step's weights do not match the schema")
        self._open.append(step)

    def end_sequence(self, info: SequenceInfo) -> None:
        """Mark the current sequence complete (kept even if the run later fails)."""
        self._done.append((len(self._done), self._open, info))
        self._open = []

    @property
    def sequences_done(self) -> int:
        """Sequences completed so far."""
        return len(self._done)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None and not (self.keep_on_error and self._done):
            return
        meta = dataclasses.replace(self.meta, sequences=tuple(info for _, _, info in self._done))
        schema = specrun_schema(meta, self.with_weights)
        with atomic_path(self.path) as tmp, pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, schema) as writer:
            for seq, steps, _ in self._done:
                if steps:
                    writer.write_batch(_steps_to_batch(schema, meta, seq, steps))


def _steps_to_batch(schema: pa.Schema, meta: SpecRunMeta, seq: int, steps: list[VerifyStep]) -> pa.RecordBatch:
    layers = np.asarray(meta.geometry.moe_layers, np.uint16)
    n_layers, k = len(layers), meta.geometry.top_k
    slots = np.array([s.drafted + 1 for s in steps])
    rows_per_step = slots * n_layers

    def per_step(values: list[float] | list[int], dtype: type) -> pa.Array:
        return pa.array(np.repeat(np.asarray(values, dtype), rows_per_step))

    def per_slot(arrays: list[np.ndarray], dtype: type) -> pa.Array:
        return pa.array(np.repeat(np.concatenate(arrays).astype(dtype), n_layers))

    experts = np.concatenate([s.experts for s in steps]).astype(meta.geometry.expert_id_type.to_pandas_dtype())
    columns = {
        "seq": pa.array(np.full(int(rows_per_step.sum()), seq, np.uint32)),
        "step": per_step(list(range(len(steps))), np.uint32),
        "slot": per_slot([np.arange(n) for n in slots], np.uint16),
        "pos": per_slot([s.pos0 + np.arange(s.drafted + 1) for s in steps], np.uint32),
        "layer": pa.array(np.tile(layers, int(slots.sum()))),
        "token": per_slot([s.tokens for s in steps], np.int32),
        "target_token": per_slot([s.target_tokens for s in steps], np.int32),
        "experts": pa.FixedSizeListArray.from_arrays(pa.array(experts.reshape(-1)), k),
        "drafted": per_step([s.drafted for s in steps], np.uint16),
        "accepted": per_step([s.accepted for s in steps], np.uint16),
        "draft_us": per_step([s.draft_us for s in steps], np.float64),
        "verify_us": per_step([s.verify_us for s in steps], np.float64),
    }
    if "weights" in schema.names:
        weights = np.concatenate([s.weights for s in steps]).astype(np.float32)  # type: ignore[misc]
        columns["weights"] = pa.FixedSizeListArray.from_arrays(pa.array(weights.reshape(-1)), k)
    return pa.RecordBatch.from_arrays([columns[f.name] for f in schema], schema=schema)


# ---- reading and validation -----------------------------------------------------------------


def _expected_type(name: str, meta: SpecRunMeta) -> pa.DataType:
    k = meta.geometry.top_k
    types: dict[str, pa.DataType] = {
        "seq": pa.uint32(),
        "step": pa.uint32(),
        "slot": pa.uint16(),
        "pos": pa.uint32(),
        "layer": pa.uint16(),
        "token": pa.int32(),
        "target_token": pa.int32(),
        "experts": pa.list_(meta.geometry.expert_id_type, k),
        "weights": pa.list_(pa.float32(), k),
        "drafted": pa.uint16(),
        "accepted": pa.uint16(),
        "draft_us": pa.float64(),
        "verify_us": pa.float64(),
    }
    return types[name]


REQUIRED_COLUMNS = (
    "seq", "step", "slot", "pos", "layer", "token", "target_token", "experts", "drafted", "accepted", "draft_us", "verify_us",
)  # fmt: skip


def _read_table(path: Path) -> tuple[SpecRunMeta, pa.Table]:
    reader = open_ipc_file(path, "speculative-run")
    try:
        table = reader.read_all()
        table.validate(full=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        first = first_line(exc)
        raise InputError(f"{path}: unreadable Arrow data ({first})") from None
    metadata = reader.schema.metadata or {}
    meta_json = checked_format(metadata, str(path), SPECRUN_FORMAT, SPECRUN_FORMAT_VERSION, ("speculative run", "speculative-run", ""))
    meta = SpecRunMeta.from_json(meta_json, str(path))
    for name in (*REQUIRED_COLUMNS, "weights"):
        if name not in table.schema.names:
            if name == "weights":
                continue
            raise InputError(f"{path}: column '{name}' is missing")
        if table.schema.field(name).type != _expected_type(name, meta):
            raise InputError(f"{path}: column '{name}' has type {table.schema.field(name).type}, expected {_expected_type(name, meta)}")
        if table.column(name).null_count:
            raise InputError(f"{path}: column '{name}' holds nulls")
    return meta, table


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).combine_chunks().to_numpy(zero_copy_only=False)


def _fail(path: Path, row: int, field_name: str, why: str) -> InputError:
    return InputError(f"{path}: row {row}: field '{field_name}' {why}")


def read_spec_run(path: str | os.PathLike[str]) -> SpecRun:
    """Read and fully validate a speculative run."""
    path = Path(path)
    meta, table = _read_table(path)
    g = meta.geometry
    n_layers, k = len(g.moe_layers), g.top_k
    n_rows = table.num_rows
    if n_rows == 0:
        raise InputError(f"{path}: the speculative run has no rows")
    cols = {name: _column(table, name) for name in REQUIRED_COLUMNS if name != "experts"}
    expected_layer = np.tile(np.asarray(g.moe_layers, np.uint16), n_rows // n_layers + 1)[:n_rows]
    bad = np.flatnonzero(cols["layer"] != expected_layer)
    if bad.size or n_rows % n_layers:
        row = int(bad[0]) if bad.size else n_rows - 1
        raise _fail(path, row, "layer", f"is {cols['layer'][row]}: every pass slot needs the MoE layers {list(g.moe_layers)} in order")
    for name in ("seq", "step", "slot", "pos", "token", "target_token", "drafted", "accepted", "draft_us", "verify_us"):
        values = cols[name].reshape(-1, n_layers)
        mismatch = np.flatnonzero((values != values[:, :1]).any(axis=1))
        if mismatch.size:
            raise _fail(path, int(mismatch[0]) * n_layers, name, "differs between the MoE layers of one pass slot")
    slot_cols = {name: values[::n_layers] for name, values in cols.items()}
    experts = table.column("experts").combine_chunks().flatten().to_numpy().reshape(-1, n_layers, k)
    weights = None
    if "weights" in table.schema.names:
        weights = table.column("weights").combine_chunks().flatten().to_numpy().reshape(-1, n_layers, k)
    slot_start = _check_steps(path, meta, slot_cols, n_layers)
    _check_routing(path, g, experts, weights, n_layers)
    first = slot_start[:-1]
    steps = pl.DataFrame(
        {
            "seq": slot_cols["seq"][first],
            "step": slot_cols["step"][first],
            "pos0": slot_cols["pos"][first],
            "drafted": slot_cols["drafted"][first],
            "accepted": slot_cols["accepted"][first],
            "draft_us": slot_cols["draft_us"][first],
            "verify_us": slot_cols["verify_us"][first],
        }
    )
    return SpecRun(meta, steps, slot_start, slot_cols["token"], slot_cols["target_token"], experts, weights)


def _check_steps(path: Path, meta: SpecRunMeta, c: dict[str, np.ndarray], n_layers: int) -> np.ndarray:
    """Check the (seq, step, slot) structure and positions; return each step's first slot row."""
    seq, step, slot = c["seq"].astype(np.int64), c["step"].astype(np.int64), c["slot"].astype(np.int64)
    starts = np.flatnonzero(slot == 0)
    if starts.size == 0 or starts[0] != 0:
        raise _fail(path, 0, "slot", "must start at 0 in every verify step")
    slot_start = np.append(starts, seq.shape[0])
    lengths = np.diff(slot_start)
    first = slot_start[:-1]
    drafted = c["drafted"][first].astype(np.int64)
    bad = np.flatnonzero(lengths != drafted + 1)
    if bad.size:
        i = int(first[bad[0]])
        raise _fail(path, i * n_layers, "drafted", f"is {drafted[bad[0]]} but the verify pass has {lengths[bad[0]]} slots")
    inner = np.arange(seq.shape[0]) - np.repeat(first, lengths)
    bad = np.flatnonzero((slot != inner) | (seq != np.repeat(seq[first], lengths)) | (step != np.repeat(step[first], lengths)))
    if bad.size:
        raise _fail(path, int(bad[0]) * n_layers, "slot", "rows are not sorted by (seq, step, slot, layer) with slots 0..drafted")
    accepted = c["accepted"][first].astype(np.int64)
    bad = np.flatnonzero(accepted > drafted)
    if bad.size:
        raise _fail(path, int(first[bad[0]]) * n_layers, "accepted", f"is {accepted[bad[0]]}, more than drafted ({drafted[bad[0]]})")
    pos = c["pos"].astype(np.int64)
    bad = np.flatnonzero(pos != np.repeat(pos[first], lengths) + inner)
    if bad.size:
        raise _fail(path, int(bad[0]) * n_layers, "pos", "must be the step's first position plus the slot")
    step_seq, step_no, pos0 = seq[first], step[first], pos[first]
    new_seq = np.diff(step_seq, prepend=-1) != 0
    seq_first = np.maximum.accumulate(np.where(new_seq, np.arange(step_seq.shape[0]), 0))
    bad = np.flatnonzero((np.diff(step_seq, prepend=0) < 0) | (step_no != np.arange(step_seq.shape[0]) - seq_first))
    if bad.size:
        raise _fail(path, int(first[bad[0]]) * n_layers, "step", "steps must count 0, 1, 2, ... within each sequence, sequences in order")
    if step_seq.max() >= len(meta.sequences):
        raise _fail(path, 0, "seq", f"reaches {step_seq.max()} but the metadata lists {len(meta.sequences)} sequences")
    prompt = np.array([s.prompt_tokens for s in meta.sequences], np.int64)
    after_previous = np.concatenate([[0], pos0[:-1] + accepted[:-1] + 1])
    expected_pos0 = np.where(new_seq, prompt[step_seq], after_previous)
    bad = np.flatnonzero(pos0 != expected_pos0)
    if bad.size:
        i = int(bad[0])
        why = f"step starts at {pos0[i]}, expected {expected_pos0[i]} (after the prompt or the previous step)"
        raise _fail(path, int(first[i]) * n_layers, "pos", why)
    for name in ("draft_us", "verify_us"):
        values = c[name][first]
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
        if bad.size:
            raise _fail(path, int(first[bad[0]]) * n_layers, name, f"is {values[bad[0]]}, expected a finite time >= 0")
    return slot_start


def _check_routing(path: Path, g: TraceGeometry, experts: np.ndarray, weights: np.ndarray | None, n_layers: int) -> None:
    flat = experts.reshape(-1, g.top_k)
    bad = np.flatnonzero((flat >= g.experts).any(axis=1))
    if bad.size:
        raise _fail(path, int(bad[0]), "experts", f"has id {int(flat[bad[0]].max())}, but the model has {g.experts} experts")
    ordered = np.sort(flat, axis=1)
    bad = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if bad.size:
        raise _fail(path, int(bad[0]), "experts", f"repeats an expert within one top-k: {flat[bad[0]].tolist()}")
    if weights is not None and not np.isfinite(weights).all():
        row = int(np.flatnonzero(~np.isfinite(weights.reshape(-1, g.top_k)).all(axis=1))[0])
        raise _fail(path, row, "weights", "is not finite")


def spec_run_summary(run: SpecRun) -> dict[str, Any]:
    """Headline numbers: steps, mean accepted, tokens per step, mean draft and verify times, and the
    measured speedup = plain one-token decode time / ((Σ draft_us + Σ verify_us) / Σ (accepted + 1))."""
    s = run.steps
    tokens = float((s["accepted"].cast(pl.Float64) + 1.0).sum())
    spec_us_per_token = float(s["draft_us"].sum() + s["verify_us"].sum()) / tokens
    plain = [q.plain_decode_us for q in run.meta.sequences if math.isfinite(q.plain_decode_us)]
    plain_us = float(np.mean(plain)) if plain else float("nan")
    return {
        "model": run.meta.geometry.model,
        "draft_model": run.meta.draft_model,
        "draft_len": run.meta.draft_len,
        "sequences": len(run.meta.sequences),
        "steps": s.height,
        "accepted_mean": float(s["accepted"].cast(pl.Float64).mean()),  # type: ignore[arg-type]
        "tokens_per_step": tokens / s.height,
        "draft_us_mean": float(s["draft_us"].mean()),  # type: ignore[arg-type]
        "verify_us_mean": float(s["verify_us"].mean()),  # type: ignore[arg-type]
        "plain_decode_us": plain_us,
        "speedup": plain_us / spec_us_per_token,
    }


def _spec_run_counts(path: Path) -> tuple[list[np.ndarray], int] | None:
    """Accepted counts per sequence and the draft length of a speculative-run file (contract 2);
    None when `path` is not one."""
    try:
        metadata = ipc.open_file(pa.memory_map(str(path), "r")).schema.metadata or {}
    except (pa.ArrowInvalid, OSError):
        return None
    if metadata.get(META_FORMAT_KEY) != SPECRUN_FORMAT.encode():
        return None
    try:
        run = read_spec_run(path)
    except InputError as exc:
        raise FieldError("file", str(exc)) from None
    return [g["accepted"].to_numpy() for g in run.steps.partition_by("seq", maintain_order=True)], run.meta.draft_len


def read_accepted_counts(path: Path) -> tuple[list[np.ndarray], int | None]:
    """Accepted counts per sequence from a file: a speculative run (contract 2, Arrow), a .npy
    (one sequence), or a CSV/Parquet/Arrow table with an `accepted` column (optional `seq` to
    split sequences, `drafted` for the draft length)."""
    if not path.is_file():
        raise FieldError("file", f"no such file {path}")
    reader = {".csv": pl.read_csv, ".parquet": pl.read_parquet, ".arrow": pl.read_ipc}.get(path.suffix)
    if path.suffix != ".npy" and reader is None:
        raise FieldError("file", f"{path} must be .npy, .csv, .parquet or .arrow")
    if path.suffix == ".arrow":
        spec_run = _spec_run_counts(path)
        if spec_run is not None:
            return spec_run  # type: ignore[return-value]
    try:
        if reader is None:
            counts = np.asarray(np.load(path, allow_pickle=False))
            if counts.ndim != 1:
                raise FieldError("file", f"{path} must hold one sequence of accepted counts (a 1-D array), got shape {counts.shape}")
            return [counts], None
        frame = reader(path)
    except (OSError, ValueError, pl.exceptions.PolarsError) as exc:
        raise FieldError("file", f"cannot read {path} ({first_line(exc)})") from None
    if "accepted" not in frame.columns:
        raise FieldError("file", f"{path} has no column 'accepted'")
    drafted = None
    if "drafted" in frame.columns and frame.height:
        if not frame["drafted"].dtype.is_integer() or frame["drafted"].null_count():
            raise FieldError("file", f"{path}: column 'drafted' must hold integer draft lengths, got {frame['drafted'].dtype}")
        drafted = int(frame["drafted"].max())  # type: ignore[arg-type]
    if "seq" in frame.columns:
        return [g["accepted"].to_numpy() for g in frame.partition_by("seq", maintain_order=True)], drafted
    return [frame["accepted"].to_numpy()], drafted
