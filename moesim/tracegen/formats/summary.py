"""A trace's summary: what `moesim trace info` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import polars as pl

from moesim.kernels.locality import experts_used, reuse
from moesim.tracegen.formats.trace import Trace


@dataclass(frozen=True)
class TraceSummary:
    """Counts and per-layer locality of one trace."""

    model: str
    engine: str
    backend: str
    sequences: int
    tokens: int
    prompt_tokens: int
    layers: int
    moe_layers: list[int]
    experts: int
    top_k: int
    experts_used_per_layer: list[int]
    reuse_per_layer: list[float]
    mean_reuse: float
    groups: dict[str, int]
    provenance: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return asdict(self)

    def per_layer_table(self) -> pl.DataFrame:
        """One row per MoE layer."""
        return pl.DataFrame({"layer": self.moe_layers, "experts_used": self.experts_used_per_layer, "reuse": self.reuse_per_layer})


def summarize_trace(trace: Trace) -> TraceSummary:
    """Summarise a trace; reuse is mean |S_t ∩ S_t+1| / K over consecutive positions (NaN if none)."""
    g = trace.meta.geometry
    per_layer_reuse = reuse(trace.experts, trace.seq_starts, g.experts, 1)[:, 0]
    return TraceSummary(
        model=g.model,
        engine=f"{trace.meta.engine} {trace.meta.engine_version}".strip(),
        backend=trace.meta.backend,
        sequences=trace.n_seqs,
        tokens=trace.n_tokens,
        prompt_tokens=int(np.count_nonzero(trace.is_prompt)),
        layers=g.layers,
        moe_layers=list(g.moe_layers),
        experts=g.experts,
        top_k=g.top_k,
        experts_used_per_layer=experts_used(trace.experts, g.experts).tolist(),
        reuse_per_layer=per_layer_reuse.tolist(),
        mean_reuse=float(np.nanmean(per_layer_reuse)) if np.isfinite(per_layer_reuse).any() else float("nan"),
        groups={g.name: g.seqs for g in trace.meta.groups},
        provenance=dict(trace.meta.provenance),
    )
