"""Microbenchmark host logic (no torch, no llama.cpp): routings, features, expert grouping,
timing summaries and the contract-3 tables the runners write."""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.errors import ConfigError, InputError
from moesim.hw_profiles.measurements.table import load_measurements
from moesim.hw_profiles.microbench.routing import (
    ROUTINGS,
    expert_plan,
    gate_weights,
    parse_pass_sizes,
    pass_features,
    routing_ids,
)
from moesim.hw_profiles.microbench.table import (
    MoeShape,
    measurement_row,
    summarize_times,
    write_measurements,
)
from moesim.hw_profiles.microbench.torch_cuda import TorchBenchConfig
from moesim.machine import cpu_facts
from moesim.models import load_preset


def _brute_features(ids: np.ndarray) -> tuple[int, int, int, int]:
    counts = Counter(int(e) for e in ids.ravel())
    return ids.shape[0], ids.size, len(counts), max(counts.values())


@settings(max_examples=150, deadline=None)
@given(
    routing=st.sampled_from(ROUTINGS),
    n_tokens=st.integers(1, 70),
    experts=st.integers(1, 80),
    data=st.data(),
    seed=st.integers(0, 2**31),
)
def test_routings_have_the_promised_features(routing: str, n_tokens: int, experts: int, data: st.DataObject, seed: int) -> None:
    top_k = data.draw(st.integers(1, experts))
    ids = routing_ids(routing, n_tokens, experts, top_k, seed)
    assert ids.shape == (n_tokens, top_k)
    assert ids.min() >= 0 and ids.max() < experts
    assert all(len(set(row.tolist())) == top_k for row in ids), "a token picks k distinct experts"
    features = pass_features(ids, experts)
    n, slots, distinct, max_tokens = _brute_features(ids)
    assert (int(features.n_tokens), int(features.slots)) == (n, slots)
    assert (int(features.distinct_experts), int(features.max_tokens_per_expert)) == (distinct, max_tokens)
    if routing == "same":
        assert (distinct, max_tokens) == (top_k, n_tokens)
    if routing == "distinct":
        assert distinct == min(experts, n_tokens * top_k)
        assert max_tokens == math.ceil(n_tokens * top_k / experts)
    np.testing.assert_array_equal(ids, routing_ids(routing, n_tokens, experts, top_k, seed))


def test_uniform_routing_matches_the_closed_form() -> None:
    """E[U] = E·(1 − (1 − k/E)^n) for independent uniform top-k sets; every expert equally likely."""
    experts, top_k, n_tokens, draws = 64, 6, 8, 3000
    distinct = np.array(
        [int(pass_features(routing_ids("uniform", n_tokens, experts, top_k, s), experts).distinct_experts) for s in range(draws)]
    )
    expected = experts * (1 - (1 - top_k / experts) ** n_tokens)
    assert abs(distinct.mean() - expected) < 4 * distinct.std() / math.sqrt(draws)
    counts = np.bincount(np.concatenate([routing_ids("uniform", 1, experts, top_k, s).ravel() for s in range(draws)]), minlength=experts)
    mean = draws * top_k / experts
    assert np.all(np.abs(counts - mean) < 5 * math.sqrt(mean))


@settings(max_examples=100, deadline=None)
@given(n_tokens=st.integers(1, 40), experts=st.integers(2, 40), seed=st.integers(0, 1000), data=st.data())
def test_expert_plan_groups_every_slot_once(n_tokens: int, experts: int, seed: int, data: st.DataObject) -> None:
    top_k = data.draw(st.integers(1, experts))
    ids = routing_ids(data.draw(st.sampled_from(ROUTINGS)), n_tokens, experts, top_k, seed)
    plan = expert_plan(ids, experts)
    assert sorted(plan.order.tolist()) == list(range(ids.size))
    for i, expert in enumerate(plan.present.tolist()):
        group = plan.order[plan.starts[i] : plan.starts[i + 1]]
        assert set(plan.slot_experts[group].tolist()) == {expert}
        assert sorted(plan.sorted_tokens[plan.starts[i] : plan.starts[i + 1]].tolist()) == sorted(
            t for t in range(n_tokens) for j in range(top_k) if ids[t, j] == expert
        )
    counts = Counter(ids.ravel().tolist())
    assert plan.group_ends.tolist() == list(np.cumsum([counts.get(e, 0) for e in range(experts)]))
    assert set(plan.present.tolist()) == set(counts)


def test_gate_weights_are_positive_and_normalised() -> None:
    weights = gate_weights(7, 3, seed=1)
    assert weights.shape == (7, 3) and np.all(weights > 0)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0)


def test_parse_pass_sizes() -> None:
    assert parse_pass_sizes("1-4,8, 6,4") == (1, 2, 3, 4, 6, 8)
    for bad in ("x", "4-2", "0,1", "", "1-"):
        with pytest.raises(InputError, match="pass sizes"):
            parse_pass_sizes(bad)


def test_summarize_times_against_statistics() -> None:
    samples = [5.0, 1.0, 9.5, 3.25, 7.0, 2.0, 8.0, 4.0, 6.0, 10.0, 0.5]
    summary = summarize_times(samples)
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    assert summary.time_us == statistics.median(samples)
    assert summary.time_us_p10 == pytest.approx(deciles[0]) and summary.time_us_p90 == pytest.approx(deciles[-1])
    assert summary.time_us_min == 0.5 and summary.reps == len(samples)


def test_rows_carry_the_bytes_each_family_requests(tmp_path: Path) -> None:
    shape = MoeShape.from_preset(load_preset("qwen3-30b-a3b"))
    assert shape.expert_bytes == 3 * 2048 * 768 * 2  # bf16 SwiGLU expert
    ids = routing_ids("same", 4, shape.experts, shape.top_k, seed=3)
    features = pass_features(ids, shape.experts)
    timing = summarize_times([10.0, 11.0, 12.0])
    rows = [
        measurement_row(kernel=kernel, engine="e", device="d", shape=shape, routing="same", features=features, timing=timing)
        for kernel in ("per_slot", "dedup")
    ]
    assert rows[0]["bytes_requested"] == 4 * 8 * shape.expert_bytes  # n·k slots
    assert rows[1]["bytes_requested"] == 8 * shape.expert_bytes  # U = k distinct experts
    table = write_measurements(rows, tmp_path / "out", {"runner": "test"})
    frame = load_measurements(table)
    assert frame.height == 2 and frame["time_us"].to_list() == [11.0, 11.0]
    assert frame["distinct_experts"].to_list() == [8, 8] and frame["dtype"].to_list() == ["bf16", "bf16"]
    assert json.loads((tmp_path / "out" / "provenance.json").read_text()) == {"runner": "test"}
    with pytest.raises(ValueError, match="not a kernel family"):
        measurement_row(kernel="mystery", engine="e", device="d", shape=shape, routing="same", features=features, timing=timing)


def test_bad_output_folders_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        write_measurements([{"kernel": "dedup", "n_tokens": 1, "time_us": 1.0}], tmp_path / "a" / "b", {})
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        write_measurements([{"kernel": "dedup", "n_tokens": 1, "time_us": 1.0}], tmp_path / "file", {})
    with pytest.raises(InputError, match="no rows"):
        write_measurements([], tmp_path / "c", {})
    assert not (tmp_path / "c").exists()


def test_cpu_facts_describe_this_machine() -> None:
    facts = cpu_facts()
    assert facts["logical_cpus"] >= 1
    if sys.platform == "linux":
        assert facts["model_name"] and facts["memory_gib"] > 0


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("reps", 0, "'reps'"),
        ("engines", ("nope",), "unknown torch engine 'nope'"),
        ("routings", ("zipf",), "unknown routing"),
        ("device", "tpu", "device"),
    ],
)
def test_torch_config_is_validated(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        TorchBenchConfig(**{field: value}).validate()  # type: ignore[arg-type]


def test_torch_command_without_torch_is_one_line(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "torch", None)  # what an environment without torch looks like to `import torch`
    code, _, err = cli("microbench", "torch", "--out", tmp_path / "t")
    assert_one_line_error(code, err, "torch is not installed", "moesim[gpu]")
    assert not (tmp_path / "t").exists()


def test_torch_device_facts_are_what_profile_fit_reads(tmp_path: Path) -> None:
    from moesim.hw_profiles.fitting.calibrate import read_device_json
    from moesim.hw_profiles.microbench.torch_cuda import device_json

    facts = {"device": "NVIDIA H200", "torch": "2.13.0", "torch_cuda": "13.0", "capability": "9.0", "sm_count": 132}
    facts |= {"total_memory_gib": 139.8, "l2_cache_mib": 60.0}
    payload = device_json(facts, {"read_gbps": 4493.5, "copy_gbps_read_write": 4270.7})
    row = {"kernel": "dedup", "n_tokens": 1, "time_us": 1.0}
    write_measurements([row], tmp_path / "gpu", {"runner": "test"}, payload)
    measured = read_device_json(tmp_path / "gpu" / "device.json")
    assert (measured.name, measured.compute_units, measured.read_gbps) == ("NVIDIA H200", 132, 4493.5)
    assert measured.memory_gb == pytest.approx(139.8 * 2**30 / 1e9, abs=0.01)
    assert measured.l2_cache_bytes == pytest.approx(60 * 2**20, rel=1e-3) and measured.runtime_version == "CUDA 13.0"
