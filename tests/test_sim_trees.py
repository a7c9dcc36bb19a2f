"""Draft trees in the SimPy server: the `tree` acceptance against a plain-Python enumeration of
random trees, the tree cut at depth k against node counts, a tree's verify pass priced as the chain
of the same width (same positions, same routing), the config's checks, and the sweep's tree cells."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_trees import enumerate_lengths, random_paths

from moesim.errors import ConfigError
from moesim.sim.cost.tree import TreeSpec, chain, truncated_widths
from moesim.sim.serving.acceptance import Tree
from moesim.sim.serving.config import config_from_dict
from moesim.sim.serving.run import build_cost, load_trace, run_server


@pytest.mark.parametrize("seed", range(12))
def test_cut_widths_count_the_nodes_of_random_trees(seed: int) -> None:
    rng = random.Random(seed)
    paths = random_paths(rng, rng.randint(1, 14), 3)
    tree = TreeSpec(paths=tuple(paths)).tree(8)
    cap = rng.randint(0, 6)
    expected = [1 + sum(1 for p in paths if len(p) <= k) for k in range(cap + 1)]
    assert list(truncated_widths(tree, cap)) == expected
    assert truncated_widths(chain(cap), cap) == tuple(range(1, cap + 2))


@pytest.mark.parametrize("seed", range(12))
def test_tree_acceptance_survival_matches_enumeration(seed: int) -> None:
    rng = random.Random(100 + seed)
    paths = random_paths(rng, rng.randint(1, 12), 3)
    alpha, sibling = rng.uniform(0.05, 0.95), rng.uniform(0.0, 0.6)
    model = Tree(alpha=alpha, sibling_rate=sibling).with_shape(TreeSpec(paths=tuple(paths)))
    cap = max(len(p) for p in paths) + 1
    lengths = enumerate_lengths(paths, [alpha], sibling)
    expected = [sum(p for d, p in lengths.items() if d >= depth) for depth in range(1, cap + 1)]
    assert model.survival(cap) == pytest.approx(expected, abs=1e-12)


def sim_config(drafter: dict[str, Any], acceptance: dict[str, Any], k: int, **over: Any) -> Any:
    data = {
        "run": {"seed": 3, "requests": over.pop("requests", 3)},
        "workload": {"prompt_tokens": 16, "output_tokens": over.pop("output_tokens", 60)},
        "arrivals": {"kind": "closed", "concurrency": 1},
        "batching": {"max_batch": 1},
        "trace": {"synth": "uniform", "tokens": 256, "seqs": 2},
        "cost": {"kind": "steptime"},
        "target": {"model": "qwen3-30b-a3b", "profile": "nvidia-h200-vllm"},
        "drafter": drafter,
        "acceptance": acceptance,
        "policy": {"name": "static", "k": k},
        **over,
    }
    return config_from_dict(data, "t.toml", Path("."))


def record_of(config: Any) -> Any:
    trace = load_trace(config, config.target.model)
    return run_server(config, build_cost(config, trace), trace, config.policy, config.acceptance)


def test_tree_verify_is_priced_as_the_chain_of_its_width() -> None:
    """No draft is ever accepted (α = 0, no sibling matches), so both runs commit one token per pass
    and walk the same trace positions: where the tree drafts k = 3 (width 5 = 1 + 2 + 2) the chain
    drafting 4 verifies the same 5 positions, so the verify passes cost the same."""
    tree = record_of(sim_config({"kind": "eagle3", "tree": "topk=2,tokens=5"}, {"model": "tree", "alpha": 0.0, "sibling_rate": 0.0}, 3))
    plain = record_of(sim_config({"kind": "eagle3"}, {"model": "geometric", "alpha": 0.0}, 4))
    assert np.all(tree.step_accepted == 0) and np.all(plain.step_accepted == 0)
    assert tree.verify_us.size == plain.verify_us.size
    decode = np.flatnonzero(tree.batch > 0)
    full = decode[(tree.step_draft_len == 3) & (plain.step_draft_len == 4)]
    assert full.size > 100
    np.testing.assert_array_equal(tree.verify_us[full], plain.verify_us[full])
    # drafting differs: the beam runs 1 + 2 + 2 rows in 3 steps, the chain 4 rows in 4
    assert not np.array_equal(tree.draft_us[full], plain.draft_us[full])


def test_tree_runs_commit_the_trees_expected_length() -> None:
    """Mean tokens committed per pass at a static k = the tree's τ (plain-Python enumeration), within sampling error."""
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    tree = "paths=" + str([list(p) for p in paths]).replace(" ", "")
    acceptance = {"model": "tree", "alpha": 0.6, "sibling_rate": 0.3}
    config = sim_config({"kind": "eagle3", "tree": tree}, acceptance, 3, requests=4, output_tokens=4000)
    record = record_of(config)
    full = record.step_draft_len == 3
    lengths = enumerate_lengths(paths, [0.6], 0.3)
    tau = 1.0 + sum(d * p for d, p in lengths.items())
    committed = record.step_accepted[full] + 1.0
    assert committed.size > 2000
    assert abs(committed.mean() - tau) < 4.0 * committed.std() / np.sqrt(committed.size)


TABLE_COST = {"kind": "table", "target_us": [1.0, 2.0]}


@pytest.mark.parametrize(
    ("drafter", "acceptance", "over", "fragment"),
    [
        ({"kind": "eagle3", "tree": "topk=2"}, {"model": "geometric", "alpha": 0.5}, {}, "key 'acceptance.model'"),
        ({"kind": "eagle3", "tree": "topk=2"}, {"model": "tree", "alpha": 0.5}, {"cost": TABLE_COST}, "key 'drafter.tree'"),
        ({"kind": "eagle3,topk=2", "tree": "topk=3"}, {"model": "tree", "alpha": 0.5}, {}, "give it in one place"),
        ({"kind": "eagle3", "tree": "topk=x"}, {"model": "tree", "alpha": 0.5}, {}, "key 'drafter.tree'"),
        ({"kind": "eagle3,bogus"}, {"model": "tree", "alpha": 0.5}, {}, "key 'drafter.kind'"),
    ],
)
def test_tree_config_errors_name_the_key(drafter: dict, acceptance: dict, over: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        sim_config(drafter, acceptance, 2, **over)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_drafter_spec_with_its_tree_binds_the_acceptance_to_it() -> None:
    config = sim_config({"kind": "mtp,topk=2,tokens=4"}, {"model": "tree", "alpha": 0.7}, 2)
    assert config.acceptance.shape == TreeSpec(topk=2, tokens=4)
    assert sum(config.acceptance.draft_tree(2).depths[1:]) > 0


def test_sweep_cells_take_the_tree_acceptance_for_a_tree_drafter() -> None:
    from moesim.sim.sweep.cells import Cell, cell_config
    from moesim.sim.sweep.config import parse_config

    beam = "eagle3,topk=2,tokens=6"
    grid = {"models": ["qwen3-30b-a3b"], "profiles": ["nvidia-h200-vllm"], "families": ["dispatch"], "drafters": [beam]}
    sweep = parse_config({"grid": grid}, "s.toml", Path("."))
    static = {"name": "static", "k": 3}
    cell = cell_config(sweep, Cell("qwen3-30b-a3b", "nvidia-h200-vllm", "dispatch", beam, 0.7, 2, ""), static)
    assert isinstance(cell.acceptance, Tree) and cell.acceptance.shape == TreeSpec(topk=2, tokens=6)
    chained = cell_config(sweep, Cell("qwen3-30b-a3b", "nvidia-h200-vllm", "dispatch", "eagle3", 0.7, 2, ""), static)
    assert chained.acceptance.name == "geometric"
