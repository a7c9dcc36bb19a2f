"""`moesim profile fit` on a benchmark's output: a user's own run becomes a profile of that device and build.

    llama-bench -m MODEL.gguf -p 512 -n 0 -ub 1,2,3,4,5,6,7,8,12,16,32 -o csv > bench.csv
    moesim profile fit bench.csv --out my-gpu.toml

The output is imported (`moesim.hw_profiles.importers`: llama-bench in any of its forms,
llama-batched-bench, benchmark_moe.py), the device looked up in the catalog (its datasheet gives
the roofline and the device class the dispatch depends on), the engine named by the output's
backend, and the whole passes fitted (`engine_fit`): one model, so the held-out error leaves one
pass size out. The per-slot kernel's limit is learned from the data's cliff: every limit from 0 to
the sizes measured is tried (the family of each pass size follows it) and the one whose fit
leaves the smallest residual is kept; the engine source's limit for the newest build is the
prior, kept when no other limit fits better by more than `LEARN_MARGIN`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles.catalog import catalog, lookup_device
from moesim.hw_profiles.dispatch import Dispatch, DispatchRule
from moesim.hw_profiles.engines import ENGINES, Engine
from moesim.hw_profiles.families import Roofline
from moesim.hw_profiles.fitting.engine_builtins import _assumed_dense, device_facts, used_sources
from moesim.hw_profiles.fitting.engine_fit import EngineFit, ProfileFrame, fit_coefficients, fit_engine, predict_rows
from moesim.hw_profiles.fitting.whole_pass import PassRow, pass_rows
from moesim.hw_profiles.importers import ImportOptions, import_table
from moesim.hw_profiles.provenance import FittedRow, Provenance, file_sha256

LEARN_MARGIN = 0.1
# Catalog architectures -> the device classes of llama.cpp's CUDA dispatch.
CUDA_CLASS = {"pascal": "pascal", "ampere": "turing-ampere", "turing": "turing-ampere", "rdna3": "rdna3", "cdna": "cdna"}
ENGINE_OF_BACKEND = {"cuda": "llama.cpp CUDA", "rocm": "llama.cpp CUDA", "vulkan": "llama.cpp Vulkan", "metal": "llama.cpp Metal"}


@dataclass(frozen=True)
class BenchFit:
    """The fit, the per-slot limit it learned and the one the engine's source gives."""

    fit: EngineFit
    table_format: str
    learned_limit: int | None
    source_limit: int | None


def _engine_of(frame: pl.DataFrame, engine: str | None, origin: str) -> Engine:
    if engine:
        return ENGINES.create(engine)
    label = str(frame["engine"][0])
    backend = label.split()[-1].lower() if label else ""
    if backend not in ENGINE_OF_BACKEND:
        raise InputError(f"{origin}: cannot tell the engine from backend {label!r}: give --engine ({', '.join(ENGINES.names())})")
    return ENGINES.create(ENGINE_OF_BACKEND[backend])


def _per_slot_limit(dispatch: Dispatch, fmt: str) -> int | None:
    for rule in dispatch.rules:
        if rule.family == "per_slot" and fmt in rule.formats and rule.max_tokens:
            return rule.max_tokens
    return None


def with_limit(dispatch: Dispatch, fmt: str, limit: int) -> Dispatch:
    """The dispatch with the per-slot kernel running weights of `fmt` up to `limit` tokens (0: never)."""
    rules = []
    for rule in dispatch.rules:
        if rule.family == "per_slot" and fmt in rule.formats:
            rest = tuple(f for f in rule.formats if f != fmt)
            rules += [dataclasses.replace(rule, formats=rest)] if rest else []
        else:
            rules.append(rule)
    learned = [DispatchRule("per_slot", (fmt,), max_tokens=limit, note="learned from this run's cliff")] if limit else []
    return Dispatch((*learned, *rules), dispatch.source)


def _loss(rows: list[PassRow], engine: Engine, roofline: Roofline, frame: ProfileFrame) -> float:
    fitted = fit_coefficients(rows, engine, roofline)
    predicted = predict_rows(rows, rows, engine, fitted, frame)
    return float(np.mean(np.abs(predicted / np.array([r.time_us for r in rows]) - 1.0)))


def fit_bench_output(
    path: Path,
    name: str,
    options: ImportOptions,
    table_format: str | None = None,
    engine_name: str | None = None,
) -> BenchFit:
    """A profile of the device and build a benchmark output measured, with held-out errors."""
    fmt_name, frame = import_table(path, table_format, options)
    if (frame["scope"] != "pass").any() and engine_name is None and frame["engine"][0].startswith("vLLM"):
        engine_name = "vLLM fused_moe"
    device = str(frame["device"][0])
    spec = lookup_device(device)
    if spec is None:
        raise InputError(f"{path}: device {device!r} is not in the catalog (known: {', '.join(catalog())}): give --device with one of them")
    engine = _engine_of(frame, engine_name, str(path))
    architecture = CUDA_CLASS.get(spec.architecture, "volta-ada-hopper-blackwell") if engine.name == "llama.cpp CUDA" else "any"
    era = engine.eras[-1]
    source_dispatch = engine.dispatch(era.key, architecture, "engine-source")
    build = str(frame["engine_version"][0]) or "this build"
    weight_format = str(frame["dtype"][0]).upper()
    dense, assumed = _assumed_dense(spec)
    rows_provenance = tuple(
        FittedRow(int(r["source_row"] or 0) or i + 1, path.name, build, int(r["n_tokens"]))
        for i, r in enumerate(frame.iter_rows(named=True))
    )
    frame_ = ProfileFrame(
        name=name,
        description=f"{engine.name} on the {spec.name}: fitted on {path.name} ({frame.height} tests, {build})",
        device=device_facts(
            spec, engine.name, f"{build}; dispatch of builds since {era.key} ({era.since}), per-slot limit learned from the run"
        ),
        roofline=Roofline(spec.peak_bandwidth_gbps, spec.tensor_tflops),
        dispatch=source_dispatch,
        sources={
            "measurements": Provenance(
                "calibrated", path.name, file_sha256(path), note=f"{fmt_name} output, {frame.height} tests", rows=rows_provenance
            ),
            "engine-source": Provenance("published", citation=f"{engine.citation}; dispatch of builds since {era.key}: {era.since}"),
            "datasheet": Provenance("datasheet", citation=spec.citation),
            "assumed-dense": assumed,
        },
        section_sources={"device": "datasheet", "roofline": "datasheet", "pass": "assumed-dense", "families.dense": "assumed-dense"},
        calibration="measurements",
        dense_fallback=dense,
        era=build,
        status="calibrated",
    )
    source_limit = _per_slot_limit(source_dispatch, weight_format)
    learned = source_limit
    if source_limit is not None:
        sizes = sorted({int(n) for n in frame["n_tokens"].to_list() if n <= 64})
        candidates = sorted({0, source_limit, *sizes})
        losses = {}
        for limit in candidates:
            dispatch = with_limit(source_dispatch, weight_format, limit)
            try:
                losses[limit] = _loss(pass_rows(frame, [dispatch] * frame.height, [build] * frame.height), engine, frame_.roofline, frame_)
            except InputError:
                continue
        best = min(losses, key=losses.__getitem__)
        learned = best if losses[best] < losses.get(source_limit, np.inf) * (1 - LEARN_MARGIN) else source_limit
        frame_ = dataclasses.replace(frame_, dispatch=with_limit(source_dispatch, weight_format, learned))
    rows = pass_rows(frame, [frame_.dispatch] * frame.height, [build] * frame.height)
    fit = fit_engine(rows, engine, frame_)
    fit.profile = used_sources(fit.profile)
    return BenchFit(fit, fmt_name, learned, source_limit)


def is_measurement_table(path: Path) -> bool:
    """Whether a file is a contract-3 table (a microbenchmark's), not a benchmark's output."""
    if path.suffix.lower() == ".parquet":
        return True
    if path.suffix.lower() != ".csv" or not path.is_file():
        return False
    with path.open(errors="replace") as handle:
        header = handle.readline().strip().split(",")
    return {"kernel", "n_tokens", "time_us"} <= set(header)
