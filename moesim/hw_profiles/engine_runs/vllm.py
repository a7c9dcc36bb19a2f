"""vLLM's benchmark results: `vllm bench latency --output-json` and `vllm bench serve --save-result`.

`bench latency` times whole batches (`avg_latency`, `latencies`, `percentiles`): one prefill of
batch · input_len tokens, then output_len − 1 decode forwards. Its JSON does not say the batch or
the lengths; the `.pytorch.json` it writes beside it (SAVE_TO_PYTORCH_BENCHMARK_FORMAT=1) does,
in `benchmark.extra_info.args`, with `tensor_parallel_size` and `enforce_eager` (eager: no CUDA
graphs). `bench serve` keeps the run's `max_concurrency` (the batch of its steady state), token
totals, `mean_tpot_ms` and, against a server that speculates, the counters it scraped:
`spec_decode_acceptance_rate` (%), `spec_decode_acceptance_length`, `spec_decode_num_drafts`
and `spec_decode_draft_tokens` (draft_len = draft tokens per draft).
"""

from __future__ import annotations

from typing import Any

from moesim.errors import InputError
from moesim.hw_profiles.engine_runs.rows import (
    LATENCY_UNIT,
    NA,
    DecodeStep,
    EngineRows,
    RunContext,
    ServingRecord,
    SpecRun,
    json_document,
    number,
    require,
)

ENGINE = "vLLM"


def looks_like_latency(text: str) -> bool:
    """Whether the text is a latency result (plain or PyTorch-benchmark form)."""
    head = text.lstrip()[:4096]
    return ('"avg_latency"' in head and '"latencies"' in head) or ('"vLLM benchmark"' in head and '"latency"' in head)


def looks_like_serve(text: str) -> bool:
    """Whether the text is a `vllm bench serve` result (vLLM names end-to-end latency e2el)."""
    head = text.lstrip()
    return head.startswith("{") and '"mean_tpot_ms"' in head and '"mean_e2el_ms"' in head


def _graphs(args: dict[str, Any]) -> str | None:
    eager = args.get("enforce_eager")
    return None if eager is None else ("no (enforce_eager)" if eager else "yes")


def parse_latency(text: str, where: str, context: RunContext) -> EngineRows:
    """One batch-latency row: the mean over the timed iterations."""
    document = json_document(text, where)
    if isinstance(document, list):
        records = [r for r in document if isinstance(r, dict) and isinstance(r.get("metric"), dict)]
        record = next((r for r in records if r["metric"].get("name") == "latency"), None)
        if record is None:
            raise InputError(f"{where}: a PyTorch-benchmark file without a 'latency' metric")
        args = record.get("benchmark", {}).get("extra_info", {}).get("args", {})
        args = args if isinstance(args, dict) else {}
        summary = record["metric"].get("extra_info", {})
        summary = summary if isinstance(summary, dict) else {}
        given = RunContext(
            model=args.get("model"),
            tp=number(args, "tensor_parallel_size", where, integer=True, required=False),
            cuda_graphs=_graphs(args),
            batch=number(args, "batch_size", where, integer=True, required=False),
            input_len=number(args, "input_len", where, integer=True, required=False),
            output_len=number(args, "output_len", where, integer=True, required=False),
        )
        context = context.merged(given)
    elif isinstance(document, dict):
        summary = document
    else:
        raise InputError(f"{where}: expected a JSON object with avg_latency, got {type(document).__name__}")
    latency_s = number(summary, "avg_latency", where)
    step = DecodeStep(
        **context.step_fields(where, ENGINE),
        batch=require(context.batch, where, "batch_size", "--batch (or FILE@batch=B)"),
        value=latency_s,
        unit=LATENCY_UNIT,
        tokens_per_pass=1,
        input_len=require(context.input_len, where, "input_len", "--input-len (or FILE@input_len=N)"),
        output_len=require(context.output_len, where, "output_len", "--output-len (or FILE@output_len=N)"),
        tp=context.tp or 1,
        cuda_graphs=context.cuda_graphs or NA,
        notes="vllm bench latency: avg_latency over the timed iterations (prefill + output_len - 1 decode forwards)",
    )
    return EngineRows(steps=(step,))


def parse_serve(text: str, where: str, context: RunContext) -> EngineRows:
    """One row of the serving run: plain decoding, or a speculative run when the server speculated."""
    record = json_document(text, where)
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    serving = ServingRecord.read(record, where, context, ENGINE)
    model = context.model or str(record.get("model_id") or NA)
    if "spec_decode_acceptance_length" not in record:
        return EngineRows(steps=(serving.step("vllm bench serve", model, context),))
    drafts = number(record, "spec_decode_num_drafts", where, integer=True)
    drafted = number(record, "spec_decode_draft_tokens", where, integer=True)
    run = SpecRun(
        target_model=model,
        draft=context.draft or NA,
        draft_len=context.draft_len or round(drafted / drafts),
        batch=serving.batch,
        spec_value=serving.tpot_ms,
        metric="TPOT ms",
        accepted_per_drafted=number(record, "spec_decode_acceptance_rate", where, zero=True) / 100.0,
        mean_accepted_length=number(record, "spec_decode_acceptance_length", where),
        tokens_per_s=number(record, "output_throughput", where, required=False),
        concurrency=serving.concurrency,
        notes=f"vllm bench serve with speculation: {drafts} drafts of {drafted} tokens, {serving.completed} requests",
        **serving.shared,
    )
    return EngineRows(runs=(run,))
