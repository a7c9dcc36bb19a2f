"""Every input is checked at the boundary (issue 15): each case the issue lists as a traceback, as
bad input accepted, or as a misleading message now gives one line naming the file (or option), the
field and the value, exit code 2, before any work, and writes nothing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pytest
from conftest import DATA, REPO, assert_one_line_error

from moesim.models import load_preset
from moesim.tracegen.formats.specrun import read_spec_run
from moesim.tracegen.formats.trace import write_trace
from moesim.tracegen.routing.synth import Uniform, synthesize

PRESET = (REPO / "moesim" / "presets.toml").read_text().split("[olmoe-1b-7b]\n")[1].split("\n[gpt-oss-20b]")[0]
PRESET = PRESET.replace("[olmoe-1b-7b.attention]", "[attention]")
SIM = (REPO / "examples" / "sim-selfcheck.toml").read_text()
SWEEP = """[sweep]
workers = 1
[grid]
models = ["olmoe-1b-7b"]
alpha = [0.5]
max_draft = 2
max_pass = 4
[[routing]]
name = "u"
generator = "uniform"
tokens = 64
seqs = 1
"""
HF = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 1000, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "intermediate_size": 6144,
}  # fmt: skip
PARAMS = 'format = "moesim-routing-params"\nformat_version = 1\ngenerator = "mixture"\n'
SPECRUN = DATA / "cpu-validation" / "runs" / "spec-k1.arrow"


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _hf(tmp: Path, name: str, **changes: object) -> str:
    return _write(tmp / name / "config.json", json.dumps({**HF, **changes}))


def _remeta(source: Path, target: Path, change: Callable[[dict], None], rows: Callable[[pa.Table], pa.Table] | None = None) -> str:
    """A copy of an Arrow file with its `moesim.meta` JSON (and optionally its rows) changed."""
    table = ipc.open_file(source).read_all()
    metadata = dict(table.schema.metadata)
    meta = json.loads(metadata[b"moesim.meta"])
    change(meta)
    metadata[b"moesim.meta"] = json.dumps(meta).encode()
    table = table.replace_schema_metadata(metadata)
    if rows is not None:
        table = rows(table)
    with ipc.new_file(target, table.schema) as writer:
        writer.write_table(table)
    return str(target)


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with a valid trace and the inputs the cases corrupt; the working folder."""
    monkeypatch.chdir(tmp_path)
    write_trace(tmp_path / "t.arrow", synthesize(load_preset("olmoe-1b-7b"), Uniform(), 64, 2, seed=1))
    return tmp_path


def _preset_case(name: str, old: str, new: str) -> Callable[[Path], tuple[object, ...]]:
    """`trace synth` on a copy of the olmoe preset with `old` replaced by `new`."""
    return lambda d: ("trace", "synth", "--model", _write(d / name, PRESET.replace(old, new)), "--out", "x.arrow")


def _sweep_case(name: str, old: str, new: str) -> Callable[[Path], tuple[object, ...]]:
    """`sweep` on a copy of the small sweep config with `old` replaced by `new`."""
    return lambda d: ("sweep", _write(d / name, SWEEP.replace(old, new)), "--out", "o.parquet")


def _set(d: dict, path: str, value: object) -> None:
    *parents, key = path.split(".")
    for part in parents:
        d = d[part]
    d[key] = value


T = "t.arrow"
BATCH = ("batch", "--trace", T, "--profile", "nvidia-h200", "--alpha", "0.5", "--draft-len", "2")
SYNTH = ("trace", "synth", "--model", "olmoe-1b-7b", "--out", "x.arrow")
CASES: dict[str, tuple[Callable[[Path], tuple[object, ...]], tuple[str, ...]]] = {
    # ---- the 25 tracebacks
    "hf config num_attention_heads 0": (
        lambda d: ("trace", "synth", "--model", _hf(d, "h0", num_attention_heads=0), "--out", "x.arrow"),
        ("h0/config.json", "'num_attention_heads'", "got 0"),
    ),
    "hf config string hidden_size": (
        lambda d: ("trace", "synth", "--model", _hf(d, "h1", hidden_size="2048"), "--out", "x.arrow"),
        ("h1/config.json", "'hidden_size'", "'2048'"),
    ),
    "hf config string first_k_dense_replace": (
        lambda d: ("trace", "synth", "--model", _hf(d, "h2", first_k_dense_replace="1"), "--out", "x.arrow"),
        ("h2/config.json", "'first_k_dense_replace'", "'1'"),
    ),
    "preset with a string number": (
        _preset_case("s.toml", "hidden = 2048", 'hidden = "2048"'),
        ("s.toml", "'hidden'", "'2048'"),
    ),
    "preset with a string float": (
        lambda d: ("trace", "synth", "--model", _write(d / "f.toml", PRESET.replace("= 6.9", '= "6.9"')), "--out", "x.arrow"),
        ("f.toml", "'published_total_params_b'", "'6.9'"),
    ),
    "profile show with a dense --model": (lambda d: ("profile", "show", "nvidia-h200", "--model", "qwen3-0.6b"), ("qwen3-0.6b", "MoE")),
    "--seed -1": (lambda d: (*SYNTH, "--seed", "-1"), ("--seed",)),
    "--seed 2^64": (lambda d: (*SYNTH, "--seed", str(2**64)), ("--seed",)),
    "--seed 2^32 (Numba's generator takes 32 bits)": (lambda d: (*SYNTH, "--seed", str(2**32)), ("--seed",)),
    "string generator parameter in a params file": (
        lambda d: (*SYNTH, "--params", _write(d / "p.toml", PARAMS + '[params]\nkeep_prob = "0.3"\n')),
        ("p.toml", "'params.keep_prob'", "'0.3'"),
    ),
    "string generator parameter in a simulate config": (
        lambda d: (
            "simulate",
            _write(
                d / "sim.toml",
                SIM.replace("[cost]", '[trace]\nsynth = "sticky"\nsynth_params = { keep_prob = "0.3" }\n[cost]')
                + '[target]\nmodel = "olmoe-1b-7b"\n',
            ),
            "--out",
            "simo",
        ),
        ("sim.toml", "'trace.synth_params.keep_prob'", "'0.3'"),
    ),
    "string generator parameter in a sweep config": (
        _sweep_case("sw.toml", 'generator = "uniform"', 'generator = "sticky"\nparams = { keep_prob = "0.3" }'),
        ("sw.toml", "'routing[0].params.keep_prob'", "'0.3'"),
    ),
    "trace synth --tokens 10^9": (lambda d: (*SYNTH, "--tokens", "1000000000"), ("x.arrow", "1000000000 tokens", "of memory needed")),
    "trace synth --seqs 10^7": (lambda d: (*SYNTH, "--seqs", "10000000"), ("x.arrow", "10000000 sequences", "of disk needed")),
    "batch --batch 10^9": (lambda d: (*BATCH, "--batch", "1000000000"), ("too short for a batch of 1000000000",)),
    "preset with 10^8 layers": (
        _preset_case("l.toml", "layers = 16", "layers = 100000000"),
        ("l.toml", "'layers'", "100000000"),
    ),
    "sweep batch = [10^9]": (
        _sweep_case("sb.toml", "max_pass = 4", "max_pass = 4\nbatch = [1000000000]"),
        ("sb.toml", "'grid.batch'", "1000000000"),
    ),
    "sweep routing of 10^9 tokens (beyond memory)": (
        lambda d: ("sweep", _write(d / "sm.toml", SWEEP.replace("tokens = 64", "tokens = 1000000000")), "--out", "o.parquet"),
        ("sm.toml", "'routing[0]'", "batch 1", "of memory needed"),
    ),
    "sweep context = [10^15]": (
        _sweep_case("sc.toml", "max_pass = 4", "max_pass = 4\ncontext = [1000000000000000]"),
        ("sc.toml", "'grid.context'", "1000000000000000"),
    ),
    # ---- bad input accepted with exit 0
    "preset with 70,000 experts": (
        _preset_case("e.toml", "experts = 64", "experts = 70000"),
        ("e.toml", "'experts'", "70000"),
    ),
    "negative hidden in trace metadata": (
        lambda d: ("bytes", _remeta(d / T, d / "h.arrow", lambda m: _set(m, "geometry.hidden", -2048))),
        ("h.arrow", "'geometry.hidden'", "-2048"),
    ),
    "NaN expert bytes in trace metadata": (
        lambda d: ("bytes", _remeta(d / T, d / "n.arrow", lambda m: _set(m, "geometry.expert_bytes", float("nan")))),
        ("n.arrow", "'geometry.expert_bytes'", "nan"),
    ),
    "negative expert bytes in trace metadata": (
        lambda d: ("bytes", _remeta(d / T, d / "b.arrow", lambda m: _set(m, "geometry.expert_bytes", -5.0))),
        ("b.arrow", "'geometry.expert_bytes'", "-5"),
    ),
    "trace whose seq starts at 5": (
        lambda d: (
            "trace",
            "info",
            _remeta(d / T, d / "s5.arrow", lambda m: None, lambda t: t.set_column(0, "seq", pc.cast(pc.add(t["seq"], 5), pa.uint32()))),
        ),
        ("s5.arrow", "'seq'", "is 5, expected 0"),
    ),
    "speculative run with draft_len 0": (
        lambda d: (
            "validate",
            _remeta(SPECRUN, d / "k0.arrow", lambda m: _set(m, "draft_len", 0)),
            "--profile",
            DATA / "cpu-validation" / "profile.toml",
        ),
        ("k0.arrow", "'draft_len'", "got 0"),
    ),
    "speculative run with draft_len -3": (
        lambda d: (
            "validate",
            _remeta(SPECRUN, d / "k3.arrow", lambda m: _set(m, "draft_len", -3)),
            "--profile",
            DATA / "cpu-validation" / "profile.toml",
        ),
        ("k3.arrow", "'draft_len'", "-3"),
    ),
    "speculative run with a string prefill_us": (
        lambda d: (
            "validate",
            _remeta(SPECRUN, d / "ps.arrow", lambda m: m["sequences"][0].update(prefill_us="fast")),
            "--profile",
            DATA / "cpu-validation" / "profile.toml",
        ),
        ("ps.arrow", "'sequences[0].prefill_us'", "'fast'"),
    ),
    "--batch 1,,2": (lambda d: (*BATCH, "--batch", "1,,2"), ("--batch", "'1,,2'")),
    "sweep --workers -1": (lambda d: ("sweep", _write(d / "w.toml", SWEEP), "--out", "o.parquet", "--workers", "-1"), ("--workers",)),
    "params file without its section": (
        lambda d: (*SYNTH, "--params", _write(d / "np.toml", PARAMS)),
        ("np.toml", "'params'", "is required"),
    ),
    'tie_embeddings = "no"': (
        _preset_case("tie.toml", "tie_embeddings = false", 'tie_embeddings = "no"'),
        ("tie.toml", "'tie_embeddings'", "'no'"),
    ),
    "simulate with 10^9 requests": (
        lambda d: ("simulate", _write(d / "r.toml", SIM.replace("requests = 4", "requests = 1000000000")), "--out", "ro"),
        ("r.toml", "'run.requests'", "1000000000"),
    ),
    "simulate with 10^6 requests of 10^6 tokens (beyond memory)": (
        lambda d: (
            "simulate",
            _write(
                d / "rm.toml", SIM.replace("requests = 4", "requests = 1000000").replace("output_tokens = 4000", "output_tokens = 1000000")
            ),
            "--out",
            "ro",
        ),
        ("rm.toml", "'run.requests'", "of memory needed"),
    ),
    # ---- messages
    "unknown weight format in a preset": (
        _preset_case("fmt.toml", 'default_format = "BF16"', 'default_format = "Q9_X"'),
        ("fmt.toml", "'default_format'", "'Q9_X'"),
    ),
    "unknown weight format in trace metadata": (
        lambda d: ("bytes", _remeta(d / T, d / "f.arrow", lambda m: _set(m, "geometry.weight_format", "Q9_X"))),
        ("f.arrow", "'geometry.weight_format'", "'Q9_X'"),
    ),
    "unknown weight format in a sweep grid": (
        _sweep_case("sf.toml", "max_pass = 4", 'max_pass = 4\nweight_format = "Q9_X"'),
        ("sf.toml", "'grid.weight_format'", "'Q9_X'"),
    ),
    "profile fit on a one-row table blames the table": (
        lambda d: (
            pl.read_parquet(DATA / "h200" / "calibration.parquet").head(1).write_parquet(d / "one.parquet"),
            "profile",
            "fit",
            "one.parquet",
            "--out",
            "fitted.toml",
        )[1:],
        ("one.parquet",),
    ),
    "profile derive --bandwidth-scale 1e308 blames the option": (
        lambda d: ("profile", "derive", "nvidia-h200", "--bandwidth-scale", "1e308", "--out", "derived.toml"),
        ("--bandwidth-scale",),
    ),
    "--max-draft 64 says the user's bound (passes of 65 on a trace of 64 positions)": (
        lambda d: ("best-draft", "--trace", T, "--profile", "nvidia-h200", "--alpha", "0.5", "--max-draft", "64"),
        ("--max-draft 64", "65 positions", "has 64"),
    ),
    "--max-draft beyond the largest pass says the user's bound": (
        lambda d: ("best-draft", "--trace", T, "--profile", "nvidia-h200", "--alpha", "0.5", "--max-draft", "5000"),
        ("--max-draft", "0..4095", "got 5000"),
    ),
    "trace fit --max-positions 0 without numpy warnings": (
        lambda d: ("trace", "fit", T, "--out", "fit.toml", "--max-positions", "0"),
        ("--max-positions",),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_listed_case_is_one_line(files: Path, cli, case: str) -> None:  # type: ignore[no-untyped-def]
    make, fragments = CASES[case]
    args = make(files)
    before = {p.name for p in files.rglob("*")}
    code, _, err = cli(*args)
    assert_one_line_error(code, err, *fragments)
    assert {p.name for p in files.rglob("*")} == before  # nothing written, no temporary left
    for wrong in ("fitted.toml", "derived.toml", "got 65"):  # the output blamed, a bound not the user's
        assert wrong not in err


def test_valid_inputs_next_to_the_cases_still_succeed(files: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """The boundary checks refuse only what is wrong: the same inputs without the corruption work."""
    _write(files / "ok.toml", PRESET)
    assert cli("trace", "synth", "--model", "ok.toml", "--out", "x.arrow", "--tokens", "16", "--seed", str(2**32 - 1))[0] == 0
    assert cli("trace", "synth", "--model", _hf(files, "hf"), "--out", "y.arrow", "--tokens", "16")[0] == 0
    _write(files / "p.toml", PARAMS + "[params]\nkeep_prob = [0.1, 0.3]\nseq_dispersion = 2\n")
    assert cli(*SYNTH, "--params", "p.toml", "--tokens", "32")[0] == 0
    assert cli(*BATCH, "--batch", "1,2")[0] == 0
    assert cli("best-draft", "--trace", T, "--profile", "nvidia-h200", "--alpha", "0.5", "--max-draft", "8")[0] == 0
    shutil.copy(SPECRUN, files / "run.arrow")
    assert read_spec_run(files / "run.arrow").meta.draft_len == 1
