"""KV-cache pages, preemption and chunked prefill in the server against a plain-Python reference
that holds explicit page ids, on random schedules; the capacity from the device; one-line errors."""

from __future__ import annotations

import math
import tempfile
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from conftest import make_server

from moesim.errors import ConfigError
from moesim.hw_profiles.catalog import catalog, link_spec
from moesim.models import load_preset
from moesim.sim.cost.parallel import Parallelism
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.config import config_from_dict
from moesim.sim.serving.memory import KVBudget, MemorySection, kv_budget
from moesim.sim.serving.policies import Static
from moesim.sim.serving.scheduler import Scheduling
from moesim.sim.serving.workload import Arrivals, Workload

TABLE = TablePassCost(np.array([900.0 + 40.0 * n for n in range(1, 400)]), draft_step_us=20.0, prefill_us_per_token=2.0)
SWAP_US_PER_PAGE = 7.0


class Ref:
    """One request of the reference."""

    def __init__(self, rid: int, prompt: int, output: int, k: int, alpha: float, seed: int) -> None:
        self.rid, self.prompt, self.output = rid, prompt, output
        self.draws = Geometric(alpha=alpha).bind(rid, output, k, seed)
        self.decoded, self.remaining = 0, output - 1
        self.first = math.nan
        self.finish = math.nan
        self.pages: list[int] = []
        self.target, self.prefilled = prompt, 0
        self.swapped, self.seq = False, 0


class Reference:
    """The documented scheduler (moesim.sim.serving.scheduler) with page ids, iteration by
    iteration: per iteration (pages used, preempted, decoding batch, positions prefilled), per
    request (first token, finish); asserts the page invariants on the way."""

    def __init__(self, rows, requests, concurrency, max_batch, k, alpha, seed, pages, block, chunked, budget, preemption) -> None:  # type: ignore[no-untyped-def]
        self.rows, self.requests, self.max_batch, self.k, self.alpha, self.seed = rows, requests, max_batch, k, alpha, seed
        self.pages, self.block, self.chunked, self.budget, self.preemption = pages, block, chunked, budget, preemption
        self.free = list(range(pages))
        self.owner: dict[int, int] = {}
        self.freed_once: set[int] = set()
        self.reused = 0
        self.queue: deque[Ref] = deque()
        self.issued: list[Ref] = []
        self.done: list[Ref] = []
        self.decoding: list[Ref] = []
        self.prefilling: list[Ref] = []
        self.victims: list[Ref] = []
        self.swap = 0.0
        self.admissions = 0
        for _ in range(min(concurrency, requests)):
            self.issue()

    def issue(self) -> None:
        rid = len(self.issued)
        prompt, output = self.rows[rid % len(self.rows)]
        request = Ref(rid, prompt, output, self.k, self.alpha, self.seed)
        self.issued.append(request)
        self.queue.append(request)

    def take(self, r: Ref, tokens: int) -> bool:
        extra = -(-tokens // self.block) - len(r.pages)
        if extra > len(self.free):
            return False
        for _ in range(max(extra, 0)):
            page = self.free.pop()
            assert page not in self.owner
            self.owner[page] = r.rid
            self.reused += page in self.freed_once
            r.pages.append(page)
        return True

    def give_back(self, r: Ref, keep: int) -> None:
        while len(r.pages) > keep:
            page = r.pages.pop()
            del self.owner[page]
            self.freed_once.add(page)
            self.free.append(page)

    def preempt(self, v: Ref) -> None:
        self.victims.append(v)
        if self.preemption == "swap" and not math.isnan(v.first) and v.prefilled == v.target:
            self.swap += SWAP_US_PER_PAGE * len(v.pages) + 1.0
            v.swapped = True
        else:
            v.target, v.prefilled = v.prompt + v.decoded, 0
        self.give_back(v, 0)
        self.queue.appendleft(v)

    def grow(self, r: Ref, tokens: int) -> bool:
        while not self.take(r, tokens):
            v = max((x for x in self.decoding + self.prefilling if x not in self.victims), key=lambda x: x.seq)
            self.preempt(v)
            if v is r:
                return False
        return True

    def finish(self, r: Ref, now: float) -> None:
        r.finish = now
        self.give_back(r, 0)
        self.done.append(r)
        if len(self.issued) < self.requests:
            self.issue()

    def draft_lens(self) -> list[int]:
        ks, left = [], self.budget
        for i, r in enumerate(self.decoding):
            k = min(self.k, r.remaining - 1)
            if self.chunked:
                k = min(k, left - (len(self.decoding) - i))
                left -= k + 1
            ks.append(k)
        return ks

    def admit(self, left: int, whole: list[Ref], chunks: list[tuple[Ref, int, int]], swapped_in: list[Ref]) -> None:
        while not self.victims and self.queue and (left > 0 or not self.chunked):
            if len(self.decoding) + len(self.prefilling) + len(whole) + len(swapped_in) >= self.max_batch:
                break
            r = self.queue[0]
            if r.swapped:
                if not self.take(r, r.prompt + r.decoded):
                    break
                self.swap += SWAP_US_PER_PAGE * len(r.pages) + 1.0
                r.swapped = False
                swapped_in.append(r)
            elif self.chunked:
                c = min(r.target, left)
                if not self.take(r, c):
                    break
                chunks.append((r, 0, c))
                self.prefilling.append(r)
                left -= c
            else:
                if not self.take(r, r.target):
                    break
                whole.append(r)
            self.queue.popleft()
            self.admissions += 1
            r.seq = self.admissions

    def run(self) -> tuple[list[tuple[int, int, int, int]], list[tuple[float, float]], float]:
        now, log = 0.0, []
        while len(self.done) < self.requests:
            ks = self.draft_lens()
            self.victims, self.swap = [], 0.0
            for i, r in enumerate(self.decoding):
                if r not in self.victims:
                    self.grow(r, r.prompt + r.decoded + ks[i] + 1)
            left = self.budget - sum(ks) - len(ks)
            chunks: list[tuple[Ref, int, int]] = []
            whole: list[Ref] = []
            swapped_in: list[Ref] = []
            for r in self.prefilling:
                if r in self.victims or left <= 0:
                    continue
                c = min(r.target - r.prefilled, left)
                if self.grow(r, r.prefilled + c):
                    chunks.append((r, r.prefilled, c))
                    left -= c
            ks = [k for r, k in zip(self.decoding, ks, strict=True) if r not in self.victims]
            self.decoding = [r for r in self.decoding if r not in self.victims]
            self.prefilling = [r for r in self.prefilling if r not in self.victims]
            chunks = [c for c in chunks if c[0] not in self.victims]
            self.admit(left, whole, chunks, swapped_in)
            assert 0 <= len(self.free) <= self.pages and len(self.owner) == self.pages - len(self.free)
            n = len(self.decoding)
            assert n or whole or chunks or swapped_in, "the reference stalled"
            log.append((self.pages - len(self.free), len(self.victims), n, sum(c for _, _, c in chunks) + sum(r.target for r in whole)))
            tokens = sum(ks) + n + sum(c for _, _, c in chunks)
            draft = TABLE.draft_step_us * max(ks) if n else 0.0
            now += sum(TABLE.prefill_us(r.target) for r in whole) + draft + (TABLE.pass_us(tokens) if tokens else 0.0) + self.swap
            first, resumed = [], []
            for r in whole:
                r.prefilled = r.target
                (first if math.isnan(r.first) else resumed).append(r)
            for r, _, c in chunks:
                r.prefilled += c
                if r.prefilled == r.target:
                    self.prefilling.remove(r)
                    (first if math.isnan(r.first) else resumed).append(r)
            self.commit(ks, now)
            for r in first:
                r.first = now
                if r.remaining:
                    self.decoding.append(r)
                else:
                    self.finish(r, now)
            self.decoding += resumed + swapped_in
        return log, [(r.first, r.finish) for r in self.issued], now

    def commit(self, ks: list[int], now: float) -> None:
        still = []
        for r, k in zip(self.decoding, ks, strict=True):
            c = min(k, r.draws.draw(r.decoded)) + 1
            r.decoded += c
            r.remaining -= c
            if r.remaining:
                still.append(r)
            else:
                self.finish(r, now)
        self.decoding = still


def reference(**case):  # type: ignore[no-untyped-def]
    ref = Reference(**case)
    log, times, end = ref.run()
    return log, times, end, ref.reused


def run_server(rows, requests, concurrency, max_batch, k, alpha, seed, pages, block, chunked, budget, preemption):  # type: ignore[no-untyped-def]
    kv = KVBudget(pages, block, preemption, page_bytes=SWAP_US_PER_PAGE * 1e3, host_link=_link())
    workload = Workload(prompt_tokens=rows[0][0], output_tokens=rows[0][1]) if len(rows) == 1 else _file_workload(rows)
    server = make_server(
        cost=TABLE,
        policy=Static(k=k),
        acceptance=Geometric(alpha=alpha),
        workload=workload,
        arrivals=Arrivals(concurrency=concurrency),
        max_batch=max_batch,
        requests=requests,
        seed=seed,
        scheduling=Scheduling(kv, chunked, budget),
    )
    return server.run()


def _link():  # type: ignore[no-untyped-def]
    from moesim.hw_profiles.catalog import LinkSpec

    return LinkSpec("test", "test link", 1.0, 1.0, "assumed", "a link of 1 GB/s and 1 µs: 7 µs per 7 kB page")


def _file_workload(rows):  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "requests.csv"
        path.write_text("prompt_tokens,output_tokens\n" + "".join(f"{p},{o}\n" for p, o in rows))
        return Workload(file=path)


def random_case(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    rows = [(int(rng.integers(0, 120)), int(rng.integers(1, 90))) for _ in range(int(rng.integers(1, 6)))]
    block = int(rng.choice([1, 4, 16]))
    k = int(rng.integers(0, 5))
    longest = max(p + o for p, o in rows) + k
    pages = -(-longest // block) + int(rng.integers(0, 3 * longest // block + 2))
    max_batch = int(rng.integers(1, 9))
    return {
        "rows": rows,
        "requests": int(rng.integers(5, 30)),
        "concurrency": int(rng.integers(1, 12)),
        "max_batch": max_batch,
        "k": k,
        "alpha": float(rng.uniform(0.2, 0.95)),
        "seed": int(rng.integers(0, 1000)),
        "pages": pages,
        "block": block,
        "chunked": bool(rng.integers(2)),
        "budget": max_batch + int(rng.integers(0, 80)),
        "preemption": str(rng.choice(["recompute", "swap"])),
    }


@pytest.mark.parametrize("seed", range(40))
def test_pages_match_the_reference_on_random_schedules(seed: int) -> None:
    case = random_case(seed)
    log, times, end_us, _ = reference(**case)
    record = run_server(**case)
    assert record.kv_pages_used is not None and record.kv_pages_free is not None and record.preempted is not None
    columns = (record.kv_pages_used, record.preempted, record.batch, record.prefill_tokens)
    got = list(zip(*(c.tolist() for c in columns), strict=True))  # type: ignore[union-attr]
    assert got == log
    assert np.all(record.kv_pages_used >= 0) and np.all(record.kv_pages_used <= case["pages"])
    assert np.all(record.kv_pages_free == case["pages"] - record.kv_pages_used)
    got_times = [t for r in record.requests for t in (r.first_token_us, r.finish_us)]
    assert got_times == pytest.approx([t for pair in times for t in pair], rel=1e-12)
    assert record.end_us == pytest.approx(end_us, rel=1e-12)


def test_preempted_work_is_redone_and_freed_pages_reused() -> None:
    """Tight memory: requests are preempted; each recomputation prefills the prompt and the tokens
    committed before it, every request still commits exactly its output tokens, and pages given
    back are handed out again."""
    case = {
        "rows": [(40, 60)], "requests": 12, "concurrency": 6, "max_batch": 6, "k": 3, "alpha": 0.7, "seed": 4,
        "pages": 20, "block": 8, "chunked": False, "budget": 2048, "preemption": "recompute",
    }  # fmt: skip
    record = run_server(**case)
    _, _, _, reused = reference(**case)
    assert record.memory is not None and record.memory["preemptions"] > 0 and reused > 0
    committed = np.bincount(record.step_request, weights=record.step_accepted + 1, minlength=12)
    assert np.array_equal(committed, np.full(12, 59))
    assert record.admitted.sum() == 12  # one first token each, however often it was preempted
    recomputed = record.prefill_tokens.sum() - 12 * 40  # type: ignore[union-attr]
    assert recomputed > 0 and record.prefill_us.sum() == pytest.approx(2.0 * record.prefill_tokens.sum())  # type: ignore[union-attr]
    assert record.memory["max_running"] <= 6 and record.memory["max_batch_full_length"] == 20 // math.ceil(103 / 8)


def test_chunked_prefill_respects_the_token_budget() -> None:
    """Every pass's decode and verify tokens plus its prefill chunks stay within the budget, decode
    first: the verify window of every decoding request is in, chunks fill what is left."""
    case = {
        "rows": [(300, 40), (50, 80)], "requests": 30, "concurrency": 10, "max_batch": 8, "k": 4, "alpha": 0.6,
        "seed": 2, "pages": 10_000, "block": 16, "chunked": True, "budget": 64, "preemption": "recompute",
    }  # fmt: skip
    record = run_server(**case)
    offsets = np.concatenate([[0], np.cumsum(record.batch)])
    decode_tokens = np.array([int(np.sum(record.step_draft_len[offsets[i] : offsets[i + 1]] + 1)) for i in range(record.batch.size)])
    assert np.all(decode_tokens + record.prefill_tokens <= 64)  # type: ignore[operator]
    assert np.any(decode_tokens + record.prefill_tokens == 64)  # type: ignore[operator]
    pass_tokens = (decode_tokens + record.prefill_tokens)[record.batch > 0]  # type: ignore[operator]
    assert np.all(record.verify_us[record.batch > 0] == [TABLE.pass_us(int(t)) for t in pass_tokens])
    assert np.all(record.prefill_us == 0)
    assert record.prefill_tokens.sum() == sum(300 if r.rid % 2 == 0 else 50 for r in record.requests if not math.isnan(r.first_token_us))  # type: ignore[union-attr]


def test_capacity_from_the_device() -> None:
    """2 x A800 in TP: (80 GB · 0.9 − 57.4 GB of Qwen2-57B-A14B's BF16 weights per device − 1 GB of
    the Qwen2-0.5B drafter) over 16-token pages of 28 layers × 2 KV heads × 128 × 2 × 2 bytes plus
    the drafter's 24 layers × 2 × 2 × 64 × 2 bytes."""
    a800 = catalog()["nvidia-a800-80gb"]
    target, draft = load_preset("qwen2-57b-a14b"), load_preset("qwen2-0.5b")
    parallel = Parallelism(2, False, link_spec(a800.peer_link))
    budget = kv_budget(MemorySection(), target, "BF16", draft, a800, parallel, link_spec(a800.host_link))
    per_token = 28 * 2 * 2 * 128 * 2 + 24 * 2 * 2 * 64 * 2
    weights = target.weight_bytes("BF16") / 2 + draft.weight_bytes("BF16")
    assert budget.pages == int((80e9 * 0.9 - weights) // (16 * per_token))
    assert budget.page_bytes == 16 * per_token
    assert budget.swap_us(10) == pytest.approx(10.0 + 10 * 16 * per_token / 32e3)


def config(tmp_path: Path, **sections) -> dict:  # type: ignore[no-untyped-def]
    base = {
        "run": {"requests": 4},
        "trace": {"synth": "uniform", "tokens": 64, "seqs": 2},
        "cost": {"kind": "steptime"},
        "target": {"model": "qwen2-57b-a14b", "profile": "nvidia-a800-80gb-vllm"},
        "memory": {},
        "acceptance": {"model": "geometric", "alpha": 0.7},
        "policy": {"name": "static", "k": 2},
    }
    base.update(sections)
    return base


def test_weights_that_do_not_fit_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(config(tmp_path), "c.toml", tmp_path)
    message = str(info.value)
    assert "\n" not in message and message.startswith("c.toml: key 'memory':")
    assert "qwen2-57b-a14b" in message and "BF16" in message and "NVIDIA A800 80GB SXM" in message
    fits = config_from_dict(config(tmp_path, parallel={"tensor_parallel": 2}), "c.toml", tmp_path)
    assert fits.parallel.tensor_parallel == 2
    with pytest.raises(ConfigError, match=r"key 'memory\.preemption': unknown preemption 'evict'"):
        config_from_dict(config(tmp_path, memory={"preemption": "evict"}, parallel={"tensor_parallel": 2}), "c.toml", tmp_path)
