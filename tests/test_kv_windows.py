"""KV-cache pages of sliding-window layers: `kv_pages` against a count of the blocks each layer's
positions touch, a request's pages over its passes against a block manager that drops the blocks
before its windows (vLLM's SlidingWindowManager), the capacity and the longest-request check, and
a windowed model holding more requests in the same pages."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from conftest import make_server

from moesim.errors import ConfigError
from moesim.hw_profiles.catalog import catalog
from moesim.models import load_preset
from moesim.sim.cost.parallel import Parallelism
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.config import config_from_dict
from moesim.sim.serving.memory import FULL_ONLY, PAGE_PARTS, KVCache, MemorySection, check_longest_request, kv_budget, kv_pages
from moesim.sim.serving.policies import Static
from moesim.sim.serving.scheduler import Scheduling
from moesim.sim.serving.workload import Arrivals, Workload

GPT_OSS = load_preset("gpt-oss-20b")
H200 = catalog()["nvidia-h200"]


def _budget(pages: int = 0, block: int = 16):  # type: ignore[no-untyped-def]
    return kv_budget(MemorySection(block_tokens=block, pages=pages), GPT_OSS, "MXFP4", None, H200, Parallelism(), None)


def blocks_touched(window: int, tokens: int, computed: int, block: int) -> int:
    """The blocks of the positions a pass may read or write: all `tokens` of them (full attention), or
    those from the window of its first query (position `computed`) on."""
    first = max(0, computed - window + 1) if window else 0
    return len({p // block for p in range(first, tokens)})


def test_pages_are_the_blocks_each_layer_touches_weighted_by_its_bytes() -> None:
    """gpt-oss-20b: its 24 layers one by one (each its own window, its own KV bytes) against the
    budget's two groups, for decode and prefill passes at every alignment up to 300 positions."""
    budget = _budget(block=16)
    assert budget.windows == (0, 128) and budget.parts == (PAGE_PARTS // 2, PAGE_PARTS // 2)
    layers = [GPT_OSS.attention_of(i) for i in range(GPT_OSS.layers)]
    total = sum(Fraction(a.kv_cache_bytes_per_token()) for a in layers)
    for tokens in range(1, 300):
        for written in {1, 4, 9, tokens}:
            computed = tokens - written
            touched = {w: blocks_touched(w, tokens, computed, 16) for w in (0, 128)}
            exact = sum(Fraction(a.kv_cache_bytes_per_token()) * touched[a.sliding_window] for a in layers)
            assert budget.pages_for(tokens, computed) == -(-exact // total), (tokens, computed)


@pytest.mark.parametrize("seed", range(20))
def test_pages_count_the_blocks_of_random_groups(seed: int) -> None:
    rng = np.random.default_rng(seed)
    block = int(rng.choice([1, 3, 16, 64]))
    windows = tuple(sorted({int(w) for w in rng.integers(1, 200, int(rng.integers(1, 4)))}))
    parts = [int(p) for p in rng.integers(0, PAGE_PARTS // 4, len(windows))]
    groups = ((0, *windows), (PAGE_PARTS - sum(parts), *parts))
    for _ in range(300):
        tokens = int(rng.integers(0, 1000))
        computed = int(rng.integers(0, tokens + 1))
        held = sum(p * blocks_touched(w, tokens, computed, block) for w, p in zip(*groups, strict=True))
        assert kv_pages(tokens, computed, block, *groups) == -(-held // PAGE_PARTS)
        if computed == tokens - 1:  # a decode pass: at most ⌈(W − 1)/B⌉ + 1 blocks of a window, never more than ⌈t/B⌉
            for w in windows:
                assert blocks_touched(w, tokens, computed, block) <= min(-(-(w - 1) // block) + 1, -(-tokens // block))


class BlockManager:
    """One request's blocks per group as a vLLM-style manager keeps them: before a pass the blocks
    wholly before its windows are freed, then blocks are added up to the pass's last position (never
    taken back while the request runs: rejected drafts keep theirs)."""

    def __init__(self, windows: tuple[int, ...], block: int) -> None:
        self.windows, self.block = windows, block
        self.held: list[set[int]] = [set() for _ in windows]
        self.allocated = 0  # blocks handed out so far, in position order

    def step(self, tokens: int, computed: int) -> None:
        while self.allocated * self.block < tokens:
            for held in self.held:
                held.add(self.allocated)
            self.allocated += 1
        for window, held in zip(self.windows, self.held, strict=True):
            if window:
                held -= {b for b in held if (b + 1) * self.block <= computed - window + 1}


class Holder:
    kv_pages = 0
    kv_tokens = 0


@pytest.mark.parametrize("seed", range(20))
def test_a_request_holds_the_block_managers_pages_over_its_passes(seed: int) -> None:
    """Random lives: a prompt prefilled whole or in chunks, then decode passes of random draft
    lengths and acceptances (the pages of rejected drafts kept); the pool's free pages follow."""
    rng = np.random.default_rng(100 + seed)
    block = int(rng.choice([1, 4, 16]))
    windows = tuple(sorted({int(w) for w in rng.integers(1, 80, int(rng.integers(1, 3)))}))
    parts = [int(p) for p in rng.integers(1, PAGE_PARTS // 3, len(windows))]
    budget = dataclasses.replace(_budget(pages=10_000, block=block), windows=(0, *windows), parts=(PAGE_PARTS - sum(parts), *parts))
    kv, request, manager = KVCache(budget), Holder(), BlockManager(budget.windows, block)
    prompt, chunk, written = int(rng.integers(1, 300)), int(rng.integers(1, 100)), 0
    passes = [(min(c + chunk, prompt), c) for c in range(0, prompt, chunk)]
    for _ in range(60):
        k = int(rng.integers(0, 6))
        passes.append((prompt + written + k + 1, prompt + written))
        written += int(rng.integers(0, k + 1)) + 1
    for tokens, computed in passes:
        assert kv.grow(request, tokens, computed)
        manager.step(tokens, computed)
        held = sum(p * len(b) for p, b in zip(budget.parts, manager.held, strict=True))
        assert request.kv_pages == -(-held // PAGE_PARTS) and kv.free == 10_000 - request.kv_pages
    kv.release(request)
    assert kv.free == 10_000 and request.kv_pages == request.kv_tokens == 0


def test_capacity_is_the_longest_context_whose_every_decode_pass_fits() -> None:
    """400 pages of gpt-oss-20b: the capacity against a scan of every context's decode pass (the
    windowed half of a page holds at most 9 blocks of 16), about twice the 6,400 tokens of a model
    without windows; the summary's figures say how the window was counted."""
    budget = _budget(pages=400)
    scan = 0
    while True:
        t = scan + 1
        need = Fraction(1, 2) * (len(range(0, t, 16)) + blocks_touched(128, t, t - 1, 16))
        if -(-need // 1) > 400:
            break
        scan = t
    assert budget.context_tokens() == scan // 16 * 16 == 16 * (2 * 400 - 9)
    figures = budget.describe()
    assert figures["capacity_tokens"] == scan // 16 * 16 and figures["pages"] == 400
    assert figures["kv_groups"] == [{"window": 0, "page_share": 0.5}, {"window": 128, "page_share": 0.5}]
    assert "SlidingWindowManager" in figures["kv_counting"]
    plain = dataclasses.replace(budget, windows=FULL_ONLY[0], parts=FULL_ONLY[1])
    assert plain.context_tokens() == 6400 and "kv_groups" not in plain.describe()
    every_layer = dataclasses.replace(budget, windows=(128,), parts=(PAGE_PARTS,))  # no full layer: no bound
    assert every_layer.context_tokens() is None and every_layer.pass_pages(10**6, 1) == 9
    with pytest.raises(ConfigError, match=r"hold any number of tokens; the longest request needs 7005 \(438 pages"):
        check_longest_request(every_layer, Workload(prompt_tokens=6000, output_tokens=1000), [Static(k=4)])


def test_the_longest_request_needs_its_window_only_with_chunked_prefill() -> None:
    """A request of 6,000 + 1,000 tokens: beyond 400 pages of the whole model (438 pages), within
    them through the windows when its prefill (a recompute after a preemption included) comes in
    chunks of 512; a whole prefill of its context needs every block of every layer."""
    workload, policies = Workload(prompt_tokens=6000, output_tokens=1000), [Static(k=4)]
    check_longest_request(_budget(pages=400), workload, policies, 512)
    with pytest.raises(ConfigError, match=r"the longest request needs 7005 \(438 pages"):
        check_longest_request(_budget(pages=400), workload, policies)
    plain = dataclasses.replace(_budget(pages=400), windows=FULL_ONLY[0], parts=FULL_ONLY[1])
    with pytest.raises(ConfigError, match=r"hold 6400 tokens; the longest request needs 7005 \(438 pages"):
        check_longest_request(plain, workload, policies, 512)


def test_a_config_checks_the_longest_request_with_its_chunks(tmp_path: Path) -> None:
    """The same request through a config's `[batching]`: accepted with chunked prefill, one line naming
    `memory.pages` without it."""
    table = {
        "run": {"requests": 4}, "trace": {"synth": "uniform", "tokens": 64, "seqs": 2}, "cost": {"kind": "steptime"},
        "target": {"model": "gpt-oss-20b", "profile": "nvidia-h200-vllm"}, "memory": {"pages": 400},
        "batching": {"max_batch": 8, "chunked_prefill": True, "token_budget": 512},
        "workload": {"prompt_tokens": 6000, "output_tokens": 1000}, "acceptance": {"model": "geometric", "alpha": 0.7},
        "policy": {"name": "static", "k": 4},
    }  # fmt: skip
    assert config_from_dict(table, "c.toml", tmp_path).memory.pages == 400  # type: ignore[union-attr]
    table["batching"] = {"max_batch": 8}
    with pytest.raises(ConfigError, match=r"^c\.toml: key 'memory\.pages': 400 pages of 16 tokens hold 12656 tokens; .* 7005 \(438 pages"):
        config_from_dict(table, "c.toml", tmp_path)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_windowed_model_holds_more_requests_in_the_same_pages(chunked: bool) -> None:
    """64 requests of 1,000 + 300 tokens in 400 pages: with gpt-oss-20b's windows counted more run
    at once, fewer are preempted and the run ends sooner than with every layer sized for the whole
    context; the compiled lane and the Python loop agree on the windowed run."""
    table = TablePassCost(np.array([900.0 + 40.0 * n for n in range(1, 3000)]), draft_step_us=20.0, prefill_us_per_token=2.0)
    windowed = _budget(pages=400)
    runs = {}
    plain_budget = dataclasses.replace(windowed, windows=FULL_ONLY[0], parts=FULL_ONLY[1])
    for name, budget, lane in (("windowed", windowed, True), ("python", windowed, False), ("plain", plain_budget, True)):
        server = make_server(
            cost=table, policy=Static(k=3), acceptance=Geometric(alpha=0.7), workload=Workload(prompt_tokens=1000, output_tokens=300),
            arrivals=Arrivals(concurrency=32), max_batch=32, requests=64, seed=0, scheduling=Scheduling(budget, chunked, 512), lane=lane,
        )  # fmt: skip
        runs[name] = server.run()
        assert (server.lane is not None) == lane
    win, plain = runs["windowed"], runs["plain"]
    assert win.memory["max_running"] > plain.memory["max_running"]  # type: ignore[index]
    assert win.memory["preemptions"] < plain.memory["preemptions"]  # type: ignore[index]
    assert win.end_us < plain.end_us
    assert np.array_equal(win.kv_pages_used, runs["python"].kv_pages_used) and win.end_us == runs["python"].end_us  # type: ignore[arg-type]
    assert win.memory == runs["python"].memory
