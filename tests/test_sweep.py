"""`moesim sweep`: every point against an independent recomputation, batch passes against
`batch_analysis`, properties of the rows, resuming after an interruption (in-process and a real
SIGINT to the command), the Ray executor, and one-line config errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import REPO, assert_one_line_error

from moesim.errors import ConfigError
from moesim.models import load_preset
from moesim.sim.analysis.batch import batch_analysis
from moesim.sim.analysis.predict import predict
from moesim.sim.analysis.scenario import load_scenario
from moesim.sim.sweep.config import load_config, points_per_unit
from moesim.sim.sweep.plan import plan_units
from moesim.sim.sweep.run import partial_dir, run_sweep
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Sticky, synthesize

ALPHAS = [0.0, 0.3, 0.6, 0.75, 0.9, 0.97, 1.0]
BASE = (Path(__file__).parent / "sweep_base.toml").read_text()  # bench/bench_ray_sweep.py times the same sweep


def write_config(folder: Path, text: str, name: str = "sweep.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pl.DataFrame]:
    folder = tmp_path_factory.mktemp("sweep")
    summary = run_sweep(load_config(write_config(folder, BASE)), folder / "out.parquet")
    assert summary.units == 2 and summary.resumed == 0
    return folder, pl.read_parquet(summary.out)


@pytest.fixture(scope="module")
def same_trace(swept: tuple[Path, pl.DataFrame]) -> Path:
    """The routing the sweep drew (4 sticky sequences of 300 tokens, seed 5), as a trace file."""
    path = swept[0] / "t.arrow"
    write_trace(path, synthesize(load_preset("deepseek-v2-lite"), Sticky(keep_prob=0.3), 300, 4, 5))
    return path


def plain_speedups(alpha: float, target_us: list[float], step_us: float) -> list[float]:
    """S(k, α) = Σ_{i<=k} α^i · T(1) / (k·step + T(k+1)), summed term by term."""
    return [sum(alpha**i for i in range(k + 1)) * target_us[0] / (k * step_us + target_us[k]) for k in range(len(target_us))]


def draft_step_us(scenario, batch: int) -> float:  # type: ignore[no-untyped-def]
    """One qwen3-0.6b step for `batch` requests through the dense family, by hand."""
    draft = load_preset("qwen3-0.6b")
    kv = batch * 256 * draft.layers * draft.attention.kv_cache_bytes_per_token()
    return float(
        scenario.model.profile.dense.time_us(draft.non_expert_bytes_per_token() + kv, 2.0 * batch * draft.non_expert_params_per_token())
    )


def test_batch_one_points_match_plain_python_over_predicted_times(swept, same_trace: Path) -> None:  # type: ignore[no-untyped-def]
    _, rows = swept
    for engine in ("per_slot", "best"):
        scenario = load_scenario(same_trace, "nvidia-h200", engine, drafter="qwen3-0.6b", context_tokens=256)
        target = predict(scenario, 7).cost.total_us().tolist()
        for drafter, step in (("qwen3-0.6b", draft_step_us(scenario, 1)), ("ngram", 0.0)):
            points = rows.filter(
                pl.col("record") == "point", pl.col("batch") == 1, pl.col("engine") == engine, pl.col("drafter") == drafter
            ).sort("alpha", "draft_len")
            assert points.height == len(ALPHAS) * 7
            for alpha in ALPHAS:
                at = points.filter(pl.col("alpha") == alpha)
                expected = plain_speedups(alpha, target, step)
                np.testing.assert_allclose(at["speedup"].to_numpy(), expected, rtol=1e-9)
                best = max(k for k in range(7) if expected[k] >= max(expected) * (1 - 1e-12))
                assert at.filter(pl.col("best_draft"))["draft_len"].to_list() == [best]
                np.testing.assert_allclose(at["verify_us"].to_numpy(), target, rtol=1e-12)


def test_batch_points_match_batch_analysis(swept, same_trace: Path) -> None:  # type: ignore[no-untyped-def]
    _, rows = swept
    scenario = load_scenario(same_trace, "nvidia-h200", "per_slot", drafter="qwen3-0.6b", context_tokens=256)
    for k in (1, 4, 6):
        reference = batch_analysis(scenario, 0.75, k, [3], max_batches=256)
        point = rows.filter(
            pl.col("record") == "point",
            pl.col("batch") == 3,
            pl.col("engine") == "per_slot",
            pl.col("drafter") == "qwen3-0.6b",
            pl.col("alpha") == 0.75,
            pl.col("draft_len") == k,
        )
        assert point["verify_us"][0] == pytest.approx(reference.verify_us[0], rel=1e-9)
        assert point["draft_us"][0] == pytest.approx(reference.draft_us[0], rel=1e-9)
        assert point["speedup"][0] == pytest.approx(reference.speedup[0], rel=1e-9)
    single = rows.filter(pl.col("record") == "pass", pl.col("batch") == 3, pl.col("engine") == "per_slot", pl.col("n") == 1)
    assert single["time_us"][0] == pytest.approx(batch_analysis(scenario, 0.75, 1, [3], max_batches=256).single_us[0], rel=1e-9)


def test_rows_hold_the_properties_of_the_closed_forms(swept) -> None:  # type: ignore[no-untyped-def]
    _, rows = swept
    points = rows.filter(pl.col("record") == "point")
    assert (points["speedup_low"] <= points["speedup"] * (1 + 1e-12)).all() and (
        points["speedup"] <= points["speedup_high"] * (1 + 1e-12)
    ).all()
    k, a = points["draft_len"].to_numpy(), points["alpha"].to_numpy()
    np.testing.assert_allclose(points["tokens_per_pass"].to_numpy(), [sum(x**i for i in range(j + 1)) for j, x in zip(k, a, strict=True)])
    per_unit = points.filter(pl.col("best_draft")).group_by("batch", "engine", "drafter").agg(pl.col("alpha"), pl.col("draft_len"))
    for alphas, ks in zip(per_unit["alpha"].to_list(), per_unit["draft_len"].to_list(), strict=True):
        assert alphas == sorted(alphas) and len(alphas) == len(ALPHAS)  # one best k per α
        assert ks == sorted(ks)  # the staircase never steps down
    assert points.filter(pl.col("draft_len") == 0)["speedup"].to_list() == [1.0] * (points.height // 7)
    passes = rows.filter(pl.col("record") == "pass")
    assert passes["n"].max() == 10 and set(passes["engine"]) == {"per_slot", "dedup", "dedup_grouped_gemm", "dedup_loop", "best"}
    b1 = passes.filter(pl.col("batch") == 1, pl.col("n") == 1)
    assert b1["byte_share"].to_list() == [1.0] * b1.height  # one token reads K distinct experts
    assert (passes["low_us"] < passes["time_us"]).all() and (passes["time_us"] < passes["high_us"]).all()
    wide = passes.pivot(on="engine", index=["batch", "n"], values="expert_us")
    for family in ("dedup", "dedup_grouped_gemm", "dedup_loop"):
        wins = passes.filter(pl.col("engine") == family).sort("batch", "n")["dedup_wins"].to_list()
        assert wins == (wide.sort("batch", "n")[family] < wide.sort("batch", "n")["per_slot"]).to_list()
    families = ["per_slot", "dedup", "dedup_grouped_gemm", "dedup_loop"]
    assert (wide["best"] == wide.select(pl.min_horizontal(families))["per_slot"]).all()
    assert passes.filter(pl.col("engine") == "per_slot")["bandwidth_ratio"].null_count() == passes.height // 5


def test_uniform_routing_byte_share_follows_the_formula(tmp_path: Path) -> None:
    text = BASE.replace('generator = "sticky"', 'generator = "uniform"').replace("params = { keep_prob = 0.3 }", "")
    text = text.replace("tokens = 300", "tokens = 3000").replace('drafters = ["qwen3-0.6b", "ngram"]', 'drafters = ["ngram"]')
    text = text.replace("batch = [1, 3]", "batch = [1, 8]")
    rows = pl.read_parquet(run_sweep(load_config(write_config(tmp_path, text)), tmp_path / "u.parquet").out)
    for batch in (1, 8):
        passes = rows.filter(pl.col("record") == "pass", pl.col("engine") == "per_slot", pl.col("batch") == batch).sort("n")
        t = passes["n"].to_numpy() * batch
        np.testing.assert_allclose(passes["byte_share"].to_numpy(), 64 * (1 - (58 / 64) ** t) / (6 * t), rtol=0.02)


def test_interrupted_sweep_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, BASE.replace("batch = [1, 3]", "batch = [1, 2, 3, 4]")))
    out = tmp_path / "out.parquet"

    def stop_after_two(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, out, progress=stop_after_two)
    assert not out.exists()
    folder = partial_dir(config, out)
    assert len(list(folder.glob("unit-*.parquet"))) == 2 and not list(folder.glob("*.part"))
    summary = run_sweep(config, out)
    assert summary.resumed == 2 and summary.units == 4 and not folder.exists()
    fresh = run_sweep(config, tmp_path / "fresh.parquet")
    assert out.read_bytes() == fresh.out.read_bytes()


def test_sigint_to_the_command_keeps_finished_units(tmp_path: Path) -> None:
    """A real Ctrl-C (SIGINT to the process group) of `moesim sweep` with two worker processes, then the same command again."""
    text = BASE.replace("workers = 1", "workers = 2").replace("batch = [1, 3]", "batch = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]")
    config_path = write_config(tmp_path, text)
    out = tmp_path / "out.parquet"
    folder = partial_dir(load_config(config_path), out)
    command = [sys.executable, "-m", "moesim", "sweep", str(config_path), "--out", str(out)]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    while not (folder.is_dir() and list(folder.glob("unit-*.parquet"))) and process.poll() is None:  # however loaded the machine
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C on a terminal: the driver and its workers
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    kept = len(list(folder.glob("unit-*.parquet")))
    assert f"interrupted: {kept} of 12 units kept in" in err and "run the same command again to resume" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert 1 <= kept < 12 and not out.exists()
    done = subprocess.run([*command, "--json"], cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert f'"resumed": {kept}' in done.stdout and pl.read_parquet(out).height > 0


def test_ray_executor_gives_the_same_bytes(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'moesim[ray]')")
    config = load_config(write_config(tmp_path, BASE))
    local = run_sweep(config, tmp_path / "local.parquet")
    remote = run_sweep(config, tmp_path / "ray.parquet", executor="ray", workers=2)  # its time: bench/bench_ray_sweep.py
    assert remote.out.read_bytes() == local.out.read_bytes()


SIMULATED = """
[sweep]
workers = 1
[grid]
models = ["deepseek-v2-lite"]
families = ["best"]
drafters = ["qwen3-0.6b"]
alpha = [0.8]
max_draft = 4
max_pass = 6
batch = [1, 4]
context = [128]
policies = [{ name = "static", k = 2 }, { name = "static", k = 4 }, { name = "cascade" }]
[simulate]
alpha = [0.8]
requests = 8
prompt_tokens = 0
output_tokens = 256
[[routing]]
name = "sticky"
generator = "sticky"
params = { keep_prob = 0.3 }
"""


def test_simpy_cells_agree_with_the_closed_form_and_report_their_rate(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Static k with geometric acceptance, no prompt: the simulated speedup must match S(k, α) of the same sweep."""
    code, out, err = cli("sweep", write_config(tmp_path, SIMULATED), "--out", tmp_path / "s.parquet", "--json")
    assert code == 0, err
    summary = json.loads(out)
    rows = pl.read_parquet(tmp_path / "s.parquet")
    cells = rows.filter(pl.col("record") == "simulation")
    assert cells.height == summary["simulation"]["cells"] == 6 and set(cells["policy"]) == {"static k=2", "static k=4", "cascade"}
    assert summary["simulation"]["iterations"] > cells["iterations"].sum() > 0 and summary["simulated_iterations_per_s"] > 0
    for batch in (1, 4):
        for k in (2, 4):
            simulated = cells.filter(pl.col("batch") == batch, pl.col("policy") == f"static k={k}")
            closed = rows.filter(pl.col("record") == "point", pl.col("batch") == batch, pl.col("draft_len") == k)
            assert simulated["speedup"][0] == pytest.approx(closed["speedup"][0], rel=0.03)
            assert simulated["tokens_per_pass"][0] == pytest.approx(closed["tokens_per_pass"][0], rel=0.03)
    code, out, _ = cli("sweep", tmp_path / "sweep.toml", "--out", tmp_path / "s.parquet")
    assert "SimPy cells: 6 policy runs" in out.replace("\n", " ")


CONFIG_ERRORS = [
    ("[grid]\nmodels = ['deepseek-v2-lite']\npolicies = [{name = 'nope'}]", "key 'grid.policies[0].name': unknown"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\n[simulate]\nrequests = 4", "key 'simulate': SimPy settings without grid.policies"),
    (
        "[grid]\nmodels = ['deepseek-v2-lite']\npolicies = [{name = 'cascade'}]\n[simulate]\nalpha = [1.5]",
        "key 'simulate.alpha': must be in [0, 1], got 1.5",
    ),
    ("[grids]\nmodels = ['x']", "key 'grids': unknown section"),
    ("[sweep]\nworkers = 1", "key 'grid' is required"),
    ("[grid]\nmodel = ['deepseek-v2-lite']", "key 'grid.model': unknown key"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\nalpha = [0.5, 1.5]", "key 'grid.alpha': acceptance rates must lie in [0, 1], got 1.5"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\nalpha = {start = 0, stop = 1, num = 0}", "key 'grid.alpha': num must lie in"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\nmax_draft = 64", "key 'grid.max_draft': must be in 0..63, got 64"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\nmax_pass = 0", "key 'grid.max_pass'"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\nbatch = [1, 4, 4]", "key 'grid.batch': lists 4 twice"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\nbatch = 4", "key 'grid.batch': must be a list of"),
    ("[grid]\nmodels = ['no-such-model']", "key 'grid.models': unknown model preset 'no-such-model'"),
    ("[grid]\nmodels = ['qwen3-0.6b']", "key 'grid.models': model 'qwen3-0.6b' has no experts"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\nprofiles = ['no-gpu']", "key 'grid.profiles': unknown hardware profile 'no-gpu'"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\nfamilies = ['dedup_fast']", "key 'grid.families': profile 'nvidia-h200' has no family"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\ndrafters = ['fixed:-3']", "key 'grid.drafters'"),
    ("[sweep]\nexecutor = 'slurm'\n[grid]\nmodels = ['deepseek-v2-lite']", "key 'sweep.executor': unknown executor 'slurm'"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\n[[routing]]\nname = 'x'\ngenerator = 'nope'", "key 'routing[0].generator'"),
    (
        "[grid]\nmodels = ['deepseek-v2-lite']\n[[routing]]\nname = 'x'\ngenerator = 'sticky'\nparams = {keep = 1}",
        "key 'routing[0].params.keep': unknown key",
    ),
    ("[grid]\nmodels = ['deepseek-v2-lite']\n[[routing]]\nname = 'x'", "key 'routing[0].generator': give exactly one"),
    ("[grid]\nmodels = ['deepseek-v2-lite']\n[[routing]]\nname = 'x'\ntrace = 'missing.arrow'", "key 'routing[0].trace': no such trace"),
    (
        "[grid]\nmodels = ['deepseek-v2-lite']\n" + "[[routing]]\nname = 'x'\ngenerator = 'uniform'\n" * 2,
        "key 'routing[1].name': routing 'x' is named twice",
    ),
    ("[grid\nmodels = 1", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "fragment"), CONFIG_ERRORS)
def test_config_errors_name_the_key(cli, tmp_path: Path, text: str, fragment: str) -> None:  # type: ignore[no-untyped-def]
    config = write_config(tmp_path, text)
    code, out, err = cli("sweep", config, "--out", tmp_path / "out.parquet")
    assert_one_line_error(code, err, str(config), fragment)
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.toml"]


def test_trace_routing_checks_model_and_length(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    write_trace(tmp_path / "olmoe.arrow", synthesize(load_preset("olmoe-1b-7b"), Sticky(keep_prob=0.2), 40, 2, 0))
    grid = "[grid]\nmodels = ['deepseek-v2-lite']\nmax_pass = 8\nmax_draft = 4\n"
    config = write_config(tmp_path, grid + "[[routing]]\nname = 'rec'\ntrace = 'olmoe.arrow'\n")
    assert_one_line_error(*cli("sweep", config, "--out", tmp_path / "o.parquet")[::2], "key 'routing[0].trace'", "routes like none")
    grid = "[grid]\nmodels = ['olmoe-1b-7b']\nmax_pass = 8\nmax_draft = 4\nbatch = [1, 8]\n"
    config = write_config(tmp_path, grid + "[[routing]]\nname = 'rec'\ntrace = 'olmoe.arrow'\n")
    assert_one_line_error(
        *cli("sweep", config, "--out", tmp_path / "o.parquet")[::2],
        "key 'routing[0].trace'",
        "too short for a batch of 8 sequences of 8 tokens each",
        "the longest of 40 positions",
    )
    ok = write_config(tmp_path, grid.replace("[1, 8]", "[1, 4]") + "[[routing]]\nname = 'rec'\ntrace = 'olmoe.arrow'\n")
    code, out, err = cli("sweep", ok, "--out", tmp_path / "o.parquet", "--json")
    assert code == 0, err
    assert json.loads(out)["units"] == 2
    rows = pl.read_parquet(tmp_path / "o.parquet")
    assert set(rows["routing"]) == {"rec"} and set(rows["batch"]) == {1, 4} and set(rows["model"]) == {"olmoe-1b-7b"}


def test_files_in_the_grid_are_relative_to_the_config(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "h200.toml").write_bytes((REPO / "moesim" / "hw_profiles" / "profiles" / "nvidia-h200.toml").read_bytes())
    text = "[grid]\nmodels = ['deepseek-v2-lite']\nprofiles = ['h200.toml']\nmax_draft = 2\nmax_pass = 3\nalpha = [0.5]\n"
    code, out, err = cli("sweep", write_config(folder, text), "--out", tmp_path / "o.parquet", "--json")  # run from the repository
    assert code == 0, err
    assert set(pl.read_parquet(tmp_path / "o.parquet")["profile"]) == {str(folder / "h200.toml")}
    assert json.loads(out)["units"] == 1


@pytest.mark.parametrize("path", sorted((REPO / "examples" / "sweeps").glob("*.toml")), ids=lambda p: p.stem)
def test_example_sweeps_load_and_plan(path: Path) -> None:
    config = load_config(path)
    units = plan_units(config)
    assert len(units) == len(config.grid.models) * len(config.routing) * len(config.grid.batch)
    assert points_per_unit(config) * len(units) >= 10_000


def test_the_old_engines_key_still_runs_with_a_note(tmp_path: Path) -> None:
    """grid.engines is grid.families' old name: the same config, one note; both at once is one line."""
    old = tmp_path / "old.toml"
    old.write_text("[grid]\nmodels = ['deepseek-v2-lite']\nengines = ['per_slot', 'best']\n")
    new = tmp_path / "new.toml"
    new.write_text("[grid]\nmodels = ['deepseek-v2-lite']\nfamilies = ['per_slot', 'best']\n")
    config = load_config(old)
    assert config.grid == load_config(new).grid and config.grid.families == ("per_slot", "best")
    assert len(config.notes) == 1 and "grid.engines is now grid.families" in config.notes[0]
    assert load_config(new).notes == ()
    both = tmp_path / "both.toml"
    both.write_text("[grid]\nmodels = ['deepseek-v2-lite']\nengines = ['best']\nfamilies = ['best']\n")
    with pytest.raises(ConfigError, match=r"give 'grid\.families' only"):
        load_config(both)


def test_simpy_cells_at_request_rates_are_open_loops(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`simulate.rates_per_s`: each cell an open loop of Poisson arrivals; below capacity its
    throughput is the arrival rate's tokens (requests arrive over 40 / rate seconds)."""
    text = SIMULATED.replace("batch = [1, 4]", "batch = [4]").replace("requests = 8", "requests = 40\nrates_per_s = [2.0, 5.0]")
    text = text.replace("output_tokens = 256", "output_tokens = 64")
    code, _, err = cli("sweep", write_config(tmp_path, text), "--out", tmp_path / "s.parquet")
    assert code == 0, err
    cells = pl.read_parquet(tmp_path / "s.parquet").filter(pl.col("record") == "simulation")
    assert cells.height == 6 and sorted(set(cells["rate_per_s"])) == [2.0, 5.0]
    for rate in (2.0, 5.0):
        throughput = cells.filter(pl.col("rate_per_s") == rate)["throughput_tok_s"]
        assert ((throughput > 0.85 * rate * 64) & (throughput < 1.05 * rate * 64)).all(), (rate, throughput.to_list())
