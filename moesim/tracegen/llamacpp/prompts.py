"""Prompt files for the recorder and the speculative runner.

A file ending in `.jsonl` holds one JSON object per line with a string field `prompt`; any other
file holds one prompt per line. Blank lines are skipped in both. A bad line is rejected with its
line number before anything runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from moesim.errors import InputError
from moesim.parsing import load_json


@dataclass(frozen=True)
class Prompt:
    """One prompt and the line it came from (1-based)."""

    text: str
    line: int


@dataclass(frozen=True)
class PromptSet:
    """The prompts of a file, with a short description for trace metadata."""

    path: Path
    prompts: tuple[Prompt, ...]
    sha256: str

    def describe(self) -> str:
        """How the prompts were chosen, for `TraceMeta.prompts`."""
        return f"{len(self.prompts)} prompts from {self.path.name} (sha256 {self.sha256[:16]})"


def prompts_from_texts(texts: list[str], name: str) -> PromptSet:
    """A prompt set held in memory (e.g. the demo's), described by `name` and a hash of the texts."""
    data = "\n".join(texts).encode()
    return PromptSet(Path(name), tuple(Prompt(t, i + 1) for i, t in enumerate(texts)), hashlib.sha256(data).hexdigest())


def load_prompts(path: str | Path) -> PromptSet:
    """Read a prompt file (text: one per line; `.jsonl`: field `prompt` per line)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such prompt file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    jsonl = path.suffix.lower() == ".jsonl"
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if jsonl:
            record = load_json(line, f"{path}: line {number}")
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise InputError(f"{path}: line {number}: field 'prompt' is missing or not a non-empty string")
            prompts.append(Prompt(prompt, number))
        else:
            prompts.append(Prompt(line, number))
    if not prompts:
        raise InputError(f"{path}: the file holds no prompts")
    return PromptSet(path, tuple(prompts), hashlib.sha256(data).hexdigest())
