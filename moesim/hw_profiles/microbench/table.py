"""Measurement tables written by the microbenchmark runners (contract 3) and their provenance.

One row per measured (engine, shape, pass size, routing): `kernel` (the family), `n_tokens`,
`time_us` (median per MoE layer) with its spread, the pass's routing features, the expert's shape
and the bytes the family reads (as it asks for them). Every output folder holds `measurements.parquet` and
`provenance.json` (machine, versions, method, configuration); both are written atomically.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.atomic import output_dir
from moesim.errors import InputError
from moesim.hw_profiles.measurements.table import DEVICE_NAME, PROVENANCE_NAME, TABLE_NAME, is_family, load_measurements
from moesim.kernels.features import RoutingFeatures
from moesim.models import ExpertShape, ModelPreset
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec

# Column order of a runner's table: the contract's columns first, then the runner's own.
COLUMNS = (
    "kernel", "engine", "model", "device", "n_tokens", "layers", "routing", "distinct_experts", "slots",
    "max_tokens_per_expert", "hidden", "expert_intermediate", "experts", "top_k", "dtype", "expert_bytes",
    "bytes_requested", "time_us", "time_us_p10", "time_us_p90", "time_us_min", "reps",
)  # fmt: skip


@dataclass(frozen=True)
class MoeShape:
    """The routed-expert shape a benchmark runs: one expert is gate, up and down (SwiGLU)."""

    model: str
    hidden: int
    expert_intermediate: int
    experts: int
    top_k: int
    weight_format: str = "BF16"

    @classmethod
    def from_preset(cls, preset: ModelPreset, weight_format: str = "BF16") -> MoeShape:
        """The routed experts of a MoE preset."""
        if preset.kind != "moe":
            raise InputError(f"model '{preset.name}' has no routed experts")
        return cls(preset.name, preset.hidden, preset.expert_intermediate, preset.experts, preset.top_k, weight_format.upper())

    def with_overrides(self, **fields: int | None) -> MoeShape:
        """The shape with the given fields replaced (None keeps a field); the model name says so."""
        given = {k: v for k, v in fields.items() if v is not None}
        if not given:
            return self
        label = ",".join(f"{k}={v}" for k, v in sorted(given.items()))
        return dataclasses.replace(self, model=f"{self.model}[{label}]", **given)

    @property
    def expert_bytes(self) -> float:
        """Bytes of one expert = 3·hidden·intermediate · bytes per weight."""
        return ExpertShape(self.hidden, self.expert_intermediate, self.weight_format).expert_bytes

    @property
    def dtype(self) -> str:
        """Weight format as the tables spell it (lower case, as in the H200 table)."""
        return self.weight_format.lower()

    def llama_spec(self, layers: int, heads: int, kv_heads: int, vocab: int, seed: int, name: str, **extra: Any) -> TinyModelSpec:
        """A llama (Mixtral-style) model of these routed experts for the tiny-model builder (`extra`:
        other spec fields; experts=0, top_k=0 give its dense twin)."""
        shape = {"experts": self.experts, "top_k": self.top_k, **extra}
        return TinyModelSpec(arch="llama", layers=layers, hidden=self.hidden, expert_ff=self.expert_intermediate, heads=heads,
                             kv_heads=kv_heads, vocab=vocab, weight_type=self.weight_format, seed=seed, name=name, **shape)  # fmt: skip


@dataclass(frozen=True)
class TimingSummary:
    """Median and spread of repeated timings of one operation, in microseconds (spread None when
    a tool reports only a mean)."""

    time_us: float
    time_us_p10: float | None
    time_us_p90: float | None
    time_us_min: float | None
    reps: int


def summarize_times(samples_us: Sequence[float]) -> TimingSummary:
    """Median, 10th/90th percentiles (linear interpolation) and minimum of the samples."""
    values = np.asarray(samples_us, np.float64)
    if values.size == 0:
        raise ValueError("no timing samples")
    p10, median, p90 = np.percentile(values, [10, 50, 90])
    return TimingSummary(float(median), float(p10), float(p90), float(values.min()), int(values.size))


def bytes_requested(kernel: str, features: RoutingFeatures, expert_bytes: float) -> float:
    """Per-slot families request slots·b_e; deduplicating families U·b_e."""
    count = features.slots if kernel == "per_slot" else features.distinct_experts
    return float(count) * expert_bytes


def measurement_row(
    *,
    kernel: str,
    engine: str,
    device: str,
    shape: MoeShape,
    routing: str,
    features: RoutingFeatures,
    timing: TimingSummary,
    layers: int = 1,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One contract-3 row; `time_us` is the time of `layers` MoE layers' expert operation."""
    if not is_family(kernel):
        raise ValueError(f"'{kernel}' is not a kernel family")
    row: dict[str, Any] = {
        "kernel": kernel,
        "engine": engine,
        "model": shape.model,
        "device": device,
        "n_tokens": int(features.n_tokens),
        "layers": layers,
        "routing": routing,
        "distinct_experts": int(features.distinct_experts),
        "slots": int(features.slots),
        "max_tokens_per_expert": int(features.max_tokens_per_expert),
        "hidden": shape.hidden,
        "expert_intermediate": shape.expert_intermediate,
        "experts": shape.experts,
        "top_k": shape.top_k,
        "dtype": shape.dtype,
        "expert_bytes": shape.expert_bytes,
        "bytes_requested": bytes_requested(kernel, features, shape.expert_bytes),
        "time_us": timing.time_us,
        "time_us_p10": timing.time_us_p10,
        "time_us_p90": timing.time_us_p90,
        "time_us_min": timing.time_us_min,
        "reps": timing.reps,
    }
    row.update(extra or {})
    return row


def rows_to_frame(rows: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    """Rows as a polars frame, contract columns first in a fixed order."""
    if not rows:
        raise InputError("the benchmark measured nothing (no rows)")
    frame = pl.DataFrame(list(rows), infer_schema_length=None)
    ordered = [c for c in COLUMNS if c in frame.columns]
    return frame.select(ordered + [c for c in frame.columns if c not in ordered])


def write_measurements(
    rows: Sequence[Mapping[str, Any]],
    out_dir: Path,
    provenance: Mapping[str, Any],
    device: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Path:
    """Write `provenance.json`, `device.json` when given (device facts and ceilings in the format of
    `data/h200/device.json`, which `profile fit` reads beside a table) and `measurements.parquet`
    into `out_dir`, each atomically; the table is checked against contract 3 before it replaces an
    older one. Returns the table's path."""
    frame = rows_to_frame(rows)
    with output_dir(out_dir, force) as staging:
        for name, payload in ((PROVENANCE_NAME, provenance), (DEVICE_NAME, device)):
            if payload is not None:
                (staging / name).write_text(json.dumps(payload, indent=1, sort_keys=True, default=str) + "\n")
        frame.write_parquet(staging / TABLE_NAME)
        load_measurements(staging / TABLE_NAME)
    return out_dir / TABLE_NAME


def rows_summary(rows: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    """Rows per kernel family and engine with their smallest and largest pass size."""
    n_tokens = pl.col("n_tokens")
    summary = (
        pl.DataFrame(rows)
        .group_by("kernel", "engine")
        .agg(pl.len().alias("rows"), n_tokens.min().alias("n_min"), n_tokens.max().alias("n_max"))
    )
    return summary.sort("kernel", "engine")
