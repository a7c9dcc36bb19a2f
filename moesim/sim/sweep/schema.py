"""The rows of a sweep's Parquet file: key columns, pass-row, point-row and simulation-row
columns (docs/sweeps.md), as one Arrow schema."""

from __future__ import annotations

import polars as pl
import pyarrow as pa

KEYS = {
    "record": pa.string(),  # "pass" (one per n and kernel family or engine) or "point" (one per α and k)
    "model": pa.string(),
    "profile": pa.string(),
    "routing": pa.string(),
    "batch": pa.int32(),
    "context_tokens": pa.int32(),
    "engine": pa.string(),
    "family": pa.string(),
    "drafter": pa.string(),
    "policy": pa.string(),
    "n": pa.int32(),
    "draft_len": pa.int32(),
    "alpha": pa.float64(),
}
PASS_COLUMNS = {
    "time_us": pa.float64(),
    "low_us": pa.float64(),
    "high_us": pa.float64(),
    "expert_us": pa.float64(),
    "dense_us": pa.float64(),
    "fixed_us": pa.float64(),
    "distinct_experts": pa.float64(),
    "byte_share": pa.float64(),
    "bandwidth_ratio": pa.float64(),
    "dedup_wins": pa.bool_(),
    "extrapolation": pa.float64(),
}
POINT_COLUMNS = {
    "tokens_per_pass": pa.float64(),
    "draft_us": pa.float64(),
    "verify_us": pa.float64(),
    "relative_cost": pa.float64(),
    "speedup": pa.float64(),
    "speedup_low": pa.float64(),
    "speedup_high": pa.float64(),
    "best_draft": pa.bool_(),
}
SIMULATION_COLUMNS = {  # besides speedup and tokens_per_pass (as in point rows, but simulated)
    "throughput_tok_s": pa.float64(),
    "tpot_speedup": pa.float64(),
    "tpot_mean_us": pa.float64(),
    "tpot_p99_us": pa.float64(),
    "worst_slowdown": pa.float64(),
    "mean_draft_len": pa.float64(),
    "acceptance_rate": pa.float64(),
    "iterations": pa.int64(),
    "rate_per_s": pa.float64(),  # an open loop's Poisson arrival rate (null: a closed loop of B)
}
SCHEMA = pa.schema([pa.field(name, kind) for name, kind in {**KEYS, **PASS_COLUMNS, **POINT_COLUMNS, **SIMULATION_COLUMNS}.items()])
TALLY_KEY = b"moesim.simulation"
POLARS_SCHEMA = pl.from_arrow(SCHEMA.empty_table()).schema  # type: ignore[union-attr]
