"""An engine's dispatch (contract 4, optional [dispatch] table): rules, TOML, and the `dispatch` engine."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import numpy as np
import pytest

from moesim.errors import ConfigError, InputError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.dispatch import Dispatch, DispatchRule
from moesim.hw_profiles.schema import profile_from_dict, profile_to_toml, read_profile
from moesim.kernels.features import RoutingFeatures
from moesim.models import load_preset
from moesim.sim.cost.steptime import StepTimeModel, default_family


def _reference(rules: list[DispatchRule], fmt: str, n: int, experts: int, top_k: int) -> str | None:
    """The first rule whose every condition holds, written out plainly."""
    for r in rules:
        if r.formats and fmt not in r.formats:
            continue
        if n < r.min_tokens or (r.max_tokens and n > r.max_tokens) or n * top_k < r.min_slots or (r.max_slots and n * top_k > r.max_slots):
            continue
        if n * top_k / experts < r.min_slots_per_expert or (r.max_tokens_per_expert and n / experts > r.max_tokens_per_expert):
            continue
        return r.family
    return None


def test_first_matching_rule_wins_against_a_plain_reference() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        rules = [
            DispatchRule(
                family=f"dedup{i}",
                formats=tuple(rng.choice(["Q4_0", "Q4_K", "BF16"], size=int(rng.integers(0, 3)), replace=False)),
                min_tokens=int(rng.integers(1, 20)),
                max_tokens=int(rng.choice([0, int(rng.integers(1, 64))])),
                min_slots=int(rng.choice([0, 64])),
                max_slots=int(rng.choice([0, 700])),
                min_slots_per_expert=float(rng.choice([0.0, 4.0])),
                max_tokens_per_expert=float(rng.choice([0.0, 1.0])),
            )
            for i in range(int(rng.integers(1, 4)))
        ] + [DispatchRule("per_slot")]
        dispatch = Dispatch(tuple(rules), "src")
        experts, top_k = int(rng.choice([8, 64, 128])), int(rng.choice([2, 6, 8]))
        for fmt in ("Q4_0", "Q4_K", "BF16"):
            n = np.arange(1, 300)
            got = dispatch.family_for(fmt, n, experts, top_k)
            assert list(got) == [_reference(rules, fmt, int(x), experts, top_k) for x in n]


def test_no_rule_for_a_format_is_one_line() -> None:
    dispatch = Dispatch((DispatchRule("per_slot", formats=("Q4_0",)),), "src")
    with pytest.raises(InputError, match="no kernel for weight format BF16 at 1 tokens"):
        dispatch.family_for("BF16", [1, 2], 64, 6)
    assert dispatch.switches("Q4_0", 64, 6, 4) == []


def _with_dispatch(tmp_path: Path) -> Path:
    base = load_profile("nvidia-h200")
    rules = (DispatchRule("per_slot", max_tokens=8, note="mat-vec per slot"), DispatchRule("dedup_grouped_gemm"))
    profile = dataclasses.replace(base, name="h200-dispatch", dispatch=Dispatch(rules, "table"), partial=True)
    path = tmp_path / "h200-dispatch.toml"
    path.write_text(profile_to_toml(profile))
    return path


def test_dispatch_round_trips_and_the_engine_follows_it(tmp_path: Path) -> None:
    path = _with_dispatch(tmp_path)
    profile = read_profile(path)
    assert profile.partial and profile.dispatch is not None and profile.dispatch.families == ("per_slot", "dedup_grouped_gemm")
    assert profile_to_toml(profile) == path.read_text()
    assert default_family(profile) == "dispatch" and default_family(load_profile("nvidia-h200")) == "per_slot"
    preset = load_preset("deepseek-v2-lite")
    n = np.arange(1, 17, dtype=float)[:, None]
    u = np.minimum(n * 6, 64.0) * np.ones((1, len(preset.moe_layers)))
    features = RoutingFeatures(n, n * 6, u, np.ones_like(u))
    dispatched = StepTimeModel(preset, profile, "dispatch").pass_cost(features, 512.0)
    per_slot = StepTimeModel(preset, profile, "per_slot").pass_cost(features, 512.0)
    gemm = StepTimeModel(preset, profile, "dedup_grouped_gemm").pass_cost(features, 512.0)
    expected = np.where(n[:, 0] <= 8, per_slot.total_us(), gemm.total_us())
    np.testing.assert_array_equal(dispatched.total_us(), expected)
    assert list(dispatched.family) == ["per_slot"] * 8 + ["dedup_grouped_gemm"] * 8
    model = StepTimeModel(preset, profile, "dispatch")
    for size in (4, 12):  # the simulator's fast path takes the dispatched family too
        one = RoutingFeatures(np.full(26, float(size)), np.full(26, size * 6.0), np.full(26, 20.0), np.full(26, 2.0))
        assert model.pass_time_us(one, 512.0) == pytest.approx(float(model.pass_cost(one, 512.0).total_us()))


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: d["dispatch"]["rules"][0].__setitem__("family", "dedup_mystery"), "dispatch.rules[0].family"),
        (lambda d: d["dispatch"]["rules"][0].__setitem__("max_tokens", -2), "dispatch.rules[0].max_tokens"),
        (lambda d: d["dispatch"]["rules"][1].__setitem__("when", 3), "dispatch.rules[1].when"),
        (lambda d: d["dispatch"].__setitem__("source", "nowhere"), "dispatch.source"),
        (lambda d: d["dispatch"].__setitem__("rules", []), "dispatch.rules"),
        (lambda d: d.__setitem__("partial", "yes"), "partial"),
        (lambda d: d["sources"]["table"].__setitem__("rows", [{"row": 0, "source": "x", "variant": "v", "n_tokens": 1}]), "rows"),
    ],
)
def test_bad_dispatch_tables_are_one_line(tmp_path: Path, mutate, fragment: str) -> None:  # type: ignore[no-untyped-def]
    data = tomllib.loads(_with_dispatch(tmp_path).read_text())
    mutate(data)
    with pytest.raises(ConfigError) as info:
        profile_from_dict(data, "bad.toml")
    assert "\n" not in str(info.value) and fragment in str(info.value)
