"""Outputs never destroy what the user has (issue 15): an output that is an input, or a folder
holding one, is refused; output folders are written into (a manifest names moesim's files), a
foreign non-empty folder needs --force and even then keeps the user's files; temporaries of killed
runs are removed; SIGTERM is handled like Ctrl-C; sweep errors leave no partial folder; Numba
without a writable cache compiles in memory with one warning."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import DATA, REPO, assert_one_line_error

from moesim.atomic import MANIFEST, output_files
from moesim.errors import InputError
from moesim.models import load_preset
from moesim.sim.sweep.config import load_config
from moesim.sim.sweep.run import partial_dir, run_sweep
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Uniform, synthesize

SIM = (REPO / "examples" / "sim-selfcheck.toml").read_text()
PRESET = """kind = "moe"
layers = 4
hidden = 64
vocab = 300
experts = 8
top_k = 2
expert_intermediate = 32
[attention]
kind = "gqa"
heads = 4
kv_heads = 2
head_dim = 16
"""
PARAMS = """format = "moesim-routing-params"
format_version = 1
generator = "mixture"
[params]
keep_prob = 0.2
seq_dispersion = 1.0
"""
SWEEP = """[sweep]
workers = 1
[grid]
models = ["olmoe-1b-7b"]
families = ["per_slot", "best"]
alpha = [0.3, 0.6, 0.9]
max_draft = 3
max_pass = 4
batch = [1, 2, 3, 4]
[[routing]]
name = "u"
generator = "uniform"
tokens = 64
seqs = 2
"""


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (temporaries included)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def small_trace(path: Path) -> Path:
    write_trace(path, synthesize(load_preset("olmoe-1b-7b"), Uniform(), 24, 2, seed=1))
    return path


def no_temporaries(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if p.name.endswith((".part", ".partial"))]


# ---- an output that is an input ---------------------------------------------------------------


def _inputs(tmp_path: Path) -> None:
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "sim.toml").write_text(SIM)
    (tmp_path / "exp" / "thesis.tex").write_text("my thesis")
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "s.parquet").write_bytes(b"PAR1 a sweep result")
    (tmp_path / "tiny.toml").write_text(PRESET)
    (tmp_path / "p.toml").write_text(PARAMS)
    small_trace(tmp_path / "t.arrow")
    shutil.copy(DATA / "h200" / "calibration.parquet", tmp_path / "m.parquet")
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "s.toml").write_text(SWEEP)
    (tmp_path / "r.csv").write_text("seq,token,layer,slot,expert\n0,0,0,0,1\n")


INPUT_AS_OUTPUT = [
    (("simulate", "exp/sim.toml", "--out", "exp"), "holds sim.toml, an input"),
    (("simulate", "exp/sim.toml", "--out", "exp", "--force"), "holds sim.toml, an input"),
    (("report", "res/s.parquet", "--out", "res"), "holds s.parquet, an input"),
    (("trace", "synth", "--model", "tiny.toml", "--out", "tiny.toml"), "is an input"),
    (("trace", "synth", "--model", "olmoe-1b-7b", "--params", "p.toml", "--out", "p.toml"), "is an input"),
    (("trace", "fit", "t.arrow", "--out", "t.arrow"), "is an input"),
    (("profile", "fit", "m.parquet", "--out", "m.parquet"), "is an input"),
    (("sweep", "sw/s.toml", "--out", "sw/s.toml"), "is an input"),
    (("trace", "import", "r.csv", "--model", "olmoe-1b-7b", "--out", "r.csv"), "is an input"),
    (("trace", "synth", "--model", "tiny.toml", "--out", "link.toml"), "is an input"),  # a symbolic link to the input
    (("simulate", "sim.toml", "--out", "."), "holds sim.toml, an input"),
]


@pytest.mark.parametrize(("args", "fragment"), INPUT_AS_OUTPUT, ids=[" ".join(a) for a, _ in INPUT_AS_OUTPUT])
def test_an_output_that_is_an_input_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli, args, fragment) -> None:  # type: ignore[no-untyped-def]
    _inputs(tmp_path)
    (tmp_path / "link.toml").symlink_to(tmp_path / "tiny.toml")
    (tmp_path / "sim.toml").write_text(SIM)
    before = digests(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, _out, err = cli(*args)
    assert_one_line_error(code, err, fragment)
    assert digests(tmp_path) == before  # nothing changed, nothing left behind
    assert (tmp_path / "link.toml").is_symlink()


# ---- output folders -----------------------------------------------------------------------------


def test_an_output_folder_is_written_into_and_keeps_the_users_files(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "sim.toml"
    config.write_text(SIM)
    out = tmp_path / "run"
    code, _, err = cli("simulate", config, "--out", out)
    assert code == 0, err
    written = output_files(out)
    assert {"requests.arrow", "iterations.arrow", "summary.json"} <= set(written)
    assert sorted(json.loads((out / MANIFEST).read_text())["files"]) == written
    (out / "notes.txt").write_text("mine")  # the user adds a file beside moesim's
    first = digests(out)
    code, _, err = cli("simulate", config, "--out", out)  # moesim's own folder: no --force needed
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine" and digests(out) == first  # same seed, same bytes; the note kept
    assert no_temporaries(tmp_path)


def test_a_foreign_folder_needs_force_and_keeps_every_user_file(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "sim.toml"
    config.write_text(SIM)
    out = tmp_path / "papers"
    out.mkdir()
    (out / "thesis.tex").write_text("chapter 1")
    code, _, err = cli("simulate", config, "--out", out)
    assert_one_line_error(code, err, str(out), "moesim did not write", "thesis.tex", "--force")
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    code, _, err = cli("simulate", config, "--out", out, "--force")
    assert code == 0, err
    assert (out / "thesis.tex").read_text() == "chapter 1" and "thesis.tex" not in output_files(out)
    (out / "summary.json").unlink()
    (out / "summary.json").write_text("the user's own summary")  # a user file where moesim writes one
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["files"]["summary.json"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    before = digests(out)
    code, _, err = cli("simulate", config, "--out", out, "--force")
    assert_one_line_error(code, err, "summary.json", "moesim did not write")
    assert digests(out) == before and no_temporaries(tmp_path)


def test_a_study_replaces_only_moesims_stale_files(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run.toml"
    run.write_text(SIM)
    study = tmp_path / "study.toml"
    study.write_text((REPO / "examples" / "cascade-table-study.toml").read_text())
    out = tmp_path / "out"
    assert cli("simulate", run, "--out", out)[0] == 0
    (out / "keep.md").write_text("mine")
    code, _, err = cli("simulate", study, "--out", out)
    assert code == 0, err
    assert set(output_files(out)) == {"study.arrow", "study.csv", "config.toml"}  # the run's files were moesim's: removed
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "keep.md", "study.arrow", "study.csv", "config.toml"])


@pytest.mark.parametrize("out", ["/proc/moesim-x.arrow", "/sys/moesim-x.arrow", "x" * 300 + ".arrow"])
def test_unwritable_output_paths_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli, out: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("trace", "synth", "--model", "olmoe-1b-7b", "--tokens", 8, "--out", out)
    assert_one_line_error(code, err, out[:40])
    folder = out.replace(".arrow", "")
    code, _, err = cli("simulate", REPO / "examples" / "sim-selfcheck.toml", "--out", folder)
    assert_one_line_error(code, err, folder[:40])
    assert list(tmp_path.iterdir()) == []


# ---- temporaries ----------------------------------------------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_of_a_killed_run_are_removed(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    dead, alive = _dead_pid(), os.getpid()
    stale = [tmp_path / f".t.arrow.{dead}.part", tmp_path / f".t.arrow.{dead}.k3j2.part", tmp_path / f".p.toml.{dead}.x1.part"]
    live = tmp_path / f".t.arrow.{alive}.zz.part"
    other = tmp_path / ".unrelated.part"
    for path in [*stale, live, other]:
        path.write_bytes(b"half a file")
    assert cli("trace", "synth", "--model", "olmoe-1b-7b", "--tokens", 8, "--out", tmp_path / "t.arrow")[0] == 0
    assert not stale[0].exists() and not stale[1].exists()
    assert stale[2].exists() and live.exists() and other.exists()  # another target's, a running process's, not ours


def test_outputs_get_the_permissions_open_would_give(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """Atomic writes go through a private temporary; the file renamed into place is not left 0600."""
    mask = os.umask(0o027)
    try:
        assert cli("trace", "synth", "--model", "olmoe-1b-7b", "--tokens", 8, "--out", tmp_path / "t.arrow")[0] == 0
        assert cli("profile", "derive", "nvidia-h200", "--bandwidth-scale", 2, "--out", tmp_path / "p.toml")[0] == 0
    finally:
        os.umask(mask)
    for name in ("t.arrow", "p.toml"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name


def test_a_sweep_error_leaves_no_partial_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_path = tmp_path / "s.toml"
    config_path.write_text(SWEEP)
    config = load_config(config_path)
    calls = []

    def failing(cfg, unit):  # type: ignore[no-untyped-def]
        calls.append(unit)
        if len(calls) == 2:
            raise InputError("a unit failed")
        return real(cfg, unit)

    import moesim.sim.sweep.run as run_module

    real = run_module.compute_unit
    monkeypatch.setattr(run_module, "compute_unit", failing)
    with pytest.raises(InputError, match="a unit failed"):
        run_sweep(config, tmp_path / "o.parquet")
    assert not partial_dir(config, tmp_path / "o.parquet").exists() and not (tmp_path / "o.parquet").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


def test_sigterm_stops_a_sweep_like_ctrl_c_and_the_rerun_gives_the_same_bytes(tmp_path: Path) -> None:
    config_path = tmp_path / "s.toml"
    config_path.write_text(SWEEP.replace("batch = [1, 2, 3, 4]", "batch = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]"))
    out = tmp_path / "o.parquet"
    folder = partial_dir(load_config(config_path), out)
    command = [sys.executable, "-m", "moesim", "sweep", str(config_path), "--out", str(out)]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (folder.is_dir() and list(folder.glob("unit-*.parquet"))) and process.poll() is None:  # however loaded the machine
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    kept = len(list(folder.glob("unit-*.parquet")))
    assert err.startswith(f"moesim: terminated: {kept} of 16 units kept in") and len(err.strip().splitlines()) == 1, err
    assert 1 <= kept < 16 and not out.exists() and not list(tmp_path.rglob("*.part"))
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    fresh = run_sweep(load_config(config_path), tmp_path / "fresh.parquet")
    assert out.read_bytes() == fresh.out.read_bytes() and not folder.exists()


INTERRUPTED_AT_CREATION = """
import os, signal, sys, tempfile
from pathlib import Path
from moesim import atomic
from moesim.errors import Terminated, interrupt_code

def terminate(signum, frame):
    raise Terminated  # as the CLI does

signal.signal(signal.SIGTERM, terminate)
folder, sent, what = Path(sys.argv[1]), getattr(signal, sys.argv[2]), sys.argv[3]
made = {"mkstemp": tempfile.mkstemp, "mkdtemp": tempfile.mkdtemp}

def interrupted(name):
    def make(*args, **kwargs):
        result = made[name](*args, **kwargs)
        os.kill(os.getpid(), sent)  # the interrupt the moment the temporary exists
        return result
    return make

tempfile.mkstemp, tempfile.mkdtemp = interrupted("mkstemp"), interrupted("mkdtemp")
try:
    if what == "file":
        atomic.write_text_atomic(folder / "out.txt", "x")
    else:
        with atomic.output_dir(folder / "out") as staging:
            (staging / "a.txt").write_text("x")
except KeyboardInterrupt as exc:
    sys.exit(interrupt_code(exc))
"""


@pytest.mark.parametrize("what", ["file", "folder"])
@pytest.mark.parametrize(("sent", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_as_a_temporary_is_made_leaves_nothing_behind(tmp_path: Path, what: str, sent: str, code: int) -> None:
    """SIGINT or SIGTERM the moment `atomic_path`'s temporary file or `output_dir`'s staging folder
    exists: held until the block that removes it has begun, so the run stops and leaves nothing."""
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_AT_CREATION, str(tmp_path), sent, what], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == code, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_numba_without_a_writable_cache_compiles_in_memory_with_one_warning(tmp_path: Path) -> None:
    """A read-only copy of the package, no writable HOME, no NUMBA_CACHE_DIR: `trace synth` still works."""
    root = os.geteuid() == 0  # root writes anywhere: run as nobody, for whom the copy is read-only
    if root and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only install cannot be made")
    base = Path(tempfile.mkdtemp(prefix="moesim-ro-")) if root else tmp_path  # pytest's folders are private to root
    try:
        install, work, home = base / "install", base / "work", base / "home"
        shutil.copytree(REPO / "moesim", install / "moesim", ignore=shutil.ignore_patterns("__pycache__"))
        work.mkdir()
        home.mkdir()
        for path in [install, *install.rglob("*"), home]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        work.chmod(0o777)
        base.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
        env.update(HOME=str(home), XDG_CACHE_HOME=str(home), PYTHONPATH=str(install))
        code = (
            "import sys, moesim.cli; assert moesim.cli.__file__.startswith(sys.argv[1]), moesim.cli.__file__; "
            "sys.exit(moesim.cli.main(['trace', 'synth', '--model', 'olmoe-1b-7b', '--tokens', '16', '--out', 't.arrow']))"
        )
        command = [sys.executable, "-c", code, str(install)]
        if root:
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        result = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "no writable Numba cache" in lines[0], result.stderr
        assert (work / "t.arrow").stat().st_size > 0 and not list(install.rglob("*.nbi"))
    finally:
        for path in [base, *base.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        if root:
            shutil.rmtree(base)
