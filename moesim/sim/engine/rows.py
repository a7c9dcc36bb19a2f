"""The shared engine-overheads rows in the layout `fit_engine_terms` reads: each row of
`dense_decode_steps.csv` and `dense_speculative_runs.csv` joined with moesim's description of it
(`runs_moesim.toml`: preset, catalog device, format, drafter, τ), or listed with why it cannot
be described.

Measured times: a decode row's `value` in its `unit` becomes the time of one forward (`time_us`:
llama-bench t/s over `tokens_per_pass` tokens, TPOT, ms per token, a scorer's time); a run's
`spec_value` and `baseline_value` in its `metric` become the time per output token of one request
(`token_us`, `baseline_token_us`: tokens/s per request, or TPOT).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from moesim.errors import ConfigError
from moesim.fields import build
from moesim.hw_profiles.engines.host import ENGINE_HOSTS, engine_of
from moesim.hw_profiles.importers.rows import prompt_scope
from moesim.tomlfile import read_toml

DATA = Path("data/engine-overheads")
STEPS_TABLE = DATA / "dense_decode_steps.csv"
RUNS_TABLE = DATA / "dense_speculative_runs.csv"
DESCRIPTIONS = DATA / "runs_moesim.toml"

STEP_COLUMNS = ("row", "source_url", "engine", "engine_key", "device_key", "preset", "weight_format", "tp", "batch")
STEP_COLUMNS += ("sequences", "tokens_per_forward", "context_tokens", "eager", "verified_tokens", "time_us", "head_share", "logit_rows")
RUN_COLUMNS = ("row", "source_url", "engine", "engine_key", "device_key", "preset", "weight_format", "tp", "batch", "context_tokens")
RUN_COLUMNS += ("drafter", "draft_format", "draft_len", "tau", "token_us", "baseline_token_us")


@dataclass(frozen=True)
class StepDescription:
    """Decode-step rows described alike."""

    rows: tuple[int, ...]
    preset: str
    device: str
    weight_format: str
    context_tokens: int = 0
    eager: bool | None = None
    tokens_per_sequence: int = 0  # 0: the row's tokens_per_pass
    expanded: bool | None = None  # every scored token its own sequence; None: as the engine scores (vLLM V0's batch expansion)
    note: str = ""


@dataclass(frozen=True)
class RunDescription:
    """Speculative-run rows described alike."""

    rows: tuple[int, ...]
    preset: str
    device: str
    weight_format: str
    drafter: str
    draft_format: str = ""
    draft_len: int = 0
    tau: float = math.nan
    measured_speedup: float = math.nan
    context_tokens: int = 0
    note: str = ""


@dataclass(frozen=True)
class Described:
    """The shared rows in fit layout, and the rows left out with their reasons."""

    steps: pl.DataFrame
    runs: pl.DataFrame
    left_out: list[dict[str, object]] = field(default_factory=list)


def _number(text: str) -> float:
    match = re.search(r"-?\d+(\.\d+)?", text or "")
    return float(match.group(0)) if match else math.nan


def forward_time_us(value: float, unit: str, tokens_per_pass: int) -> float:
    """One forward's time from a decode row: t/s over the test (tokens_per_pass / value), TPOT or ms."""
    unit = unit.lower()
    if unit == "t/s":
        return 1e6 * tokens_per_pass / value
    if "ms" in unit:
        return 1e3 * value
    raise ConfigError(f"decode-step unit '{unit}' is not a time per forward")


def token_time_us(value: float, metric: str) -> float:
    """Time per output token of one request: 1e6 / tokens per second, or TPOT in ms."""
    metric = metric.lower()
    if "tpot" in metric:
        return 1e3 * value
    if re.search(r"tok|t/s|tps", metric) and not re.search(r"\bratio\b", metric):
        return 1e6 / value
    raise ConfigError(f"speculative-run metric '{metric}' is not a rate or a time per token")


def _expand(tables: list[dict], what: str, path: Path, cls: type) -> dict[int, object]:
    out: dict[int, object] = {}
    for i, table in enumerate(tables):
        entry = build(cls, {**table, "rows": tuple(table.get("rows", ()))}, f"{what}[{i}]", str(path), path.parent)
        for row in entry.rows:
            if row in out:
                raise ConfigError(f"{path}: {what} row {row} is described twice")
            out[row] = entry
    return out


def _int(text: str, default: int) -> int:
    value = _number(text)
    return int(value) if math.isfinite(value) else default


def step_logits(engine_key: str, prompt: int, generated: int, tokens: int) -> tuple[float, int]:
    """(head_share, logit_rows) of a decode-step row's forwards of `tokens` tokens: llama.cpp's prompt
    tests (llama-bench ppN, no token generated) ask logits of the last token only, so the output head
    runs once per n_batch chunk on one row (`prompt_scope`; the unused rows skipped since
    ggml-org/llama.cpp#6122, March 2024: the older shared rows are single forwards of <= 11 tokens,
    where the head's other rows are < 0.1 % of the time); every other forward on each of its tokens."""
    if engine_key == "llama.cpp" and prompt > 0 and generated == 0:
        return prompt_scope(prompt, tokens).head_share, 1
    return 1.0, tokens


def _eager(described: StepDescription, record: dict, engine_key: str, tokens: int) -> bool:
    """Eager as described, else as the row says (graphs off), else wider than the engine captures."""
    if described.eager is not None:
        return described.eager
    if (record["cuda_graphs"] or "").lower().startswith("no"):
        return True
    return tokens > ENGINE_HOSTS[engine_key].graph_max_tokens


def describe(steps_table: Path = STEPS_TABLE, runs_table: Path = RUNS_TABLE, descriptions: Path = DESCRIPTIONS) -> Described:
    """Every described row of both tables in fit layout (the rest in `left_out` with a reason)."""
    data = read_toml(descriptions, "engine-overheads descriptions")
    step_desc = _expand(data.get("step", []), "step", descriptions, StepDescription)
    run_desc = _expand(data.get("run", []), "run", descriptions, RunDescription)
    steps_raw = pl.read_csv(steps_table, infer_schema_length=0)
    runs_raw = pl.read_csv(runs_table, infer_schema_length=0)
    steps, runs, left = [], [], []
    for i, record in enumerate(steps_raw.iter_rows(named=True), start=1):
        d = step_desc.get(i)
        key = engine_of(record["engine"], record["engine_version"])
        if d is None or key is None:
            left.append({"table": "decode steps", "row": i, "engine": record["engine"], "reason": step_reason(record)})
            continue
        batch = _int(record["batch"], 1)
        per_pass = _int(record["tokens_per_pass"], 1)
        tokens = batch * (d.tokens_per_sequence or per_pass)  # type: ignore[attr-defined]
        head_share, logit_rows = step_logits(key, _int(record["input_len"], 0), _int(record["output_len"], 0), tokens)
        expanded = d.expanded if d.expanded is not None else ENGINE_HOSTS[key].scoring == "batch-expansion" and tokens > batch  # type: ignore[attr-defined]
        steps.append(
            {
                "row": i, "source_url": record["source_url"], "engine": record["engine"], "engine_key": key,
                "device_key": d.device, "preset": d.preset, "weight_format": d.weight_format,  # type: ignore[attr-defined]
                "tp": _int(record["tp"], 1), "batch": batch, "tokens_per_forward": tokens,
                "context_tokens": d.context_tokens, "eager": _eager(d, record, key, tokens),  # type: ignore[arg-type, attr-defined]
                "sequences": tokens if expanded else batch, "verified_tokens": tokens if expanded else 0,
                "time_us": forward_time_us(float(record["value"]), record["unit"], per_pass),
                "head_share": head_share, "logit_rows": logit_rows,
            }
        )  # fmt: skip
    for i, record in enumerate(runs_raw.iter_rows(named=True), start=1):
        d = run_desc.get(i)
        key = engine_of(record["engine"], record["engine_version"])
        if d is None or key is None:
            left.append({"table": "speculative runs", "row": i, "engine": record["engine"], "reason": run_reason(record)})
            continue
        token_us = token_time_us(float(record["spec_value"]), record["metric"])
        speedup = d.measured_speedup  # type: ignore[attr-defined]
        baseline = token_us * speedup if math.isfinite(speedup) else token_time_us(float(record["baseline_value"]), record["metric"])
        tau = d.tau if math.isfinite(d.tau) else _number(record["acceptance"])  # type: ignore[attr-defined]
        runs.append(
            {
                "row": i, "source_url": record["source_url"], "engine": record["engine"], "engine_key": key,
                "device_key": d.device, "preset": d.preset, "weight_format": d.weight_format,  # type: ignore[attr-defined]
                "tp": _int(record["tp"], 1), "batch": _int(record["batch"], 1), "context_tokens": d.context_tokens,  # type: ignore[attr-defined]
                "drafter": d.drafter, "draft_format": d.draft_format or d.weight_format,  # type: ignore[attr-defined]
                "draft_len": d.draft_len or _int(record["draft_len"], 1), "tau": tau,  # type: ignore[attr-defined]
                "token_us": token_us, "baseline_token_us": baseline,
            }
        )  # fmt: skip
    return Described(pl.DataFrame(steps), pl.DataFrame(runs), left)


def step_reason(record: dict) -> str:
    """Why a decode-step row is not described (the first that applies)."""
    device, model, unit = (record["device"] or "NA"), record["model"], record["unit"]
    if "batch latency" in unit:
        return "tensor-parallel batch latency, NCCL against custom all-reduce: the parallel terms' rows, not a forward's engine time"
    if device.startswith("NA"):
        return "device not named in the source"
    if "s per request" in unit:
        return "time per request including prefill, device not named"
    if re.search(r"160m|gemma", model, re.I):
        return f"no preset of {model}"
    return "not described"


def run_reason(record: dict) -> str:
    """Why a speculative-run row is not described (the first that applies)."""
    device, target, acceptance = (record["device"] or "NA"), record["target_model"], record["acceptance"] or "NA"
    if "ROCm" in record["engine"]:
        return "concurrency not stated (baselines of 1.2-3.7k tok/s: many requests in flight); no MI300X in the catalog"
    if "hybrid" in target or "GDN" in target:
        return "dense-FFN hybrid with Gated DeltaNet attention: verify rolls back recurrent state, no preset"
    if re.search(r"\bratio\b", record["metric"]):
        return "speedup ratios read from figures, no acceptance, tensor parallel over 4 devices"
    if device.startswith("NA") or device.startswith("2 GPUs") or device.startswith("one 24GB"):
        return "device not named in the source"
    if (record["baseline_value"] or "NA") == "NA":
        return "no baseline without speculation in the source"
    if acceptance == "NA" or acceptance.startswith("<"):
        return "acceptance not stated (tokens per iteration unknown)"
    if "default" in (record["draft_len"] or ""):
        return "draft length not stated (the engine's default, not given)"
    return "not described"
