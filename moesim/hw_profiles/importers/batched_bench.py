"""llama-batched-bench output (llama.cpp `tools/batched-bench`): the markdown table

    |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |

and the jsonl form (one object per row with pp, tg, pl, t_tg, speed_tg, …). Each row's decode
phase is one measurement: `tg` passes of B tokens (one per sequence), time per pass = T_TG / TG
(= B / S_TG), sequence i attending over its prompt and its j-th generated token (the KV read per
pass is summed over the B sequences, also with `-pps`: each sequence reads the shared prompt).
"""

from __future__ import annotations

import re

from moesim.errors import InputError
from moesim.hw_profiles.importers.rows import MAX_TEST_NS, MAX_TOKENS, Measured, decode_scope
from moesim.parsing import load_json, parse_float, parse_int

_COLUMNS = ("pp", "tg", "b", "n_kv", "t_pp s", "s_pp t/s", "t_tg s", "s_tg t/s", "t s", "s t/s")
_FIELDS = (("pp", "prompt"), ("tg", "count"), ("b", "count"), ("t_tg s", "seconds"))  # the columns one measurement reads
_JSONL_FIELDS = (("pp", "prompt"), ("tg", "count"), ("pl", "count"), ("t_tg", "seconds"))


def _cell(value: object, where: str, column: str, kind: str) -> float:
    """A cell, checked: a prompt length (>= 0), a count (>= 1) or a time in seconds (> 0, finite)."""
    what = f"{where}: column '{column}'"
    if kind == "seconds":
        seconds = parse_float(value, what, 0.0, MAX_TEST_NS / 1e9)
        if not seconds > 0:
            raise InputError(f"{what}: must be a positive time in seconds, got {value!r}")
        return seconds
    return parse_int(value, what, 0 if kind == "prompt" else 1, MAX_TOKENS)


def _decode(pp: int, tg: int, sequences: int, t_tg_s: float, where: str, line: int) -> Measured:
    if tg < 1 or sequences < 1 or not t_tg_s > 0:
        raise InputError(f"{where}: line {line}: TG, B and T_TG s must be positive, got {tg}, {sequences}, {t_tg_s}")
    scope = decode_scope(tg, sequences=sequences, prompt_tokens=pp)
    return Measured(
        time_us=t_tg_s * 1e6 / tg,
        scope="pass",
        passes=scope,
        source=where,
        source_row=line,
        time_source="T_TG / TG",
        test=f"batched decode pp{pp} tg{tg} B{sequences}",
    )


def parse_batched_bench(text: str, where: str) -> list[Measured]:
    """Every decode measurement of a markdown or jsonl llama-batched-bench output (model and
    device are the caller's: the tool prints neither)."""
    measured = []
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("|") and "S_TG" in line), None)
    if header_at is not None:
        header = [cell.strip().lower() for cell in lines[header_at].strip().strip("|").split("|")]
        if tuple(header) != _COLUMNS:
            raise InputError(f"{where}: line {header_at + 1}: unknown column layout {'|'.join(header)!r} (expected {'|'.join(_COLUMNS)})")
        for number, line in enumerate(lines[header_at + 2 :], start=header_at + 3):
            if not line.lstrip().startswith("|"):
                continue
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) != len(_COLUMNS):
                raise InputError(f"{where}: line {number}: {len(cells)} cells under a header of {len(_COLUMNS)}")
            values = dict(zip(_COLUMNS, cells, strict=True))
            pp, tg, b, t_tg = (_cell(values[key], f"{where}: line {number}", key, kind) for key, kind in _FIELDS)
            measured.append(_decode(pp, tg, b, t_tg, where, number))
        return measured
    for number, line in enumerate(lines, start=1):
        if not line.strip().startswith("{"):
            continue
        record = load_json(line, f"{where}: line {number}")
        if not isinstance(record, dict) or any(key not in record for key, _ in _JSONL_FIELDS):
            raise InputError(
                f"{where}: line {number}: not a llama-batched-bench jsonl row (needs {', '.join(k for k, _ in _JSONL_FIELDS)})"
            )
        pp, tg, b, t_tg = (_cell(record[key], f"{where}: line {number}", key, kind) for key, kind in _JSONL_FIELDS)
        measured.append(_decode(pp, tg, b, t_tg, where, number))
    if not measured:
        raise InputError(f"{where}: no llama-batched-bench table (| PP | TG | B | ... | S_TG t/s |) or jsonl rows")
    return measured


def looks_like_batched_bench(text: str) -> bool:
    """Whether the text is llama-batched-bench output."""
    return bool(re.search(r"\|\s*PP\s*\|\s*TG\s*\|\s*B\s*\|", text)) or '"speed_tg"' in text
