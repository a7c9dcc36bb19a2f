"""`moesim best-draft`: the best draft length k*(α) with its speedup, interval over the error box,
staircase and break-even acceptances; with `verdict`, whether speculation pays at all and why
(`moesim.sim.analysis.verdict`). The drafter's tree sets every k's verify width; the profile's
spec-path terms add to every speculative iteration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from moesim.sim.analysis.scenario import Scenario
from moesim.sim.analysis.speculation import speedups
from moesim.sim.analysis.verdict import Verdict, verdicts


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
    (and the spec-path terms' bound), all from one `speculation.speedups`; `verdict` adds whether
    speculation pays at each point. `max_draft` None: the speculation math's default."""
    found = speedups(scenario, list(np.ravel(alphas)), accept_lengths or [], depth_rates or [], runs or [], max_draft, batch, verdict)
    labels = tuple(p.label for p in found.points)
    overhead = found.costs.overhead_us
    return BestDraft(
        alpha=found.alpha,
        best_draft=found.best_draft,
        speedup=found.speedup,
        speedup_low=found.speedup_low,
        speedup_high=found.speedup_high,
        best_draft_low=found.best_draft_low,
        best_draft_high=found.best_draft_high,
        relative_cost=found.relative_cost,
        break_even=found.break_even,
        steps=found.steps,
        warnings=found.warnings,
        acceptance=labels if any(not label.startswith("alpha=") for label in labels) else (),
        verify_tokens=found.verify_tokens,
        spec_overhead_us=tuple(float(o) for o in overhead) if np.any(overhead) else (),
        batch=batch,
        verdicts=tuple(verdicts(found, scenario.drafter.tree)) if verdict else (),
    )
