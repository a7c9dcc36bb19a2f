"""MLX through mlx_lm (the `mlx` extra, CPU backend here): tiny model folders, routing recorded from
mlx_lm's own MoE blocks and checked against a numpy router on the same weights, speculative runs
through mlx_lm's speculative generation, the SwitchGLU microbenchmark and its engine profile, and
the one-line error of every MLX command without the extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from safetensors.numpy import load_file

from moesim.tracegen.formats.specrun import read_spec_run
from moesim.tracegen.formats.trace import read_trace
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec
from moesim.tracegen.llamacpp.prompts import load_prompts, prompts_from_texts
from moesim.tracegen.llamacpp.recorder import RecordConfig
from moesim.tracegen.llamacpp.speculate import SpeculateConfig
from moesim.tracegen.mlx import is_mlx_model

mx = pytest.importorskip("mlx.core", reason="the mlx extra (make test installs it)")

PROMPTS = ["The quick brown fox jumps", "Mixture of experts route tokens", "abc def ghi"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny qwen3_moe target, a noisy copy of it (the draft), a tiny Mixtral-style model."""
    from moesim.tracegen.mlx.builder import build_mlx_model, write_tiny_mlx_model

    root = tmp_path_factory.mktemp("mlx-models")
    build_mlx_model(root / "target", TinyModelSpec(layers=3, experts=8, top_k=2, hidden=64, expert_ff=32, vocab=300, seed=3))
    write_tiny_mlx_model(root / "draft", {}, root / "target", 0.05)
    build_mlx_model(root / "mixtral", TinyModelSpec(arch="llama", layers=2, experts=6, top_k=2, hidden=32, expert_ff=16, vocab=280))
    return {name: root / name for name in ("target", "draft", "mixtral")}


def _numpy_router(x: np.ndarray, gate: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Independent router: logits = x Wᵀ in float64, softmax, the k largest (highest first), weights."""
    logits = x.astype(np.float64) @ gate.astype(np.float64).T
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, axis=-1)
    return ids, w / w.sum(axis=-1, keepdims=True) if normalize else w


@pytest.mark.parametrize("name", ["target", "mixtral"])
def test_router_matches_numpy_bit_for_bit_on_ids(models: dict[str, Path], name: str) -> None:
    from moesim.tracegen.mlx.runtime import RoutingCapture, TimedModel, load_model

    loaded = load_model(models[name])
    capture = RoutingCapture(loaded, keep_inputs=True)
    timed = TimedModel(loaded.model, capture)
    tokens = loaded.tokenize(" ".join(PROMPTS))
    timed(mx.array(tokens)[None])
    ids, weights = capture.take()
    inputs = capture.inputs[0]
    weights_file = load_file(str(models[name] / "model.safetensors"))
    prefix = "block_sparse_moe" if name == "mixtral" else "mlp"
    assert ids.shape == (len(tokens), len(loaded.blocks), loaded.config["num_experts_per_tok"])
    for slot, (layer, _) in enumerate(loaded.blocks):
        gate = weights_file[f"model.layers.{layer}.{prefix}.gate.weight"]
        want_ids, want_w = _numpy_router(inputs[:, slot], gate, ids.shape[2], True)
        np.testing.assert_array_equal(ids[:, slot], want_ids)
        np.testing.assert_allclose(weights[:, slot], want_w, rtol=1e-5)
    assert len(np.unique(ids)) > 2  # routing is not degenerate


def test_tiny_model_and_record_through_the_cli(models: dict[str, Path], tmp_path: Path, cli) -> None:
    folder, prompts = tmp_path / "tiny", tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    code, _, err = cli("trace", "tiny-model", "--format", "mlx", "--out", folder, "--experts", 8, "--top-k", 2, "--seed", 5)
    assert code == 0, err
    assert is_mlx_model(folder) and json.loads((folder / "config.json").read_text())["num_experts"] == 8
    results = {}
    for batch, extra in ((0, ()), (1, ()), (3, ("--no-weights", "--verbose"))):
        path = tmp_path / f"b{batch}.arrow"
        args = ("--out", path, "--max-tokens", 6, "--prompt-batch", batch, *extra)
        code, _out, err = cli("trace", "record", folder, "--prompts", prompts, *args)
        assert code == 0, err
        results[batch] = read_trace(path)
    assert results[0].weights is not None and results[3].weights is None
    trace = results[0]
    meta = trace.meta
    assert (meta.engine, meta.backend, meta.geometry.experts, meta.geometry.top_k) == ("mlx_lm", "cpu", 8, 2)
    assert meta.geometry.moe_layers == (0, 1, 2, 3) and meta.geometry.weight_format == "F32"
    assert trace.n_seqs == 3 and trace.n_tokens == sum(len(p.encode()) + 6 for p in PROMPTS)
    for other in (results[1], results[3]):  # the prompt in one chunk, token by token or in chunks of 3: the same experts
        np.testing.assert_array_equal(other.experts, trace.experts)


def test_recorded_routing_equals_the_router_of_each_pass(models: dict[str, Path], tmp_path: Path) -> None:
    from moesim.tracegen.mlx.recorder import record_trace

    prompts = prompts_from_texts(PROMPTS[:2], "test")
    result = record_trace(models["target"], prompts, tmp_path / "t.arrow", RecordConfig(max_tokens=5, with_weights=True))
    trace = read_trace(result.path)
    assert result.prompts_done == 2 and result.generated == 10
    w = trace.weights.reshape(trace.n_tokens, -1, 2)
    np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-5)  # qwen3_moe with norm_topk_prob: renormalised
    assert np.all(w[..., 0] >= w[..., 1])  # highest weight first


def test_speculate_through_mlx_lm(models: dict[str, Path], tmp_path: Path, cli) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    record = tmp_path / "plain.arrow"
    assert cli("trace", "record", models["target"], "--prompts", prompts, "--out", record, "--max-tokens", 16)[0] == 0
    path = tmp_path / "spec.arrow"
    code, _out, err = cli("trace", "speculate", models["target"], models["draft"], "--prompts", prompts, "--out", path,
                         "--draft-len", 3, "--max-tokens", 12)  # fmt: skip
    assert code == 0, err
    run, trace = read_spec_run(path), read_trace(record)
    steps = run.steps
    assert run.meta.engine == "mlx_lm" and run.meta.draft_len == 3 and set(steps["drafted"].to_list()) == {3}
    assert steps["accepted"].max() > 0 and np.all(steps["accepted"].to_numpy() <= 3)
    assert np.all(steps["verify_us"].to_numpy() > 0) and np.all(steps["draft_us"].to_numpy() > 0)
    for seq, info in enumerate(run.meta.sequences):
        assert info.prompt_tokens == len(PROMPTS[seq].encode()) - 1  # mlx_lm verifies the prompt's last token with the drafts
        assert info.generated_tokens >= 12 and info.plain_match_tokens == info.generated_tokens
    bare = tmp_path / "bare.arrow"
    code, _, err = cli("trace", "speculate", models["target"], models["draft"], "--prompts", prompts, "--out", bare,
                       "--draft-len", 1, "--max-tokens", 4, "--no-baseline", "--no-weights")  # fmt: skip
    assert code == 0, err
    plain = read_spec_run(bare)
    assert plain.weights is None and all(s.plain_match_tokens == -1 and np.isnan(s.plain_decode_us) for s in plain.meta.sequences)
    assert set(plain.steps["drafted"].to_list()) == {1}
    # each verify pass routes its accepted slots and the bonus as plain greedy decoding routed those positions
    starts = np.concatenate([[0], np.cumsum(trace.seq_lengths())])
    for i, step in enumerate(steps.iter_rows(named=True)):
        keep = step["accepted"] + 1
        if step["pos0"] + keep > trace.seq_lengths()[step["seq"]]:
            continue
        slots = run.experts[run.slot_start[i] : run.slot_start[i] + keep]
        first = starts[step["seq"]] + step["pos0"]
        np.testing.assert_array_equal(np.sort(slots, axis=-1), np.sort(trace.experts[first : first + keep], axis=-1))


def test_speculative_options_of_the_llamacpp_runner_refused(models: dict[str, Path], tmp_path: Path) -> None:
    from moesim.errors import InputError
    from moesim.tracegen.mlx.speculate import speculative_run

    with pytest.raises(InputError, match="--threads 2"):
        speculative_run(
            models["target"], models["draft"], prompts_from_texts(PROMPTS, "t"), tmp_path / "s.arrow", SpeculateConfig(n_threads=2)
        )
    assert not (tmp_path / "s.arrow").exists()
    prompts = tmp_path / "p.txt"
    prompts.write_text("a fine prompt\nx\n")
    with pytest.raises(InputError, match="line 2: a prompt of 1 token"):
        speculative_run(models["target"], models["draft"], load_prompts(prompts), tmp_path / "s.arrow")
    assert not (tmp_path / "s.arrow").exists()


def test_microbench_orders_match_switchglu_and_fit_an_engine_profile(tmp_path: Path, cli) -> None:
    from moesim.hw_profiles import load_profile

    out = tmp_path / "bench"
    code, _, err = cli("microbench", "mlx", "--out", out, "--hidden", 64, "--expert-intermediate", 64, "--experts", 8, "--top-k", 2,
                       "--pass-sizes", "1,2,33", "--format", "F32", "--format", "AFFINE4",
                       "--reps", 2, "--warmup", 0, "--layers", 1)  # fmt: skip
    assert code == 0, err
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["backend"] == "cpu" and provenance["engine"] == "MLX CPU" and "mlx 0.32" in provenance["engine_version"]
    assert provenance["check_against_mlx_lm_max_relative"] < 3e-2
    import polars as pl

    table = pl.read_parquet(out / "measurements.parquet")
    assert table.height == 2 * 2 * 3 * 3 * 2  # shapes x formats x sizes x routings x families
    assert set(table["kernel"]) == {"per_slot", "dedup_gather_sorted"} and set(table["dtype"]) == {"f32", "affine4"}
    assert table.filter(pl.col("n_tokens") == 33)["mlx_lm_sorts"].all() and not table.filter(pl.col("n_tokens") == 1)["mlx_lm_sorts"].any()
    profile_path = tmp_path / "profile.toml"
    code, _, err = cli("profile", "fit", out / "measurements.parquet", "--out", profile_path, "--filter", "dtype=f32", "--backend", "cpu")
    assert code == 0, err
    profile = load_profile(str(profile_path))
    assert set(profile.expert_families) == {"per_slot", "dedup_gather_sorted"}
    assert [r.family for r in profile.dispatch.rules] == ["dedup_gather_sorted", "per_slot"]
    assert profile.dispatch.rules[0].min_slots == 64
    code, _, err = cli("microbench", "mlx", "--out", tmp_path / "bad", "--hidden", 96, "--format", "AFFINE4")
    assert code == 2 and "groups of 64" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["trace", "tiny-model", "--format", "mlx", "--out", "{tmp}/m"],
        ["trace", "record", "{mlx}", "--prompts", "{prompts}", "--out", "{tmp}/t.arrow"],
        ["trace", "speculate", "{mlx}", "{mlx}", "--prompts", "{prompts}", "--out", "{tmp}/s.arrow"],
        ["microbench", "mlx", "--out", "{tmp}/b"],
    ],
)
def test_without_the_extra_every_mlx_command_says_what_to_install(models: dict[str, Path], tmp_path: Path, args: list[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    argv = [a.format(tmp=tmp_path, mlx=models["target"], prompts=prompts) for a in args]
    blocked = (
        "import sys; sys.modules.update(dict.fromkeys(['mlx', 'mlx.core', 'mlx.nn', 'mlx_lm'])); from moesim.cli import entry; entry()"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-c", blocked, *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'moesim[mlx]'" in lines[0], done.stderr
    assert not any(tmp_path.glob("*.arrow")) and not (tmp_path / "m").exists() and not (tmp_path / "b").exists()


def test_longest_paying_draft() -> None:
    from moesim.sim.validate.mlx_cpu import crossover

    k = np.array([0, 1, 2, 4, 8])
    assert crossover(k, np.array([10.0, 12.0, 11.0, 9.0, 7.0])) == 2
    assert crossover(k, np.array([10.0, 9.0, 12.0, 9.0, 7.0])) == 2
    assert crossover(k, np.array([10.0, 9.0, 8.0, 7.0, 6.0])) == 0


def test_mlx_validation_pipeline_on_tiny_models(tmp_path: Path) -> None:
    import polars as pl

    from moesim.hw_profiles.microbench.mlx_switch import MlxBenchConfig, run_mlx_microbench
    from moesim.hw_profiles.microbench.table import MoeShape, write_measurements
    from moesim.sim.validate.mlx_cpu import MlxValidationConfig, analyze, measured_r, run_mlx_validation

    shapes = [MoeShape("a", 64, 32, 8, 2, "F32"), MoeShape("b", 96, 48, 8, 2, "F32")]
    bench = run_mlx_microbench(MlxBenchConfig(pass_sizes=(1, 2, 3, 5), routings=("uniform", "same"), formats=("F32",), reps=3, warmup=1,
                                              layers=1, vocab=300), shapes)  # fmt: skip
    write_measurements(bench.rows, tmp_path / "cal", bench.provenance)
    config = MlxValidationConfig(draft_lens=(1, 4), repetitions=2, max_tokens=6, shape=shapes[0], vocab=300, prompts=tuple(PROMPTS[:2]))
    validation, summary = run_mlx_validation(config, tmp_path / "out", tmp_path / "cal")
    per_k = validation.per_k
    assert per_k["draft_len"].to_list() == [0, 1, 4]
    assert set(summary["best_draft"]) >= {"measured", "predicted_from_source"} and set(summary["longest_paying_draft"]) == {
        "measured", "predicted_from_source", "predicted_on_measured_passes"}  # fmt: skip
    assert np.all(per_k["tokens_per_s_predicted"].to_numpy() > 0) and np.all(per_k["tokens_per_s"].to_numpy() > 0)
    # the source's first step of every prompt, truncated to k = 1, accepts what the run at k = 1 accepted there (greedy: a prefix)
    first = {k: read_spec_run(tmp_path / "out" / "runs" / f"spec-k{k}.arrow").steps.filter(pl.col("step") == 0) for k in (1, 4)}
    assert first[1]["accepted"].to_list() == [min(a, 1) for a in first[4]["accepted"].to_list()]
    again = analyze(tmp_path / "out", config)  # the comparison again from the files alone
    assert again.per_k.equals(per_k)
    r = measured_r(tmp_path / "cal" / "measurements.parquet")
    u = r["u"].to_numpy()
    assert r.height == 2 * 4 and np.all((u > 0) & (u <= 1))
    np.testing.assert_allclose(r["r"].to_numpy(), u * r["per_slot_us"].to_numpy() / r["sorted_us"].to_numpy())


def test_committed_mlx_validation_recomputes_from_its_files(tmp_path: Path) -> None:
    import shutil

    import polars as pl
    from conftest import DATA
    from polars.testing import assert_frame_equal

    from moesim.sim.validate.mlx_cpu import MlxValidationConfig, analyze

    folder = shutil.copytree(DATA / "mlx-cpu-validation", tmp_path / "v")
    validation = analyze(folder, MlxValidationConfig())
    committed = pl.read_csv(DATA / "mlx-cpu-validation" / "per_k.csv")
    assert_frame_equal(validation.per_k.select(committed.columns), committed, check_exact=False, rel_tol=1e-9)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["best_draft"]["measured"] == summary["best_draft"]["predicted_from_source"]


def test_microbench_option_combinations(tmp_path: Path, cli) -> None:
    import polars as pl

    out = tmp_path / "b"
    code, _, err = cli("microbench", "mlx", "--out", out, "--hidden", 64, "--expert-intermediate", 32, "--experts", 4, "--top-k", 2,
                       "--pass-sizes", "1,3", "--routing", "same", "--format", "F32", "--family", "per_slot",
                       "--clock", "wall", "--statistic", "median",
                       "--no-dense-twins", "--reps", 3, "--warmup", 0, "--layers", 1)  # fmt: skip
    assert code == 0, err
    table = pl.read_parquet(out / "measurements.parquet")
    assert table.height == 2 * 2 and set(table["kernel"]) == {"per_slot"} and set(table["routing"]) == {"same"}
    assert "reps_us_dense_L" not in table.columns and set(table["statistic"]) == {"median"}
    np.testing.assert_allclose(table["time_us"].to_numpy(), [np.median(r) for r in table["reps_us"].to_list()])
    assert json.loads((out / "provenance.json").read_text())["config"]["clock"] == "wall"
    code, _, err = cli("microbench", "mlx", "--out", tmp_path / "c", "--clock", "sundial")
    assert code == 2 and "clock" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"hidden_size": "wide"}, "field 'hidden_size' = 'wide'"),
        ({"num_experts_per_tok": 0}, "field 'num_experts_per_tok' = 0"),
        ({"model_type": "bert"}, "model_type 'bert'"),
        ({"num_local_experts": 7}, "could not load the model"),
    ],
)
def test_a_malformed_mlx_folder_is_one_line(models: dict[str, Path], tmp_path: Path, cli, edit: dict, message: str) -> None:
    import shutil

    folder = shutil.copytree(models["mixtral"], tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code, _, err = cli("trace", "record", folder, "--prompts", prompts, "--out", tmp_path / "t.arrow")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "t.arrow").exists()


def test_every_quantisation_of_mlx_lm_runs_and_holds_its_bytes() -> None:
    from moesim.hw_profiles.microbench.mlx_switch import MLX_FORMATS, MlxBenchConfig, run_mlx_microbench
    from moesim.hw_profiles.microbench.table import MoeShape

    formats = tuple(MLX_FORMATS)
    config = MlxBenchConfig(pass_sizes=(2,), routings=("uniform",), formats=formats, reps=1, warmup=0, layers=1, dense_twins=False)
    rows = run_mlx_microbench(config, [MoeShape("t", 64, 64, 4, 2, "F32")]).rows
    assert sorted({r["dtype"] for r in rows}) == sorted(f.lower() for f in MLX_FORMATS)
    by_format = {r["dtype"]: r["expert_bytes"] for r in rows}
    assert by_format["mxfp4"] < by_format["affine4"] < by_format["affine6"] < by_format["affine8"] < by_format["f32"]


def test_sorted_rows_are_the_engines_family_on_each_backend() -> None:
    from moesim.hw_profiles.engines import ENGINES
    from moesim.hw_profiles.microbench.mlx_switch import FAMILIES, row_family

    for backend_name, engine in (("cpu", "MLX CPU"), ("metal", "MLX")):
        written = {row_family(family, backend_name) for family in FAMILIES}
        assert written == set(ENGINES.create(engine).families())
