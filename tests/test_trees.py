"""Draft trees: acceptance and verify width against plain-Python enumerations on random trees; the
chain reproduced bit for bit; the pruned beam is the best subtree of its candidates."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from moesim.errors import ConfigError
from moesim.sim.analysis.speculation import speedup_table, tokens_per_pass, tokens_per_pass_table
from moesim.sim.cost.tree import (
    TreeSpec,
    accepted_survival,
    beam_tree,
    break_even_alpha_tree,
    chain,
    parse_tree,
    solve_alpha,
    tree_from_paths,
    tree_tokens_per_pass,
)


def q_of(alphas: list[float], depth: int, rank: int, sibling: float) -> float:
    """Written out: the top candidate at depth d matches with α_d, each further one with s of what the ones before missed."""
    alpha = alphas[min(depth, len(alphas)) - 1]
    missed = 1.0 - alpha
    if rank == 0:
        return alpha
    for _ in range(rank - 1):
        missed -= missed * sibling
    return missed * sibling


def enumerate_lengths(paths: list[tuple[int, ...]], alphas: list[float], sibling: float) -> dict[int, float]:
    """P(A = d) by walking every outcome: at an accepted node the target's next token is one child
    (each with its q) or none of them."""
    nodes = set(paths)
    out: dict[int, float] = {}

    def walk(node: tuple[int, ...], p: float) -> None:
        children = [c for c in nodes if len(c) == len(node) + 1 and c[:-1] == node]
        stop = 1.0
        for child in children:
            q = q_of(alphas, len(child), child[-1], sibling)
            stop -= q
            walk(child, p * q)
        out[len(node)] = out.get(len(node), 0.0) + p * stop

    walk((), 1.0)
    return out


def random_paths(rng: random.Random, size: int, max_rank: int) -> list[tuple[int, ...]]:
    """A random tree: each new node a fresh rank under a random existing node."""
    paths: list[tuple[int, ...]] = []
    for _ in range(size):
        parent = rng.choice([(), *paths])
        used = {p[-1] for p in paths if p[:-1] == parent}
        free = [r for r in range(max_rank) if r not in used]
        if free:
            paths.append((*parent, rng.choice(free)))
    return paths


@pytest.mark.parametrize("seed", range(25))
def test_tree_acceptance_matches_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    paths = random_paths(rng, rng.randint(1, 14), rng.randint(1, 4))
    alphas = [rng.random() for _ in range(rng.randint(1, 5))]
    sibling = rng.random()
    tree = tree_from_paths(tuple(paths))
    lengths = enumerate_lengths(paths, alphas, sibling)
    assert sum(lengths.values()) == pytest.approx(1.0)
    survival = accepted_survival(tree, np.array([alphas]), sibling)[0]
    for d in range(1, tree.depth + 1):
        assert survival[d - 1] == pytest.approx(sum(p for length, p in lengths.items() if length >= d), abs=1e-12)
    expected = 1.0 + sum(length * p for length, p in lengths.items())
    assert tree_tokens_per_pass(tree, np.array([alphas]), sibling)[0] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_verify_width_and_draft_rows_of_random_trees(seed: int) -> None:
    rng = random.Random(100 + seed)
    paths = random_paths(rng, rng.randint(1, 20), 3)
    spec = TreeSpec(paths=tuple(paths))
    for k in range(0, max(len(p) for p in paths) + 2):
        kept = [p for p in paths if len(p) <= k]
        assert spec.width(k) == 1 + len(kept) == spec.tree(k).tokens
        expanded = {p[:-1] for p in kept}
        assert spec.draft_rows(k) == tuple(sum(1 for e in expanded if len(e) == d) for d in range(max((len(p) for p in kept), default=0)))


def reference_beam(steps: int, topk: int, tokens: int | None, alpha: float, sibling: float) -> list[tuple[int, ...]]:
    """SGLang's construction on rank paths: frontier = the topk best of each step's candidates."""
    score = {(r,): q_of([alpha], 1, r, sibling) for r in range(topk)}
    frontier = list(score)
    for depth in range(2, steps + 1):
        fresh = {(*f, r): score[f] * q_of([alpha], depth, r, sibling) for f in frontier for r in range(topk)}
        score.update(fresh)
        frontier = sorted(fresh, key=lambda p: -fresh[p])[:topk]
    keep = len(score) if tokens is None else tokens - 1
    return sorted(score, key=lambda p: (-score[p], len(p)))[:keep]


@pytest.mark.parametrize(
    ("steps", "topk", "tokens", "alpha"), [(1, 3, 3, 0.6), (2, 2, 5, 0.7), (3, 2, 6, 0.5), (3, 3, 8, 0.8), (4, 2, None, 0.65)]
)
def test_beam_tree_width_and_acceptance_against_a_plain_construction(steps: int, topk: int, tokens: int | None, alpha: float) -> None:
    sibling = 0.3
    tree = beam_tree(steps, topk, tokens, np.array([alpha]), sibling)
    reference = reference_beam(steps, topk, tokens, alpha, sibling)
    spec = TreeSpec(topk=topk, tokens=tokens)
    assert tree.tokens == 1 + len(reference) == spec.width(steps)
    expected = 1.0 + sum(np.prod([q_of([alpha], i + 1, r, sibling) for i, r in enumerate(p)]) for p in reference)
    assert tree_tokens_per_pass(tree, np.array([[alpha]]), sibling)[0] == pytest.approx(expected, abs=1e-12)
    assert spec.draft_rows(steps) == (1,) + (topk,) * (steps - 1)


def test_pruned_beam_is_the_best_parent_closed_subtree_of_its_candidates() -> None:
    """EAGLE-2's argument: keeping the N − 1 candidates of largest path probability maximises E[A]."""
    alpha, sibling, steps, topk, tokens = 0.55, 0.35, 3, 2, 5
    full = reference_beam(steps, topk, None, alpha, sibling)
    value = {p: float(np.prod([q_of([alpha], i + 1, r, sibling) for i, r in enumerate(p)])) for p in full}
    best = max(
        sum(value[p] for p in subset)
        for subset in itertools.combinations(full, tokens - 1)
        if all(len(p) == 1 or p[:-1] in subset for p in subset)
    )
    tree = beam_tree(steps, topk, tokens, np.array([alpha]), sibling)
    assert tree_tokens_per_pass(tree, np.array([[alpha]]), sibling)[0] - 1.0 == pytest.approx(best, abs=1e-12)


def test_the_chain_is_reproduced_bit_for_bit() -> None:
    alphas = np.linspace(0.0, 1.0, 41)
    cost = np.array([1.0, 1.3, 1.45, 1.7, 1.9, 2.4])
    assert np.array_equal(tokens_per_pass_table(alphas, cost.size - 1, TreeSpec()) / cost, speedup_table(alphas, cost))
    for k in range(6):
        spec_tau = TreeSpec().tokens_per_pass(k, alphas)
        table_tau = speedup_table(alphas, np.ones(k + 1))[:, k]
        assert np.array_equal(spec_tau, table_tau)
        assert np.allclose(spec_tau, tokens_per_pass(k, alphas), rtol=1e-12)
        assert tree_from_paths(tuple((0,) * d for d in range(1, k + 1))) == chain(k)
        assert TreeSpec(paths=tuple((0,) * d for d in range(1, 9))).width(k) == k + 1 == TreeSpec().width(k)


def test_solve_alpha_round_trips_and_break_even_bounds() -> None:
    spec = TreeSpec(topk=3, tokens=8)
    for alpha in (0.3, 0.6, 0.9):
        tau = float(spec.tokens_per_pass(4, np.array([alpha]))[0])
        assert spec.tokens_per_pass(4, np.array([solve_alpha(spec, 4, tau)]))[0] == pytest.approx(tau, abs=1e-9)
    with pytest.raises(ConfigError, match="outside what the tree"):
        solve_alpha(TreeSpec(), 2, 3.5)  # a chain of 2 commits at most 3 tokens
    assert break_even_alpha_tree(TreeSpec(), 3, 0.9) == 0.0
    assert np.isnan(break_even_alpha_tree(TreeSpec(), 3, 4.5))
    assert np.isnan(break_even_alpha_tree(TreeSpec(), 0, 1.2))


def test_tree_specs_parse_and_refuse_bad_ones() -> None:
    assert parse_tree("") == TreeSpec() == parse_tree("chain")
    assert parse_tree("topk=4,tokens=8") == TreeSpec(topk=4, tokens=8)
    assert parse_tree("paths=[[0],[0,0],[1]]").width(2) == 4
    for bad in ("topk=0", "tokens=1", "depth=3", "paths=[[0],[0,1],[", "topk=2,paths=[[0]]"):
        with pytest.raises(ConfigError):
            parse_tree(bad)
    with pytest.raises(ConfigError, match="no parent"):
        tree_from_paths(((0, 0),))
