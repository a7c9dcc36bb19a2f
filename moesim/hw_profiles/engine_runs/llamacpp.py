"""llama.cpp's outputs: `llama-bench` rows, `llama-speculative`'s summary, the timing lines every
tool prints (`llama_perf_context_print` / `llama_print_timings`), and `llama-server`'s
per-request timings (the `timings` object of a completion response, or the slot's log lines).

    llama-speculative:  decoded  257 tokens in    4.291 seconds, speed:   59.894 t/s
                        n_draft   = 16 / n_predict = 257 / n_drafted = 208 / n_accept  = 176
    timing lines:       llama_perf_context_print:  eval time = 3979.58 ms / 127 runs ( 31.34 ms per token, 31.91 tokens per second)
    llama-server log:   eval time = 2367.37 ms / 128 tokens ( 18.50 ms per token, 54.07 tokens per second)
                        draft acceptance rate = 0.57576 (   19 accepted /    33 generated)
    llama-server JSON:  "timings": {"predicted_n": ..., "predicted_per_second": ..., "draft_n": ..., "draft_n_accepted": ...}

llama-bench's `tgN` rows are plain decoding of one sequence; its `ppN` rows one forward over
min(N, n_ubatch) tokens (the verify shape), `t/s` = tokens per pass / time per pass. A timing
line's `eval time` counts single-token forwards of one sequence (a multi-token batch counts as
prompt eval), so it is plain decoding at batch 1. llama-speculative drafts one sequence.
"""

from __future__ import annotations

import re
from typing import Any

from moesim.errors import InputError
from moesim.hw_profiles.engine_runs.rows import (
    NA,
    DecodeStep,
    EngineRows,
    RunContext,
    SpecRun,
    json_document,
    json_lines,
    number,
    rate_run,
    rate_step,
)
from moesim.hw_profiles.importers.llama_bench import BenchTest, parse_markdown, parse_records
from moesim.hw_profiles.importers.names import format_in_description

ENGINE = "llama.cpp"
_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_TEST = re.compile(r"^(pp|tg)(\d+)(?:\s*@\s*d(\d+))?")
_BUILD = re.compile(r"^build:\s*(?:(\d+)\s*\(([0-9a-f]+)\)|([0-9a-f]+)\s*\((\d+)\))", re.MULTILINE)
_DECODED = re.compile(rf"decoded\s+(\d+)\s+tokens in\s+{_NUMBER}\s+seconds, speed:\s+{_NUMBER}\s+t/s")
_ENCODED = re.compile(r"encoded\s+(\d+)\s+tokens in")
_COUNTER = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")
_EVAL = re.compile(
    rf"(?<!prompt )eval time\s*=\s*{_NUMBER}\s*ms\s*/\s*(\d+)\s*(?:runs|tokens)\s*"
    rf"\(\s*{_NUMBER}\s*ms per token,\s*{_NUMBER}\s*tokens per second\)"
)
_PROMPT = re.compile(r"prompt eval time\s*=\s*[0-9.]+\s*ms\s*/\s*(\d+)\s*tokens")
_ACCEPT = re.compile(r"draft acceptance rate\s*=\s*[0-9.]+\s*\(\s*(\d+)\s*accepted\s*/\s*(\d+)\s*generated\)")


def _build(text: str, context: RunContext) -> str:
    """The build as llama-bench writes it, `HASH (bNUMBER)`, from either tool's `build:` line."""
    match = _BUILD.search(text)
    if context.engine_version or match is None:
        return context.engine_version or NA
    number_, commit = (match[1], match[2]) if match[1] else (match[4], match[3])
    return f"{commit} (b{number_})"


def looks_like_bench(text: str) -> bool:
    """Whether the text is llama-bench output (markdown, csv, json or jsonl)."""
    start = text.lstrip()
    markdown = any(line.lstrip().lower().startswith("| model") for line in text.splitlines()[:200])
    return markdown or start.startswith("build_commit,") or (start[:1] in "[{" and '"build_commit"' in start[:4096])


def _bench_step(test: BenchTest, where: str, context: RunContext) -> DecodeStep | None:
    match = _TEST.match(test.test.strip())
    if match is None or "+" in test.test:
        return None
    tokens, depth = int(match[2]), int(match[3] or 0)
    per_pass = 1 if match[1] == "tg" else min(tokens, test.n_ubatch)
    rate = test.tokens_per_s if test.tokens_per_s > 0 else (tokens * 1e9 / test.total_ns if test.total_ns else 0.0)
    at = f"{where}: line {test.line}"
    what = (
        f"tg{tokens}: one-token forwards" if match[1] == "tg" else f"pp{tokens} at n_ubatch {test.n_ubatch}: forwards of {per_pass} tokens"
    )
    return DecodeStep(
        source_url=at,
        engine=f"{ENGINE} {test.backend}".strip(),
        engine_version=context.engine_version or test.build or NA,
        device=context.device or test.device or NA,
        model=context.model or test.model,
        dtype=context.dtype or format_in_description(test.model) or NA,
        batch=1,
        value=rate,
        unit="t/s",
        tokens_per_pass=per_pass,
        input_len=depth if match[1] == "tg" else tokens,
        output_len=tokens if match[1] == "tg" else 0,
        cuda_graphs=context.cuda_graphs or NA,
        notes=f"llama-bench {what}" + (f" at depth {depth}" if depth else ""),
    )


def parse_bench(text: str, where: str, context: RunContext) -> EngineRows:
    """Every tg and pp row (a combined ppN+tgM row is neither and is left out)."""
    start = text.lstrip()
    if start.startswith("build_commit,"):
        tests = parse_records(text, where, "csv", context.device or "")
    elif start.startswith("["):
        tests = parse_records(text, where, "json", context.device or "")
    elif start.startswith("{"):
        tests = parse_records(text, where, "jsonl", context.device or "")
    else:
        tests = parse_markdown(text, where, context.device or "")
    steps = tuple(step for test in tests if (step := _bench_step(test, where, context)) is not None)
    if not steps:
        raise InputError(f"{where}: no tgN or ppN row in this llama-bench output")
    return EngineRows(steps=steps)


def looks_like_speculative(text: str) -> bool:
    """Whether the text is llama-speculative's (or llama-speculative-simple's) console."""
    return "n_drafted" in text and "n_accept" in text and bool(_DECODED.search(text))


def parse_speculative(text: str, where: str, context: RunContext) -> EngineRows:
    """The run's speed with its draft length and acceptance (accepted / drafted)."""
    decoded = _DECODED.search(text)
    if decoded is None:
        raise InputError(f"{where}: no 'decoded N tokens in T seconds, speed: S t/s' line")
    counters = dict(_COUNTER.findall(text))
    for name in ("n_draft", "n_drafted", "n_accept"):
        if name not in counters:
            raise InputError(f"{where}: field '{name}' is missing (not llama-speculative output?)")
    drafted, accepted = int(counters["n_drafted"]), int(counters["n_accept"])
    if drafted < 1 or accepted > drafted:
        raise InputError(f"{where}: field 'n_accept' is {accepted} of n_drafted {drafted}: needs 0 <= n_accept <= n_drafted >= 1")
    speed = float(decoded[3])
    encoded = _ENCODED.search(text)
    line = text[: decoded.start()].count("\n") + 1
    run = SpecRun(
        source_url=f"{where}: line {line}",
        engine=ENGINE,
        engine_version=_build(text, context),
        device=context.device or NA,
        target_model=context.model or NA,
        draft=context.draft or NA,
        draft_len=context.draft_len or int(counters["n_draft"]),
        batch=1,
        spec_value=speed,
        metric="t/s",
        accepted_per_drafted=accepted / drafted,
        tokens_per_s=speed,
        input_len=int(encoded[1]) if encoded else None,
        output_len=int(decoded[1]),
        concurrency=1,
        notes=f"llama-speculative: {accepted} of {drafted} drafted tokens accepted",
    )
    return EngineRows(runs=(run,))


def looks_like_timings(text: str) -> bool:
    """Whether the text holds llama.cpp timing lines (a tool's perf print or llama-server's log)."""
    return bool(_EVAL.search(text))


def parse_timings(text: str, where: str, context: RunContext) -> EngineRows:
    """Each `eval time` line a row at batch 1 (or --batch), a speculative run when a `draft
    acceptance rate` line follows it (llama-server)."""
    build = _build(text, context)
    lines = text.splitlines()
    steps: list[DecodeStep] = []
    runs: list[SpecRun] = []
    prompt_tokens = None
    for index, line in enumerate(lines):
        if match := _PROMPT.search(line):
            prompt_tokens = int(match[1])
            continue
        match = _EVAL.search(line)
        if match is None:
            continue
        at = f"{where}: line {index + 1}"
        tokens, rate = int(match[2]), float(match[4])
        if not rate > 0:
            raise InputError(f"{at}: field 'tokens per second' must be > 0, got {match[4]}")
        following = next((_ACCEPT.search(x) for x in lines[index + 1 : index + 4] if _ACCEPT.search(x)), None)
        shared = {
            "source_url": at,
            "engine": ENGINE,
            "engine_version": build,
            "device": context.device or NA,
            "batch": context.batch or 1,
            "input_len": prompt_tokens,
            "output_len": tokens,
        }
        if following is None:
            note = "llama.cpp timing line: eval time of single-token forwards" + ("" if context.batch else " (batch 1 unless --batch)")
            steps.append(rate_step(context, rate, note, shared, cuda_graphs=context.cuda_graphs or NA))
        else:
            accepted, generated = int(following[1]), int(following[2])
            if generated < 1 or accepted > generated:
                raise InputError(
                    f"{at}: draft acceptance {accepted} accepted / {generated} generated: needs 0 <= accepted <= generated >= 1"
                )
            notes = f"llama-server: {accepted} of {generated} drafted tokens accepted"
            runs.append(rate_run(context.model or NA, context, rate, accepted / generated, notes, shared))
        prompt_tokens = None
    if not steps and not runs:
        raise InputError(f"{where}: no 'eval time = ... tokens per second' line")
    return EngineRows(tuple(steps), tuple(runs))


def looks_like_server_json(text: str) -> bool:
    """Whether the text is llama-server completion responses (JSON or JSONL) with their timings."""
    start = text.lstrip()
    return start[:1] in "[{" and '"timings"' in start and '"predicted_per_second"' in start


def _server_row(response: Any, at: str, context: RunContext) -> DecodeStep | SpecRun:
    if not isinstance(response, dict) or not isinstance(response.get("timings"), dict):
        raise InputError(f"{at}: field 'timings' is missing (not a llama-server completion response?)")
    timings = response["timings"]
    rate = number(timings, "predicted_per_second", at)
    fingerprint = response.get("system_fingerprint")
    shared = {
        "source_url": at,
        "engine": ENGINE,
        "engine_version": context.engine_version or (str(fingerprint) if fingerprint else NA),
        "device": context.device or NA,
        "batch": context.batch or 1,
        "input_len": number(timings, "prompt_n", at, integer=True, required=False, zero=True),
        "output_len": number(timings, "predicted_n", at, integer=True),
    }
    model = context.model or str(response.get("model") or NA)
    drafted = number(timings, "draft_n", at, integer=True, required=False, zero=True)
    if not drafted:
        note = "llama-server timings: predicted_per_second of one request" + ("" if context.batch else " (batch 1 unless --batch)")
        return DecodeStep(
            model=model, dtype=context.dtype or NA, value=rate, unit="t/s", notes=note, cuda_graphs=context.cuda_graphs or NA, **shared
        )
    accepted = number(timings, "draft_n_accepted", at, integer=True, zero=True)
    if accepted > drafted:
        raise InputError(f"{at}: field 'draft_n_accepted' is {accepted}, more than draft_n {drafted}")
    return rate_run(
        model, context, rate, accepted / drafted, f"llama-server timings: {accepted} of {drafted} drafted tokens accepted", shared
    )


def parse_server_json(text: str, where: str, context: RunContext) -> EngineRows:
    """One row per completion response (a JSON object, a list of them, or JSONL)."""
    start = text.lstrip()
    if start.startswith("["):
        document = json_document(text, where)
        rows = [_server_row(r, f"{where}: response {i + 1}", context) for i, r in enumerate(document)]
    elif len([line for line in text.splitlines() if line.strip()]) > 1 and start.startswith("{") and _single_line_objects(text):
        rows = [_server_row(r, f"{where}: line {n}", context) for n, r in json_lines(text, where)]
    else:
        rows = [_server_row(json_document(text, where), where, context)]
    return EngineRows(
        steps=tuple(r for r in rows if isinstance(r, DecodeStep)),
        runs=tuple(r for r in rows if isinstance(r, SpecRun)),
    )


def _single_line_objects(text: str) -> bool:
    first = next(line for line in text.splitlines() if line.strip())
    return first.strip().startswith("{") and first.strip().endswith("}")
