"""Corruptions of moesim's inputs for the fuzz suite (tests/test_input_fuzz.py, bench/fuzz_inputs.py).

Every input kind has a valid document (a parsed TOML or JSON tree, or a table) and the boundary
function moesim reads it with; a hypothesis strategy corrupts the document (a value replaced by
one of another type or an extreme one, a key deleted or added, a value wrapped in a list), the
document is written where the boundary reads it, and `check_boundary` asserts what issue 15
promises: success, or a MoesimError whose message is one line naming the file; no other
exception; nothing in the folder changed; no temporary left.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.ipc as ipc
from hypothesis import strategies as st

from moesim.errors import MoesimError
from moesim.hw_profiles.measurements.table import load_measurements
from moesim.hw_profiles.microbench.plan import read_plan
from moesim.hw_profiles.schema import read_profile
from moesim.models import load_preset
from moesim.sim.serving.config import load_config as load_simulation
from moesim.sim.sweep.config import load_config as load_sweep
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.specrun import read_spec_run
from moesim.tracegen.formats.trace import read_trace, write_trace
from moesim.tracegen.routing.params import load_params
from moesim.tracegen.routing.synth import Uniform, synthesize

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "moesim"
DATA = REPO / "data"

# ---- writing TOML (the test's own: no TOML writer is a dependency) ---------------------------


def _toml_value(value: Any) -> str:
    if type(value) is float and math.isfinite(value):  # most of a profile's values: first, the same text as below
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def to_toml(doc: dict[str, Any], prefix: str = "") -> str:
    """A TOML document for a tree of tables, arrays of tables and values."""
    lines, tables = [], []
    for key, value in doc.items():
        name = f"{prefix}.{json.dumps(str(key))}" if prefix else json.dumps(str(key))
        if isinstance(value, dict):
            tables.append(f"[{name}]\n" + to_toml(value, name))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables += [f"[[{name}]]\n" + to_toml(v, name) for v in value]
        else:
            lines.append(f"{json.dumps(str(key))} = {_toml_value(value)}")
    return "\n".join(lines) + "\n" + "".join(tables)


# ---- corrupting a document ---------------------------------------------------------------

EDGE_INTS = [0, -1, 1, 2, 255, 256, 65535, 65536, 70000, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, -(2**63)]
EDGE_FLOATS = [0.0, -0.0, -1.0, 0.5, 1.0, 1.5, 1e-300, 1e308, -1e308, math.inf, -math.inf, math.nan]


def _scalars(json_like: bool) -> st.SearchStrategy[Any]:
    """Values a user could type: extreme and ordinary numbers, strings, booleans (JSON: null and big ints)."""
    ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**63 - 1))
    options = [ints, st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True), st.text(max_size=6), st.booleans(), st.just("")]
    if json_like:
        options += [st.none(), st.integers(2**64, 2**70)]
    return st.one_of(*options)


def _values(json_like: bool) -> st.SearchStrategy[Any]:
    """A scalar, or a short list or table of them."""
    leaf = _scalars(json_like)
    return st.one_of(leaf, leaf, leaf, st.lists(leaf, max_size=3), st.dictionaries(st.text(min_size=1, max_size=4), leaf, max_size=2))


VALUES = {False: _values(False), True: _values(True)}  # built once: hypothesis validates a strategy on first use
ACTIONS = st.sampled_from(["replace", "replace", "replace", "delete", "add", "wrap"])
NEW_KEYS = st.text(min_size=1, max_size=5)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node[:4]):
            found += _paths(value, (*prefix, i))
    return found


_PATHS: dict[int, tuple[Any, list[tuple[Any, ...]]]] = {}  # id of a valid document → (the document, kept alive; its paths)


def _paths_of_valid(doc: Any) -> list[tuple[Any, ...]]:
    """`_paths` of a valid document, walked once (every example's first corruption starts from it)."""
    if id(doc) not in _PATHS:
        _PATHS[id(doc)] = (doc, _paths(doc))
    return _PATHS[id(doc)][1]


def _shallow(node: Any) -> Any:
    return dict(node) if isinstance(node, dict) else list(node) if isinstance(node, list) else node


@st.composite
def corrupted(draw: st.DrawFn, doc: dict[str, Any], json_like: bool = False) -> dict[str, Any]:
    """`doc` with 1 to 3 corruptions at random places (the tables and lists on the way to each copied,
    the rest shared with `doc`, which stays as it was)."""
    valid, doc = doc, _shallow(doc)
    for i in range(draw(st.integers(1, 3))):
        paths = _paths_of_valid(valid) if i == 0 else _paths(doc)
        if not paths:
            break
        *parents, key = paths[draw(st.integers(0, len(paths) - 1))]
        node = doc
        for part in parents:
            node[part] = _shallow(node[part])
            node = node[part]
        action = draw(ACTIONS)
        if action == "replace":
            node[key] = draw(VALUES[json_like])
        elif action == "delete" and isinstance(node, dict):
            del node[key]
        elif action == "add" and isinstance(node, dict):
            node[draw(NEW_KEYS)] = draw(VALUES[json_like])
        elif action == "wrap":
            node[key] = [node[key]]
    return doc


# ---- the input kinds ---------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """An input kind: its file name, its valid document, how to write a document, the boundary
    that reads it, and a command reading it through the CLI (`{file}`, outputs under `out`)."""

    name: str
    file: str
    doc: Any
    write: Callable[[Path, Any], None]
    read: Callable[[Path], Any]
    command: tuple[str, ...]
    json_like: bool = False


def _write_toml(path: Path, doc: Any) -> None:
    path.write_text(to_toml(doc))


def _write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc, allow_nan=True))


def _meta_of(path: Path) -> dict[str, Any]:
    return json.loads(ipc.open_file(path).schema.metadata[b"moesim.meta"])


def _write_with_meta(source: Path) -> Callable[[Path, Any], None]:
    """Write a copy of the Arrow file `source` with its `moesim.meta` replaced by the document."""
    table = ipc.open_file(source).read_all()

    def write(path: Path, doc: Any) -> None:
        metadata = {**table.schema.metadata, b"moesim.meta": json.dumps(doc, allow_nan=True).encode()}
        with ipc.new_file(path, table.schema.with_metadata(metadata)) as writer:
            writer.write_table(table.replace_schema_metadata(metadata))

    return write


def _write_table(path: Path, doc: Any) -> None:
    (pl.DataFrame(doc, strict=False) if isinstance(doc, dict) else doc).write_parquet(path)


def _table_doc() -> dict[str, Any]:
    frame = pl.read_parquet(DATA / "h200" / "calibration.parquet").head(40)
    return {name: frame[name].to_list() for name in frame.columns}


SIM = tomllib.loads((REPO / "examples" / "sim-selfcheck.toml").read_text())
SWEEP = {
    "sweep": {"workers": 1},
    "grid": {"models": ["olmoe-1b-7b"], "alpha": [0.5], "max_draft": 2, "max_pass": 4},
    "routing": [{"name": "u", "generator": "sticky", "params": {"keep_prob": 0.3}, "tokens": 64, "seqs": 1}],
}
HF = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 1000, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "intermediate_size": 6144, "tie_word_embeddings": False,
}  # fmt: skip
GEOMETRY = TraceGeometry.from_preset(load_preset("olmoe-1b-7b"))
PLANNED = {"model": "qwen3-30b-a3b", "hidden": 2048, "expert_intermediate": 768, "experts": 128, "top_k": 8, "weight_format": "BF16",
           "family": "per_slot", "n_tokens": 4, "distinct_experts": 20, "max_tokens_per_expert": 3, "rung": "fitted",
           "time_share": 0.25}  # fmt: skip
PLAN = {
    "format": "moesim-measurement-plan", "version": 1, "source": "validate held.parquet --profile p.toml", "profile": "p",
    "answer_share": 0.5, "notes": [], "passes": [PLANNED, {**PLANNED, "n_tokens": 1, "distinct_experts": 8, "max_tokens_per_expert": 1}],
}  # fmt: skip


def kinds(folder: Path) -> dict[str, Kind]:
    """Every input kind, its valid inputs written into `folder` where needed."""
    (folder / "out").mkdir(exist_ok=True)  # where the commands write
    trace = folder / "valid.arrow"
    if not trace.exists():
        write_trace(trace, synthesize(load_preset("olmoe-1b-7b"), Uniform(), 24, 2, seed=3))
    spec = DATA / "cpu-validation" / "runs" / "spec-k1.arrow"
    presets = tomllib.loads((PACKAGE / "presets.toml").read_text())
    profile = DATA / "cpu-validation" / "profile.toml"
    synth = ("trace", "synth", "--tokens", "8", "--out", "{out}/t.arrow")
    found = [
        Kind("preset", "p.toml", presets["olmoe-1b-7b"], _write_toml, load_preset, (*synth, "--model", "{file}")),
        Kind("hf-config", "config.json", HF, _write_json, load_preset, (*synth, "--model", "{file}"), json_like=True),
        Kind("trace-meta", "t.arrow", _meta_of(trace), _write_with_meta(trace), read_trace, ("trace", "info", "{file}"), json_like=True),
        Kind(
            "specrun-meta",
            "r.arrow",
            _meta_of(spec),
            _write_with_meta(spec),
            read_spec_run,
            ("validate", "{file}", "--profile", str(profile), "--out", "{out}/v"),
            json_like=True,
        ),
        Kind(
            "generator-params",
            "g.toml",
            tomllib.loads((PACKAGE / "tracegen" / "data" / "esft-vanilla-lite" / "mixture.params.toml").read_text()),
            _write_toml,
            lambda path: load_params(path, GEOMETRY),
            ("trace", "synth", "--model", "olmoe-1b-7b", "--tokens", "8", "--params", "{file}", "--out", "{out}/t.arrow"),
        ),
        Kind(
            "profile",
            "h.toml",
            tomllib.loads((PACKAGE / "hw_profiles" / "profiles" / "nvidia-h200.toml").read_text()),
            _write_toml,
            read_profile,
            ("profile", "show", "{file}"),
        ),
        Kind("measurements", "m.parquet", _table_doc(), _write_table, load_measurements, ("profile", "fit", "{file}", "--out", "{out}/f")),
        Kind("simulation", "s.toml", SIM, _write_toml, load_simulation, ("simulate", "{file}", "--out", "{out}/sim")),
        Kind("sweep", "w.toml", SWEEP, _write_toml, load_sweep, ("sweep", "{file}", "--out", "{out}/w.parquet")),
        Kind("plan", "plan.toml", PLAN, _write_toml, read_plan, ("microbench", "torch", "--plan", "{file}", "--dry-run")),
    ]
    return {kind.name: kind for kind in found}


@st.composite
def corrupted_table(draw: st.DrawFn, doc: dict[str, list[Any]]) -> pl.DataFrame:
    """A measurement table with a cell or a column's type changed, a column dropped, or no rows."""
    columns = {k: list(v) for k, v in doc.items()}
    action = draw(st.sampled_from(["cell", "cell", "cell", "column", "drop", "empty"]))
    name = draw(st.sampled_from(sorted(columns)))
    if action == "cell":
        row = draw(st.integers(0, len(columns[name]) - 1))
        numeric = isinstance(columns[name][0], int | float) and not isinstance(columns[name][0], bool)
        cell = st.one_of(st.sampled_from(EDGE_FLOATS), st.sampled_from(EDGE_INTS[:12]), st.none()) if numeric else st.text(max_size=6)
        columns[name][row] = draw(cell)
    elif action == "column":
        columns[name] = [str(v) for v in columns[name]]
    elif action == "drop":
        del columns[name]
    frame = pl.DataFrame(columns, strict=False)
    return frame.head(0) if action == "empty" else frame


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under `folder`."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def check_boundary(kind: Kind, path: Path, doc: Any) -> str:
    """Write `doc` as `path`, read it through the kind's boundary; returns 'ok' or 'refused' and
    fails the test on any other outcome."""
    kind.write(path, doc)
    before = snapshot(path.parent)
    try:
        kind.read(path)
        outcome = "ok"
    except MoesimError as exc:
        message = str(exc)
        assert "\n" not in message, message
        assert path.name in message, (kind.name, message)
        outcome = "refused"
    assert snapshot(path.parent) == before
    assert not [p for p in path.parent.rglob("*.part")]
    return outcome
