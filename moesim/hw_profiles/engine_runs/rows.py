"""The normalised rows every engine-output importer produces, in the column layout of the shared
engine-overheads tables: plain decoding (`DecodeStep`, as `dense_decode_steps.csv`) and
speculative runs (`SpecRun`, as `dense_speculative_runs.csv`).

A row keeps the number the tool printed (`value` in its `unit`, as the shared table does) and
says how many target forwards it covers, so a fit reads one time per forward from any tool:

    unit                      time per forward (µs)
    t/s                       tokens_per_pass · 1e6 / value     (one sequence: llama-bench, llama timings)
    t/s (batch total)         batch · 1e6 / value               (all sequences' tokens: mlx_lm.benchmark)
    TPOT ms                   1000 · value                      (plain decoding: one token per step)
    ms per step               1000 · value                      (SGLang bench_one_batch's median step)
    s (batch latency)         the whole batch: a prefill of batch · input_len tokens, then
                              output_len − 1 decode forwards (vLLM bench latency); no single step

A speculative run's speedup is its tokens per second over its baseline's (or the baseline's
TPOT over its own), read from `spec_value`/`baseline_value` in `metric`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from typing import Any

from moesim.errors import InputError, first_line
from moesim.fields import Checked, option

NA = "NA"
DECODE_COLUMNS = (
    "source_url",
    "engine",
    "engine_version",
    "device",
    "tp",
    "cuda_graphs",
    "model",
    "dtype",
    "batch",
    "input_len",
    "output_len",
    "value",
    "unit",
    "notes",
    "tokens_per_pass",
    "raw_file",
)
SPEC_COLUMNS = (
    "source_url",
    "engine",
    "device",
    "target_model",
    "draft",
    "draft_len",
    "acceptance",
    "tokens_per_s",
    "baseline_tokens_per_s",
    "batch",
    "notes",
    "engine_version",
    "tp",
    "input_len",
    "output_len",
    "concurrency",
    "spec_value",
    "baseline_value",
    "metric",
    "raw_file",
)
STEP_UNITS = ("t/s", "t/s (batch total)", "TPOT ms", "ms per step")
LATENCY_UNIT = "s (batch latency)"
RATE_METRICS = ("t/s", "t/s (batch total)")
TIME_METRICS = ("TPOT ms",)
MAX_ROWS = 100_000
MAX_FILE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class RunContext(Checked):
    """What an output may not say itself, given by the user (None: not given): the engine's
    version, the device, the model, tensor parallelism, CUDA graphs, and a run's shape. What an
    output prints wins over the command's options; `FILE@key=value` wins over both."""

    engine_version: str | None = option(None, "The engine's version (vllm --version, llama.cpp's build), where the output does not say it.")
    device: str | None = option(None, "The device the runs ran on, where the output does not say it.")
    model: str | None = None
    dtype: str | None = None
    tp: int | None = option(None, "Tensor-parallel GPUs of the runs, where the output does not say it.", ge=1)
    cuda_graphs: str | None = option(None, "Whether the runs captured CUDA graphs (yes, no), where the output does not say it.")
    batch: int | None = option(None, "Sequences decoded together, where the output does not say it (vllm bench latency).", ge=1)
    input_len: int | None = option(None, "Prompt tokens per sequence, where the output does not say it.", ge=1)
    output_len: int | None = option(None, "Generated tokens per sequence, where the output does not say it.", ge=2)
    draft: str | None = option(None, "The draft (model or head) of the speculative runs, as a label.")
    draft_len: int | None = option(None, "Draft tokens per speculative iteration, where the output does not say it.", ge=1)

    def merged(self, other: RunContext) -> RunContext:
        """This context with every field `other` gives replaced by it."""
        return replace(self, **{f.name: v for f in fields(other) if (v := getattr(other, f.name)) is not None})

    def step_fields(self, source_url: str, engine: str) -> dict[str, str]:
        """A decode step's source, engine and the context's version, device, model and dtype (NA where not given)."""
        return {
            "source_url": source_url,
            "engine": engine,
            "engine_version": self.engine_version or NA,
            "device": self.device or NA,
            "model": self.model or NA,
            "dtype": self.dtype or NA,
        }


@dataclass(frozen=True)
class DecodeStep:
    """Plain decoding (or one forward of several tokens) as a tool measured it."""

    source_url: str
    engine: str
    engine_version: str
    device: str
    model: str
    dtype: str
    batch: int
    value: float
    unit: str
    tokens_per_pass: int = 1
    input_len: int | None = None
    output_len: int | None = None
    tp: int = 1
    cuda_graphs: str = NA
    notes: str = ""
    raw_file: str = ""

    def __post_init__(self) -> None:
        if self.unit not in (*STEP_UNITS, LATENCY_UNIT):
            raise InputError(f"{self.source_url}: unit {self.unit!r} is not one of {', '.join((*STEP_UNITS, LATENCY_UNIT))}")
        positive(self.value, self.source_url, "value")
        for name in ("batch", "tokens_per_pass", "tp"):
            if getattr(self, name) < 1:
                raise InputError(f"{self.source_url}: field '{name}' must be >= 1, got {getattr(self, name)}")
        if self.unit == LATENCY_UNIT and (not self.input_len or not self.output_len or self.output_len < 2):
            raise InputError(f"{self.source_url}: a batch latency needs input_len >= 1 and output_len >= 2")

    def forward_us(self) -> float | None:
        """Time per target forward (µs) as the unit gives it; None for a whole-batch latency."""
        return step_us(self.value, self.unit, self.batch, self.tokens_per_pass)

    def record(self) -> dict[str, str]:
        """The row in `DECODE_COLUMNS`, unknowns as NA."""
        return {name: cell(getattr(self, name)) for name in DECODE_COLUMNS}


@dataclass(frozen=True)
class SpecRun:
    """A speculative run as a tool measured it, with its plain-decoding baseline where one was given."""

    source_url: str
    engine: str
    engine_version: str
    device: str
    target_model: str
    draft: str
    draft_len: int | None
    batch: int
    spec_value: float
    metric: str
    accepted_per_drafted: float | None = None
    mean_accepted_length: float | None = None
    baseline_value: float | None = None
    tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    tp: int = 1
    input_len: int | None = None
    output_len: int | None = None
    concurrency: int | None = None
    notes: str = ""
    raw_file: str = ""

    def __post_init__(self) -> None:
        if self.metric not in (*RATE_METRICS, *TIME_METRICS):
            raise InputError(f"{self.source_url}: metric {self.metric!r} is not one of {', '.join((*RATE_METRICS, *TIME_METRICS))}")
        positive(self.spec_value, self.source_url, "spec_value")
        if self.baseline_value is not None:
            positive(self.baseline_value, self.source_url, "baseline_value")
        if self.accepted_per_drafted is not None and not 0.0 <= self.accepted_per_drafted <= 1.0:
            raise InputError(f"{self.source_url}: field 'acceptance' must be in 0..1 accepted per drafted, got {self.accepted_per_drafted}")
        if self.mean_accepted_length is not None and not self.mean_accepted_length >= 1.0:
            raise InputError(f"{self.source_url}: field 'acceptance' (mean accepted length) must be >= 1, got {self.mean_accepted_length}")
        if self.draft_len is not None and self.draft_len < 1:
            raise InputError(f"{self.source_url}: field 'draft_len' must be >= 1, got {self.draft_len}")

    @property
    def acceptance(self) -> str:
        """The acceptance as the shared table writes it: 'AL x' and/or 'p% accepted/drafted'."""
        parts = [f"AL {self.mean_accepted_length:.4g}"] if self.mean_accepted_length is not None else []
        parts += [f"{100 * self.accepted_per_drafted:.4g}% accepted/drafted"] if self.accepted_per_drafted is not None else []
        return "; ".join(parts) or NA

    def speedup(self) -> float | None:
        """Spec over baseline: value / baseline for rates, baseline / value for times; None without a baseline."""
        if self.baseline_value is None:
            return None
        return self.spec_value / self.baseline_value if self.metric in RATE_METRICS else self.baseline_value / self.spec_value

    def tokens_per_iteration(self) -> float | None:
        """τ, tokens committed per target forward: the mean accepted length, else 1 + a·k."""
        if self.mean_accepted_length is not None:
            return self.mean_accepted_length
        if self.accepted_per_drafted is not None and self.draft_len is not None:
            return 1.0 + self.accepted_per_drafted * self.draft_len
        return None

    def with_baseline(self, baseline: DecodeStep) -> SpecRun:
        """The run with a plain-decoding row of the same setup as its baseline (in the run's metric)."""
        per_token_us = forward_per_token_us(baseline)
        if self.metric in RATE_METRICS:
            scale = self.batch if self.metric == "t/s (batch total)" else 1
            value = scale * 1e6 / per_token_us
        else:
            value = per_token_us / 1000.0
        note = f"baseline: {baseline.source_url}"
        return replace(self, baseline_value=value, notes="; ".join(filter(None, (self.notes, note))))

    def record(self) -> dict[str, str]:
        """The row in `SPEC_COLUMNS`, unknowns as NA."""
        return {name: cell(getattr(self, name)) for name in SPEC_COLUMNS}


def rate_run(
    target_model: str, context: RunContext, rate: float, accepted_per_drafted: float | None, notes: str, shared: dict[str, Any]
) -> SpecRun:
    """A speculative run measured as its generation rate: its value and its tokens/s both the rate (t/s)."""
    return SpecRun(
        target_model=target_model,
        draft=context.draft or NA,
        draft_len=context.draft_len,
        spec_value=rate,
        metric="t/s",
        accepted_per_drafted=accepted_per_drafted,
        tokens_per_s=rate,
        notes=notes,
        **shared,
    )


def rate_step(context: RunContext, rate: float, notes: str, shared: dict[str, Any], **fields: Any) -> DecodeStep:
    """A decode step measured as one sequence's generation rate (t/s), of the context's model and dtype."""
    return DecodeStep(model=context.model or NA, dtype=context.dtype or NA, value=rate, unit="t/s", notes=notes, **fields, **shared)


def step_us(value: float, unit: str, batch: int, tokens_per_pass: int = 1) -> float | None:
    """Time per forward (µs) of a value in a step unit (the module's table); None for a batch latency."""
    if unit == "t/s":
        return tokens_per_pass * 1e6 / value
    if unit == "t/s (batch total)":
        return batch * 1e6 / value
    if unit in ("TPOT ms", "ms per step"):
        return 1000.0 * value
    return None


def forward_per_token_us(step: DecodeStep) -> float:
    """One sequence's time per generated token of plain decoding (µs): the step time, or a batch
    latency spread over its output tokens (its prefill included)."""
    forward = step.forward_us()
    if forward is not None:
        return forward / step.tokens_per_pass
    return step.value * 1e6 / float(step.output_len or 1)


def positive(value: float, where: str, name: str) -> None:
    """A finite number > 0, or one line naming the field."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise InputError(f"{where}: field '{name}' must be a finite number > 0, got {value!r}")


def cell(value: object) -> str:
    """A CSV cell: NA for unknown, numbers as printed."""
    if value is None or value == "":
        return NA
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def pair_baselines(runs: list[SpecRun], steps: list[DecodeStep]) -> list[SpecRun]:
    """Each speculative run without a baseline paired with the plain decoding of the same engine
    (its first word: llama-bench names the backend), version, device, model and batch (one token
    per pass); of several, the one whose mean context is nearest the run's."""
    paired = []
    for run in runs:
        if run.baseline_value is None:
            key = (run.engine.split()[0], run.engine_version, run.device, run.target_model, run.batch, 1)
            same = [s for s in steps if (s.engine.split()[0], s.engine_version, s.device, s.model, s.batch, s.tokens_per_pass) == key]
            context = float(run.input_len or 0) + float(run.output_len or 0) / 2
            nearest = min(same, key=lambda s: abs(float(s.input_len or 0) + float(s.output_len or 0) / 2 - context), default=None)
            run = run.with_baseline(nearest) if nearest is not None else run
        paired.append(run)
    return paired


@dataclass(frozen=True)
class EngineRows:
    """What one or more outputs hold: plain-decoding rows and speculative runs."""

    steps: tuple[DecodeStep, ...] = ()
    runs: tuple[SpecRun, ...] = ()

    def __add__(self, other: EngineRows) -> EngineRows:
        return EngineRows(self.steps + other.steps, self.runs + other.runs)

    def __len__(self) -> int:
        return len(self.steps) + len(self.runs)


def json_document(text: str, where: str) -> Any:
    """A JSON document, or one line naming the file and where it stops parsing."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InputError(f"{where}: not JSON ({first_line(exc)[:80]})") from None


def json_lines(text: str, where: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-empty line of a JSONL file."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            record = json_document(line, f"{where}: line {number}")
            if not isinstance(record, dict):
                raise InputError(f"{where}: line {number}: expected a JSON object, got {type(record).__name__}")
            records.append((number, record))
    return records


def number(record: dict[str, Any], key: str, where: str, *, integer: bool = False, required: bool = True, zero: bool = False) -> Any:
    """A record's finite number > 0 (>= 0 with `zero`; an integer when `integer`); None when absent and not required."""
    value = record.get(key)
    if value is None:
        if required:
            raise InputError(f"{where}: field '{key}' is missing")
        return None
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and (value > 0 or (zero and value == 0))
    if not ok or (integer and float(value) != int(value)):
        bound = ">= 0" if zero else (">= 1" if integer else "> 0")
        kind = f"an integer {bound}" if integer else f"a finite number {bound}"
        raise InputError(f"{where}: field '{key}' must be {kind}, got {value!r}")
    return int(value) if integer else float(value)


def require(value: Any, where: str, field: str, option: str) -> Any:
    """A value the output does not give and the user must: one line naming the option otherwise."""
    if value is None:
        raise InputError(f"{where}: field '{field}' is not in this output: give {option}")
    return value


@dataclass(frozen=True)
class ServingRecord:
    """What every row of a serving benchmark's record shares: requests, concurrency, batch, mean TPOT, row fields."""

    completed: int
    concurrency: int | None
    batch: int
    tpot_ms: float
    shared: dict[str, Any]

    @classmethod
    def read(cls, record: dict[str, Any], where: str, context: RunContext, engine: str) -> ServingRecord:
        """The record's counts and mean TPOT; batch is the concurrency unless the context gives one."""
        completed = number(record, "completed", where, integer=True)
        concurrency = number(record, "max_concurrency", where, integer=True, required=False)
        batch = require(concurrency or context.batch, where, "max_concurrency", "--batch (or FILE@batch=B)")
        shared = {
            "source_url": where,
            "engine": engine,
            "engine_version": context.engine_version or NA,
            "device": context.device or NA,
            "tp": context.tp or 1,
            "input_len": round(number(record, "total_input_tokens", where) / completed),
            "output_len": round(number(record, "total_output_tokens", where) / completed),
        }
        return cls(completed, concurrency, batch, number(record, "mean_tpot_ms", where), shared)

    def step(self, tool: str, model: str, context: RunContext) -> DecodeStep:
        """Plain decoding: the mean time per output token (TPOT ms) at the run's concurrency."""
        note = f"{tool}: mean TPOT at max_concurrency {self.concurrency or NA}, {self.completed} requests"
        return DecodeStep(
            model=model,
            dtype=context.dtype or NA,
            batch=self.batch,
            value=self.tpot_ms,
            unit="TPOT ms",
            notes=note,
            cuda_graphs=context.cuda_graphs or NA,
            **self.shared,
        )
