"""`moesim batch`: speedup and MoESD target efficiency T(B, 1) / T(B, v) against the batch size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.sim.analysis.scenario import Scenario, extrapolation_warnings, uniform_twin
from moesim.sim.analysis.speculation import batch_iteration, target_efficiency
from moesim.sim.cost.pass_features import union_pass_cost
from moesim.tracegen.formats.trace import Trace


@dataclass(frozen=True)
class BatchEffect:
    """Per batch size B: target pass times for 1 and v tokens per sequence, MoESD's target
    efficiency T(B, 1) / T(B, v), and the speedup of speculation at α and k (τ: `tokens_per_pass`)."""

    alpha: float
    draft_len: int
    verify_tokens: int
    batch: np.ndarray
    single_us: np.ndarray
    verify_us: np.ndarray
    draft_us: np.ndarray
    distinct_experts: np.ndarray
    extrapolation: np.ndarray
    source: list[str]
    tokens_per_pass: float
    warnings: list[str] = field(default_factory=list)
    tree: bool = False  # τ is the drafter's tree's at α, not the chain's τ(k, α)
    spec_us: np.ndarray | None = None  # the profile's spec-path overhead per B (None: no [speculative] table)

    @property
    def efficiency(self) -> np.ndarray:
        """T_T(B, 1) / T_T(B, v)."""
        return target_efficiency(self.single_us, self.verify_us)

    @property
    def speedup(self) -> np.ndarray:
        """S(B) = τ·T(B, 1) / (T_draft(B, k) + T(B, v) + O(B)), v = k + 1 or the tree's width."""
        spent = self.draft_us + self.verify_us if self.spec_us is None else self.draft_us + self.verify_us + self.spec_us
        return self.tokens_per_pass * self.single_us / spent

    def table(self) -> pl.DataFrame:
        """One row per B."""
        extra = {} if self.spec_us is None else {"spec_us": self.spec_us}
        return pl.DataFrame(
            {
                "batch": self.batch,
                "single_us": self.single_us,
                "verify_us": self.verify_us,
                "draft_us": self.draft_us,
                **extra,
                "distinct_experts": self.distinct_experts,
                "target_efficiency": self.efficiency,
                "speedup": self.speedup,
                "extrapolation": self.extrapolation,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        tree = {"tokens_per_pass": self.tokens_per_pass} if self.tree else {}
        return {
            "alpha": self.alpha,
            "draft_len": self.draft_len,
            "verify_tokens": self.verify_tokens,
            **tree,
            "batches": self.table().to_dicts(),
            "lanes": self.source,
            "warnings": self.warnings,
        }


def _batch_pass_us(scenario: Scenario, trace: Trace, batch: int, n: int, max_batches: int) -> tuple[float, float, float, str]:
    cost, distinct, lanes = union_pass_cost(scenario.model, trace, batch, n, max_batches, scenario.context_tokens)
    return float(cost.total_us().mean()), float(distinct.mean()), float(cost.extrapolation.max()), lanes


def batch_analysis(
    scenario: Scenario,
    alpha: float,
    draft_len: int,
    batches: list[int],
    moesd_slots: bool = False,
    routing: str = "trace",
    max_batches: int = 256,
) -> BatchEffect:
    """Speedup and target efficiency vs batch size. MoESD's convention verifies γ = k slots per
    sequence (`moesd_slots`); moesim's verifies k + 1, or the width of the drafter's tree at k; the
    profile's spec-path terms (if any) add to every iteration."""
    if routing not in ("trace", "uniform"):
        raise InputError(f"routing must be 'trace' or 'uniform', got '{routing}'")
    trace = scenario.trace if routing == "trace" else uniform_twin(scenario.trace, scenario.model.preset, batch=max(batches))
    # the one-token passes first: each batch size fits the trace (`fitting_lanes`) before the
    # iteration lays out anything per request (an array of B); the passes' costs hold the engine's
    # time per forward (StepTimeModel.engine_us)
    singles = [_batch_pass_us(scenario, trace, b, 1, max_batches) for b in batches]
    iteration = batch_iteration(scenario, alpha, draft_len, batches, moesd_slots)
    rows = []
    for b, (single, _, x1, source) in zip(batches, singles, strict=True):
        multi, distinct, xv, _ = _batch_pass_us(scenario, trace, b, iteration.verify_tokens, max_batches)
        rows.append((single, multi, distinct, max(x1, xv), f"B={b}: {source}"))
    single, multi, distinct, factor, source = zip(*rows, strict=True)
    sizes = np.asarray(batches)
    return BatchEffect(
        alpha=float(alpha),
        draft_len=iteration.draft_len,
        verify_tokens=iteration.verify_tokens,
        batch=sizes,
        single_us=np.asarray(single),
        verify_us=np.asarray(multi),
        draft_us=iteration.draft_us,
        distinct_experts=np.asarray(distinct),
        extrapolation=np.asarray(factor),
        source=list(source),
        tokens_per_pass=iteration.tokens_per_pass,
        warnings=extrapolation_warnings("batch", "B", np.asarray(factor), sizes),
        tree=iteration.tree,
        spec_us=iteration.spec_us,
    )
