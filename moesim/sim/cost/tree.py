"""Draft trees: the shape a drafter proposes per verify pass, the verify pass's width, the rows the
drafter runs per draft step, and the distribution of the accepted length (docs/math.md, "Draft trees").

A tree's node 0 is its root, the last verified token; every other node is a drafted token with a
parent and a rank among its siblings (0 = the drafter's top candidate). The verify pass feeds every
node, root included, so its width is the node count; the chain of k drafts is the tree
0 <- 1 <- ... <- k, every node of rank 0, width k + 1.

Acceptance (greedy verification, one child can match): q(v) = P(the target's next token after v's
parent is v | the parent was accepted); P(v accepted) = the product of q along the path from the
root; at most one node per depth is accepted, so P(A >= d) = S_d = Σ_{v at depth d} P(v) and the
tokens committed per pass are τ = 1 + Σ_{v != root} P(v). The rank model: the top candidate at
depth d matches with α_d; each further sibling with `sibling_rate` of the mass the higher ranks
missed, q(rank r >= 1) = (1 − α_d)·s·(1 − s)^(r − 1).

A tree family (`TreeSpec`) gives the tree at every draft length k = its draft steps:
- the chain (topk 1): k drafts in a row;
- `topk=K,tokens=N` (EAGLE-2/3, SGLang's `--speculative-eagle-topk` and
  `--speculative-num-draft-tokens`): step 1 proposes the root's top K children, each later step
  expands the K frontier nodes of largest path score into K children each and keeps the K best as
  the next frontier; the candidates (K + (k − 1)·K²) are pruned to the N − 1 of largest path score
  (sglang-project/sglang `eagle_utils.py` organize_draft_results); scores are the model's own
  path probabilities (a calibrated drafter), so the pruned tree depends on the acceptance;
- `paths=[[0],[0,0],[0,1],...]`: an explicit static tree (vLLM's `speculative_token_tree`,
  Medusa's sparse trees), truncated to depth k.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from moesim.errors import ConfigError, InputError
from moesim.parsing import load_json, parse_int

MAX_TREE_NODES = 4096  # nodes of a draft tree (its verify pass), and its ranks and depths
MAX_TOPK = 64  # candidates per node of a beam (its pool grows as topk² per step)
DEFAULT_SIBLING_RATE = 0.2  # assumed: no shared run resolves the acceptance of second candidates


@dataclass(frozen=True)
class DraftTree:
    """One tree: parents (node 0 the root, parent −1), ranks among siblings, depths, and the rows
    the drafter runs at each draft step (one entry per step)."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depths: tuple[int, ...]
    draft_rows: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Verify width: every node, root included."""
        return len(self.parents)

    @property
    def depth(self) -> int:
        """Longest path from the root."""
        return max(self.depths)


def chain(draft_len: int) -> DraftTree:
    """The chain of k drafts: one row per draft step."""
    nodes = range(draft_len + 1)
    return DraftTree(tuple(i - 1 for i in nodes), (0,) * (draft_len + 1), tuple(nodes), (1,) * draft_len)


def tree_from_paths(paths: tuple[tuple[int, ...], ...]) -> DraftTree:
    """An explicit tree from its nodes' rank paths, e.g. ((0,), (0, 0), (0, 1)); each path's prefix
    must be a node too. Draft step d runs on the nodes at depth d − 1 that have children."""
    index = {(): 0}
    parents, ranks, depths = [-1], [0], [0]
    for path in sorted(set(paths), key=lambda p: (len(p), p)):
        if path[:-1] not in index:
            raise ConfigError(f"tree path {list(path)} has no parent node {list(path[:-1])}")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
        depths.append(len(path))
    depth = max(depths)
    expanded = {p for p in parents[1:]}
    rows = tuple(sum(1 for i in expanded if depths[i] == d - 1) for d in range(1, depth + 1))
    return DraftTree(tuple(parents), tuple(ranks), tuple(depths), rows)


def rank_probability(alpha: np.ndarray, rank: int, sibling_rate: float) -> np.ndarray:
    """q(rank r) = α for r = 0, (1 − α)·s·(1 − s)^(r − 1) for r >= 1."""
    if rank == 0:
        return alpha
    return (1.0 - alpha) * sibling_rate * (1.0 - sibling_rate) ** (rank - 1)


def depth_alphas(alphas: np.ndarray, depth: int) -> np.ndarray:
    """Per-point top-1 acceptance at depths 1..depth: shape (points, depth); a point's last rate repeats."""
    a = np.asarray(alphas, np.float64)
    a = a.reshape(-1, 1) if a.ndim < 2 else a
    if a.shape[1] >= depth:
        return a[:, :depth]
    return np.concatenate([a, np.repeat(a[:, -1:], depth - a.shape[1], axis=1)], axis=1)


def node_probabilities(tree: DraftTree, alphas: np.ndarray, sibling_rate: float) -> np.ndarray:
    """P(v accepted) = Π q along the path, per point (rows of `alphas`, per-depth rates) and node: shape (points, nodes)."""
    per_depth = depth_alphas(alphas, max(tree.depth, 1))
    out = np.empty((per_depth.shape[0], tree.tokens))
    out[:, 0] = 1.0
    for v in range(1, tree.tokens):
        out[:, v] = out[:, tree.parents[v]] * rank_probability(per_depth[:, tree.depths[v] - 1], tree.ranks[v], sibling_rate)
    return out


def accepted_survival(tree: DraftTree, alphas: np.ndarray, sibling_rate: float) -> np.ndarray:
    """S_d = P(A >= d) = Σ_{v at depth d} P(v), d = 1..depth: shape (points, depth)."""
    probs = node_probabilities(tree, alphas, sibling_rate)
    depths = np.asarray(tree.depths)
    return np.stack([probs[:, depths == d].sum(axis=1) for d in range(1, tree.depth + 1)], axis=1)


def tree_tokens_per_pass(tree: DraftTree, alphas: np.ndarray, sibling_rate: float) -> np.ndarray:
    """τ = 1 + Σ_{v != root} P(v), summed in node order (for the chain: Σ_{i<=k} α^i, as `speculation.speedup_table` sums it)."""
    probs = node_probabilities(tree, alphas, sibling_rate)
    total = probs[:, 0].copy()
    for v in range(1, tree.tokens):
        total += probs[:, v]
    return total


def beam_tree(steps: int, topk: int, tokens: int | None, alphas: np.ndarray, sibling_rate: float) -> DraftTree:
    """EAGLE-2 / SGLang's dynamic tree of `steps` draft steps at one acceptance point (per-depth
    rates `alphas`): beam of `topk` frontier nodes, candidates pruned to `tokens` − 1 by path score."""
    if steps == 0:
        return chain(0)
    per_depth = depth_alphas(np.asarray(alphas, np.float64).reshape(1, -1), steps)[0]
    q = [float(rank_probability(per_depth[0:1], r, sibling_rate)[0]) for r in range(topk)]
    # candidates: (score, depth, order, parent candidate, rank); the root is candidate −1
    pool: list[tuple[float, int, int, int, int]] = [(q[r], 1, r, -1, r) for r in range(topk)]
    frontier = list(range(topk))
    for depth in range(2, steps + 1):
        q = [float(rank_probability(per_depth[depth - 1 : depth], r, sibling_rate)[0]) for r in range(topk)]
        first = len(pool)
        for parent in frontier:
            pool.extend((pool[parent][0] * q[r], depth, len(pool), parent, r) for r in range(topk))
        fresh = sorted(range(first, len(pool)), key=lambda i: (-pool[i][0], i))
        frontier = fresh[:topk]
    keep = len(pool) if tokens is None else min(len(pool), tokens - 1)
    chosen = sorted(sorted(range(len(pool)), key=lambda i: (-pool[i][0], pool[i][1], i))[:keep])
    node_of = {c: i + 1 for i, c in enumerate(chosen)}
    parents = [-1] + [0 if pool[c][3] < 0 else node_of[pool[c][3]] for c in chosen]
    rows = (1,) + (topk,) * (steps - 1)
    return DraftTree(tuple(parents), (0, *(pool[c][4] for c in chosen)), (0, *(pool[c][1] for c in chosen)), rows)


@dataclass(frozen=True)
class TreeSpec:
    """A tree family: the tree a drafter verifies at every draft length k (the chain by default)."""

    topk: int = 1
    tokens: int | None = None
    paths: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ConfigError(f"tree topk must be >= 1, got {self.topk}")
        if self.tokens is not None and self.tokens < 2:
            raise ConfigError(f"tree tokens must be >= 2 (the root and one draft), got {self.tokens}")
        if self.paths and (self.topk != 1 or self.tokens is not None):
            raise ConfigError("give a tree as topk/tokens or as paths, not both")
        if any(not p or min(p) < 0 for p in self.paths):
            raise ConfigError("tree paths must be non-empty lists of ranks >= 0")

    def check_depth(self, draft_len: int) -> None:
        """Refuse a draft length deeper than an explicit tree reaches."""
        if self.max_depth is not None and draft_len > self.max_depth:
            raise ConfigError(
                f"the policy drafts up to {draft_len} tokens, deeper than the drafter's tree ({self.label()} reaches depth "
                f"{self.max_depth}); give a deeper tree or a smaller k"
            )

    @property
    def is_chain(self) -> bool:
        """One draft per step (the chain moesim always verified)."""
        return not self.paths and self.topk == 1 and self.tokens is None

    @property
    def max_depth(self) -> int | None:
        """The deepest draft length an explicit tree reaches (None: any)."""
        return max(len(p) for p in self.paths) if self.paths else None

    def label(self) -> str:
        """How a drafter spec names it ('' for the chain)."""
        if self.paths:
            return "paths=" + json.dumps([list(p) for p in self.paths], separators=(",", ":"))
        if self.is_chain:
            return ""
        return f"topk={self.topk}" + (f",tokens={self.tokens}" if self.tokens is not None else "")

    def width(self, draft_len: int) -> int:
        """Verify width at draft length k (independent of the acceptance)."""
        if draft_len == 0:
            return 1
        if self.paths:
            return 1 + sum(1 for p in self.paths if len(p) <= draft_len)
        pool = self.topk + (draft_len - 1) * self.topk**2
        return 1 + (pool if self.tokens is None else min(pool, self.tokens - 1))

    def draft_rows(self, draft_len: int) -> tuple[int, ...]:
        """Rows the drafter runs at each of its k steps, per request."""
        if self.paths:
            return self.tree(draft_len).draft_rows
        return (1,) * min(draft_len, 1) + (self.topk,) * max(draft_len - 1, 0)

    def tree(self, draft_len: int, alphas: np.ndarray | None = None, sibling_rate: float = DEFAULT_SIBLING_RATE) -> DraftTree:
        """The tree at draft length k (a pruned beam needs the acceptance point it is pruned for)."""
        if self.paths:
            return tree_from_paths(tuple(p for p in self.paths if len(p) <= draft_len))
        if self.topk == 1:
            return chain(draft_len)
        if alphas is None:
            raise ConfigError(f"the tree {self.label()} is pruned by the drafter's scores: it needs an acceptance point")
        return beam_tree(draft_len, self.topk, self.tokens, alphas, sibling_rate)

    def tokens_per_pass(self, draft_len: int, alphas: np.ndarray, sibling_rate: float = DEFAULT_SIBLING_RATE) -> np.ndarray:
        """τ at draft length k for every point (rows of per-depth rates): shape (points,)."""
        points = depth_alphas(alphas, max(draft_len, 1))
        if draft_len == 0:
            return np.ones(points.shape[0])
        if self.topk == 1 or self.paths:  # the tree does not depend on the acceptance
            return tree_tokens_per_pass(self.tree(draft_len), points, sibling_rate)
        return np.array([tree_tokens_per_pass(self.tree(draft_len, row, sibling_rate), row[None, :], sibling_rate)[0] for row in points])


def parse_tree(text: str) -> TreeSpec:
    """'topk=K[,tokens=N]' or 'paths=[[0],[0,0],...]' (JSON), or '' / 'chain'."""
    text = text.strip()
    if text in ("", "chain"):
        return TreeSpec()
    shown = text if len(text) <= 60 else text[:57] + "..."
    if text.startswith("paths="):
        usage = f"tree '{shown}': paths must be a JSON list of rank lists, e.g. [[0],[0,0],[0,1]]"
        try:
            paths = load_json(text.removeprefix("paths="), f"tree '{shown}'", max_depth=2)
        except InputError as exc:
            raise ConfigError(f"{usage} ({exc})") from None
        if not isinstance(paths, list) or not all(isinstance(p, list) and all(type(r) is int for r in p) for p in paths):
            raise ConfigError(usage)
        if len(paths) > MAX_TREE_NODES or any(len(p) > MAX_TREE_NODES or max(p, default=0) >= MAX_TREE_NODES for p in paths):
            raise ConfigError(f"tree '{shown}': at most {MAX_TREE_NODES} nodes, each path and rank below {MAX_TREE_NODES}")
        return TreeSpec(paths=tuple(tuple(p) for p in paths))
    values: dict[str, int] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in ("topk", "tokens"):
            raise ConfigError(f"tree '{shown}': give topk=K[,tokens=N] or paths=[[0],...] (got '{item[:40]}')")
        try:
            high = MAX_TOPK if key.strip() == "topk" else MAX_TREE_NODES
            values[key.strip()] = parse_int(value, f"tree '{shown}': {key.strip()}", 1, high)
        except InputError as exc:
            raise ConfigError(str(exc)) from None
    return TreeSpec(topk=values.get("topk", 1), tokens=values.get("tokens"))


def solve_alpha(spec: TreeSpec, draft_len: int, tokens_per_pass: float, sibling_rate: float = DEFAULT_SIBLING_RATE) -> float:
    """The top-1 rate α at which the family's tree at draft length k commits `tokens_per_pass`
    tokens per pass (a measured mean acceptance length, bonus token included): bisection."""
    low, high = 0.0, 1.0
    at = [float(spec.tokens_per_pass(draft_len, np.array([a]), sibling_rate)[0]) for a in (low, high)]
    if not at[0] - 1e-9 <= tokens_per_pass <= at[1] + 1e-9 or not math.isfinite(tokens_per_pass):
        raise ConfigError(
            f"acceptance length {tokens_per_pass} is outside what the tree at draft length {draft_len} commits "
            f"({at[0]:.3f} at α = 0 to {at[1]:.3f} at α = 1)"
        )
    for _ in range(60):
        mid = 0.5 * (low + high)
        if spec.tokens_per_pass(draft_len, np.array([mid]), sibling_rate)[0] < tokens_per_pass:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def break_even_alpha_tree(spec: TreeSpec, draft_len: int, relative_cost: float, sibling_rate: float = DEFAULT_SIBLING_RATE) -> float:
    """α*(k) at which the family's tree at k commits C(k) tokens per pass: 0 when it does already at
    α = 0, NaN when not even at α = 1 (and at k = 0, plain decoding)."""
    if draft_len == 0:
        return math.nan
    low, high = (float(spec.tokens_per_pass(draft_len, np.array([a]), sibling_rate)[0]) for a in (0.0, 1.0))
    if relative_cost <= low:
        return 0.0
    if relative_cost > high:
        return math.nan
    return solve_alpha(spec, draft_len, relative_cost, sibling_rate)


def truncated_widths(tree: DraftTree, max_draft: int) -> tuple[int, ...]:
    """Verify width of the tree cut at depth k, k = 0..max_draft: 1 + #{v : 1 <= depth(v) <= k}."""
    depths = np.asarray(tree.depths)
    return tuple(1 + int(np.count_nonzero((depths >= 1) & (depths <= k))) for k in range(max_draft + 1))
