"""`trace synth` streams (issue 15): the generators draw groups of whole sequences (a long one a
few layers at a time) with exactly the ids of one call over the whole trace, and the file is
written in bounded record batches; same seed, same bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow.ipc as ipc
import pytest

from moesim.models import load_preset
from moesim.tracegen.formats import trace as trace_module
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import read_trace
from moesim.tracegen.routing import synth
from moesim.tracegen.routing.synth import Mixture, Sticky, Uniform, WorkingSet, synthesize_layout, synthesize_to

GEOMETRY = TraceGeometry.from_preset(load_preset("olmoe-1b-7b"))
LENGTHS = np.array([7, 130, 1, 45, 300, 12])
STARTS = np.concatenate([[0], np.cumsum(LENGTHS)])
GENERATORS = [Uniform(), Sticky(keep_prob=0.4, zipf_exponent=0.5), Mixture(keep_prob=-0.2, keep_prob_2=0.3), WorkingSet()]


@pytest.mark.parametrize("generator", GENERATORS, ids=lambda g: g.name)
@pytest.mark.parametrize("max_positions", [1, 50, 200, 10_000])
def test_groups_hold_whole_sequences_and_the_ids_of_one_call(generator: object, max_positions: int) -> None:
    whole = generator.generate_layout(GEOMETRY, STARTS, 4)  # type: ignore[attr-defined]
    groups = list(generator.iter_groups(GEOMETRY, STARTS, 4, max_positions))  # type: ignore[attr-defined]
    assert [first for first, _, _ in groups] == [0, *[end for _, end, _ in groups[:-1]]]  # consecutive, from sequence 0
    assert groups[-1][1] == LENGTHS.size
    for first, end, ids in groups:
        assert ids.shape[0] == STARTS[end] - STARTS[first]
        assert end - first == 1 or ids.shape[0] <= max_positions  # over the bound only as one long sequence
    assert np.array_equal(np.concatenate([ids for _, _, ids in groups]), whole)
    assert whole.dtype == np.uint8 and int(whole.max()) < GEOMETRY.experts


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("generator", [Mixture(), WorkingSet()], ids=lambda g: g.name)
def test_streamed_file_is_the_in_memory_trace_in_bounded_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, generator: object
) -> None:
    monkeypatch.setattr(synth, "GROUP_POSITIONS", 64)
    monkeypatch.setattr(trace_module, "MAX_BATCH_ROWS", 16 * 1000)  # batches: whole sequences, 4096 positions (65,536 rows) at most
    lengths = np.array([7, 5000, 3, 130])  # 5000 positions of 16 MoE layers: 80,000 rows, split
    seen: list[tuple[int, int]] = []
    synthesize_to(tmp_path / "a.arrow", GEOMETRY, generator, lengths, 9, lambda done, total: seen.append((done, total)))  # type: ignore[arg-type]
    expected = synthesize_layout(GEOMETRY, generator, lengths, 9)  # type: ignore[arg-type]
    got = read_trace(tmp_path / "a.arrow")
    assert np.array_equal(got.seq, expected.seq) and np.array_equal(got.pos, expected.pos)
    assert np.array_equal(got.experts, expected.experts)
    assert got.meta == expected.meta
    reader = ipc.open_file(tmp_path / "a.arrow")
    rows = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
    assert max(rows) <= trace_module.DEFAULT_BATCH_ROWS < 5000 * 16 and sum(rows) == int(lengths.sum()) * 16
    assert seen[-1] == (int(lengths.sum()), int(lengths.sum())) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    synthesize_to(tmp_path / "b.arrow", GEOMETRY, generator, lengths, 9)  # type: ignore[arg-type]
    assert _sha(tmp_path / "a.arrow") == _sha(tmp_path / "b.arrow")  # same seed, same bytes


def test_trace_synth_same_seed_same_bytes(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    for name in ("a", "b"):
        args = ("trace", "synth", "--model", "olmoe-1b-7b", "--params", "esft-vanilla-lite-working-set", "--tokens", 90, "--seqs", 3)
        assert cli(*args, "--seed", 5, "--out", tmp_path / f"{name}.arrow")[0] == 0
    assert _sha(tmp_path / "a.arrow") == _sha(tmp_path / "b.arrow")
    assert cli("trace", "synth", "--model", "olmoe-1b-7b", "--like", "esft-vanilla-lite", "--out", tmp_path / "like.arrow")[0] == 0
    assert np.array_equal(read_trace(tmp_path / "like.arrow").seq_lengths(), read_trace("esft-vanilla-lite").seq_lengths())
