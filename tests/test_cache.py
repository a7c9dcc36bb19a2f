"""The disk cache (`moesim.cache`) and what goes through it: the step-time model's layer tables
(`moesim.sim.cost.layer_tables`) and a sweep's window features. A cached entry gives the same
bits as building it; a damaged, stale or foreign entry is rebuilt; a folder that cannot be
written costs one warning line and nothing else; the cache can be turned off."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from conftest import make_server

from moesim import cache
from moesim.hw_profiles import builtin, load_profile
from moesim.hw_profiles.families import ExpertFamily
from moesim.kernels.reuse import group_features
from moesim.kernels.unions import batch_lanes, batch_windows
from moesim.models import load_preset
from moesim.sim.cost import layer_tables
from moesim.sim.cost.drafters import make_drafter
from moesim.sim.cost.pass_features import cached_group_features
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.cost.trace_batch import TraceBatchCost
from moesim.sim.serving.acceptance import Geometric
from moesim.sim.serving.policies import Static
from moesim.sim.serving.scheduler import Scheduling
from moesim.sim.serving.workload import Arrivals, TraceWindows, Workload
from moesim.tracegen.routing.synth import Sticky, synthesize

QWEN3 = load_preset("qwen3-30b-a3b")
LAB = load_profile("nvidia-h200")
TRACE = synthesize(QWEN3, Sticky(keep_prob=0.3), 512, 8, 0)
WINDOWS = TraceWindows.from_trace(TRACE, offset_stride=0, window_max=5, source="test")
SHAPES = {"a": ((2, 3), np.dtype(np.float64)), "b": ((4,), np.dtype(np.int64))}


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder, and a process that holds no tables and has warned of nothing."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("MOESIM_CACHE_DIR", str(folder))
    monkeypatch.delenv("MOESIM_CACHE", raising=False)
    forget(monkeypatch)
    monkeypatch.setattr(cache, "_STATE", {"written": 0, "checked": False, "warned": False})
    return folder


def forget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop every table this process holds (as a new worker process starts)."""
    monkeypatch.setattr(layer_tables, "_MEMORY", {})
    monkeypatch.setattr(layer_tables, "_HELD", {"bytes": 0})
    monkeypatch.setattr(layer_tables, "_PRICED", {})


def _arrays() -> dict[str, np.ndarray]:
    return {"a": np.arange(6.0).reshape(2, 3) / 7.0, "b": np.arange(4, dtype=np.int64)}


def test_an_entry_is_read_back_exactly_and_only_under_its_own_key(fresh: Path) -> None:
    entry = cache.group("test", "content", 1.5)
    assert entry is not None and entry.folder.is_relative_to(fresh)
    assert entry.load("x", SHAPES) is None  # a miss
    entry.store("x", _arrays())
    loaded = entry.load("x", SHAPES)
    assert loaded is not None and all(np.array_equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in _arrays().items())
    assert entry.names() == {"x"}
    assert cache.group("test", "content", 1.5) == entry  # the same content, the same key
    other = cache.group("test", "content", 1.5000000000000002)  # one ulp apart: another entry
    assert other is not None and other.key != entry.key and other.load("x", SHAPES) is None
    assert entry.load("x", {**SHAPES, "a": ((3, 2), np.dtype(np.float64))}) is None  # other shapes
    assert entry.load("x", {**SHAPES, "b": ((4,), np.dtype(np.int32))}) is None  # another dtype
    assert entry.load("x", {"a": SHAPES["a"]}) is None  # other arrays


def test_a_damaged_or_foreign_entry_is_ignored(fresh: Path) -> None:
    entry = cache.group("test", "damaged")
    assert entry is not None
    entry.store("x", _arrays())
    path = entry.folder / "x.npz"
    data = bytearray(path.read_bytes())
    at = data.find(_arrays()["a"].tobytes()[8:16])
    assert at > 0
    data[at] ^= 0x01  # one bit of an array flipped: zip's CRC-32 refuses it
    path.write_bytes(bytes(data))
    assert entry.load("x", SHAPES) is None
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert entry.load("x", SHAPES) is None
    path.write_text("not a zip file")
    assert entry.load("x", SHAPES) is None
    elsewhere = cache.group("test", "another")
    assert elsewhere is not None
    elsewhere.store("x", _arrays())
    os.replace(elsewhere.folder / "x.npz", path)  # another key's entry under this name
    assert entry.load("x", SHAPES) is None
    entry.store("x", _arrays())  # rebuilt and overwritten
    assert entry.load("x", SHAPES) is not None


def test_the_cache_can_be_turned_off(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOESIM_CACHE", "off")
    assert cache.group("test", "x") is None
    model = StepTimeModel(QWEN3, LAB, "dedup")
    model.layer_time_table("dedup", 5)
    assert not fresh.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_folder_costs_one_warning(fresh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh.mkdir()
    fresh.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        model = StepTimeModel(QWEN3, LAB, "best")
        for name, n in _pairs(model):
            model.layer_time_table(name, n)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "warning" in err and str(fresh) in err
    finally:
        fresh.chmod(stat.S_IRWXU)
    assert not any(fresh.iterdir())


def test_an_unwritable_cache_path_costs_one_warning(fresh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cache folder that cannot be made (a file stands in its place), as a read-only one for root."""
    fresh.write_text("a file, not a folder")
    model = StepTimeModel(QWEN3, LAB, "best")
    for name, n in _pairs(model):
        model.layer_time_table(name, n)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err and "cannot be written" in err
    assert fresh.read_text() == "a file, not a folder"


def _pairs(model: StepTimeModel) -> list[tuple[str, int]]:
    return [(name, n) for name in model.families for n in (3, 4)]


def test_cached_layer_tables_equal_the_ladders_per_pass_prices(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables a model builds, stores and another process loads hold, bit for bit, what the
    family's ladder prices pass by pass (`fast_time_us`, the path of sizes without tables)."""
    model = StepTimeModel(QWEN3, LAB, "best")
    shape, k = model.expert_shape, QWEN3.top_k
    rng = np.random.default_rng(3)
    for n in (1, 7, 40, 129):
        built = {name: model.layer_time_table(name, n) for name in model.families}
        forget(monkeypatch)
        loaded = StepTimeModel(QWEN3, LAB, "best")
        assert all(n in loaded._family_tables(name).cached_sizes() for name in model.families)
        for name, table in built.items():
            assert np.array_equal(loaded.layer_time_table(name, n), table)
            u = rng.integers(0, QWEN3.experts + 1, 200)
            m = rng.integers(0, n + 1, 200)
            per_pass = LAB.expert_families[name].fast_time_us(np.full(200, float(n * k)), u.astype(float), m.astype(float), shape, k)
            assert np.array_equal(table[u, m], per_pass), (name, n)


def _record(tables_on_disk: bool) -> tuple:
    model = StepTimeModel(QWEN3, LAB, "best")
    if tables_on_disk:  # every size of the run already has tables: each is looked up from its first pass
        assert model.pass_tables.seen[24] == model.pass_tables.after - 1
    cost = TraceBatchCost(model, TRACE, make_drafter("ngram", QWEN3))
    server = make_server(
        cost=cost,
        policy=Static(k=2),
        acceptance=Geometric(alpha=0.7),
        workload=Workload(prompt_tokens=100, output_tokens=40),
        arrivals=Arrivals(concurrency=8),
        max_batch=8,
        requests=24,
        seed=0,
        windows=WINDOWS,
        scheduling=Scheduling(),
    )
    record = server.run()
    return tuple(
        (f.name, getattr(record, f.name).tobytes()) for f in dataclasses.fields(record) if isinstance(getattr(record, f.name), np.ndarray)
    )


def test_cached_tables_give_the_same_simulation_records(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run without the cache, one that builds and stores tables, and one (a new process) that
    loads every table from the disk from its first pass write the same records, bit for bit."""
    monkeypatch.setenv("MOESIM_CACHE", "off")
    uncached = _record(False)
    monkeypatch.delenv("MOESIM_CACHE")
    forget(monkeypatch)
    assert _record(False) == uncached
    assert any(fresh.rglob("*.npz"))
    model = StepTimeModel(QWEN3, LAB, "best")
    for name in model.families:  # every size of the run (decode passes up to 8 · 3 tokens, prefill 100) on disk
        for n in [*range(1, 25), 100]:
            model.layer_time_table(name, n)
    forget(monkeypatch)
    monkeypatch.setattr(ExpertFamily, "time_us", _refuse)  # nothing priced or built: every table read from the disk
    assert _record(True) == uncached


def test_cached_window_features_equal_the_counted_ones(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = batch_lanes(TRACE.seq_starts, 4)
    windows = batch_windows(lanes, 3, 16)
    counted = group_features(TRACE.experts, TRACE.meta.geometry.experts, *windows)
    first = cached_group_features(TRACE, *windows)
    assert any((fresh / "window-features").rglob("*.npz"))
    monkeypatch.setattr("moesim.sim.cost.pass_features.group_features", _refuse)  # the second read must come from the disk
    second = cached_group_features(TRACE, *windows)
    for f in (first, second):
        for name in ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert", "reread_histogram"):
            assert np.array_equal(getattr(f, name), getattr(counted, name)), name
        assert f.chunk_reads is not None and counted.chunk_reads is not None
        assert all(np.array_equal(f.chunk_reads[t], r) for t, r in counted.chunk_reads.items())


def _refuse(*args: object) -> None:
    raise AssertionError("built again instead of read from the cache")


def test_the_cache_stays_within_its_bound(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [cache.group("test", i) for i in range(6)]
    for i, entry in enumerate(entries):
        assert entry is not None
        entry.store("x", _arrays())
        os.utime(entry.folder / "x.npz", (1000.0 + i, 1000.0 + i))
    size = (entries[0].folder / "x.npz").stat().st_size  # type: ignore[union-attr]
    cache.prune(fresh, limit=3 * size)
    kept = [entry.load("x", SHAPES) is not None for entry in entries]  # type: ignore[union-attr]
    assert kept == [False, False, False, True, True, True]  # the oldest removed first


def test_pruning_leaves_files_the_cache_did_not_write(fresh: Path) -> None:
    """A user's own .npz files in a folder given as the cache are never removed, however old."""
    entry = cache.group("test", 0)
    assert entry is not None
    entry.store("x", _arrays())
    mine = fresh / "results" / "run-1" / "mine.npz"
    mine.parent.mkdir(parents=True)
    np.savez(mine, a=np.zeros(1000))
    os.utime(mine, (1.0, 1.0))
    cache.prune(fresh, limit=0)
    assert mine.is_file()
    assert entry.load("x", SHAPES) is None  # the cache's own entry goes


def test_a_profile_file_is_parsed_again_when_it_changes(tmp_path: Path) -> None:
    source = builtin.profiles_dir() / "nvidia-h200-vllm.toml"
    path = tmp_path / "mine.toml"
    path.write_text(source.read_text())
    first = load_profile(path)
    assert load_profile(path) is first  # parsed once per content
    path.write_text(source.read_text().replace('name = "nvidia-h200-vllm"', 'name = "edited"', 1))
    edited = load_profile(path)
    assert edited is not first and edited.name == "edited"
