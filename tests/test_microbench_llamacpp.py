"""The llama.cpp microbenchmark on the CPU build with small models the code builds: designed
routing is realised exactly (checked against llama.cpp's own routing), and a run writes a valid
contract-3 table with positive times. No timing thresholds."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error

from moesim.errors import ConfigError, InputError
from moesim.hw_profiles.measurements.table import load_measurements
from moesim.hw_profiles.microbench.llama_cpp import (
    BenchContexts,
    LlamaBenchConfig,
    PassDesign,
    build_models,
    design_passes,
    layer_time_us,
    run_llamacpp_shapes,
)
from moesim.hw_profiles.microbench.routing import ROUTINGS, pass_features, routing_ids, routing_seed
from moesim.hw_profiles.microbench.table import MoeShape, write_measurements
from moesim.tracegen.llamacpp.gguf_builder import BYTE_TOKENS_START
from moesim.tracegen.llamacpp.runtime import LlamaContext, LlamaModel, RoutingCapture

SMALL = MoeShape("small", hidden=256, expert_intermediate=512, experts=8, top_k=2, weight_format="F32")
CONFIG = LlamaBenchConfig(shape=SMALL, layers=2, heads=4, kv_heads=1, pass_sizes=(1, 3, 12), reps=5, warmup=1, prefix=8, n_threads=1)


def test_designed_tokens_encode_each_pass() -> None:
    passes, sets = design_passes(CONFIG)
    assert [(p.routing, p.n_tokens) for p in passes] == [(r, n) for r in ROUTINGS for n in (1, 3, 12)]
    assert len(set(sets)) == len(sets)
    for p in passes:
        assert [sets[t - BYTE_TOKENS_START] for t in p.tokens] == [tuple(sorted(row)) for row in p.ids.tolist()]
        want = routing_ids(p.routing, p.n_tokens, SMALL.experts, SMALL.top_k, routing_seed(0, "llama", p.routing, p.n_tokens))
        np.testing.assert_array_equal(p.ids, want)
    with pytest.raises(ConfigError, match="distinct expert sets"):
        design_passes(LlamaBenchConfig(pass_sizes=tuple(range(1, 120))))


def test_llama_cpp_routes_exactly_as_designed(tmp_path: Path) -> None:
    """Every layer of the built model selects each token's designed set, read back through
    llama.cpp's eval callback; a pass whose design differs is caught."""
    passes, sets = design_passes(CONFIG)
    paths = build_models(CONFIG, sets, tmp_path, lambda _m: None)
    assert sorted(paths) == ["dense_2L", "dense_L", "moe_2L", "moe_L"]
    capture = RoutingCapture(range(4), SMALL.top_k)
    with LlamaModel(paths["moe_2L"]) as model, LlamaContext(model, 64, 1, capture=capture) as context:
        for p in passes:
            context.decode(list(p.tokens), 0)
            ids, weights = capture.take(p.n_tokens)
            context.clear()
            assert np.array_equal(np.sort(ids, axis=2), np.broadcast_to(np.sort(p.ids, axis=1)[:, None, :], ids.shape))
            assert weights is not None and np.allclose(weights, 1 / SMALL.top_k)  # equal router logits within the set
    with contextlib.ExitStack() as stack:
        contexts = BenchContexts(CONFIG, paths, gpu=False, stack=stack)
        contexts.check_routing(passes[1])
        wrong = passes[1].ids.copy()
        wrong[0] = (wrong[0] + 1) % SMALL.experts
        with pytest.raises(InputError, match="did not route as designed"):
            contexts.check_routing(PassDesign("same", wrong, passes[1].tokens, pass_features(wrong, SMALL.experts)))


def test_layer_time_is_the_difference_of_differences() -> None:
    reps = [{"moe_L": 10.0 + i, "moe_2L": 30.0 + i, "dense_L": 4.0, "dense_2L": 6.0 + 2 * i} for i in range(5)]
    # medians: moe 12 -> 32, dense 4 -> 10; L = 2: ((32 - 12) - (10 - 4)) / 2 = 7
    assert layer_time_us(CONFIG, reps, np.median) == (7.0, 10.0, 3.0)
    assert layer_time_us(CONFIG, reps, np.min)[0] == ((30 - 10) - (6 - 4)) / 2


def test_cpu_run_writes_a_contract_table(tmp_path: Path) -> None:
    # min, as the module advises on a shared machine: load only adds time, so the minimum keeps
    # the layer difference above the noise where the median of a tiny model's passes may not
    result = run_llamacpp_shapes(dataclasses.replace(CONFIG, statistic="min"), [SMALL])
    assert not result.provenance["runs"][0]["failures"], result.provenance["runs"][0]["failures"]
    table = load_measurements(write_measurements(result.rows, tmp_path / "cpu", result.provenance))
    assert table.height == len(ROUTINGS) * 3
    assert set(table["kernel"]) == {"dedup_llamacpp_cpu"} and set(table["backend"]) == {"cpu"}
    for row in table.iter_rows(named=True):
        assert row["time_us"] > 0 and row["time_us"] == row["time_us_min"] and row["time_us_moe_layer"] > 0
        assert all(len(row[f"reps_us_{m}"]) == row["reps"] for m in ("moe_L", "moe_2L", "dense_L", "dense_2L"))
        # the minimum-based estimate recomputed from the stored repetitions
        mins = {m: min(row[f"reps_us_{m}"]) for m in ("moe_L", "moe_2L", "dense_L", "dense_2L")}
        assert row["time_us_min"] == pytest.approx(((mins["moe_2L"] - mins["moe_L"]) - (mins["dense_2L"] - mins["dense_L"])) / 2)
        ids = routing_ids(row["routing"], row["n_tokens"], 8, 2, routing_seed(0, "llama", row["routing"], row["n_tokens"]))
        counts = Counter(ids.ravel().tolist())
        assert (row["slots"], row["distinct_experts"], row["max_tokens_per_expert"]) == (ids.size, len(counts), max(counts.values()))
        assert row["bytes_requested"] == row["distinct_experts"] * 3 * 256 * 512 * 4
    provenance = json.loads((tmp_path / "cpu" / "provenance.json").read_text())
    assert provenance["versions"]["llama_cpp_python"] and provenance["machine"]["logical_cpus"] >= 1
    models = provenance["runs"][0]["models"]
    assert models["moe_2L"]["layers"] == 4 and models["dense_L"]["experts"] == 0


def test_cli_llama_cpp(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    args = ["--hidden", "128", "--expert-intermediate", "256", "--experts", "8", "--top-k", "2", "--format", "F32"]
    args += ["--layers", "1", "--heads", "4", "--pass-sizes", "1,4", "--routing", "distinct", "--reps", "3", "--warmup", "1"]
    args += ["--threads", "1", "--prefix", "4", "--no-subtract-attention", "--models-dir", tmp_path / "models"]
    code, _, err = cli("microbench", "llama-cpp", *args, "--out", tmp_path / "t")
    assert code == 0, err
    table = load_measurements(tmp_path / "t" / "measurements.parquet")
    assert table["n_tokens"].to_list() == [1, 4] and table["distinct_experts"].to_list() == [2, 8]
    assert table["model"][0] == "deepseek-v2-lite[expert_intermediate=256,experts=8,hidden=128,top_k=2]"
    (folder,) = (tmp_path / "models").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["moe_2L.gguf", "moe_L.gguf"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--experts", "4096"], ["experts <= hidden", "experts=4096"]),
        (["--experts", "2048", "--layers", "8"], ["GB", "memory"]),
        (["--format", "Q4_K"], ["F16 or F32", "Q4_K"]),
        (["--heads", "3"], ["heads"]),
        (["--pass-sizes", "0"], ["pass sizes"]),
        (["--model", "olmoe-1b-7b", "--model", "olmoe-1b-7b"], ["distinct model shapes"]),
        (["--statistic", "mean"], ["statistic", "mean"]),
    ],
)
def test_cli_llama_cpp_bad_config(cli, tmp_path: Path, args: list[str], fragments: list[str]) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("microbench", "llama-cpp", *args, "--out", tmp_path / "t")
    assert_one_line_error(code, err, *fragments)
    assert not (tmp_path / "t").exists()


def test_shipped_cpu_calibration_is_a_valid_table() -> None:
    """data/cpu/: the real calibration of the project's 2-core CPU (docs/microbench.md)."""
    from conftest import DATA

    table = load_measurements(DATA / "cpu" / "measurements.parquet")
    provenance = json.loads((DATA / "cpu" / "provenance.json").read_text())
    assert set(table["kernel"]) == {"dedup_llamacpp_cpu"} and set(table["features"]) == {"exact"}
    assert set(table["model"]) == {"deepseek-v2-lite", "qwen3-30b-a3b"} and set(table["routing"]) == set(ROUTINGS)
    assert (table["time_us"] > 0).all() and table["bytes_requested"].min() >= 6 * 3 * 2048 * 768 * 2
    assert provenance["versions"]["llama_cpp_python"] and provenance["machine"]["model_name"]
    assert all(run["expert_weight_bytes_2L"] >= 1e9 for run in provenance["runs"])
