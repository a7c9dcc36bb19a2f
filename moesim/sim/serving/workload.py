"""The simulated workload: request lengths, arrivals, and where each request sits in the trace.

- Lengths: fixed prompt and output tokens, or rows of a request file (CSV, Parquet or JSONL
  with `prompt_tokens` and `output_tokens`), request r taking row r mod rows.
- Arrivals: a closed loop (`concurrency` requests in flight; a finished request is replaced
  at once), or an open loop: Poisson at `rate_per_s` (exponential gaps from a seeded stream),
  `gamma` at `rate_per_s` with a coefficient of variation `cv` of its gaps (bursty above 1;
  `cv` = 1 is Poisson's law from another stream), or `replay`: the timestamps of a file's
  `arrival_us` column (each gap the difference of consecutive times, the first from t = 0).
- Trace windows: request r decodes sequence s = r mod S of the trace, from the sequence's first
  generated position (after its prompt positions; position 0 if it has none) shifted by
  (r div S) · offset_stride within the generated part. A verify window never crosses the
  sequence's end: a pass that would is moved back to the start of the generated part, and
  the request counts one wrap.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import polars as pl

from moesim.errors import first_line
from moesim.fields import FieldError, require
from moesim.tracegen.formats.trace import Trace

_STREAM_ARRIVALS = 0xA221
_STREAM_GAMMA = 0xA222


@dataclass(frozen=True)
class Workload:
    """Request lengths: fixed, or from `file`."""

    prompt_tokens: int = 128
    output_tokens: int = 256
    file: Path | None = None
    prompts: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())
    outputs: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if self.file is None:
            require(self.prompt_tokens >= 0, "prompt_tokens", f"must be >= 0, got {self.prompt_tokens}")
            require(self.output_tokens >= 1, "output_tokens", f"must be >= 1, got {self.output_tokens}")
            prompts, outputs = (self.prompt_tokens,), (self.output_tokens,)
        else:
            prompts, outputs = read_request_file(self.file)
        object.__setattr__(self, "prompts", prompts)
        object.__setattr__(self, "outputs", outputs)

    def lengths(self, request_id: int) -> tuple[int, int]:
        """(prompt tokens, output tokens) of request `request_id`."""
        row = request_id % len(self.prompts)
        return self.prompts[row], self.outputs[row]


def _read_table(path: Path) -> pl.DataFrame:
    """A CSV, Parquet or JSONL file as a frame (FieldError of key 'file' when it cannot be read)."""
    if not path.is_file():
        raise FieldError("file", f"no such file {path}")
    reader = {".csv": pl.read_csv, ".parquet": pl.read_parquet, ".jsonl": pl.read_ndjson}.get(path.suffix)
    if reader is None:
        raise FieldError("file", f"{path} must be .csv, .parquet or .jsonl")
    try:
        return reader(path)
    except (OSError, ValueError, pl.exceptions.PolarsError) as exc:
        raise FieldError("file", f"cannot read {path} ({first_line(exc)})") from None


def read_request_file(path: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prompt and output lengths from a CSV, Parquet or JSONL file."""
    frame = _read_table(path)
    columns = []
    for name, minimum in (("prompt_tokens", 0), ("output_tokens", 1)):
        if name not in frame.columns:
            raise FieldError("file", f"{path} has no column '{name}'")
        values = frame[name]
        if not values.dtype.is_integer() or values.null_count() or frame.height == 0:
            raise FieldError("file", f"{path}: column '{name}' must hold integers (no nulls, at least one row)")
        bad = np.flatnonzero(values.to_numpy() < minimum)
        if bad.size:
            raise FieldError("file", f"{path}: row {int(bad[0])} column '{name}' must be >= {minimum}, got {values[int(bad[0])]}")
        columns.append(tuple(int(v) for v in values.to_list()))
    return columns[0], columns[1]


@dataclass(frozen=True)
class Arrivals:
    """How requests arrive: a closed loop at `concurrency`, or an open loop (Poisson or gamma at
    `rate_per_s`, or the timestamps of `file` replayed; see the module docstring)."""

    KINDS: ClassVar[tuple[str, ...]] = ("closed", "poisson", "gamma", "replay")
    kind: str = "closed"
    concurrency: int = 1
    rate_per_s: float | None = None
    cv: float = 1.0
    file: Path | None = None
    times_us: tuple[float, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        require(self.kind in self.KINDS, "kind", f"unknown arrival kind '{self.kind}' (known: {', '.join(self.KINDS)})")
        require(self.concurrency >= 1, "concurrency", f"must be >= 1, got {self.concurrency}")
        require(math.isfinite(self.cv) and self.cv > 0, "cv", f"must be > 0, got {self.cv}")
        if self.kind in ("poisson", "gamma"):
            rate = self.rate_per_s
            good = rate is not None and math.isfinite(rate) and rate > 0
            require(good, "rate_per_s", f"{self.kind} arrivals need a rate > 0, got {rate}")
        if self.kind == "replay":
            require(self.file is not None, "file", "replayed arrivals need a file with an 'arrival_us' column")
            object.__setattr__(self, "times_us", read_arrival_file(self.file))  # type: ignore[arg-type]

    @property
    def open(self) -> bool:
        """Whether requests arrive on their own (not replaced as they finish)."""
        return self.kind != "closed"

    @property
    def limit(self) -> int:
        """The most requests the stream can issue (0: unbounded)."""
        return len(self.times_us) if self.kind == "replay" else 0

    def gaps_us(self, seed: int, block: int = 4096) -> Iterator[float]:
        """The inter-arrival gaps (µs) of an open loop, the first from t = 0, drawn in blocks (a
        replayed file's gaps end with its rows)."""
        if self.kind == "replay":
            times = np.array(self.times_us)
            yield from np.diff(times, prepend=0.0).tolist()
            return
        mean = 1e6 / self.rate_per_s  # type: ignore[operator]
        if self.kind == "poisson":
            rng = np.random.default_rng([seed, _STREAM_ARRIVALS])
            while True:
                yield from rng.exponential(mean, block).tolist()
        rng = np.random.default_rng([seed, _STREAM_GAMMA])
        shape = 1.0 / (self.cv * self.cv)
        while True:
            yield from rng.gamma(shape, mean / shape, block).tolist()


def read_arrival_file(path: Path) -> tuple[float, ...]:
    """The `arrival_us` column of a CSV, Parquet or JSONL file: finite, >= 0, not decreasing."""
    frame = _read_table(path)
    if "arrival_us" not in frame.columns:
        raise FieldError("file", f"{path} has no column 'arrival_us'")
    values = frame["arrival_us"]
    if not values.dtype.is_numeric() or values.null_count() or frame.height == 0:
        raise FieldError("file", f"{path}: column 'arrival_us' must hold numbers (no nulls, at least one row)")
    times = values.cast(pl.Float64).to_numpy()
    bad = np.flatnonzero(~np.isfinite(times) | (times < 0) | (np.diff(times, prepend=0.0) < 0))
    if bad.size:
        row = int(bad[0])
        raise FieldError("file", f"{path}: row {row} column 'arrival_us' must be finite, >= 0 and >= the row before, got {times[row]}")
    return tuple(times.tolist())


@dataclass(frozen=True)
class TraceWindows:
    """Where each request decodes in the trace (see the module docstring)."""

    decode_start: np.ndarray  # per sequence: first generated position (local)
    length: np.ndarray  # per sequence: positions
    offset_stride: int = 0

    @classmethod
    def from_trace(cls, trace: Trace, offset_stride: int, window_max: int, source: str) -> TraceWindows:
        """Per sequence, the generated part; every one must hold a window of `window_max` tokens."""
        starts = trace.seq_starts
        length = np.diff(starts)
        decode_start = np.zeros_like(length)
        for s in range(trace.n_seqs):
            generated = np.flatnonzero(~trace.is_prompt[starts[s] : starts[s + 1]])
            decode_start[s] = generated[0] if generated.size else 0
        short = np.flatnonzero(length - decode_start < window_max)
        if short.size:
            s = int(short[0])
            raise FieldError(
                "path",
                f"{source}: sequence {s} has {int(length[s] - decode_start[s])} generated positions, "
                f"fewer than the largest verify window ({window_max} tokens)",
            )
        return cls(decode_start=decode_start, length=length, offset_stride=offset_stride)

    def place(self, request_id: int) -> tuple[int, int, int, int]:
        """(sequence, first window position, start of the generated part, sequence end)."""
        n_seqs = self.length.size
        s = request_id % n_seqs
        lo, hi = int(self.decode_start[s]), int(self.length[s])
        offset = ((request_id // n_seqs) * self.offset_stride) % (hi - lo)
        return s, lo + offset, lo, hi
