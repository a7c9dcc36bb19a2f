"""The collectives' latency terms: calibrated on the shared all-reduce rows (the shipped table is
what the calibration writes), held out one source at a time, priced by formula (custom all-reduce
vs NCCL by fabric and message size); and one path: the closed forms' pass on several devices is the
server's pass, tensor and expert parallel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fitted_files import same_fitted_toml

from moesim.hw_profiles import load_profile
from moesim.hw_profiles.catalog import collective_terms, link_spec
from moesim.hw_profiles.provenance import file_sha256
from moesim.kernels.reuse import group_features
from moesim.models import load_preset
from moesim.sim.cost.drafters import make_drafter
from moesim.sim.cost.parallel import Devices, Parallelism, all_reduce_us, custom_all_reduce_us, ring_all_reduce_us
from moesim.sim.cost.pass_features import ranked_costs
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.cost.trace_batch import TraceBatchCost
from moesim.sim.serving.config import load_config, placement
from moesim.sim.validate.collectives import (
    ALLREDUCE_TABLE,
    collectives_toml,
    fit_term,
    leave_one_source_out,
    message_bytes,
    read_rows,
)
from moesim.tracegen.routing.synth import Sticky, synthesize

REPO = Path(__file__).resolve().parents[1]
PRESET = load_preset("deepseek-v2-lite")
TRACE = synthesize(PRESET, Sticky(keep_prob=0.3), tokens=256, seqs=4, seed=5)


def test_shipped_collectives_are_current(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    shipped = (REPO / "moesim" / "hw_profiles" / "data" / "collectives.toml").read_text()
    assert same_fitted_toml(shipped, collectives_toml()), "run python -m moesim.sim.validate.collectives"
    assert f'sha256 = "{file_sha256(REPO / ALLREDUCE_TABLE)}"' in shipped


@pytest.mark.parametrize(
    ("printed", "notes", "expected"),
    [
        ("32", "", 32.0),
        ("24K", "bf16 (4,3072)", 24 * 1024.0),
        ("0.50 MB", "bf16 (32, 8192)", 0.5 * (1 << 20)),
        ("up to 1KB (as printed)", "", 1024.0),
        ("128 to 65536 (sweep range)", "", 65536.0),
        ("NA", "vLLM custom allreduce; data size 512 (float32 elements in test_trt_reduce.py)", 2048.0),
        ("NA", "fused all-reduce+RMSNorm bf16 [M=6, 6144], CUDA graph", 2.0 * 6 * 6144),
        ("NA", "TRT-LLM ONESHOT fused AR+residual+RMSNorm, bf16 128x8192", 2.0 * 128 * 8192),
        ("NA", "bf16 [seq_len=32, 8192], residual", 2.0 * 32 * 8192),
        ("NA", "no size here", None),
    ],
)
def test_message_sizes_as_the_sources_print_them(printed: str, notes: str, expected: float | None) -> None:
    assert message_bytes(printed, notes) == expected


def test_rows_and_their_latency_terms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of the table is either calibrating (size known, up to 1 MiB) or left out with a
    reason; a row's latency term puts its own time back through the formula."""
    monkeypatch.chdir(REPO)
    rows, left_out = read_rows()
    assert len(rows) + len(left_out) == 96
    assert {r.fabric for r in rows} == {"nvlink", "pcie", "xgmi"} and {r.algorithm for r in rows} == {"nccl", "custom"}
    for r in rows:
        if r.latency_us() > 0:
            assert r.predicted_us(r.latency_us()) <= r.time_us * (1 + 1e-9)
        if r.algorithm == "nccl":
            assert r.predicted_us(r.latency_us()) == pytest.approx(r.time_us)


def test_leave_one_source_out_never_sees_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    rows, _ = read_rows()
    held = leave_one_source_out(rows)
    assert len(held) == len({r.source for r in rows}) == 10
    for h in held:
        term = fit_term([r for r in rows if r.source != h.source], h.fabric, h.algorithm)
        assert term is not None and h.source not in term.sources and term.latency_us == h.latency_us
        own = [r for r in rows if r.source == h.source]
        assert h.errors == tuple(r.predicted_us(term.latency_us) / r.time_us - 1 for r in own)
    pcie = next(h for h in held if h.fabric == "pcie")
    assert pcie.transferred  # the only PCIe source: held out, PCIe is priced from the other fabrics' NCCL rows


def test_collective_formulas_by_hand() -> None:
    nvlink, pcie = link_spec("nvlink4-h100"), link_spec("pcie4-x16")
    terms = collective_terms("nvlink")
    assert terms is not None and terms.custom_shot_us > 0 and collective_terms("pcie").custom_shot_us == 0.0  # type: ignore[union-attr]
    beta = nvlink.bandwidth_gbps * 1e3
    small, large = 16384.0, 16e6
    one_shot, two_shot = terms.custom_shot_us + 3 * small / beta, 2 * terms.custom_shot_us + 2 * 3 / 4 * small / beta
    assert custom_all_reduce_us(small, 4, terms.custom_shot_us, nvlink.bandwidth_gbps) == pytest.approx(min(one_shot, two_shot))
    assert ring_all_reduce_us(small, 4, 2.0, 100.0) == pytest.approx(6 * 2.0 + 1.5 * small / 100e3)
    # auto: the custom all-reduce within its buffer, NCCL's ring above it and on PCIe
    assert all_reduce_us(small, 4, nvlink) == pytest.approx(min(one_shot, two_shot))
    assert all_reduce_us(large, 4, nvlink) == pytest.approx(ring_all_reduce_us(large, 4, terms.nccl_step_us, nvlink.bandwidth_gbps))
    assert all_reduce_us(small, 4, nvlink, "nccl") == pytest.approx(ring_all_reduce_us(small, 4, terms.nccl_step_us, nvlink.bandwidth_gbps))
    assert all_reduce_us(small, 2, pcie) == all_reduce_us(small, 2, pcie, "nccl")
    # latency-bound at small messages: a decode pass's all-reduce costs its latency terms
    assert all_reduce_us(2048 * 2.0, 2, nvlink) == pytest.approx(terms.custom_shot_us, rel=0.01)


def test_interval_of_the_collectives_is_a_factor() -> None:
    """TP 2 on NVLink: the collectives move by (1 + ε)^±1 with the dense corner, within the interval."""
    model = StepTimeModel(PRESET, load_profile("nvidia-h200"), "per_slot", parallel=Parallelism(2, False, link_spec("nvlink4-h200")))
    features = group_features(TRACE.experts, PRESET.experts, np.array([0, 1]), np.array([0]), np.array([4]))
    cost = model.pass_cost(features, 100.0)
    eps = collective_terms("nvlink").custom_epsilon  # type: ignore[union-attr]
    comm = float(np.asarray(cost.comm_us)[0])
    assert comm == pytest.approx(2 * PRESET.layers * all_reduce_us(4 * PRESET.hidden * 2.0, 2, link_spec("nvlink4-h200")))
    assert float(np.asarray(cost.comm_epsilon)[0]) == eps
    base = cost.total_us(0.0, 0.0) - comm
    assert cost.total_us(0.0, 1.0) - base - cost.dense_us * cost.dense_epsilon == pytest.approx(comm * (1 + eps))
    assert cost.total_us(0.0, -1.0) - base + cost.dense_us * cost.dense_epsilon == pytest.approx(comm / (1 + eps))
    assert "calibrated" in cost.provenance_share()


@pytest.mark.parametrize("profile", ["nvidia-h200", "nvidia-h200-vllm"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_the_closed_forms_price_a_pass_as_the_server_does(profile: str, expert_parallel: bool) -> None:
    """A batch of two windows over 4 devices: the analysis pass (`pass_cost`, or per rank
    `ranked_costs`) is the server's `TraceBatchCost.verify_us`, to rounding."""
    hw = load_profile(profile)
    family = "dedup" if hw.dispatch is None else "dispatch"
    model = StepTimeModel(PRESET, hw, family, parallel=Parallelism(4, expert_parallel, link_spec("nvlink4-h200")))
    seqs, starts, n, context = np.array([0, 2]), np.array([10, 30]), np.array([3, 3]), np.array([100, 200])
    server = TraceBatchCost(model, TRACE, make_drafter("ngram", PRESET)).verify_us(seqs, starts, n, context)
    windows = (np.array([0, 2]), (TRACE.seq_starts[seqs] + starts).astype(np.int64), n.astype(np.int64))
    if expert_parallel:
        cost, _ = ranked_costs(model, TRACE, windows, float(context.sum()), 2.0)
    else:
        cost = model.pass_cost(group_features(TRACE.experts, PRESET.experts, *windows), float(context.sum()), 2.0)
    assert float(cost.total_us()[0]) == pytest.approx(server, rel=1e-12)


def test_the_analysis_devices_are_the_simulators(tmp_path: Path) -> None:
    """--tensor-parallel / --expert-parallel / --link / --all-reduce make the Parallelism a
    simulation config's [parallel] makes on the same device."""
    config = tmp_path / "c.toml"
    config.write_text(
        """
[run]
requests = 2
[workload]
prompt_tokens = 8
output_tokens = 8
[target]
model = "deepseek-v2-lite"
profile = "nvidia-h200"
[parallel]
tensor_parallel = 4
expert_parallel = true
all_reduce = "nccl"
[cost]
kind = "steptime"
[trace]
path = "esft-vanilla-lite"
[acceptance]
model = "geometric"
alpha = 0.5
[policy]
name = "static"
k = 1
"""
    )
    simulated = placement(load_config(config))[0]
    assert Devices(1, 4, "", "nccl").parallelism(load_profile("nvidia-h200")) == simulated
    assert simulated.link == link_spec("nvlink4-h200")
    assert Devices(2).parallelism(load_profile("nvidia-h200")).comm_us(PRESET, 1.0) > 0
