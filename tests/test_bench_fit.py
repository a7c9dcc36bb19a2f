"""`moesim profile fit` on a user's llama-bench run: a profile of that device and build, its
per-slot limit learned from the run's cliff, its held-out error from leaving one pass size out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line_error

from moesim.hw_profiles.fitting.bench_fit import LEARN_MARGIN, SHARE_FLOOR, fit_bench_output
from moesim.hw_profiles.fitting.engine_builtins import PUBLIC_TABLE
from moesim.hw_profiles.fitting.pooled.routing_share import ROUTED_SHARES, fit_errors, median_error
from moesim.hw_profiles.importers import ImportOptions
from moesim.hw_profiles.schema import read_profile, write_profile
from moesim.kernels.features import uniform_distinct_experts
from moesim.models import load_preset

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32)


def _synthetic_run(cliff: int, noise: float = 0.0, share: float = 1.0) -> str:
    """llama-bench markdown of pp512 runs from a plain formula: per pass a fixed 3 ms, the
    non-expert weights at 800 GB/s, and per MoE layer either every slot's expert read at 800 GB/s
    (n <= cliff) or 150 µs + each distinct expert read at 700 GB/s + the slots' FLOPs at 20 TFLOP/s;
    llama-bench's random tokens routed uniformly over a share of the experts (default: all)."""
    preset = load_preset("deepseek-v2-lite")
    expert_bytes = 3 * 2048 * 1408 * 18 / 32
    layers, experts, top_k = len(preset.moe_layers), preset.experts, preset.top_k

    def pass_us(n: int) -> float:
        if n <= cliff:
            moe = layers * top_k * n * expert_bytes / 800e3
        else:
            distinct = float(uniform_distinct_experts(n, share * experts, top_k))
            moe = layers * (150 + distinct * expert_bytes / 700e3 + n * top_k * 6 * 2048 * 1408 / 20e6)
        return 3000 + preset.non_expert_bytes_per_token("Q4_0") / 800e3 + moe

    lines = [
        "| model | size | params | backend | ngl | n_ubatch | test | t/s |",
        "| --- | ---: | ---: | --- | --: | ---: | ---: | ---: |",
    ]
    for i, n in enumerate(SIZES):
        wobble = 1 + noise * (1 if i % 2 else -1)
        lines.append(f"| deepseek2 16B Q4_0 | 8.29 GiB | 15.71 B | CUDA | 99 | {n} | pp512 | {n / pass_us(n) * 1e6 * wobble:.2f} ± 0.10 |")
    return "\n".join(lines) + "\n\nbuild: 1234abc (9999)\n"


@pytest.mark.parametrize("cliff", [4, 8])
def test_fit_learns_the_cliff_and_predicts_held_out_sizes(tmp_path: Path, cliff: int) -> None:
    """Tokens routed over every expert, fitted at that share."""
    run = tmp_path / "bench.md"
    run.write_text(_synthetic_run(cliff, noise=0.01, share=1.0))
    result = fit_bench_output(run, "mine", ImportOptions(device="RTX 3090"), share=1.0)
    assert f"per-slot kernel up to {cliff} tokens" in result.choice.sentence()
    write_profile(tmp_path / "mine.toml", result.fit.profile)
    profile = read_profile(tmp_path / "mine.toml")
    assert profile.status == "calibrated" and profile.dispatch is not None and profile.device.name == "NVIDIA GeForce RTX 3090"
    assert profile.bench_routed_share == 1.0
    assert list(profile.dispatch.family_for("Q4_0", list(SIZES), 64, 6)) == ["per_slot" if n <= cliff else "dedup_mmq" for n in SIZES]
    held = profile.expert_family("dedup_mmq").heldout_error.leave_one_size_out
    mat_mat_sizes = sum(1 for n in SIZES if n > cliff)
    bound = 0.05 if mat_mat_sizes > 3 else 0.2  # with three mat-mat sizes, leaving one out leaves two to fit its rates
    assert held is not None and held.median < bound and held.rows == mat_mat_sizes
    assert [row.n_tokens for row in profile.sources["measurements"].rows] == list(SIZES)


def test_fit_at_the_engines_routed_share(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """Tokens routed over half the experts, fitted by `profile fit --routed-share 0.5`: the cliff, the
    share stored and noted, and the seven mat-mat sizes each predicted without it."""
    run = tmp_path / "bench.md"
    run.write_text(_synthetic_run(4, noise=0.01, share=0.5))
    out = tmp_path / "mine.toml"
    code, stdout, err = cli("profile", "fit", run, "--device", "RTX 3090", "--routed-share", "0.5", "--out", out)
    assert code == 0, err
    assert "per-slot kernel up to 4 tokens" in stdout.replace("\n", " ")
    profile = read_profile(out)
    assert profile.bench_routed_share == 0.5 and any("over 50% of the experts" in note for note in profile.notes)
    assert profile.dispatch is not None
    assert list(profile.dispatch.family_for("Q4_0", list(SIZES), 64, 6)) == ["per_slot" if n <= 4 else "dedup_mmq" for n in SIZES]
    held = profile.expert_family("dedup_mmq").heldout_error.leave_one_size_out
    assert held is not None and held.median < 0.05 and held.rows == 7


def test_the_readme_example_fits(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    code, stdout, err = cli(
        "profile", "fit", REPO / "examples" / "llama-bench-synthetic.md", "--device", "RTX 3090", "--out", tmp_path / "p.toml"
    )
    assert code == 0, err
    assert "per-slot kernel up to" in stdout and "routed share" in stdout


def test_bench_fit_errors_are_one_line(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "bench.md"
    run.write_text(_synthetic_run(4))
    code, _, err = cli("profile", "fit", run, "--out", tmp_path / "p.toml")
    assert_one_line_error(code, err, "bench.md", "--device")
    code, _, err = cli("profile", "fit", run, "--device", "Mystery GPU 9000", "--out", tmp_path / "p.toml")
    assert_one_line_error(code, err, "Mystery GPU 9000", "not in the catalog")
    code, _, err = cli("profile", "fit", run, "--device", "RTX 3090", "--routed-share", "1.5", "--out", tmp_path / "p.toml")
    assert_one_line_error(code, err, "--routed-share", "1.5")
    assert not (tmp_path / "p.toml").exists()


def _compare_run() -> str:
    """compare-llama-bench's layout of two builds of the synthetic run: GPU first, no backend column,
    master's per-slot kernel up to 8 tokens, the PR's up to 4."""
    master, pr = (
        {int(cells[6]): cells[8] for cells in (line.split("|") for line in _synthetic_run(c).splitlines()[2:] if line.startswith("|"))}
        for c in (8, 4)
    )
    lines = ["| GPU | Model | Microbatch size | Test | t/s master | t/s PR | Speedup |", "|:---|:---|---:|:---|---:|---:|---:|"]
    for n in SIZES:
        lines.append(f"| RTX 3090 | deepseek2 16B Q4_0 | {n} | pp512 | {master[n].strip()} | {pr[n].strip()} | 1.00 |")
    return "\n".join(lines) + "\n"


def test_a_compare_table_fits_without_flags_and_validates(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """The GPU column names the device, the device's backend the engine; of two variants the last is
    fitted and a line says so; --filter chooses the other; validate checks the profile on the rows."""
    run = tmp_path / "cmp.md"
    run.write_text(_compare_run())
    code, stdout, err = cli("profile", "fit", run, "--out", tmp_path / "pr.toml")
    text = " ".join(stdout.split())
    assert code == 0, err
    assert "2 variants (master, PR): using 'PR', the last (choose one with --filter variant=NAME)" in text
    assert "per-slot kernel up to 4 tokens, moved by this run from the engine source's 8" in text
    assert read_profile(tmp_path / "pr.toml").device.engine == "llama.cpp CUDA"
    code, stdout, err = cli("profile", "fit", run, "--out", tmp_path / "master.toml", "--filter", "variant=master")
    text = " ".join(stdout.split())
    assert code == 0 and "using" not in text and "per-slot kernel up to 8 tokens, the engine source's" in text
    code, stdout, err = cli("validate", run, "--profile", tmp_path / "pr.toml", "--json")
    assert code == 0, err
    checked = json.loads(stdout)
    assert checked["predicted_rows"] == checked["rows"] == len(SIZES) and checked["median_abs_pct_error"] < 1.0
    # the rows a profile was fitted on are never beyond its calibrated range
    assert checked["extrapolated_rows"] == 0 and {r["extrapolated_x"] for r in checked["rows_predicted"]} == {1.0}
    code, stdout, _ = cli("validate", run, "--profile", tmp_path / "pr.toml", "--filter", "variant=master", "--out", tmp_path / "v")
    assert code == 0 and (tmp_path / "v" / "predictions.parquet").is_file()
    worse = float(" ".join(stdout.split()).split("p90 ")[1].split(" %")[0])
    assert worse > 5.0  # master's rows 5..8 (per-slot there) against the PR's profile (mat-mat there): the check can fail
    code, stdout, err = cli("profile", "import", run, "--out", tmp_path / "cmp.csv")  # the imported table validates the same
    assert code == 0 and "using 'PR'" in " ".join(stdout.split()), err
    code, stdout, err = cli("validate", tmp_path / "cmp.csv", "--profile", tmp_path / "pr.toml", "--json")
    assert code == 0 and json.loads(stdout)["median_abs_pct_error"] == pytest.approx(checked["median_abs_pct_error"]), err
    code, _, err = cli("validate", run, REPO / "examples" / "llama-bench-synthetic.md", "--profile", "nvidia-h200")
    assert_one_line_error(code, err, "no engine dispatch")


@pytest.mark.parametrize(("share", "noise"), [(1.0, 0.01), (0.4, 0.0), (0.4, 0.01)])
def test_the_run_chooses_its_routed_share(tmp_path: Path, share: float, noise: float) -> None:
    """A run whose random tokens route over a share of the experts, fitted without `--routed-share`:
    each candidate's held-out error recomputed from a fit at that share alone, the largest share
    within the margin and floor of the least kept, stored and said. A run made at every expert keeps
    every expert; one made at 0.4 leaves every expert (0.4 and 0.5, or 0.5 and 0.7 with noise, are
    within the margin of each other, so the larger is kept)."""
    run = tmp_path / "bench.md"
    run.write_text(_synthetic_run(4, noise=noise, share=share))
    result = fit_bench_output(run, "mine", ImportOptions(device="RTX 3090"))
    alone = {
        candidate: median_error([fit_errors(fit_bench_output(run, "mine", ImportOptions(device="RTX 3090"), share=candidate).fit)])
        for candidate in ROUTED_SHARES
    }
    assert result.share.errors == pytest.approx(alone)
    least = min(alone.values())
    chosen = max(c for c, e in alone.items() if e <= least * (1 + LEARN_MARGIN) + SHARE_FLOOR)
    assert result.share.share == chosen and result.fit.profile.bench_routed_share == chosen
    assert chosen == 1.0 if share == 1.0 else chosen < 1.0
    assert any(note.startswith(f"routed share {chosen:g}: the largest share whose fit") for note in result.fit.profile.notes)


def test_a_run_without_llama_bench_passes_routes_over_every_expert(tmp_path: Path) -> None:
    """llama-batched-bench decodes one token id per sequence: no share describes it, none is chosen."""
    result = fit_bench_output(PUBLIC_TABLE, "mine", ImportOptions(rows=tuple(range(331, 341))))  # RX 7900 XTX Vulkan, B = 1..64
    assert result.share.share == 1.0 and result.share.errors == {}
    assert "no test of this run passes several random token ids" in result.share.sentence()
