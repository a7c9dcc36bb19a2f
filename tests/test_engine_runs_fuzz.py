"""Bad engine outputs for `profile fit-engine`: every corruption of every example output is read
into checked rows or refused with one line naming the file (never another exception), sizes are
checked before reading, and through the command a refusal is exit 2 with nothing written."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line_error

from moesim.errors import MoesimError
from moesim.hw_profiles import engine_runs
from moesim.hw_profiles.engine_runs import RunContext, read_outputs

EXAMPLES = REPO / "examples" / "engine-runs"
FILES = sorted(p for p in EXAMPLES.rglob("*") if p.is_file() and p.suffix != ".py")
CONTEXT = RunContext(model="opt-30b", batch=2, input_len=16, output_len=32, draft_len=3)
NUMBER = re.compile(r"\d+(?:\.\d+)?")
BAD_NUMBERS = ("nan", "-5", "0", "1e400", "abc", "", "-0.0", "99999999999999999999")


def _corruptions(text: str, seed: int) -> list[str]:
    """Truncations, each number in turn replaced by a bad one, lines dropped and doubled, bytes flipped."""
    rng = random.Random(seed)
    out = [text[: int(len(text) * f)] for f in (0.0, 0.1, 0.33, 0.5, 0.9, 0.99)]
    numbers = list(NUMBER.finditer(text))
    for match in rng.sample(numbers, min(12, len(numbers))):
        out.append(text[: match.start()] + rng.choice(BAD_NUMBERS) + text[match.end() :])
    lines = text.splitlines(keepends=True)
    for _ in range(4):
        i = rng.randrange(len(lines))
        out.append("".join(lines[:i] + lines[i + 1 :]))
        out.append("".join(lines[:i] + [lines[i]] * 3 + lines[i + 1 :]))
    chars = list(text)
    for _ in range(4):
        j = rng.randrange(len(chars))
        chars[j] = rng.choice('{}[]",:|=\n\x00')
    out.append("".join(chars))
    return out


def _json_corruptions(text: str) -> list[str]:
    """Each key of a JSON object (or of each line) dropped, or its value made null, a string, negative, a list."""
    try:
        documents = [json.loads(text)]
        lines = False
    except json.JSONDecodeError:
        documents = [json.loads(line) for line in text.splitlines() if line.strip()]
        lines = True
    out = []
    first = documents[0] if isinstance(documents[0], dict) else documents[0][0]
    for key in list(first):
        for value in (None, "x", -1, [], True, math.inf):
            changed = dict(first)
            if value is math.inf:
                changed.pop(key)
            else:
                changed[key] = value
            rest = documents[1:]
            if lines:
                out.append("\n".join(json.dumps(d, allow_nan=True) for d in [changed, *rest]))
            elif isinstance(documents[0], list):
                out.append(json.dumps([changed, *documents[0][1:]]))
            else:
                out.append(json.dumps(changed))
    return out


def _read_or_refuse(path: Path) -> None:
    try:
        rows = read_outputs([str(path)], CONTEXT)
    except MoesimError as exc:
        message = str(exc)
        assert "\n" not in message and path.name in message, message
        return
    for row in (*rows.steps, *rows.runs):
        value = row.value if hasattr(row, "value") else row.spec_value
        assert math.isfinite(value) and value > 0 and row.batch >= 1


@pytest.mark.parametrize("source", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_corruption_is_read_or_refused_in_one_line(source: Path, tmp_path: Path) -> None:
    text = source.read_text()
    cases = _corruptions(text, seed=len(text))
    if source.suffix in (".json", ".jsonl"):
        cases += _json_corruptions(text)
    for i, case in enumerate(cases):
        path = tmp_path / f"case{i}{source.suffix}"
        path.write_text(case)
        _read_or_refuse(path)


def test_binary_and_empty_files_are_refused(tmp_path: Path) -> None:
    binary = tmp_path / "run.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 10)
    with pytest.raises(MoesimError, match="not a text file"):
        read_outputs([str(binary)])
    empty = tmp_path / "empty.log"
    empty.write_text("")
    with pytest.raises(MoesimError, match="unknown engine output"):
        read_outputs([str(empty)])
    with pytest.raises(MoesimError, match="no such file"):
        read_outputs([str(tmp_path / "missing.json")])


def test_sizes_are_checked_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = EXAMPLES / "sglang" / "bench-one-batch.log"
    monkeypatch.setattr(engine_runs, "MAX_FILE_BYTES", 100)
    with pytest.raises(MoesimError, match=r"bench-one-batch.log: \d+ bytes, more than the 100"):
        read_outputs([str(source)])
    monkeypatch.setattr(engine_runs, "MAX_FILE_BYTES", 1 << 26)
    monkeypatch.setattr(engine_runs, "MAX_ROWS", 2)
    with pytest.raises(MoesimError, match="more than 2 rows"):
        read_outputs([str(source)])


@pytest.mark.parametrize(
    ("argument", "fragment"),
    [
        ("@batch=0", "field 'batch' must be an integer >= 1"),
        ("@batch=two", "field 'batch' must be an integer >= 1"),
        ("@colour=red", "unknown run field 'colour'"),
        ("@output_len=1", "output_len"),
    ],
)
def test_bad_annotations_are_one_line(argument: str, fragment: str) -> None:
    with pytest.raises(MoesimError, match=re.escape(fragment)):
        read_outputs([str(EXAMPLES / "vllm" / "serve-c1.json") + argument])


def test_refusals_through_the_command_write_nothing(cli, tmp_path: Path) -> None:
    out, rows = tmp_path / "p.toml", tmp_path / "rows"
    bad = tmp_path / "serve.json"
    record = json.loads((EXAMPLES / "vllm" / "serve-c1.json").read_text())
    record["mean_tpot_ms"] = -3
    bad.write_text(json.dumps(record))
    base = ("profile", "fit-engine", "--profile", "nvidia-h200-vllm", "--model", "opt-30b", "--engine-version", "0.11.0")
    code, _, err = cli(*base, bad, "--out", out, "--rows", rows)
    assert_one_line_error(code, err, "serve.json", "mean_tpot_ms", "-3")
    assert not out.exists() and not rows.exists()
    code, _, err = cli(*base, bad, "--batch", "0", "--out", out)
    assert_one_line_error(code, err, "--batch: must be >= 1, got 0")
    (tmp_path / "rows2").mkdir()
    (tmp_path / "rows2" / "mine.txt").write_text("keep")
    code, _, err = cli(*base, EXAMPLES / "vllm" / "serve-c1.json", "--out", out, "--rows", tmp_path / "rows2")
    assert_one_line_error(code, err, "rows2")
    assert (tmp_path / "rows2" / "mine.txt").read_text() == "keep" and not out.exists()
