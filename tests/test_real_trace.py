"""The built-in real trace `esft-vanilla-lite`: loads by name, validates, and every window's distinct
experts equal an independent count from the source table (plain Python and numpy, not moesim's
kernels); the conversion reproduces it; the importer's wide layout, tasks and provenance."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.ipc as ipc
import pytest
from conftest import DATA, assert_one_line_error

from moesim.errors import InputError
from moesim.kernels.windows import window_features
from moesim.models import load_preset
from moesim.tracegen.formats.builtin import resolve_trace
from moesim.tracegen.formats.schema import META_JSON_KEY, SequenceGroup, TraceGeometry
from moesim.tracegen.formats.trace import read_meta, read_trace, write_trace
from moesim.tracegen.importers import import_routing
from moesim.tracegen.routing.synth import Sticky, synthesize

SOURCE = DATA / "routing" / "esft-vanilla-lite"
CSV = SOURCE / "routing_ids.csv.gz"
GEOMETRY = TraceGeometry.from_preset(load_preset("deepseek-v2-lite"))
MAX_PASS = 64


@pytest.fixture(scope="module")
def source_rows() -> dict[tuple[str, int], dict[int, dict[int, list[int]]]]:
    """The CSV read with the standard library: (task, seq) -> pos -> layer -> six ids."""
    rows: dict[tuple[str, int], dict[int, dict[int, list[int]]]] = {}
    with gzip.open(CSV, "rt", newline="") as handle:
        reader = csv.reader(handle)
        assert next(reader) == ["task", "seq", "pos", "layer", "e0", "e1", "e2", "e3", "e4", "e5"]
        for task, seq, pos, layer, *ids in reader:
            rows.setdefault((task, int(seq)), {}).setdefault(int(pos), {})[int(layer)] = [int(i) for i in ids]
    return rows


def _independent_membership(rows: dict[tuple[str, int], dict[int, dict[int, list[int]]]]) -> tuple[np.ndarray, np.ndarray]:
    """Membership (T, 26, 64) in the trace's sequence order (tasks by first appearance, then seq), and sequence starts."""
    tasks = list(dict.fromkeys(task for task, _ in rows))
    order = sorted(rows, key=lambda key: (tasks.index(key[0]), key[1]))
    member, starts = [], [0]
    for key in order:
        positions = rows[key]
        for pos in range(len(positions)):
            token = np.zeros((26, 64), bool)
            for li, layer in enumerate(range(1, 27)):
                token[li, positions[pos][layer]] = True
            member.append(token)
        starts.append(starts[-1] + len(positions))
    return np.stack(member), np.asarray(starts)


def test_builtin_trace_loads_by_name_and_validates(cli) -> None:  # type: ignore[no-untyped-def]
    trace = read_trace("esft-vanilla-lite")  # the reader validates every row (order, layers, ids, no repeats)
    assert (trace.n_seqs, trace.n_tokens) == (160, 16549)
    assert trace.meta.geometry == GEOMETRY
    assert trace.meta.groups == (SequenceGroup("intent", 0, 127), SequenceGroup("law", 127, 33))
    assert trace.meta.provenance["source"] == "github:deepseek-ai/ESFT@18d23501abc867f049f90c0dd7af17efc749c500"
    assert trace.meta.provenance["imported_sha256"] == "4f08c7e90fb679989af7954cc214cf4cc493c0ea69c73c77d96c13e653bd61e5"
    licence = resolve_trace("esft-vanilla-lite").parent / "LICENSE-ESFT-CODE.txt"
    assert licence.read_text() == (SOURCE / "LICENSE-ESFT-CODE.txt").read_text()
    code, out, err = cli("trace", "info", "esft-vanilla-lite")
    assert code == 0, err
    assert "intent (127 sequences), law (33 sequences)" in out and "160 sequences, 16549 tokens" in out
    assert read_meta(Path("some/config/folder/esft-vanilla-lite")) == trace.meta  # a name resolved against a folder still finds it


def test_distinct_experts_of_every_window_equal_an_independent_count_from_the_csv(source_rows) -> None:  # type: ignore[no-untyped-def]
    member, starts = _independent_membership(source_rows)
    trace = read_trace("esft-vanilla-lite")
    assert np.array_equal(trace.seq_starts, starts)
    counted = window_features(trace.experts, trace.seq_starts, GEOMETRY.experts, MAX_PASS).distinct_experts
    tokens = member.shape[0]  # 16,549: the running counts fit 16 bits
    cumulative = np.concatenate([np.zeros((1, 26, 64), np.uint16), np.cumsum(member, axis=0, dtype=np.uint16)])
    first_row = np.repeat(starts[:-1], np.diff(starts))
    rows = np.arange(tokens)
    for n in range(1, MAX_PASS + 1):  # the window of n tokens ending at row r: rows r - n + 1 .. r
        expected = np.zeros((tokens, 26), np.int64)  # rows r < n - 1: no whole window
        inside = rows[n - 1 :] - n + 1 >= first_row[n - 1 :]  # a window never crosses a sequence boundary
        occurs = cumulative[n:] != cumulative[: tokens - n + 1]  # an expert occurs in the window iff its count grew over it
        expected[n - 1 :] = np.where(inside[:, None], np.count_nonzero(occurs, axis=2), 0)
        np.testing.assert_array_equal(counted[:, :, n - 1], expected, err_msg=f"n = {n}")
    # the windows of 8 tokens: 27 distinct experts per layer against 34.9 under uniform routing (the figures)
    eight = counted[counted[:, 0, 7] > 0, :, 7]
    assert eight.mean() == pytest.approx(27.0, abs=0.1)


def test_the_conversion_command_reproduces_the_builtin(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "esft.trace.arrow"
    provenance = SOURCE / "provenance.json"
    code, _, err = cli(
        "trace", "import", CSV, "--model", "deepseek-v2-lite", "--provenance", provenance, "--compress", "zstd", "--out", out
    )
    assert code == 0, err
    shipped, again = read_trace("esft-vanilla-lite"), read_trace(out)
    assert again.meta == shipped.meta
    np.testing.assert_array_equal(again.experts, shipped.experts)
    np.testing.assert_array_equal(again.seq, shipped.seq)
    assert not again.is_prompt.any() and again.weights is None and again.token is None
    assert json.loads(provenance.read_text()).items() <= again.meta.provenance.items()
    # compressed: the file is well under the 16 bytes per row of the plain layout
    assert out.stat().st_size < 0.2 * 16 * 430274


def test_old_readers_see_the_version_1_metadata_unchanged() -> None:
    """Provenance and groups live in keys of their own: `moesim.meta` keeps exactly the keys a
    version-1 reader parses, so an older moesim reads the built-in trace."""
    schema = ipc.open_file(str(resolve_trace("esft-vanilla-lite"))).schema
    meta = json.loads(schema.metadata[META_JSON_KEY])
    assert set(meta) == {"geometry", "engine", "engine_version", "backend", "prompts", "generator", "format_version"}
    assert schema.metadata[b"moesim.format_version"] == b"1"


def _wide_frame(trace) -> pl.DataFrame:  # type: ignore[no-untyped-def]
    """A wide table (one row per token and layer, ids in e0..e5) with two tasks, written with plain loops."""
    rows: dict[str, list[object]] = {"task": [], "seq": [], "pos": [], "layer": []} | {f"e{j}": [] for j in range(6)}
    for t in range(trace.n_tokens):
        s = int(trace.seq[t])
        for li, layer in enumerate(GEOMETRY.moe_layers):
            rows["task"].append("b" if s < 2 else "a")  # task "b" appears first in the file
            rows["seq"].append(s if s < 2 else 10 - s)  # seq ids restart per task, in any order
            rows["pos"].append(int(trace.pos[t]))
            rows["layer"].append(layer)
            for j in range(6):
                rows[f"e{j}"].append(int(trace.experts[t, li, j]))
    return pl.DataFrame(rows)


def test_wide_table_with_tasks_as_gzipped_csv(tmp_path: Path) -> None:
    trace = synthesize(load_preset("deepseek-v2-lite"), Sticky(keep_prob=0.4), 9, 4, seed=2)
    path = tmp_path / "routing.csv.gz"
    frame = _wide_frame(trace)
    with gzip.open(path, "wb") as handle:  # rows in any order after the first (whose task comes first)
        pl.concat([frame.head(1), frame.tail(-1).sample(fraction=1.0, shuffle=True, seed=1)]).write_csv(handle)
    back = import_routing(path, GEOMETRY)  # `.csv.gz` is a table (not Parquet)
    assert back.meta.groups == (SequenceGroup("b", 0, 2), SequenceGroup("a", 2, 2))
    # b: seqs 0, 1 in id order; a: seq ids 7 (from 3) and 8 (from 2) in id order
    expected = np.concatenate([trace.experts[0:18], trace.experts[27:36], trace.experts[18:27]])
    np.testing.assert_array_equal(back.experts, expected)
    assert back.meta.provenance == {"imported_file": "routing.csv.gz", "imported_sha256": back.meta.provenance["imported_sha256"]}
    write_trace(tmp_path / "t.arrow", back, compression="zstd")
    assert read_trace(tmp_path / "t.arrow").meta.groups == back.meta.groups


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda f: f.drop("e5"), "column 'e5' is missing"),
        (lambda f: f.with_columns(pl.col("e0").alias("e6")), "column 'e6' is one id more"),
        (lambda f: f.with_columns(pl.lit(0.5).alias("weight")), "column 'weight' belongs to the long layout"),
        (lambda f: f.with_columns(pl.when(pl.col("pos") == 3).then(64).otherwise(pl.col("e2")).alias("e2")), "field 'e2' is 64"),
        (lambda f: pl.concat([f, f.head(1)]), "(task b seq 0 pos 0, layer 1) appears twice"),
        (lambda f: f.filter(~((pl.col("pos") == 4) & (pl.col("seq") == 1))), "task b seq 1 pos 0: no rows for pos 4"),
        (lambda f: f.with_columns(pl.lit(None, pl.String).alias("task")), "field 'task' is empty"),
    ],
)
def test_wide_table_errors_are_one_line(change, fragment: str, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    trace = synthesize(load_preset("deepseek-v2-lite"), Sticky(keep_prob=0.4), 6, 2, seed=3)
    path = tmp_path / "bad.csv"
    change(_wide_frame(trace)).write_csv(path)
    with pytest.raises(InputError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        import_routing(path, GEOMETRY)
    code, _, err = cli("trace", "import", path, "--model", "deepseek-v2-lite", "--out", tmp_path / "t.arrow")
    assert_one_line_error(code, err, "bad.csv")
    assert not (tmp_path / "t.arrow").exists()


def test_provenance_and_compression_options_fail_in_one_line(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trace = synthesize(load_preset("deepseek-v2-lite"), Sticky(keep_prob=0.4), 6, 2, seed=3)
    table = tmp_path / "t.csv"
    _wide_frame(trace).write_csv(table)
    out = tmp_path / "t.arrow"
    for text, fragment in (("[1, 2]", "one JSON object"), ("{", "not valid JSON")):
        bad = tmp_path / "p.json"
        bad.write_text(text)
        code, _, err = cli("trace", "import", table, "--model", "deepseek-v2-lite", "--provenance", bad, "--out", out)
        assert_one_line_error(code, err, "p.json", fragment)
    code, _, err = cli("trace", "import", table, "--model", "deepseek-v2-lite", "--compress", "gzip", "--out", out)
    assert_one_line_error(code, err, "unknown trace compression 'gzip'", "zstd")
    assert not out.exists()


@pytest.mark.parametrize(
    ("groups", "fragment"),
    [
        ('[{"name": "a", "first_seq": 0, "seqs": 1}]', "covers 1 sequences, the trace has 2"),
        ('[{"name": "a", "first_seq": 1, "seqs": 1}]', "'groups[0].first_seq' is 1, expected 0"),
        ('[{"name": "a", "first_seq": 0, "seqs": 1}, {"name": "a", "first_seq": 1, "seqs": 1}]', "'groups[1].name'"),
        ('[{"name": "a", "first_seq": 0, "seqs": 0}]', "'groups[0].seqs' is 0"),
        ('{"name": "a"}', "must be a list"),
        ('[{"name": "a", "first": 0}]', "must be a list"),
    ],
)
def test_malformed_groups_metadata_is_one_line(groups: str, fragment: str, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    import pyarrow as pa

    good = tmp_path / "good.arrow"
    write_trace(good, synthesize(load_preset("deepseek-v2-lite"), Sticky(keep_prob=0.4), 5, 2, seed=1))
    table = ipc.open_file(str(good)).read_all()
    bad = tmp_path / "bad.arrow"
    with ipc.new_file(str(bad), table.schema.with_metadata({**table.schema.metadata, b"moesim.groups": groups.encode()})) as writer:
        writer.write_table(table)
    assert isinstance(table, pa.Table)
    with pytest.raises(InputError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        read_trace(bad)
    assert_one_line_error(*cli("trace", "info", bad)[::2], "bad.arrow")


def test_synth_like_the_real_trace_with_the_shipped_fit(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "ws.arrow"
    args = ("trace", "synth", "--model", "deepseek-v2-lite", "--params", "esft-vanilla-lite-working-set", "--like", "esft-vanilla-lite")
    code, _, err = cli(*args, "--out", out)
    assert code == 0, err
    synthetic, real = read_trace(out), read_trace("esft-vanilla-lite")
    assert np.array_equal(synthetic.seq_lengths(), real.seq_lengths()) and synthetic.meta.generator["name"] == "working-set"
    assert_one_line_error(*cli(*args, "--tokens", 5, "--out", tmp_path / "x.arrow")[::2], "--like excludes --tokens")
    for extra, fragment in ((("--sequences", "code"), "no sequence group 'code' (known: all, intent, law"),
                            (("--generator", "sticky"), "'sticky' cannot be fitted (fittable: mixture, working-set)")):  # fmt: skip
        code, _, err = cli("trace", "fit", "esft-vanilla-lite", *extra, "--out", tmp_path / "p.toml")
        assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "p.toml").exists() and not (tmp_path / "x.arrow").exists()


def test_the_demo_replays_the_real_trace_and_every_table_names_its_source(demo_run) -> None:  # type: ignore[no-untyped-def]
    assert demo_run.code == 0, demo_run.err
    text = " ".join(demo_run.out.split())  # captions wrap at the terminal's width
    sections = 7  # bytes, tokens per expert, per-slot vs dedup, best draft, recorded, simulated, sweep
    assert text.count("Routing: ") == sections
    assert text.count("Routing: real, recorded from deepseek-ai/ESFT-vanilla-lite on intent (127 sequences) and law (33 sequences)") == 5
    assert "Routing: uniform" in text and "Routing: recorded now through llama.cpp" in text
    copied = read_trace(demo_run.out_dir / "trace.arrow")
    assert copied.meta.provenance == read_meta("esft-vanilla-lite").provenance
    assert (demo_run.out_dir / "LICENSE-ESFT-CODE.txt").read_text() == (SOURCE / "LICENSE-ESFT-CODE.txt").read_text()
