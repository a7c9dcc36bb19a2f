"""The collectives' latency terms, calibrated on the shared all-reduce rows, and their held-out check.

`data/engine-overheads/allreduce.csv` (copied unchanged from the team's shared folder) holds
small-message all-reduce times published in public threads: nccl-tests rows (NCCL) and the
engines' custom all-reduces (vLLM, SGLang, TensorRT-LLM, FlashInfer, FlagGems; some fused with
RMSNorm) on NVLink, PCIe and xGMI. Each row's latency term is what is left of its time once the
bandwidth term of `moesim.sim.cost.parallel` on the device's catalog link is taken off:

    NCCL:    λ = (t − 2(G − 1)/G · S/β) / (2(G − 1))     (a ring step)
    custom:  μ = t − (G − 1) · S/β                        (one shot: small messages)

A source (one thread) is one vote: its rows' median; a fabric's term is the median of its
sources' votes (a fabric without a source of its own takes every source of the algorithm:
`transferred`). Only rows up to CALIBRATION_MAX_BYTES calibrate (a decode or verify pass moves
a few kB to a few hundred kB per all-reduce); larger rows are listed, not fitted (their time is bandwidth, the datasheet term).

Leave one source out: each source's rows predicted from the terms fitted without it; each term's
ε makes a factor (1 + ε)^±1 holding 90 % of those held-out rows (`python -m moesim.sim.validate.collectives` writes
`moesim/hw_profiles/data/collectives.toml`; `docs/validation.md` reports the check).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moesim.atomic import write_text_atomic
from moesim.hw_profiles.catalog import LinkSpec, link_spec
from moesim.hw_profiles.heldout import COVERAGE, ErrorStats
from moesim.hw_profiles.provenance import file_sha256
from moesim.sim.cost.parallel import custom_all_reduce_us, ring_all_reduce_us

ALLREDUCE_TABLE = Path("data/engine-overheads/allreduce.csv")
CALIBRATION_MAX_BYTES = 1 << 20
CUSTOM_MAX_BYTES = 8 << 20  # vLLM's and SGLang's custom all-reduce buffer (larger messages go to NCCL)
FABRICS = ("nvlink", "pcie", "xgmi")
CUSTOM_FABRICS = ("nvlink", "xgmi")  # the engines' custom all-reduce needs peer-to-peer loads (not over PCIe)
# The catalog link whose bandwidth a row's device reaches its peers over.
DEVICE_LINKS = (
    ("mi355x", "xgmi-mi300x"),
    ("gb200", "nvlink5-b200"),
    ("b200", "nvlink5-b200"),
    ("h100", "nvlink4-h100"),
    ("a100", "nvlink3-a100"),
    ("rtx 4090", "pcie4-x16"),
)
_SHAPE = re.compile(r"\[(?:\w+=)?(\d+),\s*(\d+)\]|\((\d+),\s*(\d+)\)|\b(\d+)x(\d+)\b")
_ELEMENTS = re.compile(r"data size (\d+) \(float32")
_PRINTED = re.compile(r"^([\d.]+)\s*([KM]B?)?\b")


@dataclass(frozen=True)
class AllReduceRow:
    """One published all-reduce time: its source, device link, algorithm, devices, message size and time."""

    row: int
    source: str
    link: LinkSpec
    algorithm: str
    devices: int
    message_bytes: float
    time_us: float

    @property
    def fabric(self) -> str:
        """nvlink, pcie or xgmi."""
        return self.link.fabric

    def latency_us(self) -> float:
        """The row's latency term: its time less the bandwidth term (a ring step for NCCL, a shot for custom)."""
        g, volume = self.devices, self.message_bytes / (self.link.bandwidth_gbps * 1e3)
        if self.algorithm == "nccl":
            return max(self.time_us - 2.0 * (g - 1) / g * volume, 0.0) / (2.0 * (g - 1))
        return max(self.time_us - (g - 1) * volume, 0.0)

    def predicted_us(self, latency_us: float) -> float:
        """The row's time from a latency term (`moesim.sim.cost.parallel`'s formulas)."""
        if self.algorithm == "nccl":
            return float(ring_all_reduce_us(self.message_bytes, self.devices, latency_us, self.link.bandwidth_gbps))
        return float(custom_all_reduce_us(self.message_bytes, self.devices, latency_us, self.link.bandwidth_gbps))


def message_bytes(printed: str, notes: str) -> float | None:
    """The message size of a row: its `message_bytes` (a count, '24K', '0.50 MB', 'up to 1KB'), or
    from the tensor in its notes (float32 elements, bf16 [M, N]); None when neither says."""
    text = printed.strip()
    if text.isdigit():
        return float(text)
    if text.startswith("up to "):
        text = text[len("up to ") :]
    sweep = re.match(r"^(\d+) to (\d+)", text)
    if sweep:  # a sweep's range: its largest size bounds the time's bandwidth term
        return float(sweep.group(2))
    match = _PRINTED.match(text)
    if match and match.group(2):
        return float(match.group(1)) * (1 << 10 if match.group(2).startswith("K") else 1 << 20)
    elements = _ELEMENTS.search(notes)
    if elements:
        return 4.0 * int(elements.group(1))
    shape = _SHAPE.search(notes)
    if shape and "bf16" in notes:
        a, b = (int(x) for x in shape.groups() if x is not None)
        return 2.0 * a * b
    return 0.0 if text.startswith("small messages") else None


def device_link(device: str) -> LinkSpec:
    """The catalog link of a row's device."""
    name = device.lower()
    return link_spec(next(key for pattern, key in DEVICE_LINKS if pattern in name))


def read_rows(path: Path = ALLREDUCE_TABLE) -> tuple[list[AllReduceRow], list[tuple[int, str]]]:
    """The calibration rows (message size known, at most CALIBRATION_MAX_BYTES) and the rows left
    out with the reason. `row` counts data rows from 1."""
    rows, left_out = [], []
    with path.open(newline="") as handle:
        for number, record in enumerate(csv.DictReader(handle), start=1):
            size = message_bytes(record["message_bytes"], record["notes"])
            if size is None:
                left_out.append((number, "message size not given"))
                continue
            if size > CALIBRATION_MAX_BYTES:
                left_out.append((number, f"{size / (1 << 20):.1f} MiB: above the latency-bound sizes"))
                continue
            value = float(record["value"]) * (1e3 if record["unit"] == "ms" else 1.0)
            algorithm = "nccl" if "/nccl" in record["source_url"].lower() else "custom"
            rows.append(
                AllReduceRow(number, record["source_url"], device_link(record["device"]), algorithm, int(record["n_gpus"]), size, value)
            )
    return rows, left_out


@dataclass(frozen=True)
class Term:
    """One fabric's latency term of one algorithm: its value and the sources that set it."""

    fabric: str
    algorithm: str
    latency_us: float
    sources: tuple[str, ...]
    transferred: bool


def source_votes(rows: list[AllReduceRow]) -> dict[str, float]:
    """Each source's latency term: the median over its rows."""
    by_source: dict[str, list[float]] = {}
    for r in rows:
        by_source.setdefault(r.source, []).append(r.latency_us())
    return {source: float(np.median(values)) for source, values in by_source.items()}


def fit_term(rows: list[AllReduceRow], fabric: str, algorithm: str) -> Term | None:
    """The median of the sources' votes on this fabric, else (transferred) of every source of the algorithm."""
    own = [r for r in rows if r.algorithm == algorithm and r.fabric == fabric]
    pool = own or [r for r in rows if r.algorithm == algorithm]
    if not pool:
        return None
    votes = source_votes(pool)
    return Term(fabric, algorithm, float(np.median(list(votes.values()))), tuple(votes), not own)


@dataclass(frozen=True)
class HeldOutSource:
    """One source's rows predicted from the terms fitted without it."""

    source: str
    fabric: str
    algorithm: str
    rows: int
    measured_us: tuple[float, float]
    latency_us: float
    transferred: bool
    errors: tuple[float, ...]

    @property
    def median_error(self) -> float:
        """Median |predicted − measured| / measured over its rows."""
        return float(np.median(np.abs(self.errors)))


def leave_one_source_out(rows: list[AllReduceRow]) -> list[HeldOutSource]:
    """Every source held out in turn."""
    out = []
    for source in dict.fromkeys(r.source for r in rows):
        held = [r for r in rows if r.source == source]
        first = held[0]
        term = fit_term([r for r in rows if r.source != source], first.fabric, first.algorithm)
        if term is None:
            continue
        errors = tuple(r.predicted_us(term.latency_us) / r.time_us - 1.0 for r in held)
        measured = (min(r.time_us for r in held), max(r.time_us for r in held))
        out.append(HeldOutSource(source, first.fabric, first.algorithm, len(held), measured, term.latency_us, term.transferred, errors))
    return out


def term_error(held: list[HeldOutSource], algorithm: str) -> ErrorStats:
    """The held-out relative errors of one algorithm's rows, every source held out."""
    return ErrorStats.from_errors(np.array([e for h in held if h.algorithm == algorithm for e in h.errors]))


def factor_epsilon(held: list[HeldOutSource], algorithm: str) -> float:
    """The term's bound as a factor: ε with 90 % of held-out rows within predicted · (1 + ε)^±1,
    exp(p90 |ln(predicted / measured)|) − 1 (errors span several-fold, both ways)."""
    logs = np.abs(np.log1p(np.array([e for h in held if h.algorithm == algorithm for e in h.errors])))
    return float(np.expm1(np.quantile(logs, COVERAGE)))


HEADER = """# The latency terms of each fabric's collectives (moesim.sim.cost.parallel), calibrated on the
# small-message all-reduce rows of data/engine-overheads/allreduce.csv (public threads, copied
# unchanged from the team's shared folder) by `python -m moesim.sim.validate.collectives`: do not
# edit by hand. nccl_step_us: NCCL's latency per ring step; custom_shot_us: the engines' custom
# all-reduce's per shot (0: none on this fabric), up to custom_max_bytes; *_epsilon: the bound as
# a factor, 90 % of the rows within predicted x (1 + eps)^+-1 with each source held out
# (docs/validation.md); *_source: the sources that set the term.
"""


def collectives_toml(path: Path = ALLREDUCE_TABLE) -> str:
    """The shipped collectives table from the all-reduce rows."""
    rows, _ = read_rows(path)
    held = leave_one_source_out(rows)
    sha = file_sha256(path)
    lines = [HEADER]
    for fabric in FABRICS:
        nccl = fit_term(rows, fabric, "nccl")
        custom = fit_term(rows, fabric, "custom") if fabric in CUSTOM_FABRICS else None
        assert nccl is not None
        lines += [
            f"[{fabric}]",
            f"nccl_step_us = {nccl.latency_us:.4f}",
            f"nccl_epsilon = {factor_epsilon(held, 'nccl'):.4f}",
            f'nccl_source = "{_describe(nccl)}"',
            f"custom_shot_us = {custom.latency_us if custom else 0.0:.4f}",
            f"custom_epsilon = {factor_epsilon(held, 'custom') if custom else 0.0:.4f}",
            f'custom_source = "{_describe(custom) if custom else "none: NCCL only (no peer-to-peer loads)"}"',
            f"custom_max_bytes = {float(CUSTOM_MAX_BYTES)}",
            'kind = "calibrated"',
            f'file = "{ALLREDUCE_TABLE.as_posix()}"',
            f'sha256 = "{sha}"',
            "",
        ]
    return "\n".join(lines)


def _describe(term: Term) -> str:
    how = "transferred: the median of every fabric's sources" if term.transferred else "the median of its sources"
    short = ", ".join(s.removeprefix("https://github.com/") for s in term.sources)
    return f"{how} ({short})"


def write_collectives(target: Path = Path("moesim/hw_profiles/data/collectives.toml"), path: Path = ALLREDUCE_TABLE) -> Path:
    """Write the shipped collectives table."""
    write_text_atomic(target, collectives_toml(path))
    return target


def report(path: Path = ALLREDUCE_TABLE) -> str:
    """The held-out check as a markdown table (docs/validation.md)."""
    rows, left_out = read_rows(path)
    held = leave_one_source_out(rows)
    lines = [
        "| source | fabric | algorithm | rows | measured µs | held-out term µs | basis | median abs. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for h in held:
        basis = "transferred" if h.transferred else "same fabric"
        lines.append(
            f"| {h.source.removeprefix('https://github.com/')} | {h.fabric} | {h.algorithm} | {h.rows} | "
            f"{h.measured_us[0]:.1f}-{h.measured_us[1]:.1f} | {h.latency_us:.2f} | {basis} | {100 * h.median_error:.0f} % |"
        )
    for algorithm in ("nccl", "custom"):
        stats = term_error(held, algorithm)
        lines.append(
            f"\n{algorithm}: {stats.rows} held-out rows, median abs. error {100 * stats.median:.0f} %, p90 {100 * stats.p90:.0f} %; "
            f"bound factor 1 + ε = {1 + factor_epsilon(held, algorithm):.2f}"
        )
    lines.append(f"\nrows left out: {len(left_out)} ({'; '.join(f'{n}: {why}' for n, why in left_out)})")
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"wrote {write_collectives()}")
    print(report())
