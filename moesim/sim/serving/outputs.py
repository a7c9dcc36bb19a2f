"""Outputs of a simulation: per-request and per-iteration tables (Arrow) and a summary.

- `requests`.arrow: one row per issued request: arrival, first token, finish, latency, time per
  output token (TPOT = (finish − first token) / (output tokens − 1)), decode iterations, drafted
  and accepted tokens, mean draft length, its draft length per iteration (`draft_lens`, k over
  time), where it decoded in the trace and how often it wrapped; with a speculation-off
  comparison also the same request's TPOT with speculation off and the slowdown ratio.
- `iterations`.arrow: one row per server iteration: start, prefill / draft / verify time, the
  decoding batch size, requests whose prefill yielded their first token, tokens committed, mean
  distinct experts per MoE layer of the verify pass (null when the cost model does not report
  it), and per decoding request its id, draft length and accepted count (list columns, in batch
  order); with KV memory or chunked prefill also the positions prefilled and the requests
  preempted, and with memory the pages used and free at the pass and the swap time.
- config.toml: the config fully resolved (every section with its defaults, files as the run
  named them, from the run's working folder) and `[moesim]`: moesim's version, the command, the sha256 of every input (trace,
  profile, preset and length files); `moesim simulate OUT/config.toml` reruns it to the same bytes.
- summary.json: throughput, TPOT mean / p50 / p99, latency, acceptance, and against the same
  run with speculation off: speedup (throughput ratio), TPOT speedup, the worst request's
  slowdown; with memory, its preemptions and `memory` (the pages and what they rest on, the
  most requests held at once, how many of the longest requests fit without preemption).

Everything is a function of the config and the seed: no timestamps, no host names; the same
inputs give the same bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc

from moesim.atomic import output_dir
from moesim.fields import dump
from moesim.hw_profiles.builtin import profile_files
from moesim.sim.serving.config import SimConfig
from moesim.sim.serving.server import ServerRecord
from moesim.tomlfile import RUN_CONFIG, run_header, toml_document
from moesim.tracegen.formats.builtin import resolve_trace

FORMAT = "moesim.simulate/1"


def _list_column(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=value_type))


def _tpot_us(record: ServerRecord) -> np.ndarray:
    tpot = np.full(len(record.requests), np.nan)
    for i, r in enumerate(record.requests):
        if r.output_tokens > 1 and math.isfinite(r.finish_us):
            tpot[i] = (r.finish_us - r.first_token_us) / (r.output_tokens - 1)
    return tpot


def iterations_table(record: ServerRecord) -> pa.Table:
    """The per-iteration table."""
    n = record.prefill_us.size
    offsets = np.concatenate([[0], np.cumsum(record.batch)])
    committed = record.step_accepted + 1
    tokens = np.add.reduceat(committed, offsets[:-1]) if committed.size else np.zeros(n, np.int64)
    tokens = np.where(record.batch > 0, tokens, 0) + record.admitted
    distinct = pa.array(record.distinct_experts, from_pandas=True)
    return pa.table(
        {
            "iteration": pa.array(np.arange(n, dtype=np.uint32)),
            "start_us": pa.array(record.start_us),
            "prefill_us": pa.array(record.prefill_us),
            "draft_us": pa.array(record.draft_us),
            "verify_us": pa.array(record.verify_us),
            "batch": pa.array(record.batch.astype(np.uint32)),
            "admitted": pa.array(record.admitted.astype(np.uint32)),
            "tokens": pa.array(tokens.astype(np.uint32)),
            "distinct_experts": distinct,
            "requests": _list_column(offsets, record.step_request.astype(np.uint32), pa.uint32()),
            "draft_lens": _list_column(offsets, record.step_draft_len.astype(np.uint8), pa.uint8()),
            "accepted": _list_column(offsets, record.step_accepted.astype(np.uint8), pa.uint8()),
            **_extended_columns(record),
        }
    )


def _extended_columns(record: ServerRecord) -> dict[str, pa.Array]:
    """The per-iteration columns of KV memory and chunked prefill (those the run has)."""
    columns = {}
    if record.prefill_tokens is not None and record.preempted is not None:
        columns["prefill_tokens"] = pa.array(record.prefill_tokens.astype(np.uint32))
        columns["preempted"] = pa.array(record.preempted.astype(np.uint32))
    if record.kv_pages_used is not None and record.kv_pages_free is not None and record.swap_us is not None:
        columns["kv_pages_used"] = pa.array(record.kv_pages_used.astype(np.uint32))
        columns["kv_pages_free"] = pa.array(record.kv_pages_free.astype(np.uint32))
        columns["swap_us"] = pa.array(record.swap_us)
    return columns


def requests_table(record: ServerRecord, alphas: np.ndarray, off: ServerRecord | None = None) -> pa.Table:
    """The per-request table; `alphas` is each request's acceptance rate (NaN where undefined)."""
    reqs = record.requests
    n = len(reqs)
    order = np.argsort(record.step_request, kind="stable")
    counts = np.bincount(record.step_request, minlength=n)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    drafted = np.bincount(record.step_request, weights=record.step_draft_len, minlength=n)
    accepted = np.bincount(record.step_request, weights=record.step_accepted, minlength=n)
    arrival = np.array([r.arrival_us for r in reqs])
    first = np.array([r.first_token_us for r in reqs])
    finish = np.array([r.finish_us for r in reqs])
    tpot = _tpot_us(record)
    with np.errstate(invalid="ignore", divide="ignore"):
        columns: dict[str, Any] = {
            "request": pa.array(np.arange(n, dtype=np.uint32)),
            "arrival_us": pa.array(arrival),
            "prompt_tokens": pa.array(np.array([r.prompt_tokens for r in reqs], np.uint32)),
            "output_tokens": pa.array(np.array([r.output_tokens for r in reqs], np.uint32)),
            "completed": pa.array(np.isfinite(finish)),
            "first_token_us": pa.array(first, from_pandas=True),
            "finish_us": pa.array(finish, from_pandas=True),
            "ttft_us": pa.array(first - arrival, from_pandas=True),
            "latency_us": pa.array(finish - arrival, from_pandas=True),
            "tpot_us": pa.array(tpot, from_pandas=True),
            "iterations": pa.array(counts.astype(np.uint32)),
            "drafted": pa.array(drafted.astype(np.uint32)),
            "accepted": pa.array(accepted.astype(np.uint32)),
            "acceptance_rate": pa.array(np.where(drafted > 0, accepted / drafted, np.nan), from_pandas=True),
            "mean_draft_len": pa.array(np.where(counts > 0, drafted / counts, np.nan), from_pandas=True),
            "alpha": pa.array(alphas, from_pandas=True),
            "trace_seq": pa.array(np.array([r.seq for r in reqs], np.int32)),
            "trace_start": pa.array(np.array([r.trace_start for r in reqs], np.int32)),
            "wraps": pa.array(np.array([r.wraps for r in reqs], np.uint32)),
            "draft_lens": _list_column(offsets, record.step_draft_len[order].astype(np.uint8), pa.uint8()),
        }
        if record.memory is not None:
            columns["preemptions"] = pa.array(np.array([r.preemptions for r in reqs], np.uint32))
        if off is not None:
            tpot_off = _tpot_us(off)[:n]
            tpot_off = np.concatenate([tpot_off, np.full(n - tpot_off.size, np.nan)])
            columns["tpot_off_us"] = pa.array(tpot_off, from_pandas=True)
            columns["slowdown"] = pa.array(tpot / tpot_off, from_pandas=True)
    return pa.table(columns)


def _stats(record: ServerRecord) -> dict[str, Any]:
    tpot = _tpot_us(record)
    tpot = tpot[np.isfinite(tpot)]
    finish = np.array([r.finish_us for r in record.requests])
    done = np.isfinite(finish)
    latency = finish[done] - np.array([r.arrival_us for r in record.requests])[done]
    tokens = int(record.step_accepted.sum() + record.step_accepted.size + record.admitted.sum())
    drafted = int(record.step_draft_len.sum())
    iterations = int(record.prefill_us.size)
    decode_iterations = int(np.count_nonzero(record.batch))

    def stat(values: np.ndarray, fn: Any) -> float:
        return float(fn(values)) if values.size else math.nan

    return {
        "requests_issued": len(record.requests),
        "requests_completed": int(done.sum()),
        "iterations": iterations,
        "simulated_s": record.end_us / 1e6,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / record.end_us * 1e6 if record.end_us > 0 else math.nan,
        "tpot_mean_us": stat(tpot, np.mean),
        "tpot_p50_us": stat(tpot, lambda v: np.percentile(v, 50)),
        "tpot_p99_us": stat(tpot, lambda v: np.percentile(v, 99)),
        "latency_mean_us": stat(latency, np.mean),
        "mean_batch": float(record.batch[record.batch > 0].mean()) if decode_iterations else math.nan,
        "mean_draft_len": drafted / record.step_draft_len.size if record.step_draft_len.size else math.nan,
        "acceptance_rate": int(record.step_accepted.sum()) / drafted if drafted else math.nan,
        "tokens_per_pass": 1.0 + float(record.step_accepted.mean()) if record.step_accepted.size else math.nan,
        "wraps": int(sum(r.wraps for r in record.requests)),
        **({"preemptions": record.memory["preemptions"], "memory": record.memory} if record.memory is not None else {}),
    }


def summary(record: ServerRecord, off: ServerRecord | None, describe: dict[str, Any]) -> dict[str, Any]:
    """The run's summary; against `off` (the same run with speculation off) when given."""
    result: dict[str, Any] = {"format": FORMAT, **describe, **_stats(record)}
    if off is not None:
        off_stats = _stats(off)
        result["off"] = {
            k: off_stats[k] for k in ("throughput_tok_s", "tpot_mean_us", "tpot_p50_us", "tpot_p99_us", "latency_mean_us", "simulated_s")
        }
        result["speedup"] = result["throughput_tok_s"] / off_stats["throughput_tok_s"]
        result["tpot_speedup"] = off_stats["tpot_mean_us"] / result["tpot_mean_us"]
        tpot, tpot_off = _tpot_us(record), _tpot_us(off)
        n = min(tpot.size, tpot_off.size)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = tpot[:n] / tpot_off[:n]
        valid = np.isfinite(ratio)
        if valid.any():
            worst = int(np.flatnonzero(valid)[np.argmax(ratio[valid])])
            result["worst_slowdown"] = float(ratio[worst])
            result["worst_request"] = worst
            result["requests_slowed"] = int(np.sum(ratio[valid] > 1.0))
        else:
            result["worst_slowdown"], result["worst_request"], result["requests_slowed"] = math.nan, None, 0
    return result


def json_text(payload: Any) -> str:
    """Deterministic JSON (sorted keys; NaN and infinities become null)."""
    finite = json.loads(json.dumps(payload), parse_constant=lambda _: None)
    return json.dumps(finite, sort_keys=True, indent=2) + "\n"


def _files(value: Any) -> list[str]:
    """Every existing file a config's table names (a built-in trace by name: its file)."""
    if isinstance(value, dict):
        return [f for v in value.values() for f in _files(v)]
    if isinstance(value, list):
        return [f for v in value for f in _files(v)]
    return [str(resolve_trace(value))] if isinstance(value, str) and value and resolve_trace(value).is_file() else []


def config_table(config: SimConfig) -> dict[str, Any]:
    """The config fully resolved, as the TOML document `config_from_dict` reads back to it: every
    section with its defaults, files as the run named them (a relative one from the run's working
    folder), and `[moesim]` (version, command, the sha256 of every input file, the profiles' among
    them)."""
    entry = lambda selector, e: {selector: e.name, **dump(e)}  # noqa: E731
    doc: dict[str, Any] = {
        name: dump(getattr(config, name))
        for name in ("run", "workload", "arrivals", "batching", "memory", "parallel", "trace", "cost", "target", "drafter")
        if getattr(config, name) is not None
    }
    doc |= {"acceptance": entry("model", config.acceptance), "policy": entry("name", config.policy)}
    study = config.study
    if study is not None:
        doc["study"] = {
            "models": list(study.models),
            "workloads": {name: entry("model", a) for name, a in study.workloads},
            "policies": [entry("name", p) for p in study.policies],
            "batches": list(study.batches),
            "devices": [dump(d) for d in study.devices],
            "drafters": {model: dump(d) for model, d in study.drafters},
        }
    profiles = {config.target.profile, *(d.profile for d in study.devices)} if study is not None else {config.target.profile}
    files = _files(doc) + [str(f) for p in sorted(profiles - {None}) for f in profile_files(p)]  # type: ignore[type-var]
    return {**doc, "moesim": run_header("simulate", files)}


def config_text(config: SimConfig) -> str:
    """`config_table` as the TOML text of an output folder's config.toml."""
    return toml_document(config_table(config))


def write_arrow(path: Path, table: pa.Table) -> None:
    """An Arrow IPC file with the format in its schema metadata."""
    table = table.replace_schema_metadata({"moesim.format": FORMAT})
    with ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)


def write_run(out_dir: Path, tables: dict[str, pa.Table], summary_payload: dict[str, Any], config: str, force: bool = False) -> None:
    """The run's files in `out_dir` (each atomically): one Arrow file per table, summary.json and
    config.toml (`config`: its text)."""
    with output_dir(out_dir, force) as staging:
        for name, table in tables.items():
            write_arrow(staging / f"{name}.arrow", table)
        (staging / "summary.json").write_text(json_text(summary_payload))
        (staging / RUN_CONFIG).write_text(config)


SUMMARY_ROWS = (
    ("throughput_tok_s", "throughput (tokens/s)"),
    ("tpot_mean_us", "TPOT mean (µs)"),
    ("tpot_p50_us", "TPOT p50 (µs)"),
    ("tpot_p99_us", "TPOT p99 (µs)"),
    ("latency_mean_us", "latency mean (µs)"),
    ("mean_draft_len", "mean draft length"),
    ("acceptance_rate", "accepted / drafted"),
    ("tokens_per_pass", "tokens per request per verify pass"),
    ("speedup", "speedup vs speculation off (throughput)"),
    ("tpot_speedup", "speedup vs speculation off (mean TPOT)"),
    ("worst_slowdown", "worst request's slowdown (TPOT / TPOT off)"),
    ("requests_completed", "requests completed"),
    ("iterations", "iterations"),
    ("wraps", "trace wraps"),
    ("preemptions", "preemptions (KV memory)"),
)


def summary_rows(payload: dict[str, Any]) -> pl.DataFrame:
    """The summary's headline figures as (metric, value) rows for display."""
    rows = [(label, float(payload[key])) for key, label in SUMMARY_ROWS if payload.get(key) is not None]
    return pl.DataFrame(rows, schema=["metric", "value"], orient="row")
