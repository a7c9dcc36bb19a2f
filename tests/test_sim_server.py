"""The SimPy server against a plain-Python reference, conservation laws, arrivals, trace windows."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_server

from moesim.models import load_preset
from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.policies import Off, Policy, Static
from moesim.sim.serving.workload import Arrivals, TraceWindows, Workload
from moesim.tracegen.routing.synth import Uniform, synthesize

TABLE = TablePassCost(np.array([1000.0 + 120.0 * n for n in range(1, 80)]), draft_step_us=25.0, prefill_us_per_token=3.0)


def run(policy: Policy, *, alpha: float = 0.6, requests: int = 6, max_batch: int = 1, workload: Workload | None = None, **kw):  # type: ignore[no-untyped-def]
    server = make_server(
        cost=kw.pop("cost", TABLE),
        policy=policy,
        acceptance=kw.pop("acceptance", Geometric(alpha=alpha)),
        workload=workload or Workload(prompt_tokens=50, output_tokens=300),
        arrivals=kw.pop("arrivals", Arrivals()),
        max_batch=max_batch,
        requests=requests,
        duration_us=kw.pop("duration_us", 0.0),
        seed=kw.pop("seed", 11),
        **kw,
    )
    return server.run()


def reference_batch1(k_static: int, alpha: float, requests: int, prompt: int, output: int, seed: int) -> list[tuple[float, float]]:
    """Plain-Python replay of a closed loop at concurrency 1: prefill, then decode passes (first token, finish)."""
    acceptance = Geometric(alpha=alpha)
    t = 0.0
    out = []
    for rid in range(requests):
        draws = acceptance.bind(rid, output, k_static, seed)
        t += TABLE.prefill_us(prompt)
        first = t
        remaining, decoded = output - 1, 0
        while remaining:
            k = min(k_static, remaining - 1)
            t += TABLE.draft_step_us * k + TABLE.pass_us(k + 1)
            c = min(k, draws.draw(decoded)) + 1
            decoded += c
            remaining -= c
        out.append((first, t))
    return out


@pytest.mark.parametrize("k", [0, 1, 4])
def test_batch1_matches_plain_python_reference(k: int) -> None:
    record = run(Static(k=k), alpha=0.7)
    expected = reference_batch1(k, 0.7, 6, 50, 300, 11)
    got = [t for r in record.requests for t in (r.first_token_us, r.finish_us)]
    assert got == pytest.approx([t for pair in expected for t in pair], rel=1e-12)
    assert record.end_us == pytest.approx(expected[-1][1], rel=1e-12)


def test_continuous_batching_conservation() -> None:
    workload = Workload(prompt_tokens=20, output_tokens=97)
    record = run(Static(k=3), requests=40, max_batch=8, workload=workload, arrivals=Arrivals(kind="closed", concurrency=12))
    assert all(r.finish_us > r.first_token_us >= r.arrival_us for r in record.requests)
    assert record.batch.max() == 8 and np.all(record.batch + record.admitted <= 8)
    # every request commits exactly its output tokens: one from prefill, the rest from decode steps
    committed = np.bincount(record.step_request, weights=record.step_accepted + 1, minlength=40)
    assert np.array_equal(committed, np.full(40, 96))
    assert record.admitted.sum() == 40
    # the clock: each iteration starts when the previous one ends (the server is never idle in a closed loop)
    ends = record.start_us + record.prefill_us + record.draft_us + record.verify_us
    assert np.allclose(record.start_us[1:], ends[:-1], rtol=0, atol=1e-6)
    # verify time is the table at the batch's total tokens
    offsets = np.concatenate([[0], np.cumsum(record.batch)])
    for i in np.flatnonzero(record.batch)[:50]:
        ks = record.step_draft_len[offsets[i] : offsets[i + 1]]
        assert record.verify_us[i] == TABLE.pass_us(int(np.sum(ks + 1)))
        assert record.draft_us[i] == TABLE.draft_step_us * ks.max()
    # draft lengths never exceed remaining tokens - 1 (no token drafted past the output)
    assert np.all(record.step_accepted <= record.step_draft_len)


def test_poisson_arrivals_follow_their_stream() -> None:
    arrivals = Arrivals(kind="poisson", rate_per_s=2.0)
    record = run(Static(k=2), requests=30, max_batch=4, arrivals=arrivals, seed=5)
    expected = np.cumsum(np.random.default_rng([5, 0xA221]).exponential(1e6 / 2.0, 30))
    assert np.allclose([r.arrival_us for r in record.requests], expected)
    assert all(r.first_token_us >= r.arrival_us for r in record.requests)
    # at 2 requests/s and ~0.2 s per request the server idles between arrivals
    ends = record.start_us + record.prefill_us + record.draft_us + record.verify_us
    assert np.any(record.start_us[1:] > ends[:-1] + 1.0)


def test_progress_callback_reaches_the_end() -> None:
    seen: list[float] = []
    run(Static(k=1), requests=4, workload=Workload(prompt_tokens=0, output_tokens=6000), progress=seen.append)
    assert len(seen) >= 3 and seen == sorted(seen) and seen[0] > 0 and seen[-1] <= 1.0


def test_duration_bounded_run() -> None:
    record = run(Static(k=2), requests=0, duration_us=2e6, workload=Workload(prompt_tokens=0, output_tokens=10**9))
    assert record.end_us == 2e6
    ends = record.start_us + record.prefill_us + record.draft_us + record.verify_us
    assert ends[-1] <= 2e6 and record.requests[0].finish_us != record.requests[0].finish_us  # in flight: NaN


def test_trace_windows_and_wraps() -> None:
    """Requests decode their sequence round-robin; a window that would cross the end wraps to the
    start of the generated part; wraps counted exactly as a brute-force walk does."""
    trace = synthesize(load_preset("olmoe-1b-7b"), Uniform(), 57, 3, 0)
    windows = TraceWindows.from_trace(trace, offset_stride=5, window_max=5, source="t")
    record = run(Static(k=4), alpha=0.5, requests=7, windows=windows, workload=Workload(prompt_tokens=0, output_tokens=400))
    for r in record.requests:
        assert r.seq == r.rid % 3
        assert r.trace_start == ((r.rid // 3) * 5) % 57
        # brute force: walk this request's steps
        mask = record.step_request == r.rid
        pos, wraps = r.trace_start, 0
        for k, a in zip(record.step_draft_len[mask], record.step_accepted[mask], strict=True):
            if pos + k + 1 > 57:
                pos, wraps = 0, wraps + 1
            pos += a + 1
        assert (r.wraps, r.pos) == (wraps, pos)
        assert r.wraps >= 1


def test_trace_too_short_for_the_window() -> None:
    trace = synthesize(load_preset("olmoe-1b-7b"), Uniform(), 6, 2, 0)
    with pytest.raises(Exception, match="fewer than the largest verify window"):
        TraceWindows.from_trace(trace, 0, 9, "t")


def test_off_policy_is_plain_decoding() -> None:
    record = run(Off(), requests=3)
    assert np.all(record.step_draft_len == 0) and np.all(record.step_accepted == 0)
    decode = record.batch > 0
    assert np.all(record.verify_us[decode] == TABLE.pass_us(1))
