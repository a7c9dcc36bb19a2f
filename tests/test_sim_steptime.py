"""The simulator on the trace-driven step-time model: passes costed where the requests are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from moesim.hw_profiles import load_profile
from moesim.models import load_preset
from moesim.sim.cost.drafters import make_drafter
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.cost.trace_batch import TraceBatchCost
from moesim.sim.serving.config import config_from_dict
from moesim.sim.serving.run import load_trace, run_study, simulate

PROMPT, OUTPUT = 40, 120


def _config(policy: dict, models: list[str] | None = None):  # type: ignore[no-untyped-def]
    data = {
        "run": {"seed": 3, "requests": 2},
        "workload": {"prompt_tokens": PROMPT, "output_tokens": OUTPUT},
        "trace": {"synth": "mixture", "tokens": 300, "seqs": 2, "seed": 1},
        "target": {"model": "olmoe-1b-7b", "profile": "nvidia-h200", "engine": "dedup"},
        "drafter": {"kind": "ngram"},
        "cost": {"kind": "steptime"},
        "acceptance": {"model": "geometric", "alpha": 0.7},
        "policy": policy,
    }
    if models:
        data["study"] = {"models": models, "workloads": {"w": {"model": "geometric", "alpha": 0.7}}, "policies": [{"name": "off"}, policy]}
    return config_from_dict(data, "test", Path("."))


def test_plain_decoding_passes_cost_their_own_windows() -> None:
    config = _config({"name": "off"})
    result = simulate(config)
    trace = load_trace(config, "olmoe-1b-7b")
    preset = load_preset("olmoe-1b-7b")
    cost = TraceBatchCost(StepTimeModel(preset, load_profile("nvidia-h200"), "dedup"), trace, make_drafter("ngram", preset))
    iterations = pl.from_arrow(result.tables()["iterations"])
    decode = iterations.filter(pl.col("batch") == 1)
    assert decode.height == 2 * (OUTPUT - 1)
    # one token per pass: the union is one token's top-k in every layer
    assert (decode["distinct_experts"] == 8.0).all()
    for r in result.record.requests:
        rows = decode.filter(pl.col("requests").list.first() == r.rid)
        for i, verify_us in enumerate(rows["verify_us"].to_list()[:20]):
            expected = cost.verify_us(np.array([r.seq]), np.array([r.trace_start + i]), np.array([1]), np.array([PROMPT + 1 + i]))
            assert verify_us == pytest.approx(expected, rel=1e-12)
    assert iterations["prefill_us"].max() == pytest.approx(cost.prefill_us(PROMPT), rel=1e-12)


def test_speculative_passes_read_more_experts_and_cost_more() -> None:
    result = simulate(_config({"name": "static", "k": 3}))
    iterations = pl.from_arrow(result.tables()["iterations"]).filter(pl.col("batch") == 1)
    four = iterations.filter(pl.col("draft_lens").list.first() == 3)
    assert four.height > 10
    # a pass of 4 tokens: between one token's 8 experts and 4·8, at most all 64
    assert (four["distinct_experts"] > 8).all() and (four["distinct_experts"] <= 32).all()
    assert four["verify_us"].min() > result.off.verify_us[result.off.batch == 1].max()  # type: ignore[union-attr]
    assert result.summary["speedup"] > 1.0  # α = 0.7 at k = 3 pays on this model


def test_study_over_models() -> None:
    table = run_study(_config({"name": "static", "k": 2}, models=["olmoe-1b-7b", "qwen1.5-moe-a2.7b"]))
    assert table["model"].to_list() == ["olmoe-1b-7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "qwen1.5-moe-a2.7b"]
    assert table.filter(pl.col("policy") == "off")["speedup"].to_list() == [1.0, 1.0]
    assert table.filter(pl.col("policy") != "off")["speedup"].n_unique() == 2  # each model on its own pass times


def test_same_config_same_bytes_on_the_step_time_model(tmp_path: Path) -> None:
    config = _config({"name": "cascade", "k_max": 4})
    for out in ("a", "b"):
        simulate(config).write(tmp_path / out)
    for name in ("requests.arrow", "iterations.arrow", "summary.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize(
    ("profile", "engine", "expected"), [("nvidia-h200", None, "per_slot"), ("nvidia-rtx-3090-llamacpp", None, "dispatch")]
)
def test_target_engine_defaults_to_the_engines_dispatch_on_an_engine_profile(profile: str, engine: str | None, expected: str) -> None:
    from moesim.sim.serving.run import build_cost

    data = {
        "run": {"seed": 3, "requests": 1},
        "workload": {"prompt_tokens": PROMPT, "output_tokens": OUTPUT},
        "trace": {"synth": "mixture", "tokens": 300, "seqs": 1, "seed": 1},
        "target": {"model": "olmoe-1b-7b", "profile": profile, "weight_format": "Q4_K"},
        "cost": {"kind": "steptime"},
        "acceptance": {"model": "geometric", "alpha": 0.7},
        "policy": {"name": "off"},
    }
    config = config_from_dict(data, "test", Path("."))
    assert config.target.family is engine
    cost = build_cost(config, load_trace(config, "olmoe-1b-7b"))
    assert cost.model.family == expected  # type: ignore[attr-defined]


def test_dispatch_engine_on_a_profile_without_dispatch_names_the_key() -> None:
    from moesim.errors import ConfigError

    data = {
        "run": {"seed": 3, "requests": 1},
        "workload": {"prompt_tokens": PROMPT, "output_tokens": OUTPUT},
        "trace": {"synth": "mixture", "tokens": 300, "seqs": 1, "seed": 1},
        "target": {"model": "olmoe-1b-7b", "profile": "nvidia-h200", "family": "dispatch"},
        "cost": {"kind": "steptime"},
        "acceptance": {"model": "geometric", "alpha": 0.7},
        "policy": {"name": "off"},
    }
    with pytest.raises(ConfigError, match=r"target\.family.*no \[dispatch\] table"):
        config_from_dict(data, "test", Path("."))
