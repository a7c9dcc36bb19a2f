"""The compiled paths of the simulator against their references: one pass of the trace-driven
step-time model in one compiled call against the union counters and the model's numpy lookups,
and the server's compiled decode lane against its Python loop (the same records, bit for bit)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import make_server

from moesim.fields import FieldError
from moesim.hw_profiles import family_kernel, load_profile
from moesim.hw_profiles.catalog import LinkSpec, catalog
from moesim.models import load_preset
from moesim.sim.cost.drafters import make_drafter
from moesim.sim.cost.fast_pass import pairwise_sum
from moesim.sim.cost.parallel import Parallelism
from moesim.sim.cost.pass_table import PrefillChunks, TablePassCost
from moesim.sim.cost.steptime import TABLE_AFTER_PASSES, StepTimeModel
from moesim.sim.cost.trace_batch import TraceBatchCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.cascade import Cascade
from moesim.sim.serving.lane import exact_delays
from moesim.sim.serving.memory import PAGE_PARTS, MemorySection, kv_budget
from moesim.sim.serving.policies import Static
from moesim.sim.serving.scheduler import Scheduling
from moesim.sim.serving.workload import Arrivals, TraceWindows, Workload
from moesim.tracegen.routing.synth import Sticky, synthesize

QWEN3 = load_preset("qwen3-30b-a3b")
TRACE = synthesize(QWEN3, Sticky(keep_prob=0.3), 512, 8, 0)
WINDOWS = TraceWindows.from_trace(TRACE, offset_stride=0, window_max=5, source="test")
BUDGET = kv_budget(MemorySection(), QWEN3, "BF16", None, catalog()["nvidia-h200"], Parallelism(), None)
WINDOWED = kv_budget(MemorySection(pages=120), load_preset("gpt-oss-20b"), "MXFP4", None, None, Parallelism(), None)  # W = 128 on half


def test_pairwise_sum_has_numpys_bits() -> None:
    rng = np.random.default_rng(0)
    for n in range(0, 300, 7):
        a = rng.random(n) * 10.0 ** rng.integers(-3, 6, n)
        assert pairwise_sum(a, 0, n) == a.sum()


# the lab H200 (its families priced by the lookup ladder: never by the compiled formula) and vLLM's
# H200 engine profile (families priced by their fitted terms: `ExpertFamily.compiled`)
PROFILES = {"lab": ("nvidia-h200", ("dedup", "best")), "engine": ("nvidia-h200-vllm", ("dispatch", "best"))}
SETUPS = [(profile, engine) for profile, engines in PROFILES.values() for engine in engines]


def test_exact_delays_reach_the_end_as_simpy_adds_them() -> None:
    rng = np.random.default_rng(2)
    twice = 0
    for _ in range(20_000):
        now = float(rng.uniform(0.0, 1e6))
        end = now * float(rng.uniform(1.0, 8.0))  # the lane's clock after several sums, not now + one delay
        clock = now
        delays = exact_delays(now, end)
        for delay in delays:
            assert delay >= 0.0
            clock = clock + delay
        assert clock == end
        twice += len(delays) == 2
    assert twice  # a single delay does not always reach the end (a tie rounded to even past it)


def _cost(profile: str, engine: str, compiled: bool) -> TraceBatchCost:
    model = StepTimeModel(QWEN3, load_profile(profile), engine)
    return TraceBatchCost(model, TRACE, make_drafter("ngram", QWEN3), compiled=compiled)


def test_the_profiles_take_both_pricings() -> None:
    """The lab profile's ladder and its families' formula disagree (so the equalities below would
    catch the formula used in its place); the engine profile's families run compiled."""
    lab, engine = load_profile("nvidia-h200"), load_profile("nvidia-h200-vllm")
    assert not any(f.compiled for f in lab.expert_families.values())
    assert all(f.compiled for f in engine.expert_families.values())
    shape, k = QWEN3.expert_shape("BF16"), QWEN3.top_k
    distinct = np.arange(8.0, 33.0)  # passes of 4 tokens: 32 slots over U experts, at most 4 tokens each
    slots, most = np.full(distinct.size, 32.0), np.ceil(32.0 / distinct)
    for family in lab.expert_families.values():
        formula = np.empty(distinct.size)
        family_kernel.pass_times_us(slots, distinct, most, *family.compiled_params(shape, k), formula)
        assert not np.array_equal(formula, family.fast_time_us(slots, distinct, most, shape, k)), family.name


@pytest.mark.parametrize(("profile", "engine"), SETUPS)
def test_compiled_pass_equals_the_reference(profile: str, engine: str) -> None:
    fast, reference = _cost(profile, engine, True), _cost(profile, engine, False)
    rng = np.random.default_rng(1)
    for size in (3, 4):
        for _ in range(TABLE_AFTER_PASSES + 8):  # before and after the pass size gets its tables
            seqs = rng.integers(0, TRACE.n_seqs, 6)
            starts = rng.integers(0, 400, 6)
            n_tokens = np.full(6, size, np.int64)
            n_tokens[0] = size - 1
            context = rng.integers(1, 3000, 6)
            expected = reference.verify_us(seqs, starts, n_tokens, context)
            assert fast.verify_us(seqs, starts, n_tokens, context) == expected
            assert fast.last_distinct_experts == reference.last_distinct_experts
            chunks = PrefillChunks(rng.integers(0, TRACE.n_seqs, 2), rng.integers(0, 300, 2), rng.integers(1, 200, 2))
            expected = reference.mixed_us(seqs, starts, n_tokens, context, chunks)
            assert fast.mixed_us(seqs, starts, n_tokens, context, chunks) == expected
            assert fast.last_distinct_experts == reference.last_distinct_experts


def _records(lane: bool, cost: object, scheduling: Scheduling, **changes: object) -> tuple:
    args: dict = dict(
        policy=Static(k=3),
        acceptance=Geometric(alpha=0.7),
        workload=Workload(prompt_tokens=100, output_tokens=60),
        arrivals=Arrivals(concurrency=8),
        max_batch=8,
        requests=30,
        seed=0,
        windows=WINDOWS,
        scheduling=scheduling,
    )
    args.update(changes)
    server = make_server(cost=cost, lane=lane, **args)  # type: ignore[arg-type]
    record = server.run()
    assert (server.lane is not None) == lane
    columns = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.name == "requests":
            value = [tuple(getattr(r, s) for s in r.__slots__ if s != "acceptance") for r in value]
            value = repr(value)  # NaN first-token times compare by their text
        elif isinstance(value, np.ndarray):
            value = (value.dtype.str, value.shape, value.tobytes())
        columns[f.name] = value
    return tuple(sorted(columns.items()))


CASES = {
    "whole prefills": (Scheduling(), {}),
    "KV pages and chunked prefill": (Scheduling(BUDGET, chunked_prefill=True, token_budget=64), {}),
    "preemptions": (Scheduling(dataclasses.replace(BUDGET, pages=300), chunked_prefill=True, token_budget=256), {}),
    "sliding windows": (Scheduling(WINDOWED, chunked_prefill=True, token_budget=256), {"workload": Workload(300, 200)}),
    "Poisson arrivals": (Scheduling(BUDGET), {"arrivals": Arrivals(kind="poisson", rate_per_s=50.0)}),
    "cut by the duration": (Scheduling(), {"requests": 0, "duration_us": 3e5}),
    "batch 1": (Scheduling(), {"max_batch": 1, "arrivals": Arrivals(concurrency=1), "requests": 3, "workload": Workload(10, 5000)}),
    "MoESD slots": (Scheduling(moesd_slots=True), {}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["trace, lab", "trace, engine", "table"])
def test_the_lane_writes_the_python_loops_records(case: str, kind: str) -> None:
    scheduling, changes = CASES[case]

    def cost(compiled: bool) -> object:
        if kind == "table":
            return TablePassCost(np.array([900.0 + 150.0 * n for n in range(1, 300)]), draft_step_us=30.0)
        profile, engine = {"trace, lab": ("nvidia-h200", "best"), "trace, engine": ("nvidia-h200-vllm", "dispatch")}[kind]
        return _cost(profile, engine, compiled)

    lane = _records(True, cost(True), scheduling, **changes)
    assert lane == _records(False, cost(False), scheduling, **changes)  # the Python loop on the numpy reference path
    assert lane == _records(True, cost(True), scheduling, **changes)  # same seed, same records


@pytest.mark.parametrize("seed", range(60))
def test_the_lane_writes_the_python_loops_records_on_random_schedules(seed: int) -> None:
    """Random batch sizes, page pools (preemptions by recompute and by swap), chunk budgets, draft
    lengths, prompt and output lengths, closed loops and Poisson arrivals, KV-cache groups with
    sliding windows on half the seeds: the lane's records are the Python loop's, on a table cost
    and on the trace-driven cost of an engine profile."""
    rng = np.random.default_rng(seed)
    prompt, output, k = int(rng.integers(0, 120)), int(rng.integers(1, 90)), int(rng.integers(0, 5))
    block = int(rng.choice([1, 4, 16]))
    pages = -(-(prompt + output + k) // block) + int(rng.integers(0, 3 * (prompt + output + k) // block + 2))
    max_batch = int(rng.integers(1, 9))
    link = LinkSpec("test", "test link", 1.0, 1.0, "assumed", "a host link of 1 GB/s and 1 µs (swap preemption)")
    preemption = str(rng.choice(["recompute", "swap"]))
    budget = dataclasses.replace(BUDGET, pages=pages, block_tokens=block, preemption=preemption, host_link=link)
    scheduling = Scheduling(budget if rng.integers(2) else None, bool(rng.integers(2)), max_batch * (k + 1) + int(rng.integers(0, 80)))
    open_loop = bool(rng.integers(4) == 0)
    arrivals = Arrivals(kind="poisson", rate_per_s=200.0) if open_loop else Arrivals(concurrency=int(rng.integers(1, 12)))
    changes = dict(
        policy=Static(k=k), workload=Workload(prompt_tokens=prompt, output_tokens=output), arrivals=arrivals, max_batch=max_batch,
        requests=int(rng.integers(5, 30)), seed=int(rng.integers(0, 1000)),
    )  # fmt: skip
    if scheduling.kv is not None and rng.integers(2):  # windows of 1 … 40 positions (a block of up to 16), shares of a page
        windows = tuple(sorted({int(w) for w in rng.integers(1, 41, int(rng.integers(1, 3)))}))
        parts = [int(p) for p in rng.integers(1, PAGE_PARTS // 2, len(windows))]
        kv = dataclasses.replace(scheduling.kv, windows=(0, *windows), parts=(PAGE_PARTS - sum(parts), *parts))
        scheduling = dataclasses.replace(scheduling, kv=kv)
    table = TablePassCost(np.array([900.0 + 150.0 * n for n in range(1, 2000)]), draft_step_us=30.0)
    assert _records(True, table, scheduling, **changes) == _records(False, table, scheduling, **changes)
    fast, reference = _cost("nvidia-h200-vllm", "dispatch", True), _cost("nvidia-h200-vllm", "dispatch", False)
    assert _records(True, fast, scheduling, **changes) == _records(False, reference, scheduling, **changes)


def test_chunks_longer_than_the_prefill_region_wrap_in_the_lane_as_in_the_loop() -> None:
    """A 64-row trace: its prefill region is 64 rows, and chunks of up to 300 prompt tokens wrap
    around it several times (more windows and blocks per chunk than a long trace gives)."""
    small = synthesize(QWEN3, Sticky(keep_prob=0.3), 32, 2, 1)
    windows = TraceWindows.from_trace(small, offset_stride=0, window_max=5, source="test")
    scheduling = Scheduling(BUDGET, chunked_prefill=True, token_budget=600)

    def cost(compiled: bool) -> TraceBatchCost:
        return TraceBatchCost(
            StepTimeModel(QWEN3, load_profile("nvidia-h200-vllm"), "dispatch"), small, make_drafter("ngram", QWEN3), compiled=compiled
        )

    changes = {"windows": windows, "workload": Workload(prompt_tokens=300, output_tokens=20), "requests": 12}
    assert _records(True, cost(True), scheduling, **changes) == _records(False, cost(False), scheduling, **changes)


@pytest.mark.parametrize("case", ["whole prefills", "KV pages and chunked prefill", "MoESD slots"])
def test_the_lane_runs_admissions_and_prefills_itself(case: str) -> None:
    """In a closed loop without preemptions on an engine profile, the lane runs nearly every
    iteration: admissions, chunks, finishes and arrivals included (the Python loop only where a
    pass size reaches its tables)."""
    scheduling, changes = CASES[case]
    server = make_server(
        cost=_cost("nvidia-h200-vllm", "dispatch", True), policy=Static(k=3), acceptance=Geometric(alpha=0.7),
        workload=Workload(prompt_tokens=100, output_tokens=60), arrivals=Arrivals(concurrency=8), max_batch=8, requests=60,
        seed=0, windows=WINDOWS, scheduling=scheduling, **changes,
    )  # fmt: skip
    record = server.run()
    assert server.lane is not None
    assert np.count_nonzero(record.admitted) > 10  # many iterations yield first tokens
    assert server.lane.iterations >= 0.9 * record.draft_us.size, (server.lane.iterations, record.draft_us.size)


def test_adaptive_policies_keep_the_python_loop() -> None:
    server = make_server(
        cost=_cost("nvidia-h200", "best", True), policy=Cascade(), acceptance=Geometric(alpha=0.7), workload=Workload(10, 50),
        arrivals=Arrivals(concurrency=2), max_batch=2, requests=2, seed=0, windows=WINDOWS,
    )  # fmt: skip
    assert server.lane is None


def _open_loop(rng: np.random.Generator, tmp_path: Path, table: bool) -> Arrivals:
    """Poisson, bursty (gamma, cv 2-4) or replayed arrivals; replayed times on a 30 µs grid with
    repeats, so that arrivals often fall exactly on an iteration's end on the table cost (integer µs)."""
    kind = str(rng.choice(["poisson", "gamma", "replay"]))
    rate = float(rng.choice([20.0, 200.0, 2000.0]))
    if kind != "replay":
        return Arrivals(kind=kind, rate_per_s=rate, cv=float(rng.uniform(2.0, 4.0)) if kind == "gamma" else 1.0)
    steps = rng.choice([0, 0, 30, 60, 900, 1050, 1080, 1e4], 40) if table else rng.exponential(1e6 / rate, 40)
    path = tmp_path / f"arrivals-{rng.integers(1 << 30)}.csv"
    path.write_text("arrival_us\n" + "\n".join(repr(float(t)) for t in np.cumsum(steps)) + "\n")
    return Arrivals(kind="replay", file=path)


@pytest.mark.parametrize("seed", range(40))
def test_the_lane_writes_the_python_loops_records_on_open_loops(seed: int, tmp_path: Path) -> None:
    """Random open loops (Poisson, bursty, replayed arrivals with ties) under page pools small
    enough to preempt by recompute and by swap, with and without chunked prefill and a duration
    cut: the lane (its own arrivals, preemptions and swaps) writes the Python loop's records."""
    rng = np.random.default_rng(1000 + seed)
    prompt, output, k = int(rng.integers(0, 120)), int(rng.integers(1, 90)), int(rng.integers(0, 5))
    block = int(rng.choice([1, 4, 16]))
    max_batch = int(rng.integers(1, 9))
    pages = -(-(prompt + output + k) // block) + int(rng.integers(0, max_batch * (prompt + output + k) // (2 * block) + 2))
    link = LinkSpec("test", "test link", 1.0, 1.0, "assumed", "a host link of 1 GB/s and 1 µs (swap preemption)")
    preemption = str(rng.choice(["recompute", "swap"]))
    budget = dataclasses.replace(BUDGET, pages=pages, block_tokens=block, preemption=preemption, host_link=link)
    scheduling = Scheduling(budget, bool(rng.integers(2)), max_batch * (k + 1) + int(rng.integers(0, 80)))
    table = TablePassCost(np.array([900.0 + 150.0 * n for n in range(1, 2000)]), draft_step_us=30.0)
    arrivals = _open_loop(rng, tmp_path, True)
    cut = bool(rng.integers(3) == 0)
    changes = dict(
        policy=Static(k=k), workload=Workload(prompt_tokens=prompt, output_tokens=output), arrivals=arrivals, max_batch=max_batch,
        requests=0 if cut else int(rng.integers(5, 30)), duration_us=float(rng.uniform(2e4, 3e5)) if cut else 0.0,
        seed=int(rng.integers(0, 1000)),
    )  # fmt: skip
    assert _records(True, table, scheduling, **changes) == _records(False, table, scheduling, **changes)
    changes["arrivals"] = _open_loop(rng, tmp_path, False)
    fast, reference = _cost("nvidia-h200-vllm", "dispatch", True), _cost("nvidia-h200-vllm", "dispatch", False)
    assert _records(True, fast, scheduling, **changes) == _records(False, reference, scheduling, **changes)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("kind", ["poisson", "gamma"])
def test_the_lane_runs_open_loops_and_preemptions_itself(kind: str, preemption: str) -> None:
    """An open loop under memory pressure (pages for about a third of the batch) on an engine
    profile: the lane runs nearly every iteration, preemptions and swaps included."""
    link = LinkSpec("test", "test link", 1.0, 1.0, "assumed", "a host link of 1 GB/s and 1 µs (swap preemption)")
    budget = dataclasses.replace(BUDGET, pages=40, block_tokens=16, preemption=preemption, host_link=link)
    server = make_server(
        cost=_cost("nvidia-h200-vllm", "dispatch", True), policy=Static(k=3), acceptance=Geometric(alpha=0.7),
        workload=Workload(prompt_tokens=100, output_tokens=60), arrivals=Arrivals(kind=kind, rate_per_s=300.0, cv=3.0), max_batch=8,
        requests=80, seed=0, windows=WINDOWS, scheduling=Scheduling(budget, chunked_prefill=True, token_budget=128),
    )  # fmt: skip
    record = server.run()
    assert server.lane is not None and record.preempted is not None and record.swap_us is not None
    assert record.preempted.sum() > 5
    assert (record.swap_us.sum() > 0) == (preemption == "swap")
    assert server.lane.iterations >= 0.9 * record.draft_us.size, (server.lane.iterations, record.draft_us.size)


def test_gamma_gaps_have_the_rate_and_spread_asked() -> None:
    """The gamma stream's gaps: mean 1/rate and coefficient of variation cv (200,000 draws)."""
    for cv in (0.5, 1.0, 3.0):
        gaps = np.fromiter(itertools.islice(Arrivals(kind="gamma", rate_per_s=50.0, cv=cv).gaps_us(7), 200_000), float)
        assert abs(gaps.mean() / 2e4 - 1.0) < 0.03 * cv
        assert abs(gaps.std() / gaps.mean() / cv - 1.0) < 0.03


def test_replayed_arrivals_arrive_at_the_files_times(tmp_path: Path) -> None:
    times = [0.0, 0.0, 1500.0, 1500.0, 2e5, 2.5e5]
    path = tmp_path / "arrivals.parquet"
    pl.DataFrame({"arrival_us": times}).write_parquet(path)
    for lane in (True, False):
        server = make_server(
            cost=TablePassCost(np.array([900.0 + 150.0 * n for n in range(1, 300)]), draft_step_us=30.0), policy=Static(k=3),
            acceptance=Geometric(alpha=0.7), workload=Workload(prompt_tokens=10, output_tokens=20),
            arrivals=Arrivals(kind="replay", file=path), max_batch=4, requests=100, seed=0, lane=lane,
        )  # fmt: skip
        record = server.run()
        assert [r.arrival_us for r in record.requests] == times  # every row, then no more requests
        assert all(r.finish_us > r.arrival_us for r in record.requests)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("t\n1\n", "has no column 'arrival_us'"),
        ("arrival_us\n5\n3\n", "row 1 column 'arrival_us' must be finite, >= 0 and >= the row before, got 3.0"),
        ("arrival_us\n-1\n", "row 0 column 'arrival_us'"),
        ("arrival_us\n", "must hold numbers"),
    ],
)
def test_bad_replay_files_name_the_file_and_row(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "arrivals.csv"
    path.write_text(text)
    with pytest.raises(FieldError, match=re.escape(message)) as error:
        Arrivals(kind="replay", file=path)
    assert error.value.field == "file" and str(path) in error.value.detail
