"""Does speculation pay here? The costs of a speculative iteration at every draft length k (the
verify pass as wide as the drafter's tree, the drafting, the engine's spec-path terms), acceptance
points, and the verdict: the best speculative k, its speedup with the interval over the error
box, the break-even acceptance length C(k) and which term of C(k) − 1 decides.

    C(k) = (T_draft(k) + T_target(width(k)) + O(k)) / T_target(1),   S = τ(k) / C(k)

O(k) is the profile's `[speculative]` overhead (`moesim.hw_profiles.speculative`, 0 without one);
the break-even acceptance length (tokens per pass, bonus included) is C(k) itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import InputError
from moesim.fields import FieldError
from moesim.hw_profiles import HardwareProfile
from moesim.hw_profiles.speculative import SpecPath
from moesim.parsing import parse_float, parse_int
from moesim.sim.analysis.batch import union_pass_cost
from moesim.sim.analysis.ranks import mean_costs
from moesim.sim.analysis.scenario import LARGEST_PASS, Scenario, expected_costs
from moesim.sim.analysis.speculation import best_in_table, check_acceptance, relative_cost, tokens_per_pass_table
from moesim.sim.cost.drafters import Drafter, draft_model_layers, draft_steps, draft_us
from moesim.sim.cost.steptime import ERROR_BOX_CORNERS, SIGNS, PassCost
from moesim.sim.cost.tree import DEFAULT_SIBLING_RATE, TreeSpec, break_even_alpha_tree, solve_alpha
from moesim.tracegen.formats.specrun import read_accepted_counts

TERMS = ("verify bytes", "draft cost", "spec overhead")


def pick(cost: PassCost, index: np.ndarray) -> PassCost:
    """The pass sizes of a PassCost at `index` (positions in its arrays)."""
    cut = {f.name: getattr(cost, f.name)[index] for f in dataclasses.fields(cost) if isinstance(getattr(cost, f.name), np.ndarray)}
    return dataclasses.replace(
        cost,
        **cut,
        provenance_us={k: np.asarray(v)[index] for k, v in cost.provenance_us.items()},
        expert_by_family_us={k: v[index] for k, v in cost.expert_by_family_us.items()},
        engine_parts_us={k: np.asarray(v)[index] for k, v in cost.engine_parts_us.items()},
    )


# How to pin down each uncertain part of C(k): what to measure and the function that fits it.
CALIBRATE = {
    "expert kernels": "time the expert operation on this device (`moesim microbench llama-cpp` or `torch`), fit it (`moesim profile fit`)",
    "dense kernels": "time plain decoding of a dense model on this device and fit the profile's dense family (`moesim profile fit`)",
    "engine": "time plain decoding at batch 1 and a few batch sizes and one speculative run on this engine (vllm bench latency, "
    "llama-bench tg, mlx_lm.generate) and fit its terms into the profile's [speculative] table (`moesim profile fit-engine`)",
}


@dataclass(frozen=True)
class SpecCosts:
    """Per draft length k = 0..K of a batch: verify width (per request), drafting time, the engine's
    spec-path overhead, and the verify pass cost (kept in parts, the engine's time per forward
    among them, for the error box)."""

    widths: np.ndarray
    draft_us: np.ndarray
    overhead_us: np.ndarray
    verify: PassCost
    uses_dense: bool
    spec: SpecPath | None = None
    overhead_of: Callable[[dict[str, float]], np.ndarray] | None = None  # O per k at the engine terms' scales

    def target_us(self, expert_sign: float = 0.0, dense_sign: float = 0.0, scale: dict[str, float] | None = None) -> np.ndarray:
        """T_target(width(k)) at one corner, the engine's time per forward included (its terms at `scale`)."""
        return self.verify.total_us(expert_sign, dense_sign, scale)

    def relative(self, expert_sign: float = 0.0, dense_sign: float = 0.0, scale: dict[str, float] | None = None) -> np.ndarray:
        """C(k) at one corner of the error box."""
        draft = self.draft_us * (1.0 + dense_sign * self.verify.dense_epsilon) if self.uses_dense else self.draft_us
        overhead = self.overhead_of(scale) if scale and self.overhead_of is not None else self.overhead_us
        return relative_cost(draft + overhead, self.target_us(expert_sign, dense_sign, scale))

    def scales(self, only: str | None = None) -> list[dict[str, float] | None]:
        """The engine terms' corners (`SpecPath.corner_scales`), or the nominal terms alone without any."""
        return list(self.spec.corner_scales(only)) if self.spec is not None else [None]

    def corners(self) -> list[np.ndarray]:
        """C(k) at the nominal point, then at each corner of the kernels' box times the engine terms' box."""
        return [self.relative(), *(self.relative(e, d, s) for e, d in ERROR_BOX_CORNERS for s in self.scales())]

    def one_at_a_time(self) -> dict[str, list[np.ndarray]]:
        """C(k) at the two ends of each uncertain part alone (the others nominal): the expert and dense
        kernels' bounds, each engine term's uncertainty, the engine's held-out error."""
        out = {"expert kernels": [self.relative(e, 0.0) for e in SIGNS], "dense kernels": [self.relative(0.0, d) for d in SIGNS]}
        if self.spec is not None:
            for term in (*self.spec.uncertain_terms(), *(("heldout_error",) if self.spec.heldout_error else ())):
                out[f"engine {term}"] = [self.relative(0.0, 0.0, s) for s in self.spec.corner_scales(term)]
        return out

    def shares(self) -> dict[str, np.ndarray]:
        """C(k) − 1 by term: (T(width) − T(1)) / T(1), T_draft / T(1), O / T(1) (T with the engine's time per forward)."""
        target = self.target_us()
        return dict(zip(TERMS, ((target - target[0]) / target[0], self.draft_us / target[0], self.overhead_us / target[0]), strict=True))


def spec_costs(scenario: Scenario, max_draft: int, batch: int = 1, max_batches: int = 256) -> SpecCosts:
    """The costs of k = 0..max_draft for `batch` requests drafting in lockstep with the scenario's drafter and its tree."""
    drafter = scenario.drafter
    widths = np.array([drafter.tree.width(k) for k in range(max_draft + 1)])
    if batch == 1:
        verify = expected_costs(scenario, widths)
    else:
        verify = mean_costs([union_pass_cost(scenario, scenario.trace, batch, int(w), max_batches)[0] for w in widths])
    drafted = np.array([draft_us(drafter, np.full(batch, k), scenario.context_tokens, scenario.dense_us) for k in range(max_draft + 1)])
    return costs_on(scenario.model.profile, drafter, widths, drafted, verify, batch, scenario.model.preset.layers)


def costs_on(
    profile: HardwareProfile,
    drafter: Drafter,
    widths: np.ndarray,
    drafted: np.ndarray,
    verify: PassCost,
    batch: int,
    target_layers: int = 0,
) -> SpecCosts:
    """SpecCosts with the profile's engine terms: O(k) for `batch` requests verifying widths[k]
    tokens each (a separate draft model's steps whole forwards), and the terms' box (none without a
    `[speculative]` table)."""
    spec = profile.speculative
    uses_dense = drafter.provenance == "profile"
    if spec is None:
        return SpecCosts(widths, drafted, np.zeros(widths.size), verify, uses_dense)
    layers = draft_model_layers(drafter)

    def overhead(scale: dict[str, float] | None = None) -> np.ndarray:
        return np.array(
            [spec.overhead_us(draft_steps(drafter, k), batch * int(w), layers, batch, target_layers, scale) for k, w in enumerate(widths)]
        )

    return SpecCosts(widths, drafted, overhead(), verify, uses_dense, spec, overhead)


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


def speedup_tables(points: list[AcceptancePoint], costs: SpecCosts, tree: TreeSpec) -> tuple[np.ndarray, list[np.ndarray]]:
    """τ per point and k, and S = τ / C at the nominal point then every corner."""
    rates = np.stack([np.pad(p.rates, (0, max(len(q.rates) for q in points) - len(p.rates)), mode="edge") for p in points])
    taus = tokens_per_pass_table(rates, costs.widths.size - 1, tree)
    return taus, [taus / c for c in costs.corners()]
