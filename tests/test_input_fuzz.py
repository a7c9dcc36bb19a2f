"""The fuzz suite of issue 15: hypothesis corrupts every input kind (presets, Hugging Face
config.json, trace and speculative-run metadata, generator parameters, profiles, measurement
tables, simulation and sweep configs). Most cases go through each kind's boundary in-process;
a sample runs through the CLI in-process and a smaller one in processes of their own (the exit
code, stderr and the files a real process leaves; tests/processes.py). Each must succeed, or exit 2
with one line naming the file; never a traceback; no file changed but the declared output; no
temporary left. The counts are deterministic (derandomised: CI replays the same cases);
bench/fuzz_inputs.py runs more, at random."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fuzz_surfaces import (
    ACCEPT_OPTIONS,
    ACCEPTED_RUN,
    BACKEND_OPS,
    BACKEND_OPS_SQL,
    BATCHED_JSONL,
    BATCHED_TABLE,
    BENCHMARK_MOE,
    CACHE_VALUES,
    DEPTH_RATES,
    DRAFTER_SPECS,
    LLAMA_BENCH_CSV,
    LLAMA_BENCH_MD,
    RECORDS,
    SERVING,
    TextKind,
    check_spec,
    check_text,
    corrupted_manifest,
    corrupted_text,
)
from fuzzing import Kind, check_boundary, corrupted, corrupted_table, kinds, snapshot, to_toml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import run_moesim

from moesim.cli import main
from moesim.errors import MoesimError
from moesim.models import load_preset
from moesim.sim.serving.config import load_config as load_simulation

# cases per kind through the boundary in-process (11,400 in all), through the CLI in-process, in subprocesses
QUOTA = {
    "preset": 1800,
    "hf-config": 1800,
    "trace-meta": 1000,
    "specrun-meta": 1000,
    "generator-params": 1200,
    "profile": 1400,
    "measurements": 400,
    "simulation": 1400,
    "sweep": 1000,
    "plan": 400,
}
CLI_QUOTA, SUBPROCESS_QUOTA = 8, 1
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def _strategy(kind: Kind) -> st.SearchStrategy[object]:
    return corrupted_table(kind.doc) if kind.name == "measurements" else corrupted(kind.doc, kind.json_like)


@pytest.mark.parametrize("name", sorted(QUOTA))
def test_corrupted_inputs_are_read_or_refused_in_one_line(tmp_path: Path, name: str) -> None:
    kind = kinds(tmp_path)[name]
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=QUOTA[name])
    @given(doc=_strategy(kind))
    def case(doc: object) -> None:
        outcomes[check_boundary(kind, tmp_path / kind.file, doc)] += 1

    case()
    assert sum(outcomes.values()) >= QUOTA[name]
    assert outcomes["refused"] > QUOTA[name] // 4  # the corruptions reach the checks, not only harmless keys


def _command(kind: Kind, folder: Path) -> list[str]:
    return [part.replace("{file}", str(folder / kind.file)).replace("{out}", str(folder / "out")) for part in kind.command]


def _inputs(files: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {k: v for k, v in files.items() if not k.startswith("out")}


def _check_run(kind: Kind, folder: Path, code: int, err: str, before: dict[str, tuple[int, int]]) -> None:
    assert "Traceback" not in err, err
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip() and "warning" not in line]
        assert len(lines) == 1 and kind.file in lines[0], err
    after, before = _inputs(snapshot(folder)), _inputs(before)
    assert after == before, (kind.name, set(after) ^ set(before))  # only the declared output changed
    assert not list(folder.rglob("*.part")), kind.name


@pytest.mark.parametrize("name", sorted(QUOTA))
def test_corrupted_inputs_through_the_cli(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    kind = kinds(tmp_path)[name]

    @settings(FUZZ, max_examples=CLI_QUOTA)
    @given(doc=_strategy(kind))
    def case(doc: object) -> None:
        kind.write(tmp_path / kind.file, doc)
        before = snapshot(tmp_path)
        capsys.readouterr()
        code = main(_command(kind, tmp_path))
        _check_run(kind, tmp_path, code, capsys.readouterr().err, before)

    case()


@pytest.mark.parametrize("name", sorted(QUOTA))
def test_corrupted_inputs_in_a_subprocess(tmp_path: Path, name: str) -> None:
    kind = kinds(tmp_path)[name]
    env = {**os.environ, "COLUMNS": "200"}

    @settings(FUZZ, max_examples=SUBPROCESS_QUOTA)
    @given(doc=_strategy(kind))
    def case(doc: object) -> None:
        kind.write(tmp_path / kind.file, doc)
        before = snapshot(tmp_path)
        run = run_moesim(_command(kind, tmp_path), env=env)
        _check_run(kind, tmp_path, run.returncode, run.stderr, before)

    case()


# ---- issue 26: the surfaces since 0.1 -------------------------------------------------------------
# Cases per class (derandomised, in-process): each engine importer's output, drafter specs and
# trees, acceptance options, a recorded run's counts, the serving sections, the cache variables,
# output manifests; the counts are in docs/validation.md.

SURFACE_QUOTA = 250


def _import_kinds() -> list[TextKind]:
    from moesim.hw_profiles.importers import ImportOptions, import_table

    def reader(**options: str) -> Callable[[Path], object]:
        return lambda path: import_table(path, None, ImportOptions(**options))

    device = reader(device="RTX 3090")
    batched = reader(device="RTX 3090", model="qwen3-30b-a3b", weight_format="Q4_K_M")
    return [
        TextKind("llama-bench-md", "b.md", LLAMA_BENCH_MD, device),
        TextKind("llama-bench-csv", "b.csv", LLAMA_BENCH_CSV, reader()),
        TextKind("llama-bench-json", "b.json", json.dumps(RECORDS, indent=1), reader()),
        TextKind("llama-bench-jsonl", "b.jsonl", "".join(json.dumps(r) + "\n" for r in RECORDS), reader()),
        TextKind("batched-bench-table", "bb.txt", BATCHED_TABLE, batched),
        TextKind("batched-bench-jsonl", "bb.jsonl", BATCHED_JSONL, batched),
        TextKind("benchmark-moe", "moe.txt", BENCHMARK_MOE, device),
        TextKind("test-backend-ops", "ops.txt", BACKEND_OPS, reader()),
        TextKind("test-backend-ops-sql", "ops.sql", BACKEND_OPS_SQL, reader()),
    ]


IMPORT_KINDS = {kind.name: kind for kind in _import_kinds()}


def _run_cases(strategy: st.SearchStrategy[object], check: Callable[[object], str], quota: int = SURFACE_QUOTA) -> Counter[str]:
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=quota)
    @given(case=strategy)
    def case(case: object) -> None:
        outcomes[check(case)] += 1

    case()
    assert sum(outcomes.values()) >= quota
    return outcomes


@pytest.mark.parametrize("name", sorted(IMPORT_KINDS))
def test_engine_importer_outputs_are_read_or_refused_in_one_line(tmp_path: Path, name: str) -> None:
    kind = IMPORT_KINDS[name]
    assert check_text(kind, tmp_path, kind.text, snapshot) == "ok"  # the valid document is read
    outcomes = _run_cases(corrupted_text(kind.text), lambda text: check_text(kind, tmp_path, text, snapshot))  # type: ignore[arg-type]
    assert outcomes["refused"] > SURFACE_QUOTA // 5 and outcomes["ok"] > 0, outcomes


def test_drafter_specs_and_trees_are_read_or_refused_in_one_line() -> None:
    from moesim.sim.cost.drafters import make_drafter

    target = load_preset("qwen3-30b-a3b")
    specs = st.sampled_from(DRAFTER_SPECS).flatmap(lambda spec: corrupted_text(spec + " "))
    outcomes = _run_cases(specs, lambda spec: check_spec(lambda s: make_drafter(s.strip(), target), spec), 2 * SURFACE_QUOTA)  # type: ignore[arg-type]
    assert outcomes["refused"] > SURFACE_QUOTA // 5 and outcomes["ok"] > 0, outcomes


def test_acceptance_options_are_read_or_refused_in_one_line() -> None:
    from moesim.sim.analysis.speculation import acceptance_points
    from moesim.sim.cost.tree import TreeSpec

    def read(option: tuple[str, str]) -> str:
        which, text = option
        lengths, rates = ([text], []) if which == "length" else ([], [text])
        return check_spec(lambda _: acceptance_points([], lengths, rates, [], TreeSpec()), text)

    options = st.one_of(
        st.sampled_from(ACCEPT_OPTIONS).flatmap(corrupted_text).map(lambda t: ("length", t)),
        st.sampled_from(DEPTH_RATES).flatmap(corrupted_text).map(lambda t: ("rates", t)),
    )
    outcomes = _run_cases(options, read)  # type: ignore[arg-type]
    assert outcomes["refused"] > SURFACE_QUOTA // 5 and outcomes["ok"] > 0, outcomes


def test_recorded_accepted_counts_are_read_or_refused_in_one_line(tmp_path: Path) -> None:
    from moesim.sim.analysis.speculation import recorded_rates

    kind = TextKind("accept-run", "a.csv", ACCEPTED_RUN, lambda path: recorded_rates(str(path)))
    outcomes = _run_cases(corrupted_text(ACCEPTED_RUN), lambda text: check_text(kind, tmp_path, text, snapshot))  # type: ignore[arg-type]
    assert outcomes["refused"] > SURFACE_QUOTA // 5 and outcomes["ok"] > 0, outcomes


def test_serving_sections_are_read_or_refused_in_one_line(tmp_path: Path) -> None:
    kind = Kind("serving", "s.toml", SERVING, lambda path, doc: path.write_text(to_toml(doc)), load_simulation, ())
    assert check_boundary(kind, tmp_path / kind.file, SERVING) == "ok"
    outcomes = _run_cases(corrupted(SERVING), lambda doc: check_boundary(kind, tmp_path / kind.file, doc), 2 * SURFACE_QUOTA)
    assert outcomes["refused"] > SURFACE_QUOTA // 4 and outcomes["ok"] > 0, outcomes


def test_cache_variables_are_read_or_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moesim import cache

    monkeypatch.setenv("MOESIM_CACHE", "on")
    monkeypatch.setenv("MOESIM_CACHE_DIR", str(tmp_path / "c"))

    def check(value: str) -> str:
        monkeypatch.setenv("MOESIM_CACHE_MAX_MB", value.replace("\x00", ""))
        try:
            cache.check_settings()
        except MoesimError as exc:
            assert "\n" not in str(exc) and "MOESIM_CACHE_MAX_MB" in str(exc), str(exc)
            return "refused"
        group = cache.group("fuzz", value)
        assert group is not None
        group.store("a", {"x": np.arange(8.0)})
        assert cache.max_bytes() >= 0
        return "ok"

    values = st.one_of(st.sampled_from(CACHE_VALUES), st.text(max_size=8), st.floats(allow_nan=True).map(str))
    outcomes = _run_cases(values, check)  # type: ignore[arg-type]
    assert outcomes["refused"] > SURFACE_QUOTA // 5 and outcomes["ok"] > 0, outcomes


def test_output_manifests_are_trusted_only_for_their_own_plain_files(tmp_path: Path) -> None:
    from moesim.atomic import MANIFEST, output_dir

    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    out = tmp_path / "out"
    with output_dir(out) as staging:
        (staging / "summary.json").write_text("{}")
    valid = json.loads((out / MANIFEST).read_text())
    right = valid["files"]["summary.json"]

    def check(text: str) -> str:
        (out / MANIFEST).write_text(text.replace('"right"', json.dumps(right)))
        (out / "summary.json").write_text("{}")
        before = snapshot(tmp_path)
        try:
            with output_dir(out) as staging:
                (staging / "summary.json").write_text("{}")
            outcome = "ok"
        except MoesimError as exc:
            assert "\n" not in str(exc) and str(out) in str(exc), str(exc)  # the manifest, or the file it no longer owns
            assert snapshot(tmp_path) == before  # refused touching nothing
            outcome = "refused"
        assert victim.read_text() == "the user's file" and not list(tmp_path.rglob("*.part"))
        assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "summary.json"])
        return outcome

    outcomes = _run_cases(corrupted_manifest(valid), check)  # type: ignore[arg-type]
    assert outcomes["refused"] > SURFACE_QUOTA // 4 and outcomes["ok"] > 0, outcomes
