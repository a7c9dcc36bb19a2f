"""The FLOP rate an engine reaches, as a floor, for a family whose rows never gave its own
(`pooled.engine_pool.engine_floors`, `ExpertFamily.floor_tflops`): it binds only where the FLOPs
at that rate exceed the fitted terms, leaves a family with its own FLOP rate alone, and reads and
writes as a profile field."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error

from moesim.errors import ConfigError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.families import RANGE_FIELDS, ExpertInputs
from moesim.hw_profiles.fitting.engine_builtins import recipe
from moesim.hw_profiles.fitting.pooled.engine_pool import device_rows, engine_floors, reached_tflops
from moesim.hw_profiles.fitting.pooled.pool_validation import engine_parts
from moesim.hw_profiles.fitting.whole_pass import uniform_features
from moesim.hw_profiles.schema import profile_from_dict, profile_to_toml
from moesim.models import load_preset

SIZES = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096], np.float64)


def _inputs(model: str, weight_format: str, sizes: np.ndarray) -> ExpertInputs:
    preset = load_preset(model)
    shape = preset.expert_shape(weight_format)
    rows = [ExpertInputs.of(uniform_features(int(n), preset.experts, preset.top_k), shape) for n in sizes]
    return ExpertInputs.from_arrays(*(np.array([float(x.field(name)) for x in rows]) for name in RANGE_FIELDS))


def test_the_floor_binds_only_beyond_where_the_fitted_terms_exceed_it() -> None:
    family = load_profile("nvidia-p40-llamacpp").expert_family("dedup_mmq")
    assert math.isinf(family.compute_tflops[0]) and 0 < family.floor_tflops < family.roofline.peak_tflops
    unfloored = dataclasses.replace(family, floor_tflops=math.inf)
    for model, fmt in (("qwen3-30b-a3b", "Q3_K"), ("deepseek-v2-lite", "Q4_0")):
        x = _inputs(model, fmt, SIZES)
        fitted = unfloored.model_time_us(x)
        reads = x.distinct_experts * x.expert_bytes / (family.roofline.peak_bandwidth_gbps * 1e3)
        flops = x.slots * 6.0 * x.hidden * x.intermediate / (family.floor_tflops * 1e6)
        expected = np.max(np.stack([fitted, reads, flops]), axis=0)  # numpy's max, independent of the floor's code
        assert np.allclose(family.inputs_time_us(x), expected, rtol=1e-12)
        binds = flops > np.maximum(fitted, reads)
        assert np.array_equal(family.inputs_time_us(x) > unfloored.inputs_time_us(x) * (1 + 1e-12), binds)
        fitted_on = np.less_equal(SIZES, family.calibrated_range.bounds["n_tokens"][1])
        assert not binds[fitted_on].any(), model  # not on the sizes it was fitted on
        assert binds[SIZES >= 1024].all(), model  # far beyond them the FLOPs decide
        top_k = load_preset(model).top_k
        fast = family.fast_time_us(x.slots, x.distinct_experts, x.max_tokens_per_expert, load_preset(model).expert_shape(fmt), top_k)
        assert np.allclose(fast, expected, rtol=1e-12)  # the compiled path takes the same ceiling


def test_the_p40_floor_is_the_pooled_rate_of_the_other_devices() -> None:
    item = recipe("nvidia-p40-llamacpp")
    parts = engine_parts(item.engine, eras="dispatch")
    target = device_rows(item, eras="dispatch")
    shipped = load_profile(item.name)
    bare = dataclasses.replace(
        shipped,
        expert_families={k: dataclasses.replace(f, floor_tflops=math.inf) for k, f in shipped.expert_families.items()},
        notes=shipped.notes[:-1],
    )
    floored = engine_floors(parts, target, bare)
    assert floored.expert_family("dedup_mmq").floor_tflops == pytest.approx(shipped.expert_family("dedup_mmq").floor_tflops, rel=1e-9)
    assert math.isinf(floored.expert_family("per_slot").floor_tflops)  # a mat-vec kernel: its FLOPs ride on its reads
    note = floored.notes[-1]
    assert "dedup_mmq" in note and "transferred: the pooled llama.cpp CUDA fit" in note and "nvidia-rtx-3090" in note
    assert "nvidia-p40" not in note  # fitted on the engine's other devices only
    # without any other device of the engine there is nothing to transfer
    assert engine_floors([target], target, bare) is bare


def test_a_family_with_its_own_flop_rate_is_unchanged() -> None:
    item = recipe("nvidia-rtx-3090-llamacpp")
    profile = load_profile(item.name)
    assert math.isfinite(profile.expert_family("dedup_mmq").compute_tflops[0])
    floored = engine_floors(engine_parts(item.engine, eras="dispatch"), device_rows(item, eras="dispatch"), profile)
    assert floored.expert_families == profile.expert_families and floored.notes == profile.notes
    for name in ("nvidia-rtx-3090-llamacpp", "nvidia-h200-vllm", "nvidia-a100-80gb-vllm"):
        for family in load_profile(name).expert_families.values():
            assert math.isinf(family.floor_tflops), (name, family.name)
            assert "floor_tflops" not in profile_to_toml(load_profile(name))


def test_reached_rate() -> None:
    assert reached_tflops(3.0, 1.0, 12.0) == pytest.approx(3.0)
    assert reached_tflops(0.0, 0.0, 12.0) == math.inf


def test_the_field_round_trips_and_a_bad_value_is_one_line(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    profile = load_profile("nvidia-p40-llamacpp")
    text = profile_to_toml(profile)
    again = profile_from_dict(tomllib.loads(text), "p40.toml")
    assert again.expert_family("dedup_mmq").floor_tflops == profile.expert_family("dedup_mmq").floor_tflops
    assert profile_to_toml(again) == text
    code, out, _ = cli("profile", "show", "nvidia-p40-llamacpp", "--json")
    shown = json.loads(out)
    assert code == 0 and shown["families"]["dedup_mmq"]["floor_tflops"] == profile.expert_family("dedup_mmq").floor_tflops
    assert [row["compute_tflops"] for row in shown["family_rows"]] == ["inf", "inf (floor 3.03)", "inf"]
    for value, fragment in (("-1.0", "must be > 0, got -1"), ('"fast"', "must be a number, got 'fast'"), ("0.0", "must be > 0, got 0")):
        bad = re.sub(r"^floor_tflops = .*$", f"floor_tflops = {value}", text, count=1, flags=re.M)
        with pytest.raises(ConfigError, match=r"families\.dedup_mmq\.floor_tflops") as info:
            profile_from_dict(tomllib.loads(bad), "bad.toml")
        assert fragment in str(info.value) and "\n" not in str(info.value)
        path = tmp_path / "bad.toml"
        path.write_text(bad)
        code, _, err = cli("profile", "show", path)
        assert_one_line_error(code, err, "bad.toml", "families.dedup_mmq.floor_tflops", fragment)
