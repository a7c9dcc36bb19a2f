"""`moesim batch`: speedup and MoESD target efficiency T(B, 1) / T(B, v) against the batch size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.parsing import parse_int
from moesim.sim.analysis.moesd import target_efficiency
from moesim.sim.analysis.ranks import union_pass_cost
from moesim.sim.analysis.scenario import Scenario, extrapolation_warnings, uniform_twin
from moesim.sim.analysis.speculation import (
    check_acceptance,
    check_draft_lengths,
    tokens_per_pass,
)
from moesim.sim.cost.drafters import draft_us
from moesim.sim.cost.trace_batch import spec_overhead_us
from moesim.tracegen.formats.trace import Trace


@dataclass(frozen=True)
class BatchEffect:
    """Per batch size B: target pass times for 1 and v tokens per sequence, MoESD's target
    efficiency T(B, 1) / T(B, v), and the speedup of speculation at α and k."""

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
    warnings: list[str] = field(default_factory=list)
    tokens_per_pass: float | None = None  # τ of the drafter's tree at α (None: the chain's τ(k, α))
    spec_us: np.ndarray | None = None  # the profile's spec-path overhead per B (None: no [speculative] table)

    @property
    def efficiency(self) -> np.ndarray:
        """T_T(B, 1) / T_T(B, v)."""
        return target_efficiency(self.single_us, self.verify_us)

    @property
    def speedup(self) -> np.ndarray:
        """S(B) = τ·T(B, 1) / (T_draft(B, k) + T(B, v) + O(B)), v = k + 1 or the tree's width."""
        tau = tokens_per_pass(self.draft_len, self.alpha) if self.tokens_per_pass is None else self.tokens_per_pass
        spent = self.draft_us + self.verify_us if self.spec_us is None else self.draft_us + self.verify_us + self.spec_us
        return tau * self.single_us / spent

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
        tree = {} if self.tokens_per_pass is None else {"tokens_per_pass": self.tokens_per_pass}
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
    check_acceptance(alpha)
    k = int(check_draft_lengths(draft_len))
    if k < 1:
        raise InputError(f"batch analysis needs a draft length >= 1, got {k}")
    if not batches or min(batches) < 1:
        raise InputError(f"batch sizes must be >= 1, got {batches}")
    if routing not in ("trace", "uniform"):
        raise InputError(f"routing must be 'trace' or 'uniform', got '{routing}'")
    trace = scenario.trace if routing == "trace" else uniform_twin(scenario.trace, scenario.model.preset, batch=max(batches))
    tree = scenario.drafter.tree
    if moesd_slots and not tree.is_chain:
        raise InputError("--moesd-slots verifies gamma = k slots of a chain; the drafter has a tree")
    verify = k if moesd_slots else tree.width(k)
    spec = scenario.model.profile.speculative
    layers = scenario.model.preset.layers
    rows = []
    for b in batches:  # the passes' costs hold the engine's time per forward (StepTimeModel.engine_us)
        single, _, x1, source = _batch_pass_us(scenario, trace, b, 1, max_batches)
        multi, distinct, xv, _ = _batch_pass_us(scenario, trace, b, verify, max_batches)
        drafted = draft_us(scenario.drafter, np.full(b, k), scenario.context_tokens, scenario.dense_us)
        overhead = spec_overhead_us(spec, scenario.drafter, k, b * verify, b, layers)
        rows.append((single, multi, drafted, distinct, max(x1, xv), f"B={b}: {source}", overhead))
    single, multi, drafted, distinct, factor, source, overheads = zip(*rows, strict=True)
    sizes = np.asarray(batches)
    return BatchEffect(
        alpha=float(alpha),
        draft_len=k,
        verify_tokens=verify,
        batch=sizes,
        single_us=np.asarray(single),
        verify_us=np.asarray(multi),
        draft_us=np.asarray(drafted),
        distinct_experts=np.asarray(distinct),
        extrapolation=np.asarray(factor),
        source=list(source),
        warnings=extrapolation_warnings("batch", "B", np.asarray(factor), sizes),
        tokens_per_pass=None if tree.is_chain else float(tree.tokens_per_pass(k, np.array([alpha]))[0]),
        spec_us=None if spec is None else np.asarray(overheads),
    )


def parse_batch_sizes(text: str, option: str = "--batch") -> list[int]:
    """'1,2,4' -> [1, 2, 4]; an empty item, a non-integer or a size below 1 is one line."""
    if len(text) > 1 << 16:
        raise InputError(f"{option}: {len(text)} characters, more than any list of sizes needs")
    sizes = [parse_int(b, f"{option} '{text[:60]}' (comma-separated integers)") for b in text.split(",")]
    if min(sizes) < 1:
        raise InputError(f"{option} sizes must be >= 1, got {min(sizes)}")
    return sizes
