"""Drafters as engines build them, the profile's spec-path terms, the verdict, and the fit and
held-out judging of the shared speculative runs."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, assert_one_line_error

from moesim.errors import ConfigError
from moesim.fields import FieldError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.builtin import with_spec_path
from moesim.hw_profiles.provenance import Provenance
from moesim.hw_profiles.schema import profile_from_dict, profile_to_toml
from moesim.hw_profiles.speculative import SpecPath
from moesim.models import load_preset
from moesim.sim.analysis.best_draft import best_draft_analysis
from moesim.sim.analysis.scenario import Scenario, load_scenario
from moesim.sim.cost.drafters import DenseModelDrafter, DrafterSection, draft_us, make_drafter, parse_drafter
from moesim.sim.engine.builtin import write_spec_paths
from moesim.sim.validate.spec_runs import RunCosts, fit_terms, held_out
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Uniform, synthesize

QWEN3 = load_preset("qwen3-30b-a3b")


def bytes_of(bytes_read: float, flops: float) -> float:
    """A dense family that answers with the bytes it was asked to read."""
    return bytes_read


def test_eagle3_head_bytes_as_counted_by_hand() -> None:
    """SpecForge's Qwen3-30B-A3B head: attention on 2·2048 inputs (32 heads, 4 KV heads of 128), FFN 12288, fc, LM head."""
    h, heads, kv, d = 2048, 32, 4, 128
    attention = 2 * h * heads * d + 2 * (2 * h * kv * d) + heads * d * h + 2 * d
    layer = attention + 3 * h * 12288 + 4 * h + 3 * h * h
    for spec, vocab in (("eagle3", 32000), ("eagle3:full", QWEN3.vocab), ("eagle3:64000", 64000)):
        step = make_drafter(spec, QWEN3).step_us(1, 1, 0.0, bytes_of)
        assert step == pytest.approx(2 * (layer + vocab * h))
    assert make_drafter("eagle3", QWEN3).step_us(1, 1, 0.0, bytes_of) == pytest.approx(0.37e9, rel=0.02)  # research note D.1


def test_mtp_head_reads_its_rows_distinct_experts() -> None:
    mtp = make_drafter("mtp", QWEN3, "BF16")
    one, four = (mtp.step_us(rows, 1, 0.0, bytes_of) for rows in (1, 4))
    expert = 3 * QWEN3.hidden * QWEN3.expert_intermediate * 2
    e, k = QWEN3.experts, QWEN3.top_k
    assert four - one == pytest.approx(expert * e * ((1 - (1 - k / e) ** 4) - (1 - (1 - k / e))))
    assert make_drafter("mtp", QWEN3, "Q4_0").step_us(1, 1, 0.0, bytes_of) < one / 3
    with pytest.raises(ConfigError, match="takes no argument"):
        make_drafter("mtp:2", QWEN3)


def test_draft_time_by_mode_and_tree() -> None:
    """Autoregressive steps run their tree's rows, Medusa one row a head, DFlash one block, lookups per request."""
    calls: list[tuple[int, int]] = []

    def record(bytes_read: float, flops: float) -> float:
        calls.append((round(bytes_read), round(flops)))
        return 1.0

    eagle = make_drafter("eagle3,topk=4,tokens=8", QWEN3)
    lens = np.array([3, 3, 1])
    assert draft_us(eagle, lens, 0.0, record) == 3.0
    rows = [f // (2 * eagle.row_params) for _, f in calls]  # type: ignore[attr-defined]
    assert rows == [1 + 1 + 1, 4 + 4, 4 + 4]
    calls.clear()
    medusa = make_drafter("medusa,topk=4", QWEN3)
    assert draft_us(medusa, lens, 0.0, record) == 3.0
    assert [f // (2 * medusa.row_params) for _, f in calls] == [3, 2, 2]  # type: ignore[attr-defined]
    calls.clear()
    dflash = make_drafter("dflash", QWEN3)
    assert draft_us(dflash, lens, 0.0, record) == 1.0
    assert [f // (2 * dflash.row_params) for _, f in calls] == [4 + 4 + 2]  # type: ignore[attr-defined]
    assert draft_us(make_drafter("ngram:30", QWEN3), lens, 0.0, record) == 90.0
    assert draft_us(make_drafter("suffix:12.5", QWEN3), np.array([2, 0]), 0.0, record) == 12.5
    assert draft_us(make_drafter("ngram", QWEN3), lens, 0.0, record) == 0.0


def test_a_separate_draft_model_on_another_device_and_moe_drafts() -> None:
    here = make_drafter("qwen3-0.6b", QWEN3)
    there = make_drafter("qwen3-0.6b,device=nvidia-rtx-4090-llamacpp", QWEN3)
    h200 = load_profile("nvidia-h200").dense.time_us
    assert here.step_us(1, 1, 512.0, h200) != there.step_us(1, 1, 512.0, h200)
    rtx = load_profile("nvidia-rtx-4090-llamacpp").dense.time_us
    assert there.step_us(1, 1, 512.0, h200) == here.step_us(1, 1, 512.0, rtx)
    moe = make_drafter("preset:olmoe-1b-7b", QWEN3)
    assert moe.step_us(4, 4, 0.0, bytes_of) > moe.step_us(1, 1, 0.0, bytes_of)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("dflash,topk=2", "drafts one block"),
        ("eagle3,device=nvidia-h200", "device= applies to a separate draft model"),
        ("eagle3,depth=3", "unknown option 'depth'"),
        ("eagle3,topk", "options are KEY=VALUE"),
        ("no-such-drafter", "unknown drafter"),
        ("olmoe-1b-7b", "preset:olmoe-1b-7b"),
        ("eagle3:x", "draft vocabulary"),
    ],
)
def test_bad_drafter_specs_are_one_line(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        make_drafter(spec, QWEN3)


SPELLINGS = [
    ({"kind": "preset", "model": "qwen3-0.6b"}, "qwen3-0.6b"),
    ({"kind": "preset", "model": "olmoe-1b-7b"}, "preset:olmoe-1b-7b"),
    ({"kind": "preset:eagle-head"}, "preset:eagle-head"),
    ({"kind": "fixed", "time_us": 5.0}, "fixed:5.0"),
    ({"kind": "eagle-head"}, "eagle"),
    ({"kind": "eagle3:32000,topk=4,tokens=8"}, "eagle3:32000,topk=4,tokens=8"),
    ({"kind": "eagle3", "argument": "full", "tree": "topk=2,tokens=4"}, "eagle3:full,topk=2,tokens=4"),
    ({"kind": "mtp", "tree": "paths=[[0],[0,0],[1]]"}, "mtp,paths=[[0],[0,0],[1]]"),
    ({"kind": "ngram", "time_us": 30.0}, "ngram:30.0"),
    ({"kind": "suffix:12.5"}, "suffix:12.5"),
    ({"kind": "dflash:3"}, "dflash:3"),
    ({"kind": "qwen3-0.6b,device=nvidia-rtx-4090-llamacpp"}, "qwen3-0.6b,device=nvidia-rtx-4090-llamacpp"),
]


@pytest.mark.parametrize(("table", "spec"), SPELLINGS)
def test_a_drafter_table_and_its_spec_are_one_section(table: dict[str, object], spec: str) -> None:
    """The [drafter] table (old spellings too) and the command line's spec parse to the same typed
    section, which prints back as the spec."""
    section = DrafterSection(**table)  # type: ignore[arg-type]
    assert section == parse_drafter(spec) and section.spec() == spec and parse_drafter(section.spec()) == section
    assert type(section.make(QWEN3)).__name__ == type(make_drafter(spec, QWEN3)).__name__


def test_old_spellings_make_the_drafters_they_made() -> None:
    """The spellings the sweep translated ('fixed:US', a preset name) and a [drafter] table's give the same drafter."""
    assert parse_drafter("fixed:5") == DrafterSection(kind="fixed", time_us=5.0)
    assert make_drafter("fixed:5", QWEN3).step_us(1, 1, 0.0, lambda b, f: 0.0) == 5.0
    assert parse_drafter("eagle") == DrafterSection(kind="eagle") and parse_drafter("ngram") == DrafterSection()
    assert DrafterSection(kind="preset", model="qwen3-0.6b").make(QWEN3) == DenseModelDrafter(load_preset("qwen3-0.6b"))
    with pytest.raises(FieldError, match="give it in one place"):
        DrafterSection(kind="fixed:5", time_us=6.0)
    with pytest.raises(FieldError, match="applies to preset"):
        DrafterSection(kind="ngram", model="qwen3-0.6b")


def spec_path(**terms: float) -> SpecPath:
    values = {"pass_us": 0.0, "iteration_us": 0.0, "draft_step_us": 0.0, "verified_token_us": 0.0, "heldout_error": 0.2, **terms}
    return SpecPath(**values, provenance=Provenance("assumed", note="test"), basis={"iteration_us": "a test"}, source_id="test")


def test_speculative_table_round_trips_and_bad_values_name_the_field(tmp_path: Path) -> None:
    profile = with_spec_path(load_profile("nvidia-h200"), spec_path(iteration_us=250.0, verified_token_us=3.5))
    text = profile_to_toml(profile)
    again = profile_from_dict(tomllib.loads(text), "p.toml")
    assert again.speculative == profile.speculative
    assert profile_from_dict(tomllib.loads(profile_to_toml(load_profile("nvidia-h200"))), "p.toml").speculative is None
    for old, new, fragment in (
        ("iteration_us = 250.0", "iteration_us = -1.0", "speculative.iteration_us"),
        ('source = "test"', 'source = "nowhere"', "speculative.source"),
        ("iteration_us = 250.0", "iteration_us = 250.0\nwarp = 3", "speculative.warp"),
    ):
        with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
            profile_from_dict(tomllib.loads(text.replace(old, new, 1)), "p.toml")


@pytest.fixture(scope="module")
def qwen3_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "q.arrow"
    write_trace(path, synthesize(QWEN3, Uniform(), tokens=160, seqs=2, seed=3))
    return path


def test_verdict_by_hand_and_the_deciding_term(qwen3_trace: Path) -> None:
    scenario = load_scenario(qwen3_trace, "nvidia-h200", None, None, "eagle3,topk=3,tokens=6")
    result = best_draft_analysis(scenario, [0.7], 4, verdict=True)
    (verdict,) = result.verdicts
    k = verdict.draft_len
    assert verdict.break_even_tokens == pytest.approx(result.relative_cost[k])
    assert verdict.speedup == pytest.approx(verdict.tokens_per_pass / result.relative_cost[k])
    assert verdict.verify_tokens == scenario.drafter.tree.width(k)
    assert sum(verdict.shares.values()) == pytest.approx(result.relative_cost[k] - 1.0)
    slow = dataclasses.replace(scenario.model, profile=with_spec_path(scenario.model.profile, spec_path(iteration_us=1e6)))
    heavy = best_draft_analysis(Scenario(slow, scenario.trace, scenario.drafter, scenario.context_tokens), [0.7], 4, verdict=True)
    assert heavy.verdicts[0].verdict == "loses" and heavy.verdicts[0].decided_by == "spec overhead"
    assert heavy.best_draft[0] == 0
    costly = dataclasses.replace(scenario.model, profile=with_spec_path(scenario.model.profile, spec_path(pass_us=1e6)))
    flat = best_draft_analysis(Scenario(costly, scenario.trace, scenario.drafter, scenario.context_tokens), [0.7], 4, verdict=True)
    assert flat.relative_cost[k] == pytest.approx(1.0, abs=0.01)  # a huge time per forward makes every pass cost the same


def test_an_uncertain_engine_term_makes_the_verdict_uncertain_and_names_it(cli, qwen3_trace: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moesim.sim.analysis.speculation import spec_costs

    scenario = load_scenario(qwen3_trace, "nvidia-h200", None, None, "eagle3")
    base = best_draft_analysis(scenario, [0.7], 4, verdict=True).verdicts[0]
    plain_us = float(spec_costs(scenario, 4).target_us()[0])
    even = (base.tokens_per_pass - base.break_even_tokens) * plain_us  # the overhead per iteration that makes S(k) = 1

    def verdict_with(iteration_us: float, uncertainty: float):  # type: ignore[no-untyped-def]
        spec = dataclasses.replace(spec_path(iteration_us=iteration_us, heldout_error=0.0), uncertainty={"iteration_us": uncertainty})
        model = dataclasses.replace(scenario.model, profile=with_spec_path(scenario.model.profile, spec))
        (verdict,) = best_draft_analysis(
            Scenario(model, scenario.trace, scenario.drafter, scenario.context_tokens), [0.7], 4, verdict=True
        ).verdicts
        return verdict

    verdict = verdict_with(0.9 * even, 0.9)
    assert verdict.speedup > 1.0 > verdict.speedup_low
    assert verdict.verdict == "uncertain" and verdict.uncertain_by == "engine iteration_us"
    assert "moesim profile fit-engine" in verdict.calibrate and verdict.to_dict()["uncertain_by"] == "engine iteration_us"
    sure = verdict_with(0.5 * even, 0.0)  # known exactly and far from even: the kernels' box alone, which does not reach 1
    assert sure.verdict == "pays" and "uncertain_by" not in sure.to_dict()
    # the command line: a profile file with the uncertain term, the deciding part and how to calibrate it printed
    spec = dataclasses.replace(spec_path(iteration_us=0.9 * even, heldout_error=0.0), uncertainty={"iteration_us": 0.9})
    profile = tmp_path / "uncertain.toml"
    profile.write_text(profile_to_toml(with_spec_path(load_profile("nvidia-h200"), spec)))
    args = (
        "best-draft",
        "--trace",
        qwen3_trace,
        "--profile",
        profile,
        "--drafter",
        "eagle3",
        "--alpha",
        "0.7",
        "--max-draft",
        "4",
        "--verdict",
    )
    code, out, err = cli(*args)
    assert code == 0, err
    assert "uncertain" in out and "calibrate: alpha=0.7: uncertain, decided by engine iteration_us" in " ".join(out.split())
    code, out, err = cli(*args, "--json")
    assert code == 0 and json.loads(out)["verdict"][0]["uncertain_by"] == "engine iteration_us"


def test_best_draft_cli_takes_acceptance_lengths_rates_and_runs(cli, qwen3_trace: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    counts = tmp_path / "counts.csv"
    counts.write_text("accepted,drafted\n" + "".join(f"{a},3\n" for a in (3, 2, 0, 3, 1, 3)))
    args = ["best-draft", "--trace", qwen3_trace, "--profile", "nvidia-h200", "--max-draft", "4", "--json", "--verdict"]
    code, out, err = cli(*args, "--accept-len", "2.5@3", "--depth-rates", "0.9,0.7", "--accept-run", counts)
    assert code == 0, err
    data = json.loads(out)
    assert [p["acceptance"].split()[0] for p in data["points"]] == ["length", "rates", "run"]
    a = data["points"][0]["alpha"]
    assert 1 + a + a**2 + a**3 == pytest.approx(2.5, abs=1e-9)
    assert data["points"][2]["alpha"] == pytest.approx(5 / 6)  # S_1 = 5/6 of the recorded passes
    assert len(data["verdict"]) == 3 and {"decided_by", "break_even_tokens_per_pass"} <= set(data["verdict"][0])
    code, out, err = cli(*args[:-1], "--alpha", "0.7")
    assert code == 0 and "verdict" not in json.loads(out) and "acceptance" not in json.loads(out)["points"][0]
    assert_one_line_error(*cli(*args, "--accept-len", "9@2")[::2], "acceptance length 9.0")
    assert_one_line_error(*cli(*args)[::2], "give an acceptance")


def test_batch_verifies_the_tree_width(qwen3_trace: Path) -> None:
    from moesim.sim.analysis.batch import batch_analysis

    scenario = load_scenario(qwen3_trace, "nvidia-h200", None, None, "eagle3,topk=2,tokens=5")
    result = batch_analysis(scenario, 0.6, 3, [1, 2])
    assert result.verify_tokens == 5
    tau = scenario.drafter.tree.tokens_per_pass(3, np.array([0.6]))[0]
    assert result.to_dict()["tokens_per_pass"] == pytest.approx(tau)
    assert np.allclose(result.speedup, tau * result.single_us / (result.draft_us + result.verify_us))


def synthetic_run(row: int, engine: str, steps: int, tokens: int, terms: dict[str, float]) -> RunCosts:
    """A run whose measured speedup is exactly what `terms` predict."""
    base = RunCosts(row, "src", engine, "p", "d", steps, tokens, 3.0, 1.0, 9000.0, 6000.0, 9000.0 + 300 * tokens, 500.0)
    measured = base.predicted_speedup(terms)
    return dataclasses.replace(base, measured_speedup=measured, baseline_us=6000.0 + terms["pass_us"])


def test_fit_recovers_terms_it_can_separate_and_zeroes_the_others() -> None:
    truth = {"pass_us": 1500.0, "iteration_us": 800.0, "draft_step_us": 0.0, "verified_token_us": 40.0}
    runs = [synthetic_run(i, "a" if i < 3 else "b", 1, tokens, truth) for i, tokens in enumerate((4, 8, 16, 2, 6))]
    fit = fit_terms(runs)
    for name, value in truth.items():
        assert fit.terms[name] == pytest.approx(value, rel=1e-6, abs=1e-6)
    assert fit.basis["draft_step_us"].startswith("0: not separated")
    for frame in (held_out(runs, "row").frame, held_out(runs, "engine").frame):
        assert np.allclose(frame["predicted"], frame["measured"], rtol=1e-6)
    loro = held_out(runs, "row").frame
    assert loro["fit_iteration_us"].to_list() == pytest.approx([800.0] * 5)


def test_shipped_spec_paths_are_current(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    written = write_spec_paths(tmp_path / "spec_paths.toml")
    shipped = REPO / "moesim" / "hw_profiles" / "data" / "spec_paths.toml"
    assert written.read_text() == shipped.read_text(), "run python -m moesim.sim.engine.builtin"
    mlx = load_profile("apple-m3-ultra-mlx").speculative
    assert mlx is not None and mlx.kinds["draft_step_us"] == "transferred"  # no describable MLX dense row: llama.cpp's terms
    vllm = load_profile("nvidia-h100-sxm-vllm").speculative  # the H100 is among vLLM V1's rows' devices
    assert vllm is not None and vllm.engine == "vLLM V1" and vllm.pass_us > 0 and vllm.kinds["pass_us"] == "calibrated"
    rows = {(r.row, r.variant) for r in vllm.provenance.rows}
    assert {(84, "decode step"), (24, "speculative run"), (41, "speculative run")} <= rows
    assert load_profile("nvidia-h200-vllm").speculative.kinds["pass_us"] == "transferred"  # type: ignore[union-attr]
    llamacpp = load_profile("nvidia-rtx-3090-llamacpp").speculative  # fitted on whole passes: the time per forward is inside
    assert llamacpp is not None and llamacpp.pass_us == 0.0 and llamacpp.launch_us_per_layer == 0.0 and llamacpp.draft_step_us > 0
    assert load_profile("nvidia-h200").speculative is None  # the lab's kernels: no serving engine
