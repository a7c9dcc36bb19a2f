"""The torch microbenchmark on the CPU: every engine computes the MoE layer exactly (checked
against a float64 numpy reference), and a run writes a valid contract-3 table. Skipped only when
torch is not importable (CI does not install it); on a CUDA machine the same runner times graphs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from moesim.hw_profiles.measurements.table import load_measurements
from moesim.hw_profiles.microbench.routing import ROUTINGS, gate_weights, routing_ids, routing_seed
from moesim.hw_profiles.microbench.table import MoeShape, write_measurements
from moesim.hw_profiles.microbench.torch_cuda import (
    TORCH_ENGINES,
    LayerWeights,
    TorchBenchConfig,
    device_pass,
    run_torch_microbench,
)

torch = pytest.importorskip("torch")

TINY = MoeShape("tiny", hidden=64, expert_intermediate=32, experts=8, top_k=2)


def _numpy_reference(gate_up: np.ndarray, down: np.ndarray, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """y_t = Σ_j g_tj · W_down[e] (silu(W_gate[e] x_t) ⊙ W_up[e] x_t), float64."""
    inter = down.shape[2]
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            h = gate_up[e] @ x[t]
            gate, up = h[:inter], h[inter:]
            y[t] += weights[t, j] * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
    return y


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("n_tokens", [1, 4, 9])  # 9·2 slots > 8 experts: `distinct` wraps around
@pytest.mark.parametrize("engine", sorted(TORCH_ENGINES))
def test_every_engine_computes_the_moe_layer(engine: str, routing: str, n_tokens: int) -> None:
    rng = np.random.default_rng(n_tokens)
    gate_up = rng.normal(0, 0.2, (TINY.experts, 2 * TINY.expert_intermediate, TINY.hidden))
    down = rng.normal(0, 0.2, (TINY.experts, TINY.hidden, TINY.expert_intermediate))
    x = rng.normal(0, 1, (n_tokens, TINY.hidden))
    ids = routing_ids(routing, n_tokens, TINY.experts, TINY.top_k, seed=n_tokens)
    weights = gate_weights(n_tokens, TINY.top_k, seed=5)
    expected = _numpy_reference(gate_up, down, x, ids, weights)
    layer = LayerWeights(torch.tensor(gate_up, dtype=torch.float32), torch.tensor(down, dtype=torch.float32))
    p = device_pass(torch, ids, weights, TINY.experts, torch.device("cpu"), torch.float32)
    got = TORCH_ENGINES.create(engine).forward(torch, layer, torch.tensor(x, dtype=torch.float32), p).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_cpu_run_writes_a_contract_table(tmp_path: Path) -> None:
    sizes, config = (1, 3, 10), TorchBenchConfig(pass_sizes=(1, 3, 10), reps=3, loop_reps=2, warmup=1, layers=2, device="cpu", seed=7)
    result = run_torch_microbench(config, [TINY])
    assert len(result.rows) == len(sizes) * len(ROUTINGS) * len(TORCH_ENGINES)
    assert all(c["max_rel_error"] <= 3e-2 for c in result.provenance["checks"]) and not result.provenance["failures"]
    table = load_measurements(write_measurements(result.rows, tmp_path / "bench", result.provenance))
    assert set(table["engine"]) == set(TORCH_ENGINES)
    for row in table.iter_rows(named=True):
        assert row["kernel"] == TORCH_ENGINES.get(row["engine"]).family
        assert row["time_us"] > 0 and row["time_us_min"] <= row["time_us"] <= row["time_us_p90"] + 1e-9
        assert row["timing"] == "cpu_wall" and row["weight_copies"] == 2
        ids = routing_ids(
            row["routing"], row["n_tokens"], TINY.experts, TINY.top_k, routing_seed(7, "tiny", row["routing"], row["n_tokens"])
        )
        counts = Counter(ids.ravel().tolist())
        assert (row["slots"], row["distinct_experts"], row["max_tokens_per_expert"]) == (ids.size, len(counts), max(counts.values()))
        per_read = row["slots"] if row["kernel"] == "per_slot" else row["distinct_experts"]
        assert row["bytes_requested"] == per_read * 3 * 64 * 32 * 2
    provenance = json.loads((tmp_path / "bench" / "provenance.json").read_text())
    assert provenance["device"]["backend"] == "cpu" and provenance["config"]["pass_sizes"] == list(sizes)


def test_time_budget_stops_before_the_next_pass_size() -> None:
    config = TorchBenchConfig(pass_sizes=(1, 2), reps=1, loop_reps=1, warmup=0, layers=1, device="cpu", max_seconds=1e-9)
    result = run_torch_microbench(config, [TINY])
    assert result.rows == [] and result.provenance["stopped_early"]["before_n_tokens"] == 1


def test_cli_torch_on_cpu(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    preset = tmp_path / "tiny.toml"
    preset.write_text(
        'kind = "moe"\nlayers = 2\nhidden = 64\nvocab = 100\nexperts = 8\ntop_k = 2\nexpert_intermediate = 32\n'
        '[attention]\nkind = "mha"\nheads = 4\nkv_heads = 4\nhead_dim = 16\n'
    )
    out = tmp_path / "run"
    args = ("--device", "cpu", "--model", preset, "--pass-sizes", "1,2", "--routing", "same", "--reps", "2", "--layers", "1")
    code, stdout, err = cli("microbench", "torch", *args, "--out", out)
    assert code == 0, err
    table = load_measurements(out / "measurements.parquet")
    assert table.height == 2 * len(TORCH_ENGINES) and set(table["routing"]) == {"same"} and set(table["model"]) == {"tiny"}
    assert "measurements.parquet" in stdout


class _MissingOp:
    """An engine whose op this torch lacks (as grouped_mm is missing from old releases)."""

    name = "missing_op"
    family = "dedup_missing"
    graph = True

    def forward(self, torch, w, x, p):  # type: ignore[no-untyped-def]
        return torch.nn.functional.no_such_grouped_op(x)


def test_a_failing_engine_is_dropped_and_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TORCH_ENGINES, "missing_op", _MissingOp)
    config = TorchBenchConfig(
        pass_sizes=(1, 2), engines=("torch_grouped_mm", "missing_op"), reps=1, loop_reps=1, warmup=0, layers=1, device="cpu"
    )
    result = run_torch_microbench(config, [TINY])
    assert {row["engine"] for row in result.rows} == {"torch_grouped_mm"} and len(result.rows) == 2 * len(ROUTINGS)
    (failure,) = result.provenance["failures"]
    assert failure["engine"] == "missing_op" and failure["error"].startswith("AttributeError")


def test_a_plan_measures_exactly_the_rows_its_dry_run_lists(tmp_path: Path) -> None:
    """`--plan`: each planned pass with the engines of its family, at the plan's U and M, in the
    plan's weight format; the rows measured are the rows the dry run lists."""
    from moesim.hw_profiles.microbench.plan import PLAN_FORMAT, Plan, PlannedPass
    from moesim.hw_profiles.microbench.torch_cuda import torch_plan_rows

    shape = {"model": "tiny", "hidden": 64, "expert_intermediate": 32, "experts": 8, "top_k": 2, "weight_format": "F32"}
    passes = (
        PlannedPass(**shape, family="per_slot", n_tokens=3, distinct_experts=4, max_tokens_per_expert=3, time_share=0.4),
        PlannedPass(**shape, family="dedup", n_tokens=5, distinct_experts=7, max_tokens_per_expert=2, rung="extrapolated"),
    )
    plan = Plan(format=PLAN_FORMAT, passes=passes)
    config = TorchBenchConfig(reps=2, loop_reps=1, warmup=0, layers=1, device="cpu", seed=3)
    result = run_torch_microbench(config, [], plan=plan)
    listed, notes = torch_plan_rows(config, plan)
    assert notes == [] and not result.provenance["failures"]
    key = ("engine", "kernel", "n_tokens", "distinct_experts", "max_tokens_per_expert")
    assert [tuple(r[k] for k in key) for r in result.rows] == [tuple(r[k] for k in key) for r in listed]
    assert [r["engine"] for r in result.rows] == ["torch_slot_graph", "torch_expert_graph"]
    assert {(r["routing"], r["dtype"]) for r in result.rows} == {("planned", "f32")}
    assert [r["plan_rung"] for r in result.rows] == ["fitted", "extrapolated"]
    table = load_measurements(write_measurements(result.rows, tmp_path / "planned", result.provenance))
    assert table.height == 2 and result.provenance["plan"]["passes"] == 2
