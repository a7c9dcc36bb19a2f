"""SGLang's benchmarks: `python -m sglang.bench_one_batch` (its console, or the JSONL of
`--result-filename`) and `python -m sglang.bench_serving --output-file` (JSONL, one line per run).

bench_one_batch runs a static batch: a prefill, then decode steps, and prints per configuration

    Prefill. latency: 0.01788 s, throughput:   3355.60 token/s
    Decode 0. Batch size: 1, latency: 0.00695 s, throughput:    143.98 token/s
    Decode.  median latency: 0.00689 s, median throughput:    145.10 token/s
    Total. latency:  0.080 s, throughput:    877.74 token/s

after a warmup block ("Warmup ...") that is not a measurement: only blocks after "Benchmark ..."
are read (every block when the paste has neither marker). The batch is printed on newer
versions and is median throughput × median latency on all; the prompt length is prefill
throughput × latency / batch, the output length total throughput × latency / batch − prompt.
Its JSONL names `batch_size`, `input_len`, `output_len`, `median_decode_latency` directly.
bench_serving's JSONL keeps `max_concurrency`, token totals, `mean_tpot_ms` and, when the
server speculates, `accept_length` (mean tokens per verify, the bonus token included).
"""

from __future__ import annotations

import re
from typing import Any

from moesim.errors import InputError
from moesim.hw_profiles.engine_runs.rows import NA, DecodeStep, EngineRows, RunContext, ServingRecord, SpecRun, json_lines, number

ENGINE = "SGLang"
_NUMBER = r"([0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)"
_PREFILL = re.compile(rf"^Prefill\.\s+latency:\s*{_NUMBER}\s*s,\s*throughput:\s*{_NUMBER}\s*token/s")
_STEP_BATCH = re.compile(r"^Decode\s+\d+\.\s+Batch size:\s*(\d+)")
_MEDIAN = re.compile(rf"^Decode\.\s+median latency:\s*{_NUMBER}\s*s,\s*median throughput:\s*{_NUMBER}\s*token/s")
_TOTAL = re.compile(rf"^Total\.\s+latency:\s*{_NUMBER}\s*s,\s*throughput:\s*{_NUMBER}\s*token/s")


def looks_like_one_batch(text: str) -> bool:
    """Whether the text is bench_one_batch's console or its result JSONL."""
    return "Decode.  median latency:" in text or ('"median_decode_latency"' in text and '"batch_size"' in text)


def looks_like_serving(text: str) -> bool:
    """Whether the text is bench_serving's JSONL (SGLang names end-to-end latency e2e_latency)."""
    return text.lstrip().startswith("{") and '"mean_tpot_ms"' in text and '"mean_e2e_latency_ms"' in text


def _step(where: str, context: RunContext, batch: int, median_s: float, input_len: int | None, output_len: int | None) -> DecodeStep:
    return DecodeStep(
        **context.step_fields(where, ENGINE),
        batch=batch,
        value=median_s * 1000.0,
        unit="ms per step",
        input_len=input_len,
        output_len=output_len,
        tp=context.tp or 1,
        cuda_graphs=context.cuda_graphs or NA,
        notes="sglang.bench_one_batch: median decode step",
    )


def parse_one_batch(text: str, where: str, context: RunContext) -> EngineRows:
    """One row per measured configuration (median decode step)."""
    if text.lstrip().startswith("{"):
        steps = []
        for line, record in json_lines(text, where):
            at = f"{where}: line {line}"
            if "median_decode_latency" not in record:
                raise InputError(f"{at}: field 'median_decode_latency' is missing (output_len 1 times no decode step)")
            steps.append(
                _step(
                    at,
                    context,
                    number(record, "batch_size", at, integer=True),
                    number(record, "median_decode_latency", at),
                    number(record, "input_len", at, integer=True, required=False),
                    number(record, "output_len", at, integer=True, required=False),
                )
            )
        return EngineRows(steps=tuple(steps))
    lines = text.splitlines()
    marker = next((i for i, line in enumerate(lines) if line.strip().startswith("Benchmark ...")), -1)
    steps, prefill, batch = [], None, None
    for number_, line in enumerate(lines[marker + 1 :], start=marker + 2):
        line = line.strip()
        at = f"{where}: line {number_}"
        if line.startswith("Warmup ..."):
            prefill = None
        elif match := _PREFILL.match(line):
            prefill, batch = (float(match[1]), float(match[2])), None
        elif match := _STEP_BATCH.match(line):
            batch = int(match[1])
        elif match := _MEDIAN.match(line):
            median_s, median_rate = float(match[1]), float(match[2])
            if not median_s > 0 or not median_rate > 0:
                raise InputError(f"{at}: field 'median latency' must be > 0, got {line!r}")
            printed = batch or max(1, round(median_s * median_rate))
            input_len = max(1, round(prefill[0] * prefill[1] / printed)) if prefill else None
            steps.append([at, printed, median_s, input_len, None])
        elif (match := _TOTAL.match(line)) and steps and steps[-1][4] is None:
            row = steps[-1]
            total_tokens = round(float(match[1]) * float(match[2]) / row[1])
            row[4] = total_tokens - row[3] if row[3] is not None and total_tokens > row[3] else None
    if not steps:
        raise InputError(f"{where}: no 'Decode.  median latency' line after 'Benchmark ...' (not bench_one_batch output?)")
    return EngineRows(steps=tuple(_step(at, context, b, s, i, o) for at, b, s, i, o in steps))


def _serving_row(record: dict[str, Any], at: str, context: RunContext) -> DecodeStep | SpecRun:
    serving = ServingRecord.read(record, at, context, ENGINE)
    model = context.model or NA
    accept_length = number(record, "accept_length", at, required=False)
    if accept_length is None:
        return serving.step("sglang.bench_serving", model, context)
    return SpecRun(
        target_model=model,
        draft=context.draft or NA,
        draft_len=context.draft_len,
        batch=serving.batch,
        spec_value=serving.tpot_ms,
        metric="TPOT ms",
        mean_accepted_length=accept_length,
        tokens_per_s=number(record, "output_throughput", at, required=False),
        concurrency=serving.concurrency,
        notes=f"sglang.bench_serving with speculation: accept_length {accept_length:.4g}, {serving.completed} requests",
        **serving.shared,
    )


def parse_serving(text: str, where: str, context: RunContext) -> EngineRows:
    """One row per line (bench_serving appends one line per run)."""
    rows = [_serving_row(record, f"{where}: line {line}", context) for line, record in json_lines(text, where)]
    return EngineRows(
        steps=tuple(r for r in rows if isinstance(r, DecodeStep)),
        runs=tuple(r for r in rows if isinstance(r, SpecRun)),
    )
