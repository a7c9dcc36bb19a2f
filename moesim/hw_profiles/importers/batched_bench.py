"""llama-batched-bench output (llama.cpp `tools/batched-bench`): the markdown table

    |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |

and the jsonl form (one object per row with pp, tg, pl, t_tg, speed_tg, …). Each row's decode
phase is one measurement: `tg` passes of B tokens (one per sequence), time per pass = T_TG / TG
(= B / S_TG), sequence i attending over its prompt and its j-th generated token (the KV read per
pass is summed over the B sequences, also with `-pps`: each sequence reads the shared prompt).
"""

from __future__ import annotations

import json
import re

from moesim.errors import InputError
from moesim.hw_profiles.importers.rows import Measured, decode_scope

_COLUMNS = ("pp", "tg", "b", "n_kv", "t_pp s", "s_pp t/s", "t_tg s", "s_tg t/s", "t s", "s t/s")


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
            try:
                pp, tg, b = int(cells[0]), int(cells[1]), int(cells[2])
                t_tg = float(cells[6])
            except (ValueError, IndexError):
                raise InputError(f"{where}: line {number}: not a row of numbers ({line.strip()[:60]})") from None
            measured.append(_decode(pp, tg, b, t_tg, where, number))
        return measured
    for number, line in enumerate(lines, start=1):
        if not line.strip().startswith("{"):
            continue
        try:
            record = json.loads(line)
            pp, tg, b, t_tg = int(record["pp"]), int(record["tg"]), int(record["pl"]), float(record["t_tg"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{where}: line {number}: not a llama-batched-bench jsonl row ({exc.__class__.__name__})") from None
        measured.append(_decode(pp, tg, b, t_tg, where, number))
    if not measured:
        raise InputError(f"{where}: no llama-batched-bench table (| PP | TG | B | ... | S_TG t/s |) or jsonl rows")
    return measured


def looks_like_batched_bench(text: str) -> bool:
    """Whether the text is llama-batched-bench output."""
    return bool(re.search(r"\|\s*PP\s*\|\s*TG\s*\|\s*B\s*\|", text)) or '"speed_tg"' in text
