"""Expert bytes a pass requests, per-slot vs dedup, from a trace's routing and its geometry.

Per MoE layer and pass of n tokens: a per-slot engine requests n·K·b_e bytes, a deduplicating
engine U(n)·b_e, U = distinct experts the pass selects (b_e = bytes of one expert, from the model
preset's accounting). A batch of B sequences takes the union over its B·n slots. The routing
features come from `moesim.kernels`; this module adds the bytes and the tables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.kernels.features import uniform_distinct_experts
from moesim.kernels.unions import BatchLanes, UnionFeatures, union_features_many
from moesim.kernels.windows import MAX_PASS_LIMIT, WindowSummary, empty_summary, summarize_windows
from moesim.models import builtin_names, bytes_per_weight, load_preset
from moesim.sim.cost.pass_features import batch_pass_windows
from moesim.tracegen.formats.schema import TraceMeta
from moesim.tracegen.formats.trace import Trace, iter_chunks, read_meta, read_trace

PERCENTILES = (10.0, 50.0, 90.0)
DEFAULT_MAX_BATCHES = 2048


@dataclass(frozen=True)
class ExpertBytes:
    """Bytes of one routed expert and where the number comes from."""

    expert_bytes: float
    weight_format: str
    source: str


def expert_bytes_for(meta: TraceMeta, weight_format: str | None, where: str) -> ExpertBytes:
    """Bytes of one expert from the preset the trace names (a built-in MoE preset), else from the
    trace's geometry; the trace's top-k and expert count must match that preset."""
    g = meta.geometry
    fmt = (weight_format or g.weight_format).upper()
    bytes_per_weight(fmt)  # rejects an unknown format
    if g.model in builtin_names("moe"):
        preset = load_preset(g.model)
        for name, traced, expected in (("top_k", g.top_k, preset.top_k), ("experts", g.experts, preset.experts)):
            if traced != expected:
                raise InputError(
                    f"{where}: metadata field 'geometry.{name}' is {traced}, "
                    f"but the trace names preset '{g.model}' whose {name} is {expected}"
                )
        return ExpertBytes(preset.expert_bytes(fmt), fmt, f"preset '{g.model}' in {fmt}")
    shape_bytes = float(3 * g.hidden * g.expert_intermediate * bytes_per_weight(fmt))
    return ExpertBytes(shape_bytes, fmt, f"trace geometry (hidden {g.hidden}, expert intermediate {g.expert_intermediate}) in {fmt}")


@dataclass(frozen=True)
class PassBytesReport:
    """Routing features and expert bytes per pass size n (one row of `table` per n)."""

    trace: str
    model: str
    top_k: int
    experts: int
    moe_layers: tuple[int, ...]
    bytes: ExpertBytes
    batch: int
    windows: str  # which windows the rows count
    table: pl.DataFrame
    per_layer_byte_share: np.ndarray  # (L, N)
    extra: dict[str, Any] = field(default_factory=dict)

    def display_table(self) -> pl.DataFrame:
        """The per-n table with bytes in MB, for a terminal."""
        short = {
            "windows": "windows" if self.batch == 1 else "batches",
            "mean_distinct_experts": "mean_U",
            "uniform_distinct_experts": "uniform_U",
            "byte_share": "u(n)",
            "mean_max_tokens_per_expert": "mean_M",
            "p90_max_tokens_per_expert": "p90_M",
        }
        return (
            self.table.with_columns((pl.col("per_slot_bytes") / 1e6).alias("per_slot_MB"), (pl.col("dedup_bytes") / 1e6).alias("dedup_MB"))
            .drop("per_slot_bytes", "dedup_bytes")
            .rename(short)
        )

    def per_layer_table(self) -> pl.DataFrame:
        """Byte share u(n) per MoE layer at n = 1, 2, 4, ... and the largest n."""
        max_pass = self.per_layer_byte_share.shape[1]
        sizes = sorted({n for n in (2, 4, 8, 16, 32, 64) if n < max_pass} | {max_pass})
        columns = {f"u({n})": self.per_layer_byte_share[:, n - 1] for n in sizes}
        return pl.DataFrame({"layer": list(self.moe_layers), **columns})

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: the header fields and one object per pass size under "passes"."""
        passes = self.table.to_dicts()
        for row, share in zip(passes, self.per_layer_byte_share.T, strict=True):
            row["byte_share_per_layer"] = share.tolist()
        for key, values in self.extra.items():
            for row, value in zip(passes, values, strict=True):
                row[key] = value
        return {
            "trace": self.trace,
            "model": self.model,
            "top_k": self.top_k,
            "experts": self.experts,
            "moe_layers": list(self.moe_layers),
            "weight_format": self.bytes.weight_format,
            "expert_bytes": self.bytes.expert_bytes,
            "expert_bytes_source": self.bytes.source,
            "batch": self.batch,
            "windows": self.windows,
            "passes": passes,
        }


def _bytes_columns(frame: pl.DataFrame, expert_bytes: float, top_k: int, n_layers: int, batch: int) -> pl.DataFrame:
    return frame.with_columns(
        (pl.col("n") * batch * top_k * expert_bytes * n_layers).alias("per_slot_bytes"),
        (pl.col("mean_distinct_experts") * expert_bytes * n_layers).alias("dedup_bytes"),
    )


def summary_table(summary: WindowSummary, expert_bytes: float) -> pl.DataFrame:
    """Per n: windows, U (mean, p10/p50/p90), uniform-routing U, u(n), M (mean, p90), bytes per
    pass summed over MoE layers (per-slot and dedup)."""
    n = np.arange(1, summary.max_pass + 1)
    p_u = summary.distinct_experts_percentiles(list(PERCENTILES))
    p_m = summary.max_tokens_percentiles([90.0])
    frame = pl.DataFrame(
        {
            "n": n,
            "windows": summary.windows(),
            "mean_distinct_experts": summary.mean_distinct_experts(),
            "p10": p_u[0],
            "p50": p_u[1],
            "p90": p_u[2],
            "uniform_distinct_experts": uniform_distinct_experts(n, summary.n_experts, summary.top_k),
            "byte_share": summary.byte_share(),
            "mean_max_tokens_per_expert": summary.mean_max_tokens_per_expert(),
            "p90_max_tokens_per_expert": p_m[0],
        }
    )
    return _bytes_columns(frame, expert_bytes, summary.top_k, summary.n_layers, 1)


def pass_bytes_table(trace: Trace, max_pass: int) -> pl.DataFrame:
    """`summary_table` of every window of an in-memory trace, with the bytes of its own format."""
    g = trace.meta.geometry
    summary = summarize_windows(trace.experts, trace.seq_starts, g.experts, max_pass)
    return summary_table(summary, g.expert_bytes)


def _check_pass(max_pass: int, where: str) -> None:
    if not 1 <= max_pass <= MAX_PASS_LIMIT:
        raise InputError(f"{where}: --max-pass must be an integer in 1..{MAX_PASS_LIMIT}, got {max_pass}")


def window_bytes_report(
    path: str | os.PathLike[str], max_pass: int, weight_format: str | None = None, chunk_positions: int = 1 << 18
) -> PassBytesReport:
    """Bytes and routing features of every window of n = 1..max_pass consecutive positions of a
    sequence, streamed through the trace in chunks (bounded memory)."""
    _check_pass(max_pass, str(path))
    meta = read_meta(path)
    accounting = expert_bytes_for(meta, weight_format, str(path))
    g = meta.geometry
    summary = empty_summary(len(g.moe_layers), g.experts, g.top_k, max_pass)
    for chunk in iter_chunks(path, max_pass, chunk_positions):
        part = summarize_windows(chunk.trace.experts, chunk.trace.seq_starts, g.experts, max_pass, count_from=chunk.new_from)
        summary = summary.merge(part)
    windows = summary.windows()
    if windows[-1] == 0:
        longest = int(np.flatnonzero(windows)[-1]) + 1
        raise InputError(f"{path}: no sequence has {max_pass} positions (the longest has {longest}); lower --max-pass")
    return PassBytesReport(
        trace=str(path),
        model=g.model,
        top_k=g.top_k,
        experts=g.experts,
        moe_layers=g.moe_layers,
        bytes=accounting,
        batch=1,
        windows="every window of n consecutive positions within a sequence",
        table=summary_table(summary, accounting.expert_bytes),
        per_layer_byte_share=summary.byte_share_per_layer(),
    )


def batch_table(features: list[UnionFeatures], n_experts: int, top_k: int, batch: int, expert_bytes: float) -> pl.DataFrame:
    """Per n (features[n-1] over that n's batch passes): the `summary_table` columns for unions
    of B·n slots (the uniform column is E·(1 − (1 − K/E)^(B·n)))."""
    rows = []
    for n, f in enumerate(features, start=1):
        u = f.distinct_experts.reshape(-1)
        m = f.max_tokens_per_expert.reshape(-1)
        p_u = np.percentile(u, PERCENTILES, method="inverted_cdf")
        rows.append(
            {
                "n": n,
                "windows": f.n_tokens.size,
                "mean_distinct_experts": float(u.mean()),
                "p10": float(p_u[0]),
                "p50": float(p_u[1]),
                "p90": float(p_u[2]),
                "uniform_distinct_experts": float(uniform_distinct_experts(batch * n, n_experts, top_k)),
                "byte_share": float(u.mean() / (batch * n * top_k)),
                "mean_max_tokens_per_expert": float(m.mean()),
                "p90_max_tokens_per_expert": float(np.percentile(m, 90.0, method="inverted_cdf")),
            }
        )
    n_layers = features[0].distinct_experts.shape[1]
    return _bytes_columns(pl.DataFrame(rows), expert_bytes, top_k, n_layers, batch)


def batch_features(
    trace: Trace, max_pass: int, batch: int, max_batches: int = DEFAULT_MAX_BATCHES
) -> tuple[BatchLanes, list[UnionFeatures]]:
    """Union features of the batch passes of n = 1..max_pass tokens per lane (with the
    tokens-per-expert histogram), and the lanes they come from (`moesim.sim.cost.pass_features`)."""
    features = []
    for n in range(1, max_pass + 1):
        windows, lanes = batch_pass_windows(trace, batch, n, max_batches)
        features.append(union_features_many(trace.experts, *windows, trace.meta.geometry.experts, histogram=True))
    return lanes, features


def batch_bytes_report(
    path: str | os.PathLike[str],
    max_pass: int,
    batch: int,
    weight_format: str | None = None,
    max_batches: int = DEFAULT_MAX_BATCHES,
) -> PassBytesReport:
    """Bytes and routing features of batch passes: B lanes decoding in lockstep, each verifying n
    tokens, features of the union of the B·n slots per layer (MoESD). Reads the whole trace."""
    where = str(path)
    _check_pass(max_pass, where)
    if batch < 1:
        raise InputError(f"{where}: --batch must be >= 1, got {batch}")
    meta = read_meta(path)
    accounting = expert_bytes_for(meta, weight_format, where)
    trace = read_trace(path)
    g = meta.geometry
    try:
        lanes, features = batch_features(trace, max_pass, batch, max_batches)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    layers = len(g.moe_layers)
    # experts of a layer receiving c tokens, per batch pass and layer: index c of each list
    mean_experts_by_tokens = [(f.tokens_per_expert_histogram.sum(axis=0) / (f.n_tokens.size * layers)).tolist() for f in features]  # type: ignore[union-attr]
    per_layer = np.stack([f.distinct_experts.mean(axis=0) / (batch * n * g.top_k) for n, f in enumerate(features, start=1)], axis=1)
    return PassBytesReport(
        trace=where,
        model=g.model,
        top_k=g.top_k,
        experts=g.experts,
        moe_layers=g.moe_layers,
        bytes=accounting,
        batch=batch,
        windows=f"batch passes: {lanes.describe()}; offsets 0, n, 2n, ... (at most {max_batches} per n, evenly spread)",
        table=batch_table(features, g.experts, g.top_k, batch, accounting.expert_bytes),
        per_layer_byte_share=per_layer,
        extra={"mean_experts_by_tokens": mean_experts_by_tokens},
    )


def tokens_per_expert_table(trace: Trace, max_pass: int, batch: int) -> pl.DataFrame:
    """Per n: byte share and tokens per expert for one sequence's windows and for batch passes
    of `batch` lanes (slots per distinct expert, mean and p90 of the busiest expert's tokens)."""
    g = trace.meta.geometry
    single = summarize_windows(trace.experts, trace.seq_starts, g.experts, max_pass)
    _, features = batch_features(trace, max_pass, batch)
    batched = batch_table(features, g.experts, g.top_k, batch, g.expert_bytes)
    n = np.arange(1, max_pass + 1)
    return pl.DataFrame(
        {
            "n": n,
            "byte_share": single.byte_share(),
            "slots_per_expert": n * g.top_k / single.mean_distinct_experts(),
            "max_tokens_per_expert": single.mean_max_tokens_per_expert(),
            "p90_max_tokens": single.max_tokens_percentiles([90.0])[0],
            f"byte_share_B{batch}": batched["byte_share"],
            f"slots_per_expert_B{batch}": batch * n * g.top_k / batched["mean_distinct_experts"],
            f"max_tokens_per_expert_B{batch}": batched["mean_max_tokens_per_expert"],
        }
    )


def bytes_report(path: str | os.PathLike[str], max_pass: int, batch: int = 1, weight_format: str | None = None) -> PassBytesReport:
    """`window_bytes_report` for B = 1, `batch_bytes_report` otherwise."""
    if batch == 1:
        return window_bytes_report(path, max_pass, weight_format)
    return batch_bytes_report(path, max_pass, batch, weight_format)
