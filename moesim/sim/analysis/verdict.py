"""Does speculation pay here? Acceptance points (rates α, measured acceptance lengths, per-depth
rates, recorded runs) and the verdict: the best speculative k, its speedup with the interval over
the error box, the break-even acceptance length C(k) and which term of C(k) − 1 decides. The
iteration's costs C(k) and the speedup tables come from `moesim.sim.analysis.speculation`; the
break-even acceptance length (tokens per pass, bonus included) is C(k) itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import InputError
from moesim.fields import FieldError
from moesim.parsing import parse_float, parse_int
from moesim.sim.analysis.scenario import LARGEST_PASS
from moesim.sim.analysis.speculation import SpecCosts, best_in_table, check_acceptance
from moesim.sim.cost.tree import DEFAULT_SIBLING_RATE, TreeSpec, break_even_alpha_tree, solve_alpha
from moesim.tracegen.formats.specrun import read_accepted_counts

# How to pin down each uncertain part of C(k): what to measure and the function that fits it.
CALIBRATE = {
    "expert kernels": "time the expert operation on this device (`moesim microbench llama-cpp` or `torch`), fit it (`moesim profile fit`)",
    "dense kernels": "time plain decoding of a dense model on this device and fit the profile's dense family (`moesim profile fit`)",
    "engine": "time plain decoding at batch 1 and a few batch sizes and one speculative run on this engine (vllm bench latency, "
    "llama-bench tg, mlx_lm.generate) and fit its terms into the profile's [speculative] table (`moesim profile fit-engine`)",
}


@dataclass(frozen=True)
class AcceptancePoint:
    """One acceptance: the drafter's top-1 rate per depth (the last repeats) and how it was given."""

    label: str
    rates: np.ndarray

    @property
    def alpha(self) -> float:
        """The rate at depth 1."""
        return float(self.rates[0])


def acceptance_points(
    alphas: list[float],
    accept_lengths: list[str],
    depth_rates: list[str],
    runs: list[str],
    tree: TreeSpec,
    sibling_rate: float = DEFAULT_SIBLING_RATE,
) -> list[AcceptancePoint]:
    """Acceptance points from rates α (one per depth, the same at every depth), measured mean
    acceptance lengths 'L@k' (tokens per pass with the bonus, at draft length k of the drafter's
    tree: α solved), per-depth rates 'a1,a2,...', and recorded runs (accepted counts: α_d = S_d / S_{d−1})."""
    points = [AcceptancePoint(f"alpha={a:g}", np.array([a])) for a in check_acceptance(np.asarray(alphas, np.float64)).ravel()]
    for text in accept_lengths:
        length, sep, at = text.partition("@")
        if not sep:
            raise InputError(f"--accept-len must be LENGTH@DRAFT_LEN (e.g. 2.4@3), got '{text}'")
        k = parse_int(at, f"--accept-len '{text}': draft length", 1, LARGEST_PASS - 1)  # a verify pass of k + 1 tokens
        value = parse_float(length, f"--accept-len '{text}': length (tokens per pass, bonus included)")  # its range: solve_alpha
        points.append(AcceptancePoint(f"length {value:g} at k={k}", np.array([solve_alpha(tree, k, value, sibling_rate)])))
    for text in depth_rates:
        items = [r for r in text.split(",") if r.strip()]
        if len(items) > LARGEST_PASS:
            raise InputError(f"--depth-rates: {len(items)} rates, more than the deepest draft ({LARGEST_PASS - 1}) can use")
        rates = np.array([parse_float(r, f"--depth-rates '{text[:40]}': rate", 0.0, 1.0) for r in items])
        if rates.size == 0:
            raise InputError("--depth-rates needs at least one rate")
        points.append(AcceptancePoint(f"rates {text}", check_acceptance(rates, "depth rate")))
    for path in runs:
        points.append(AcceptancePoint(f"run {path}", recorded_rates(path)))
    if not points:
        raise InputError("give an acceptance: --alpha, --accept-len, --depth-rates or --accept-run")
    return points


def recorded_rates(path: str) -> np.ndarray:
    """Per-depth rates of a recorded run's accepted counts (draft length K): S_d = P(A >= d), α_d = S_d / S_{d−1}, d <= K."""
    try:
        sequences, drafted = read_accepted_counts(Path(path))
    except FieldError as exc:
        raise InputError(f"--accept-run {path}: {exc.detail}") from None
    counts = np.concatenate(sequences) if sequences else np.zeros(0, np.int64)
    if counts.dtype.kind not in "iu":
        raise InputError(f"--accept-run {path}: column 'accepted' must hold integer counts, got {counts.dtype} values")
    if np.any(counts < 0):
        raise InputError(f"--accept-run {path}: column 'accepted' must be >= 0, got {int(counts.min())}")
    depth = int(drafted if drafted is not None else counts.max(initial=0))
    if counts.size == 0 or depth < 1:
        raise InputError(f"--accept-run {path}: no drafted step to read acceptance from")
    if depth > LARGEST_PASS - 1:
        raise InputError(
            f"--accept-run {path}: draft length {depth} is beyond {LARGEST_PASS - 1} (reading its per-depth rates would "
            f"take {depth:.3g} passes over {counts.size} counts)"
        )
    if drafted is not None and counts.max() > drafted:
        raise InputError(f"--accept-run {path}: column 'accepted' holds {int(counts.max())}, more than the {drafted} tokens drafted")
    survival = np.array([1.0, *((counts >= d).mean() for d in range(1, depth + 1))])
    return np.divide(survival[1:], survival[:-1], out=np.zeros(depth), where=survival[:-1] > 0)


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
    uncertain_by: str = ""  # where the interval straddles 1: the uncertain part that alone moves the speedup most
    calibrate: str = ""  # what would pin that part down

    @property
    def decided_by(self) -> str:
        """The largest term of C(k) − 1."""
        return max(self.shares, key=self.shares.__getitem__)

    @property
    def verdict(self) -> str:
        """'pays' when even the interval's low end is above 1, 'loses' when its high end is below 1."""
        if self.speedup_low > 1.0:
            return "pays"
        return "loses" if self.speedup_high < 1.0 else "uncertain"

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


def verdicts(points: list[AcceptancePoint], tables: list[np.ndarray], taus: np.ndarray, costs: SpecCosts, tree: TreeSpec) -> list[Verdict]:
    """The verdict per point from the nominal speedup table (tables[0]) and the corners' (tables[1:])."""
    nominal = tables[0]
    if nominal.shape[1] < 2:
        raise InputError("a verdict needs a draft length >= 1 (--max-draft)")
    k_spec = best_in_table(nominal[:, 1:])[0] + 1
    c = costs.relative()
    shares = costs.shares()
    parts = costs.one_at_a_time()
    out = []
    for i, (point, k) in enumerate(zip(points, k_spec, strict=True)):
        at = [t[i, k] for t in tables]  # the nominal point with the corners
        alpha = break_even_alpha_tree(tree, int(k), float(c[k]))
        deciding = _deciding_part(parts, float(taus[i, k]), int(k))
        out.append(
            Verdict(
                point.label,
                int(k),
                int(costs.widths[k]),
                float(taus[i, k]),
                float(nominal[i, k]),
                float(min(at)),
                float(max(at)),
                float(c[k]),
                None if np.isnan(alpha) else alpha,
                {name: float(v[k]) for name, v in shares.items()},
                deciding,
                CALIBRATE["engine" if deciding.startswith("engine") else deciding],
            )
        )
    return out


def _deciding_part(parts: dict[str, list[np.ndarray]], tau: float, k: int) -> str:
    """The uncertain part that alone moves S(k) = τ / C(k) most, preferring one whose two ends alone straddle 1."""
    ends = {name: [tau / float(c[k]) for c in ends] for name, ends in parts.items()}
    swing = {name: max(v) - min(v) for name, v in ends.items()}
    straddles = [name for name, v in ends.items() if min(v) <= 1.0 <= max(v)]
    return max(straddles or list(swing), key=swing.__getitem__)
