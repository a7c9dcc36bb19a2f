"""The speculation math, one place for `best-draft`, `batch`, the sweeps' and the server's questions:
closed forms of speculative decoding (vectorised), the costs of a speculative iteration per k, and
what `best-draft` (`best_draft_analysis`) and `batch` (`batch_iteration`) ask of them, in one call.

k = draft length (k = 0 is plain decoding), α = acceptance rate, τ(k) = tokens per verify pass (a
chain's geometric sum, or the drafter's tree's nodes, `moesim.sim.cost.tree`), C(k) = relative
cost of one speculative iteration:

    C(k) = (T_draft(k) + T_target(width(k)) + O(k)) / T_target(1),   S = τ(k) / C(k)

width(k) = k + 1 for a chain, the tree's verify width otherwise; O(k) is the profile's
`[speculative]` overhead (`moesim.sim.cost.trace_batch.spec_overhead_us`, the server's too; 0
without one); `SpecCosts` keeps C(k)'s parts for the error box.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.fields import FieldError
from moesim.hw_profiles import HardwareProfile
from moesim.hw_profiles.speculative import SpecPath
from moesim.parsing import parse_float, parse_int
from moesim.sim.analysis.scenario import LARGEST_PASS, Scenario, expected_costs, extrapolation_warnings
from moesim.sim.analysis.verdict import Verdict, verdicts
from moesim.sim.cost.drafters import Drafter, draft_us
from moesim.sim.cost.pass_features import batch_expected_costs
from moesim.sim.cost.steptime import ERROR_BOX_CORNERS, SIGNS, PassCost
from moesim.sim.cost.trace_batch import spec_overhead_us
from moesim.sim.cost.tree import DEFAULT_SIBLING_RATE, TreeSpec, break_even_alpha_tree, depth_alphas, solve_alpha
from moesim.tracegen.formats.specrun import read_accepted_counts

TIE_RTOL = 1e-12
_NEAR_ONE = 1e-6


def check_acceptance(alpha: np.ndarray | float, name: str = "alpha") -> np.ndarray:
    """Reject acceptance rates outside [0, 1] (or not finite)."""
    values = np.asarray(alpha, np.float64)
    bad = ~np.isfinite(values) | (values < 0) | (values > 1)
    if np.any(bad):
        raise InputError(f"{name} must lie in [0, 1], got {values[bad].flat[0]}")
    return values


def check_draft_lengths(draft_len: np.ndarray | int, name: str = "draft length") -> np.ndarray:
    """Reject negative or fractional draft lengths."""
    values = np.asarray(draft_len)
    if values.dtype.kind == "f" and np.any(values != np.round(values)):
        raise InputError(f"{name} must be an integer, got {values[values != np.round(values)].flat[0]}")
    values = values.astype(np.int64)
    if np.any(values < 0):
        raise InputError(f"{name} must be >= 0, got {values[values < 0].flat[0]}")
    return values


@dataclass(frozen=True)
class AcceptancePoint:
    """One acceptance: the drafter's top-1 rate per depth (the last repeats) and how it was given."""

    label: str
    rates: np.ndarray


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


def tokens_per_pass(draft_len: np.ndarray | int, alpha: np.ndarray | float) -> np.ndarray:
    """Expected tokens committed per verify pass τ(k, α) = Σ_{i=0..k} α^i = (1 − α^(k+1)) / (1 − α)."""
    k = np.asarray(draft_len, np.float64)
    a = np.asarray(alpha, np.float64)
    k, a = np.broadcast_arrays(k, a)
    near_one = np.abs(1.0 - a) < _NEAR_ONE
    safe = np.where(near_one, 0.5, a)
    closed = (1.0 - safe ** (k + 1.0)) / (1.0 - safe)
    # near α = 1: Σ α^i = (k+1) − (k+1)k/2·(1−α) + O((1−α)²)
    series = (k + 1.0) - 0.5 * (k + 1.0) * k * (1.0 - a)
    return np.where(near_one, series, closed)


def relative_cost(draft_us: np.ndarray, target_us: np.ndarray) -> np.ndarray:
    """C(k) = (T_draft(k) + T_target(k + 1)) / T_target(1) from arrays indexed by k = 0..k_max.

    `draft_us[k]` is the drafting time of k tokens (0 at k = 0); `target_us[k]` the verify pass of
    k + 1 tokens, so `target_us[0]` is plain decoding's pass. Extra leading axes broadcast.
    """
    draft = np.asarray(draft_us, np.float64)
    target = np.asarray(target_us, np.float64)
    return (draft + target) / target[..., :1]


def speedup(draft_len: np.ndarray | int, alpha: np.ndarray | float, cost: np.ndarray) -> np.ndarray:
    """S(k, α) = τ(k, α) / C(k); `cost` is C indexed by k = 0..k_max."""
    k = np.asarray(draft_len, np.int64)
    return tokens_per_pass(k, alpha) / np.asarray(cost, np.float64)[k]


def speedup_table(alpha: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """S for every α (leading axis) and k = 0..k_max (last axis): shape (len(α), len(C)).

    τ(k, α) is summed directly, Σ_{i<=k} α^i by cumulative product and sum along k (exact near α = 1).
    """
    a = np.asarray(alpha, np.float64).reshape(-1, 1)
    c = np.asarray(cost, np.float64)
    return _chain_sums(np.broadcast_to(a, (a.shape[0], c.size - 1))) / c


def _chain_sums(rates: np.ndarray) -> np.ndarray:
    """τ(k) = Σ_{i<=k} Π_{d<=i} α_d for k = 0..K from rows of K per-depth rates: cumulative product, then sum."""
    powers = np.empty((rates.shape[0], rates.shape[1] + 1))
    powers[:, :1] = 1.0
    powers[:, 1:] = rates
    np.cumprod(powers, axis=1, out=powers)
    np.cumsum(powers, axis=1, out=powers)
    return powers


def tokens_per_pass_table(rates: np.ndarray, max_draft: int, tree: TreeSpec, sibling_rate: float = DEFAULT_SIBLING_RATE) -> np.ndarray:
    """τ for every acceptance point (rows of per-depth top-1 rates; a row's last rate repeats) and
    k = 0..max_draft: shape (points, max_draft + 1). The chain sums Π α_d by cumulative product and
    sum (as `speedup_table`, so a constant row gives its numbers bit for bit); a tree sums its nodes."""
    points = depth_alphas(rates, max(max_draft, 1))
    if not tree.is_chain:
        return np.stack([tree.tokens_per_pass(k, points, sibling_rate) for k in range(max_draft + 1)], axis=1)
    return _chain_sums(points[:, :max_draft])


def best_in_table(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the k of the largest speedup (ties within rtol 1e-12 to the larger k) and that speedup."""
    top = table.max(axis=1, keepdims=True)
    within = table >= top * (1.0 - TIE_RTOL)
    k_star = table.shape[1] - 1 - np.argmax(within[:, ::-1], axis=1)
    return k_star, table[np.arange(table.shape[0]), k_star]


def best_draft(alpha: np.ndarray | float, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k*(α) = argmax_k S(k, α) over k = 0..k_max, ties (within rtol 1e-12) to the larger k; and S(k*)."""
    a = np.asarray(alpha, np.float64)
    k_star, best = best_in_table(speedup_table(a.ravel(), cost))
    return k_star.reshape(a.shape), best.reshape(a.shape)


def break_even_alpha(draft_len: np.ndarray | int, cost: np.ndarray, iterations: int = 80) -> np.ndarray:
    """α*(k): the acceptance where τ(k, α) = C(k), so SD at draft length k pays for α > α*.

    τ rises from 1 (α = 0) to k + 1 (α = 1): α* = 0 when C(k) <= 1, NaN (never pays) when
    C(k) >= k + 1 (so always at k = 0, plain decoding); otherwise found by bisection.
    """
    k = np.atleast_1d(np.asarray(draft_len, np.int64))
    c = np.asarray(cost, np.float64)[k]
    low, high = np.zeros(k.shape), np.ones(k.shape)
    for _ in range(iterations):
        mid = 0.5 * (low + high)
        above = tokens_per_pass(k, mid) >= c
        high = np.where(above, mid, high)
        low = np.where(above, low, mid)
    result = 0.5 * (low + high)
    result = np.where(c <= 1.0, 0.0, result)
    return np.where(c >= k + 1.0, np.nan, result).reshape(np.shape(draft_len))


def staircase(
    cost: np.ndarray, grid: int = 2001, iterations: int = 60, best: Callable[[np.ndarray | float], np.ndarray] | None = None
) -> list[tuple[float, int]]:
    """The best-draft staircase [(α from which k* = k, k), ...] starting at α = 0; every jump
    between grid points is located by bisection (several jumps in one grid cell included).
    `best(α)` gives k* (default: the chain's, `best_draft(α, cost)`)."""
    if best is None:
        best = lambda a: best_draft(a, cost)[0]  # noqa: E731
    alphas = np.linspace(0.0, 1.0, grid)
    k_star = best(alphas)
    steps = [(0.0, int(k_star[0]))]
    for i in np.flatnonzero(np.diff(k_star) != 0):
        low, current = float(alphas[i]), int(k_star[i])
        while current != k_star[i + 1]:
            lo, hi = low, float(alphas[i + 1])
            for _ in range(iterations):
                mid = 0.5 * (lo + hi)
                if int(best(mid)) == current:
                    lo = mid
                else:
                    hi = mid
            current = int(best(hi))
            steps.append((hi, current))
            low = hi
    return steps


def break_even_and_staircase(tree: TreeSpec, cost: np.ndarray) -> tuple[np.ndarray, list[tuple[float, int]]]:
    """α*(k) for k = 0..K and the best-draft staircase of C(k): the chain's closed forms
    (`break_even_alpha`, `staircase`), or the tree's (`break_even_alpha_tree`; k* from its nodes, on a coarser grid)."""
    max_draft = np.size(cost) - 1
    k = np.arange(max_draft + 1)
    if tree.is_chain:
        return break_even_alpha(k, cost), staircase(cost)
    break_even = np.array([break_even_alpha_tree(tree, int(j), float(cost[j])) for j in k])

    def tree_best(alpha: np.ndarray | float) -> np.ndarray:
        """k* of the tree family at constant α (the staircase's question)."""
        return best_in_table(tokens_per_pass_table(np.reshape(alpha, (-1, 1)), max_draft, tree) / cost)[0].reshape(np.shape(alpha))

    return break_even, staircase(cost, grid=201, best=tree_best)


# ---- the costs of a speculative iteration per k (the engine's spec path among them) ---------------

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
        verify = batch_expected_costs(scenario.model, scenario.trace, batch, widths, scenario.context_tokens, max_batches)[0]
    return costs_on(
        scenario.model.profile, drafter, widths, draft_costs_us(scenario, max_draft, batch), verify, batch, scenario.model.preset.layers
    )


def draft_costs_us(scenario: Scenario, max_draft: int, batch: int = 1) -> np.ndarray:
    """T_draft(k) for k = 0..max_draft, `batch` requests drafting in lockstep."""
    return np.array(
        [
            draft_us(scenario.drafter, np.full(batch, k), scenario.context_tokens, scenario.model.dense_family_us)
            for k in range(max_draft + 1)
        ]
    )


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

    def overhead(scale: dict[str, float] | None = None) -> np.ndarray:
        return np.array([spec_overhead_us(spec, drafter, k, batch * int(w), batch, target_layers, scale) for k, w in enumerate(widths)])

    return SpecCosts(widths, drafted, overhead(), verify, uses_dense, spec, overhead)


def speedup_tables(points: list[np.ndarray], costs: SpecCosts, tree: TreeSpec) -> tuple[np.ndarray, list[np.ndarray]]:
    """τ per acceptance point (its per-depth rates, the last repeating) and k, and S = τ / C at the nominal point then every corner."""
    rates = np.stack([np.pad(p, (0, max(len(q) for q in points) - len(p)), mode="edge") for p in points])
    taus = tokens_per_pass_table(rates, costs.widths.size - 1, tree)
    return taus, [taus / c for c in costs.corners()]


def target_efficiency(single_token_us: np.ndarray, verify_us: np.ndarray) -> np.ndarray:
    """MoESD's target efficiency T_T(B, 1) / T_T(B, γ): how close to free verification is."""
    return np.asarray(single_token_us, np.float64) / np.asarray(verify_us, np.float64)


# ---- what a command asks of the speculation math, in one call ----------------------------------

DEFAULT_MAX_DRAFT = 8  # the largest draft length k of best-draft when none is given


@dataclass(frozen=True)
class BestDraft:
    """What `best-draft` asks: the acceptance points, the iteration's costs C(k) with their box, τ and
    S = τ / C per point and k (nominal, then every corner), k*(α) with its speedup, their ranges over
    the box (ambiguous where a range spans several k), break-even acceptances and the staircase; with
    `verdict`, whether speculation pays at each point and why (`moesim.sim.analysis.verdict`)."""

    points: list[AcceptancePoint]
    alpha: np.ndarray
    costs: SpecCosts
    taus: np.ndarray
    tables: list[np.ndarray]
    relative_cost: np.ndarray
    best_draft: np.ndarray
    speedup: np.ndarray
    speedup_low: np.ndarray
    speedup_high: np.ndarray
    best_draft_low: np.ndarray
    best_draft_high: np.ndarray
    break_even: np.ndarray
    steps: list[tuple[float, int]]
    verify_tokens: tuple[int, ...]  # per k when the drafter verifies a tree
    warnings: list[str]
    batch: int = 1
    spec_draft: np.ndarray | None = None  # with `verdict`: per point, the best speculative k (>= 1)
    shares: dict[str, np.ndarray] | None = None  # with `verdict`: C(k) − 1 by term (`SpecCosts.shares`)
    parts: dict[str, list[np.ndarray]] | None = None  # with `verdict`: C(k) at the ends of each uncertain part (`SpecCosts.one_at_a_time`)
    verdicts: tuple[Verdict, ...] = ()

    @property
    def acceptance(self) -> tuple[str, ...]:
        """Labels of the points when any is not a plain α (else none)."""
        labels = tuple(p.label for p in self.points)
        return labels if any(not label.startswith("alpha=") for label in labels) else ()

    @property
    def spec_overhead_us(self) -> tuple[float, ...]:
        """O(k) per k when the profile has spec-path terms (else none)."""
        overhead = self.costs.overhead_us
        return tuple(float(o) for o in overhead) if np.any(overhead) else ()

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

    def to_dict(self) -> dict[str, Any]:
        """JSON form: `points` as the issue specifies, plus staircase and break-even (and what else was asked)."""
        points = [
            {"alpha": float(a), "best_draft": int(k), "speedup": float(s), "speedup_low": float(lo), "speedup_high": float(hi),
             "best_draft_low": int(klo), "best_draft_high": int(khi), "ambiguous": bool(klo != khi)}
            for a, k, s, lo, hi, klo, khi in zip(self.alpha, self.best_draft, self.speedup, self.speedup_low, self.speedup_high,
                                                 self.best_draft_low, self.best_draft_high, strict=True)
        ]  # fmt: skip
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
    """k*(α) = argmax_k τ(k) / C(k) for k = 0..max_draft per acceptance point, over the error box too
    (the families' ε and the spec-path terms' bound); `verdict` adds whether speculation pays at each
    point (its best speculative k >= 1, C(k)'s parts). `max_draft` None: DEFAULT_MAX_DRAFT, or the
    depth of a static tree (paths) when shallower."""
    tree = scenario.drafter.tree
    depth = tree.max_depth
    if max_draft is None:
        max_draft = DEFAULT_MAX_DRAFT if depth is None else min(DEFAULT_MAX_DRAFT, depth)
    elif depth is not None and max_draft > depth:
        raise InputError(
            f"--max-draft {max_draft} is deeper than the drafter's tree ({tree.label()} reaches depth {depth}): "
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
    points = acceptance_points(list(np.ravel(alphas)), accept_lengths or [], depth_rates or [], runs or [], tree)
    costs = spec_costs(scenario, max_draft, batch)
    taus, tables = speedup_tables([p.rates for p in points], costs, tree)
    nominal = costs.relative()
    k_star, s_star = best_in_table(tables[0])
    index = np.arange(len(points))
    at_corners = [t[index, k_star] for t in tables]  # the nominal point with the corners (a term's bound may be a factor)
    k_corners = np.stack([best_in_table(t)[0] for t in tables[1:]])
    break_even, steps = break_even_and_staircase(tree, nominal)
    sizes, first = np.unique(costs.widths, return_index=True)  # one extrapolation factor per distinct verify width
    if verdict and tables[0].shape[1] < 2:
        raise InputError("a verdict needs a draft length >= 1 (--max-draft)")
    found = BestDraft(
        points=points,
        alpha=np.array([p.rates[0] for p in points], np.float64),
        costs=costs,
        taus=taus,
        tables=tables,
        relative_cost=nominal,
        best_draft=k_star,
        speedup=s_star,
        speedup_low=np.min(at_corners, axis=0),
        speedup_high=np.max(at_corners, axis=0),
        best_draft_low=k_corners.min(axis=0),
        best_draft_high=k_corners.max(axis=0),
        break_even=break_even,
        steps=steps,
        verify_tokens=() if tree.is_chain else tuple(int(w) for w in costs.widths),
        warnings=extrapolation_warnings("verify pass", "n", np.asarray(costs.verify.extrapolation)[first], sizes),
        batch=batch,
        spec_draft=best_in_table(tables[0][:, 1:])[0] + 1 if verdict else None,
        shares=costs.shares() if verdict else None,
        parts=costs.one_at_a_time() if verdict else None,
    )
    return dataclasses.replace(found, verdicts=tuple(verdicts(found, tree))) if verdict else found


@dataclass(frozen=True)
class BatchIteration:
    """What `batch` asks of the speculation math per batch size B: k, the verify width v per request,
    τ at α, T_draft(B, k) and O(B) (None without a [speculative] table)."""

    draft_len: int
    verify_tokens: int
    tokens_per_pass: float
    tree: bool  # τ is the drafter's tree's, not a chain's τ(k, α)
    draft_us: np.ndarray
    spec_us: np.ndarray | None


def batch_iteration(scenario: Scenario, alpha: float, draft_len: int, batches: list[int], moesd_slots: bool) -> BatchIteration:
    """τ(k, α) (or the tree's), v = k + 1 (the tree's width at k; k under MoESD's slots), T_draft(B, k)
    and O(B) of `B` requests drafting and verifying in lockstep, for each B of `batches`."""
    check_acceptance(alpha)
    k = int(check_draft_lengths(draft_len))
    if k < 1:
        raise InputError(f"batch analysis needs a draft length >= 1, got {k}")
    if not batches or min(batches) < 1:
        raise InputError(f"batch sizes must be >= 1, got {batches}")
    drafter = scenario.drafter
    tree = drafter.tree
    chain = tree.is_chain
    if moesd_slots and not chain:
        raise InputError("--moesd-slots verifies gamma = k slots of a chain; the drafter has a tree")
    verify = k if moesd_slots else tree.width(k)
    spec, layers = scenario.model.profile.speculative, scenario.model.preset.layers
    return BatchIteration(
        draft_len=k,
        verify_tokens=verify,
        tokens_per_pass=float(tokens_per_pass(k, alpha)) if chain else float(tree.tokens_per_pass(k, np.array([alpha]))[0]),
        tree=not chain,
        draft_us=np.asarray([draft_us(drafter, np.full(b, k), scenario.context_tokens, scenario.model.dense_family_us) for b in batches]),
        spec_us=None if spec is None else np.asarray([spec_overhead_us(spec, drafter, k, b * verify, b, layers) for b in batches]),
    )
