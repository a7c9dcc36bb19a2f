"""What every importer produces: one `Measured` per timed test, then a checked contract-3 table.

A llama-bench `ppN` test with microbatch U runs ceil(N/U) passes of U tokens over a context
growing by U per pass, after `n_depth` = D tokens already in the KV cache, each token attending
through the causal mask over the keys up to its own; llama-bench asks for
logits of the last token of each `n_batch` chunk only, so the output head runs once per chunk.
A `tgN` test runs N one-token passes, each with its logits. llama-batched-bench's decode phase
runs `tg` passes of B tokens (one per sequence, all with logits), sequence i at context pp + j.
Kernel benchmarks time one MoE layer's operation at a batch of M tokens (scope `op`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import polars as pl

from moesim.errors import InputError
from moesim.filters import apply_filters, parse_filters
from moesim.hw_profiles.importers.names import ExpertGeometry
from moesim.hw_profiles.measurements.table import DISPATCH_KERNEL, check_measurements
from moesim.models import load_preset

LLAMA_DEFAULT_UBATCH = 512
LLAMA_DEFAULT_BATCH = 2048
MAX_TOKENS = 1 << 24  # tokens of a test, a microbatch, a depth: beyond any context an engine runs
MAX_TEST_NS = 1e15  # a test's time in ns (11 days)


@dataclass(frozen=True)
class PassScope:
    """How the passes of one test ran: tokens per pass, passes, the keys a query token attends over
    (mean over the passes' tokens, summed over sequences), share of passes with the output head,
    rows of the head, sequences."""

    n_tokens: int
    passes: int = 1
    context_tokens: float = 0.0
    head_share: float = 1.0
    logit_rows: int = 1
    sequences: int = 1


def prompt_scope(prompt_tokens: int, ubatch: int, depth: int = 0, batch: int = LLAMA_DEFAULT_BATCH) -> PassScope:
    """A llama-bench `ppN @ dD` test: ceil(N/U) passes of U = min(N, U) tokens, the head once per
    n_batch chunk; through the causal mask, token i (1..U) of pass j attends over D + (j−1)·U + i
    keys: the mean over tokens and passes D + (U·P + 1)/2 (a pp512 pass of 512 tokens attends over
    256.5 keys per token, not 512)."""
    n = min(prompt_tokens, ubatch)
    passes = math.ceil(prompt_tokens / n)
    heads = math.ceil(prompt_tokens / max(batch, n))
    return PassScope(n, passes, depth + (n * passes + 1) / 2, min(1.0, heads / passes))


def decode_scope(generated_tokens: int, depth: int = 0, sequences: int = 1, prompt_tokens: int = 0) -> PassScope:
    """`tgN` (one sequence) or batched-bench's decode of B sequences: N passes of B tokens, each
    with logits, sequence contexts pp + D + j (j = 1..N)."""
    context = sequences * (prompt_tokens + depth + (generated_tokens + 1) / 2)
    return PassScope(sequences, generated_tokens, context, 1.0, sequences, sequences)


@dataclass(frozen=True)
class Measured:
    """One timed test as an importer read it: the time per pass (or per op), its scope, what ran."""

    time_us: float
    scope: str
    passes: PassScope
    model: str = ""
    expert_format: str = ""
    dense_format: str = ""
    geometry: ExpertGeometry | None = None
    kernel: str = DISPATCH_KERNEL
    device: str = ""
    engine: str = ""
    engine_version: str = ""
    variant: str = ""
    source: str = ""
    source_row: int = 0
    time_source: str = ""
    test: str = ""

    def with_context(self, **changes: object) -> Measured:
        """The same measurement with some fields replaced (device, model, engine, …)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def row(self) -> dict[str, object]:
        """The contract-3 row (shape from the preset, or the benchmark's own geometry)."""
        if self.geometry is not None:
            geometry = self.geometry
        else:
            preset = load_preset(self.model)
            geometry = ExpertGeometry(preset.hidden, preset.expert_intermediate, preset.experts, preset.top_k)
        p = self.passes
        return {
            "kernel": self.kernel,
            "n_tokens": p.n_tokens,
            "time_us": self.time_us,
            "scope": self.scope,
            "model": self.model or f"E{geometry.experts} k{geometry.top_k} {geometry.hidden}x{geometry.intermediate}",
            "dtype": self.expert_format,
            "dense_format": self.dense_format or self.expert_format,
            "hidden": geometry.hidden,
            "expert_intermediate": geometry.intermediate,
            "experts": geometry.experts,
            "top_k": geometry.top_k,
            "slots": p.n_tokens * geometry.top_k,
            "passes": p.passes,
            "context_tokens": p.context_tokens,
            "head_share": p.head_share,
            "logit_rows": p.logit_rows,
            "sequences": p.sequences,
            "routing": "uniform",
            "device": self.device,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "variant": self.variant,
            "source": self.source,
            "source_row": self.source_row or None,
            "time_source": self.time_source,
            "test": self.test,
        }


def checked_frame(frame: pl.DataFrame, origin: str, filters: tuple[str, ...] = ()) -> pl.DataFrame:
    """A contract-3 table checked, filtered (COLUMN=VALUE), and refused when it mixes what must not mix."""
    frame = apply_filters(check_measurements(frame, origin), parse_filters(list(filters)), origin)
    refuse_mixed(frame, origin)
    return frame


def measurements_frame(measured: list[Measured], origin: str, filters: tuple[str, ...] = ()) -> pl.DataFrame:
    """The checked contract-3 table of the measurements."""
    if not measured:
        raise InputError(f"{origin}: no timed tests found")
    return checked_frame(pl.DataFrame([m.row() for m in measured], infer_schema_length=None), origin, filters)


def refuse_mixed(frame: pl.DataFrame, origin: str) -> None:
    """A table may hold one device, and one variant per measured point: two variants (builds,
    branches, configs) timing the same test are different kernels that one fit must not average."""
    devices = frame["device"].unique(maintain_order=True).to_list()
    if len(devices) > 1:
        shown = ", ".join(repr(d) for d in devices[:4])
        raise InputError(f"{origin}: the table mixes {len(devices)} devices ({shown}, …): select one with --filter device=NAME")
    key = ["model", "dtype", "scope", "test", "n_tokens", "context_tokens"]
    clash = (
        frame.group_by(key, maintain_order=True).agg(pl.col("variant").unique().alias("variants")).filter(pl.col("variants").list.len() > 1)
    )
    if clash.height:
        first = clash.row(0, named=True)
        variants = ", ".join(repr(v) for v in first["variants"][:3])
        raise InputError(
            f"{origin}: the table mixes variants ({variants}) of the same test ({first['model']}, {first['test']}, "
            f"{first['n_tokens']} tokens per pass): select one with --filter variant=NAME"
        )
