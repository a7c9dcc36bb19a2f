"""Does speculation pay here? The verdict at each acceptance point: the best speculative k, its
speedup with the interval over the error box, the break-even acceptance length C(k) and which term
of C(k) − 1 decides. The acceptance points, the iteration's costs C(k) and the speedup tables come
in one `BestDraft` from `moesim.sim.analysis.speculation`; the break-even acceptance length (tokens
per pass, bonus included) is C(k) itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moesim.sim.cost.tree import TreeSpec, break_even_alpha_tree

if TYPE_CHECKING:  # the speculation math asks for the verdicts
    from moesim.sim.analysis.speculation import BestDraft

# How to pin down each uncertain part of C(k): what to measure and the function that fits it.
CALIBRATE = {
    "expert kernels": "time the expert operation on this device (`moesim microbench llama-cpp` or `torch`), fit it (`moesim profile fit`)",
    "dense kernels": "time plain decoding of a dense model on this device and fit the profile's dense family (`moesim profile fit`)",
    "engine": "time plain decoding at batch 1 and a few batch sizes and one speculative run on this engine (vllm bench latency, "
    "llama-bench tg, mlx_lm.generate) and fit its terms into the profile's [speculative] table (`moesim profile fit-engine`)",
}


@dataclass(frozen=True)
class Verdict:
    """Does speculation pay at one acceptance point: the best speculative k (>= 1), its speedup and
    interval, the break-even acceptance length C(k) (and the α giving it), C(k) − 1 by term, the
    term that decides, and 'pays' / 'loses' / 'uncertain' (the interval straddles 1)."""

    acceptance: str
    draft_len: int
    verify_tokens: int
    tokens_per_pass: float
    speedup: float
    speedup_low: float
    speedup_high: float
    break_even_tokens: float
    break_even_alpha: float | None
    shares: dict[str, float]
    decided_by: str  # the largest term of C(k) − 1
    verdict: str  # `verdict_of` the interval
    uncertain_by: str = ""  # where the interval straddles 1: the uncertain part that alone moves the speedup most
    calibrate: str = ""  # what would pin that part down

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "acceptance": self.acceptance,
            "verdict": self.verdict,
            "draft_len": self.draft_len,
            "verify_tokens": self.verify_tokens,
            "tokens_per_pass": self.tokens_per_pass,
            "speedup": self.speedup,
            "speedup_low": self.speedup_low,
            "speedup_high": self.speedup_high,
            "break_even_tokens_per_pass": self.break_even_tokens,
            "break_even_alpha": self.break_even_alpha,
            "relative_cost_terms": self.shares,
            "decided_by": self.decided_by,
            **({"uncertain_by": self.uncertain_by, "calibrate": self.calibrate} if self.verdict == "uncertain" else {}),
        }


def verdict_of(speedup_low: float, speedup_high: float) -> str:
    """'pays' when even the interval's low end is above 1, 'loses' when its high end is below 1, else 'uncertain'."""
    if speedup_low > 1.0:
        return "pays"
    return "loses" if speedup_high < 1.0 else "uncertain"


def verdicts(found: BestDraft, tree: TreeSpec) -> list[Verdict]:
    """The verdict per point at its best speculative k, from the nominal speedup table (tables[0]) and the corners' (tables[1:])."""
    tables, taus, costs, c = found.tables, found.taus, found.costs, found.relative_cost
    nominal, shares, parts = tables[0], found.shares, found.parts  # asked with `verdict`
    out = []
    for i, (point, k) in enumerate(zip(found.points, found.spec_draft, strict=True)):
        at = [t[i, k] for t in tables]  # the nominal point with the corners
        alpha = break_even_alpha_tree(tree, int(k), float(c[k]))
        deciding = _deciding_part(parts, float(taus[i, k]), int(k))
        terms = {name: float(v[k]) for name, v in shares.items()}
        out.append(
            Verdict(
                acceptance=point.label,
                draft_len=int(k),
                verify_tokens=int(costs.widths[k]),
                tokens_per_pass=float(taus[i, k]),
                speedup=float(nominal[i, k]),
                speedup_low=float(min(at)),
                speedup_high=float(max(at)),
                break_even_tokens=float(c[k]),
                break_even_alpha=None if np.isnan(alpha) else alpha,
                shares=terms,
                decided_by=max(terms, key=terms.__getitem__),
                verdict=verdict_of(float(min(at)), float(max(at))),
                uncertain_by=deciding,
                calibrate=CALIBRATE["engine" if deciding.startswith("engine") else deciding],
            )
        )
    return out


def _deciding_part(parts: dict[str, list[np.ndarray]], tau: float, k: int) -> str:
    """The uncertain part that alone moves S(k) = τ / C(k) most, preferring one whose two ends alone straddle 1."""
    ends = {name: [tau / float(c[k]) for c in ends] for name, ends in parts.items()}
    swing = {name: max(v) - min(v) for name, v in ends.items()}
    straddles = [name for name, v in ends.items() if min(v) <= 1.0 <= max(v)]
    return max(straddles or list(swing), key=swing.__getitem__)
