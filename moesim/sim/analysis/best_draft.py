"""`moesim best-draft`: the best draft length k*(α) with its speedup, interval over the error box,
staircase and break-even acceptances; with `verdict`, whether speculation pays at all and why
(`moesim.sim.analysis.verdict`). The drafter's tree sets every k's verify width; the profile's
spec-path terms add to every speculative iteration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.sim.analysis.scenario import LARGEST_PASS, Scenario, extrapolation_warnings
from moesim.sim.analysis.speculation import best_in_table, break_even_and_staircase, check_draft_lengths, spec_costs, speedup_tables
from moesim.sim.analysis.verdict import AcceptancePoint, Verdict, acceptance_points, verdicts


@dataclass(frozen=True)
class BestDraft:
    """k*(α) with speedups, their intervals, ambiguity, the staircase and break-even acceptances;
    for trees, batches, spec-path terms and other acceptances, what they were, and the verdicts."""

    alpha: np.ndarray
    best_draft: np.ndarray
    speedup: np.ndarray
    speedup_low: np.ndarray
    speedup_high: np.ndarray
    best_draft_low: np.ndarray
    best_draft_high: np.ndarray
    relative_cost: np.ndarray
    break_even: np.ndarray
    steps: list[tuple[float, int]]
    warnings: list[str] = field(default_factory=list)
    acceptance: tuple[str, ...] = ()  # labels of the points when any is not a plain α
    verify_tokens: tuple[int, ...] = ()  # per k when the drafter verifies a tree
    spec_overhead_us: tuple[float, ...] = ()  # per k when the profile has spec-path terms
    batch: int = 1
    verdicts: tuple[Verdict, ...] = ()

    def table(self) -> pl.DataFrame:
        """One row per acceptance point."""
        frame = pl.DataFrame(
            {
                "alpha": self.alpha,
                "best_draft": self.best_draft,
                "speedup": self.speedup,
                "speedup_low": self.speedup_low,
                "speedup_high": self.speedup_high,
                "best_draft_range": [
                    f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in zip(self.best_draft_low, self.best_draft_high, strict=True)
                ],
            }
        )
        return frame.with_columns(acceptance=pl.Series(self.acceptance)) if self.acceptance else frame

    def verdict_table(self) -> pl.DataFrame:
        """One row per acceptance point: does speculation pay, at which k, and why (the terms in --json)."""
        return pl.DataFrame(
            [
                {
                    "acceptance": v.acceptance,
                    "verdict": v.verdict,
                    "k": v.draft_len,
                    "verify": v.verify_tokens,
                    "tau": v.tokens_per_pass,
                    "speedup": f"{v.speedup:.3f} ({v.speedup_low:.3f}-{v.speedup_high:.3f})",
                    "break_even": v.break_even_tokens,
                    "decided_by": v.decided_by,
                    "uncertain_by": v.uncertain_by if v.verdict == "uncertain" else "",
                }
                for v in self.verdicts
            ]
        )

    def calibrations(self) -> list[str]:
        """For each uncertain verdict: the part that decides it and what would pin it down."""
        return [f"{v.acceptance}: uncertain, decided by {v.uncertain_by}: {v.calibrate}" for v in self.verdicts if v.verdict == "uncertain"]

    def to_dict(self) -> dict[str, Any]:
        """JSON form: `points` as the issue specifies, plus staircase and break-even (and what else was asked)."""
        points = [
            {
                "alpha": float(a),
                "best_draft": int(k),
                "speedup": float(s),
                "speedup_low": float(lo),
                "speedup_high": float(hi),
                "best_draft_low": int(klo),
                "best_draft_high": int(khi),
                "ambiguous": bool(klo != khi),
            }
            for a, k, s, lo, hi, klo, khi in zip(
                self.alpha,
                self.best_draft,
                self.speedup,
                self.speedup_low,
                self.speedup_high,
                self.best_draft_low,
                self.best_draft_high,
                strict=True,
            )
        ]
        for point, label in zip(points, self.acceptance, strict=False):
            point["acceptance"] = label
        out: dict[str, Any] = {
            "points": points,
            "relative_cost": self.relative_cost.tolist(),
            "break_even_alpha": [None if not np.isfinite(a) else float(a) for a in self.break_even],
            "staircase": [{"from_alpha": a, "best_draft": k} for a, k in self.steps],
            "warnings": self.warnings,
        }
        extras = {"verify_tokens": list(self.verify_tokens), "spec_overhead_us": list(self.spec_overhead_us)}
        out.update({key: value for key, value in extras.items() if value})
        if self.batch != 1:
            out["batch"] = self.batch
        if self.verdicts:
            out["verdict"] = [v.to_dict() for v in self.verdicts]
        return out


DEFAULT_MAX_DRAFT = 8  # the largest draft length k of best-draft when none is given


def best_draft_analysis(
    scenario: Scenario,
    alphas: list[float] | np.ndarray,
    max_draft: int | None = None,
    *,
    accept_lengths: list[str] | None = None,
    depth_rates: list[str] | None = None,
    runs: list[str] | None = None,
    batch: int = 1,
    verdict: bool = False,
) -> BestDraft:
    """Best draft length k = 0..max_draft per acceptance point, with intervals from the families' ε
    (and the spec-path terms' bound); `verdict` adds whether speculation pays at each point.
    `max_draft` None: DEFAULT_MAX_DRAFT, or the depth of a static tree (paths) when shallower."""
    depth = scenario.drafter.tree.max_depth
    if max_draft is None:
        max_draft = DEFAULT_MAX_DRAFT if depth is None else min(DEFAULT_MAX_DRAFT, depth)
    elif depth is not None and max_draft > depth:
        raise InputError(
            f"--max-draft {max_draft} is deeper than the drafter's tree ({scenario.drafter.tree.label()} reaches depth {depth}): "
            f"give --max-draft {depth} or less, or a deeper tree"
        )
    check_draft_lengths(max_draft, "max draft length")
    if max_draft > LARGEST_PASS - 1:  # a verify pass is k + 1 tokens
        raise InputError(f"the largest draft length (--max-draft) must lie in 0..{LARGEST_PASS - 1}, got {max_draft}")
    longest = int(scenario.trace.seq_lengths().max())
    if max_draft + 1 > longest:
        raise InputError(f"--max-draft {max_draft} needs passes of {max_draft + 1} positions; the longest in the trace has {longest}")
    if batch < 1:
        raise InputError(f"batch must be >= 1, got {batch}")
    tree = scenario.drafter.tree
    points: list[AcceptancePoint] = acceptance_points(list(np.ravel(alphas)), accept_lengths or [], depth_rates or [], runs or [], tree)
    costs = spec_costs(scenario, max_draft, batch)
    taus, tables = speedup_tables([p.rates for p in points], costs, tree)
    nominal = costs.relative()
    k_star, s_star = best_in_table(tables[0])
    index = np.arange(len(points))
    at_corners = [t[index, k_star] for t in tables]  # the nominal point with the corners (a term's bound may be a factor)
    k_corners = np.stack([best_in_table(t)[0] for t in tables[1:]])
    break_even, steps = break_even_and_staircase(tree, nominal)
    return BestDraft(
        alpha=np.array([p.alpha for p in points]),
        best_draft=k_star,
        speedup=s_star,
        speedup_low=np.min(at_corners, axis=0),
        speedup_high=np.max(at_corners, axis=0),
        best_draft_low=k_corners.min(axis=0),
        best_draft_high=k_corners.max(axis=0),
        relative_cost=nominal,
        break_even=break_even,
        steps=steps,
        warnings=extrapolation_warnings("verify pass", "n", *_distinct(costs.verify.extrapolation, costs.widths)),
        acceptance=tuple(p.label for p in points) if any(not p.label.startswith("alpha=") for p in points) else (),
        verify_tokens=() if tree.is_chain else tuple(int(w) for w in costs.widths),
        spec_overhead_us=tuple(float(o) for o in costs.overhead_us) if np.any(costs.overhead_us) else (),
        batch=batch,
        verdicts=tuple(verdicts(points, tables, taus, costs, tree)) if verdict else (),
    )


def _distinct(factor: np.ndarray, widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One extrapolation factor per distinct verify width (a tree's widths repeat once capped)."""
    sizes, first = np.unique(widths, return_index=True)
    return np.asarray(factor)[first], sizes
