"""Safety of the surfaces of issue 26: output manifests that cannot reach outside their folder,
every command's inputs protected by its signature (a walk over the whole CLI), a cache that
prunes only what it wrote, and SIGTERM handled like Ctrl-C (one line, exit 143, nothing
half-written) on simulate, sweep, profile fit and trace synth."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np
import pytest
import typer
from conftest import DATA, REPO, assert_one_line_error
from processes import cpu_seconds

from moesim import cache
from moesim.atomic import MANIFEST, output_files
from moesim.cli import app
from moesim.cli.options import Output, command_paths

SIM = (REPO / "examples" / "sim-selfcheck.toml").read_text()


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, links as their target's name."""
    found = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            found[str(p.relative_to(folder))] = "-> " + os.readlink(p)
        elif p.is_file():
            found[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


# ---- manifests --------------------------------------------------------------------------------


def _simulated(tmp_path: Path, cli) -> Path:  # type: ignore[no-untyped-def]
    (tmp_path / "sim.toml").write_text(SIM)
    out = tmp_path / "run"
    code, _, err = cli("simulate", tmp_path / "sim.toml", "--out", out)
    assert code == 0, err
    return out


def _forge(out: Path, name: str, digest: str | None = None) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"][name] = digest or "0" * 64
    (out / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("entry", ["../victim.txt", "ABSOLUTE", "sub/victim.txt", ".hidden", "victim.tex"])
@pytest.mark.parametrize("command", ["simulate", "validate"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused_touching_nothing(tmp_path: Path, cli, entry: str, command: str) -> None:  # type: ignore[no-untyped-def]
    out = _simulated(tmp_path, cli)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    (out / "sub").mkdir()
    (out / "sub" / "victim.txt").write_text("another")
    (out / "victim.tex").write_text("mine")
    name = str(victim) if entry == "ABSOLUTE" else entry
    _forge(out, name, hashlib.sha256(victim.read_bytes()).hexdigest())
    before = digests(tmp_path)
    if command == "simulate":
        code, _, err = cli("simulate", tmp_path / "sim.toml", "--out", out)
    else:
        profile = DATA / "cpu-validation" / "profile.toml"
        code, _, err = cli("validate", DATA / "cpu-validation" / "runs" / "spec-k1.arrow", "--profile", profile, "--out", out)
    assert_one_line_error(code, err, MANIFEST, "nothing was written")
    assert digests(tmp_path) == before
    # the valid neighbour: the manifest as moesim wrote it
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["files"][name]
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert cli("simulate", tmp_path / "sim.toml", "--out", out)[0] == 0
    assert victim.read_text() == "the user's file" and (out / "sub" / "victim.txt").read_text() == "another"


def test_a_link_or_a_changed_file_in_an_output_folder_is_never_removed(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    out = _simulated(tmp_path, cli)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    (out / "summary.json").unlink()
    (out / "summary.json").symlink_to(victim)  # moesim's name, now a link to the user's file
    before = digests(tmp_path)
    code, _, err = cli("simulate", tmp_path / "sim.toml", "--out", out)
    assert_one_line_error(code, err, "summary.json", "link")
    assert digests(tmp_path) == before
    (out / "summary.json").unlink()
    (out / "summary.json").write_text("edited by the user")
    code, _, err = cli("simulate", tmp_path / "sim.toml", "--out", out)
    assert_one_line_error(code, err, "summary.json", "changed since moesim wrote it")
    assert (out / "summary.json").read_text() == "edited by the user"
    (out / "summary.json").unlink()
    assert cli("simulate", tmp_path / "sim.toml", "--out", out)[0] == 0  # the neighbour: a file removed by the user
    assert victim.read_text() == "the user's file"


def test_a_manifest_of_an_older_format_or_a_link_is_refused(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    out = _simulated(tmp_path, cli)
    (tmp_path / "victim.txt").write_text("mine")
    for manifest in ("old", "link"):
        (out / MANIFEST).unlink()
        if manifest == "old":
            (out / MANIFEST).write_text(json.dumps({"format": "moesim-outputs/1", "files": ["../victim.txt"]}))
        else:
            (out / MANIFEST).symlink_to(tmp_path / "victim.txt")
        before = digests(tmp_path)
        code, _, err = cli("simulate", tmp_path / "sim.toml", "--out", out)
        assert_one_line_error(code, err, MANIFEST)
        assert digests(tmp_path) == before


def test_nested_output_folders_keep_a_manifest_each(tmp_path: Path, demo_run) -> None:  # type: ignore[no-untyped-def]
    assert demo_run.code == 0, demo_run.err
    top = json.loads((demo_run.out_dir / MANIFEST).read_text())
    assert top["folders"] == ["report"] and all("/" not in name for name in top["files"])
    assert "report/index.html" in output_files(demo_run.out_dir)
    for name, digest in top["files"].items():
        assert hashlib.sha256((demo_run.out_dir / name).read_bytes()).hexdigest() == digest


# ---- every command's inputs -------------------------------------------------------------------

READ_ONLY = {"bytes", "predict", "best-draft", "crossover", "batch", "trace info", "profile list", "profile show"}


def _commands(group: typer.Typer, prefix: tuple[str, ...] = ()) -> dict[str, object]:
    """Every command of the CLI by its name, with its callback (the command function)."""
    found = {}
    for info in group.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")  # type: ignore[union-attr]
        found[" ".join((*prefix, name))] = info.callback
    for sub in group.registered_groups:
        found.update(_commands(sub.typer_instance, (*prefix, sub.name)))  # type: ignore[arg-type]
    return found


def _click_command(name: str) -> click.Command:
    command: click.Command = typer.main.get_command(app)
    for part in name.split():
        command = command.commands[part]  # type: ignore[attr-defined]
    return command


def _argv(name: str, inputs: dict[str, Path], out_param: str, out: Path) -> list[str]:
    """A command line of `name` that parses: every required parameter given (paths from `inputs`,
    numbers 1), the output `out`."""
    argv = name.split()
    for param in _click_command(name).params:
        value: object
        if param.name == out_param:
            value = out
        elif param.name in inputs:
            value = inputs[param.name]
        elif param.required:
            value = 1  # a number: every required parameter that is not a path or a string
        else:
            continue
        if param.param_type_name == "argument":
            argv.append(str(value))
        else:
            argv += [param.opts[0], str(value)]
    return argv


WRITERS = sorted(name for name in _commands(app) if command_paths(_commands(app)[name])[1])  # type: ignore[arg-type]


def test_every_command_is_a_writer_or_read_only() -> None:
    """A new command must mark its outputs (OUT_FILE, OUT_DIR) or be listed as read-only here; a
    parameter named like an output that is not marked is a command that forgot."""
    commands = _commands(app)
    assert set(commands) == set(WRITERS) | READ_ONLY, set(commands) ^ (set(WRITERS) | READ_ONLY)
    for name, func in commands.items():
        inputs = command_paths(func)[0]  # type: ignore[arg-type]
        assert not [p for p in inputs if p in ("out", "models_dir") or p.startswith("out_")], name
        assert name in READ_ONLY or inputs or name in ("demo", "microbench torch", "microbench llama-cpp"), name


@pytest.mark.parametrize("name", WRITERS)
def test_every_writing_command_refuses_an_output_that_is_an_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli, name: str) -> None:  # type: ignore[no-untyped-def]
    """For every input of every command that writes: --out equal to it, a link to it, inside a
    folder given as it, or (a folder output) the folder holding it: one line, exit 2, nothing changed."""
    monkeypatch.chdir(tmp_path)
    inputs, outputs = command_paths(_commands(app)[name])  # type: ignore[arg-type]
    out_param, kind = next(iter(outputs.items()))
    assert isinstance(kind, Output)
    given = {p: tmp_path / "in" / f"{p}.input" for p in inputs}
    (tmp_path / "in").mkdir()
    for path in given.values():
        path.write_text("the user's input")
    tried = 0
    for param in inputs:
        if not any(p.name == param for p in _click_command(name).params):
            continue
        link = tmp_path / "link"
        link.symlink_to(given[param])
        folder = tmp_path / "folder-input"
        folder.mkdir()
        (folder / "kept").write_text("x")
        cases = [
            (given, given[param], "is an input"),
            (given, link, "is an input"),
            ({**given, param: folder}, folder / "new.out", "inside"),
        ]
        if kind.folder:
            cases.append((given, tmp_path / "in", "holds"))
        for args, out, fragment in cases:
            before = digests(tmp_path)
            code, _, err = cli(*_argv(name, args, out_param, out))
            assert_one_line_error(code, err, fragment)
            assert digests(tmp_path) == before, (name, param, out)
            tried += 1
        link.unlink()
        shutil.rmtree(folder)
    assert tried or name in ("demo", "microbench torch", "microbench llama-cpp"), name


# ---- the cache --------------------------------------------------------------------------------


def test_cache_pruning_never_removes_a_file_it_did_not_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOESIM_CACHE", "on")
    monkeypatch.setenv("MOESIM_CACHE_DIR", str(tmp_path))
    group = cache.group("tables", "some content")
    assert group is not None
    group.store("a", {"x": np.arange(1000.0)})
    # a user's files where entries would be: a 64-hex folder under a kind folder
    theirs = tmp_path / "tables" / ("ab" * 32)
    theirs.mkdir(parents=True)
    np.savez(theirs / "mine.npz", data=np.arange(10))
    np.savez(theirs / "forged.npz", __key__=np.array("somewhere/else"), data=np.arange(10))
    (theirs / "text.npz").write_text("not even a zip")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.npz"
    np.savez(outside, __key__=np.array(f"{'cd' * 32}/linked"))
    link_folder = tmp_path / "tables" / ("cd" * 32)
    link_folder.mkdir()
    (link_folder / "linked.npz").symlink_to(outside)
    for path in [*theirs.iterdir(), group.folder / "a.npz"]:
        os.utime(path, (1, 1))  # older than everything
    assert [p for p in (group.folder / "a.npz", *theirs.iterdir()) if cache.owned(p)] == [group.folder / "a.npz"]
    cache.prune(tmp_path, limit=0)
    assert not (group.folder / "a.npz").exists()  # the cache's own entry goes
    assert sorted(p.name for p in theirs.iterdir()) == ["forged.npz", "mine.npz", "text.npz"] and outside.exists()
    assert (link_folder / "linked.npz").is_symlink()
    outside.unlink()


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e400", "²", "1" * 500, "ten"])
def test_a_cache_bound_that_is_no_size_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli, value: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MOESIM_CACHE_MAX_MB", value)
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("trace", "synth", "--model", "olmoe-1b-7b", "--tokens", 8, "--out", "t.arrow")
    assert_one_line_error(code, err, "MOESIM_CACHE_MAX_MB", value[:20])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("MOESIM_CACHE_MAX_MB", "0.5")
    assert cli("trace", "synth", "--model", "olmoe-1b-7b", "--tokens", 8, "--out", "t.arrow")[0] == 0


# ---- SIGTERM ----------------------------------------------------------------------------------


def _terminate_after(command: list[str], cwd: Path, cpu_s: float, ready: object = None) -> subprocess.CompletedProcess[str]:
    """Run moesim, send SIGTERM once it has worked `cpu_s` CPU seconds (past its imports: in the
    command, whatever the machine's load) or `ready()` holds; its exit code and output."""
    process = subprocess.Popen(
        [sys.executable, "-m", "moesim", *command], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    while process.poll() is None:  # no wall-clock limit: however loaded the machine
        with_work = cpu_seconds(process.pid) >= cpu_s
        if with_work and (ready is None or ready()):  # type: ignore[operator]
            break
        time.sleep(0.02)
    assert process.poll() is None, "the command ended before it could be terminated: make it longer"
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _assert_terminated(run: subprocess.CompletedProcess[str], folder: Path, before: dict[str, str]) -> None:
    assert run.returncode == 143, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moesim: terminated"), run.stderr
    assert digests(folder) == before  # nothing half-written, no temporary left


def test_sigterm_on_simulate_is_one_line_and_exit_143(tmp_path: Path) -> None:
    (tmp_path / "long.toml").write_text(SIM.replace("requests = 4\n", "requests = 3000\n"))
    before = digests(tmp_path)
    _assert_terminated(_terminate_after(["simulate", "long.toml", "--out", "run"], tmp_path, 4.0), tmp_path, before)


def test_sigterm_on_trace_synth_is_one_line_and_exit_143(tmp_path: Path) -> None:
    before = digests(tmp_path)

    def writing() -> bool:
        return bool(list(tmp_path.glob(".t.arrow.*.part")))

    # 200,000 tokens: one group of positions (synth.GROUP_POSITIONS), ~6 CPU seconds drawn after the
    # writer opens, so the signal lands mid-work; 1,000,000 took a minute to reach the handler
    run = _terminate_after(["trace", "synth", "--model", "deepseek-v3", "--tokens", "200000", "--out", "t.arrow"], tmp_path, 0.0, writing)
    _assert_terminated(run, tmp_path, before)


def test_sigterm_on_profile_fit_is_one_line_and_exit_143(tmp_path: Path) -> None:
    shutil.copy(DATA / "h200" / "calibration.parquet", tmp_path / "m.parquet")
    before = digests(tmp_path)
    _assert_terminated(_terminate_after(["profile", "fit", "m.parquet", "--out", "p.toml"], tmp_path, 3.5), tmp_path, before)
