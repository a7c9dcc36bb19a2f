"""`moesim profile fit` on a benchmark's output: a user's own run becomes a profile of that device and build.

    llama-bench -m MODEL.gguf -p 512 -n 0 -ub 1,2,3,4,5,6,7,8,12,16,32 -o csv > bench.csv
    moesim profile fit bench.csv --out my-gpu.toml

The output is imported (`moesim.hw_profiles.importers`: llama-bench in any of its forms,
llama-batched-bench, benchmark_moe.py), the device looked up in the catalog (its datasheet gives
the roofline and the device class the dispatch depends on), the engine named by the output's
backend (or, where the output has no backend column, by the catalog device's), and the whole
passes fitted (`engine_fit`): one model, so the held-out error leaves one pass size out. A table
of several variants (compare-llama-bench) is read as its last variant unless `--filter
variant=NAME` chooses (`importers.choose_variant`).

The per-slot kernel's limit is the engine source's for its newest build (the prior). The run moves
it only where its rows clearly say so: a series of the run has a cliff (a drop in time, or a slope
over 3x its neighbours': `engine_validation.measured_cliff`) between two measured sizes that the
source's limit does not fall between. The limit then goes between them: to a limit of one of the
engine's earlier builds where one lies there (a run of an older build), else as near the source's
as the cliff allows; unless the fit at that limit is worse than at the source's by more than
`LEARN_MARGIN` of the mean relative error (then the cliff is not the kernel switch). The per-slot
kernel always runs at one token (every build of every engine moesim knows does), so no limit is
below 1. A run without a cliff keeps the source's limit: a change of kernel need not be a jump.

llama-bench times passes of random token ids, which a router sends to fewer experts than real text
(`whole_pass`: uniformly over a share ρ of them). How few depends on the model and its router, so
the run chooses: the run is fitted at each share of `pooled.routing_share.ROUTED_SHARES`, and the
share whose fit has the least held-out error on the run's own rows (the median |error| of the time
per pass and of T(n)/T(n0), leave one pass size out) is kept; as with the limit, the prior (every
expert) gives way only where the rows clearly say so: the largest share whose error is at most
(1 + `LEARN_MARGIN`)·least + `SHARE_FLOOR` is kept. No held-out row, or no test a share describes (a kernel
benchmark, llama-batched-bench), keeps every expert. Nothing but the run's rows chooses it
(docs/validation.md: on the halves of the shared series it predicts the other half better than
every expert, 7 of 12 within 5 % against 6; on published tables the team did not have, no better,
2 of 4 either way). `--routed-share` fixes it instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.filters import apply_filters, parse_filters
from moesim.hw_profiles.catalog import catalog, lookup_device
from moesim.hw_profiles.dispatch import Dispatch, DispatchRule
from moesim.hw_profiles.engines import ENGINES, Engine
from moesim.hw_profiles.families import Roofline
from moesim.hw_profiles.fitting.engine_builtins import _assumed_dense, device_facts, used_sources
from moesim.hw_profiles.fitting.engine_fit import EngineFit, ProfileFrame, fit_coefficients, fit_engine, predict_rows
from moesim.hw_profiles.fitting.engine_validation import switches
from moesim.hw_profiles.fitting.pooled.routing_share import ROUTED_SHARES, fit_errors, least_error, median_error
from moesim.hw_profiles.fitting.whole_pass import PassRow, extrapolation_x, pass_rows, predict_us, predicts
from moesim.hw_profiles.importers import ImportOptions, choose_variant, import_table
from moesim.hw_profiles.measurements.table import DISPATCH_KERNEL, load_measurements
from moesim.hw_profiles.profile import HardwareProfile
from moesim.hw_profiles.provenance import FittedRow, Provenance, file_sha256

LEARN_MARGIN = 0.25
# A share below every expert must also cut the run's held-out error by a point: both fits of the
# example run (made at every expert) are within 0.4 %, where 0.1 point is no evidence of a router,
# and a share moves the fitted bandwidth that prices real routing (docs/validation.md, third pass).
SHARE_FLOOR = 0.01
CLIFF_SIZES = 64  # a cliff above this many tokens is not the per-slot kernel's (every source limit is <= 8)
# Catalog architectures -> the device classes of llama.cpp's CUDA dispatch.
CUDA_CLASS = {"pascal": "pascal", "ampere": "turing-ampere", "turing": "turing-ampere", "rdna3": "rdna3", "cdna": "cdna"}
ENGINE_OF_BACKEND = {"cuda": "llama.cpp CUDA", "rocm": "llama.cpp CUDA", "vulkan": "llama.cpp Vulkan", "metal": "llama.cpp Metal"}


@dataclass(frozen=True)
class LimitChoice:
    """The per-slot limit kept, the source's, and what the run's rows said: the cliff's sizes
    (None: no cliff) and the mean relative error of the fit at either limit."""

    limit: int | None
    source_limit: int | None
    cliff: tuple[int, int] | None = None
    candidate: int | None = None
    error: float = float("nan")
    source_error: float = float("nan")

    def sentence(self) -> str:
        """What was chosen and why, in one line."""
        if self.source_limit is None:
            return "no per-slot kernel for this weight format in the engine's source"
        head = f"per-slot kernel up to {self.limit} tokens"
        if self.limit != self.source_limit and self.cliff is not None:
            return (
                f"{head}, moved by this run from the engine source's {self.source_limit}: its times jump between "
                f"{self.cliff[0]} and {self.cliff[1]} tokens, and the fit's mean error is {100 * self.error:.1f} % there "
                f"against {100 * self.source_error:.1f} % at the source's limit"
            )
        if self.cliff is not None and self.candidate is not None:
            return (
                f"{head}, the engine source's: this run's times jump between {self.cliff[0]} and {self.cliff[1]} tokens, but a "
                f"limit of {self.candidate} fits them worse ({100 * self.error:.1f} % against {100 * self.source_error:.1f} %)"
            )
        if self.cliff is not None:
            return f"{head}, the engine source's (this run's cliff, between {self.cliff[0]} and {self.cliff[1]} tokens, agrees with it)"
        return f"{head}, the engine source's (this run shows no cliff that says otherwise)"


@dataclass(frozen=True)
class ShareChoice:
    """The share of the experts the run's whole passes route over, and, where the run chose it, each
    candidate's held-out error (median |error| of the time per pass and of T(n)/T(n0))."""

    share: float
    errors: dict[float, float] = field(default_factory=dict)
    given: bool = False

    def sentence(self) -> str:
        """What was chosen and why, in one line."""
        head = f"routed share {self.share:g}"
        if self.given:
            return f"{head}: given (--routed-share)"
        if not self.errors:
            return f"{head}: no test of this run passes several random token ids of one sequence (llama-bench's), which a share describes"
        cells = ", ".join(f"{s:g}: {100 * e:.1f} %" if np.isfinite(e) else f"{s:g}: –" for s, e in self.errors.items())
        if not any(np.isfinite(error) for error in self.errors.values()):
            return f"{head}: the run has no held-out rows to choose a share by ({cells})"
        return (
            f"{head}: the largest share whose fit's held-out error is within {100 * LEARN_MARGIN:.0f} % and "
            f"{100 * SHARE_FLOOR:.0f} point of the least ({cells})"
        )


@dataclass(frozen=True)
class BenchFit:
    """The fit, the per-slot limit it kept and why, the routed share it chose, and what the import said."""

    fit: EngineFit
    table_format: str
    choice: LimitChoice
    share: ShareChoice
    notes: tuple[str, ...] = ()

    @property
    def learned_limit(self) -> int | None:
        """The per-slot limit of the profile."""
        return self.choice.limit

    @property
    def source_limit(self) -> int | None:
        """The engine source's per-slot limit."""
        return self.choice.source_limit


def _engine_of(frame: pl.DataFrame, engine: str | None, origin: str, device_backend: str) -> Engine:
    if engine:
        return ENGINES.create(engine)
    label = str(frame["engine"][0])
    backend = label.split()[-1].lower() if label.strip() not in ("", "llama.cpp") else device_backend.lower()
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
    learned = [DispatchRule("per_slot", (fmt,), max_tokens=limit, note="moved by this run's cliff")] if limit else []
    return Dispatch((*learned, *rules), dispatch.source)


def _loss(rows: list[PassRow], engine: Engine, roofline: Roofline, frame: ProfileFrame) -> float:
    fitted = fit_coefficients(rows, engine, roofline)
    predicted = predict_rows(rows, rows, engine, fitted, frame)
    return float(np.mean(np.abs(predicted / np.array([r.time_us for r in rows]) - 1.0)))


def choose_limit(
    frame: pl.DataFrame, engine: Engine, profile_frame: ProfileFrame, weight_format: str, build: str, architecture: str, share: float
) -> LimitChoice:
    """The per-slot limit: the source's unless the run's rows clearly say otherwise (module docstring);
    whole passes routed over the share of the experts."""
    source_limit = _per_slot_limit(profile_frame.dispatch, weight_format)
    if source_limit is None:
        return LimitChoice(None, None)
    history_limits = {_per_slot_limit(engine.dispatch(era.key, architecture), weight_format) for era in engine.eras}

    def rows_at(limit: int) -> list[PassRow]:
        dispatch = with_limit(profile_frame.dispatch, weight_format, limit)
        return pass_rows(frame, [dispatch] * frame.height, [build] * frame.height, share)

    cliffs = [
        (s.sizes[s.sizes.index(s.measured) - 1], s.measured)
        for s in switches(rows_at(source_limit))
        if s.measured is not None and s.measured <= CLIFF_SIZES
    ]
    if not cliffs:
        return LimitChoice(source_limit, source_limit)
    below, above = cliffs[0]
    if below <= source_limit < above:
        return LimitChoice(source_limit, source_limit, (below, above))
    between = range(below, above)
    history = sorted({n for n in history_limits if n in between}, key=lambda n: (abs(n - source_limit), n))
    candidate = history[0] if history else min(max(source_limit, below), above - 1)
    errors = {}
    for limit in (candidate, source_limit):
        try:
            errors[limit] = _loss(rows_at(limit), engine, profile_frame.roofline, profile_frame)
        except InputError:
            errors[limit] = np.inf
    chosen = candidate if errors[candidate] <= errors[source_limit] * (1 + LEARN_MARGIN) else source_limit
    return LimitChoice(chosen, source_limit, (below, above), candidate, errors[candidate], errors[source_limit])


def fit_bench_output(
    path: Path,
    name: str,
    options: ImportOptions,
    table_format: str | None = None,
    engine_name: str | None = None,
    share: float | None = None,
) -> BenchFit:
    """A profile of the device and build a benchmark output measured, with held-out errors; its
    whole passes routed over the share of the experts given, else over the candidate of
    `ROUTED_SHARES` whose fit has the least held-out error on the run's own rows (module docstring)."""
    options, variant_note = choose_variant(path, table_format, options)
    fmt_name, frame = import_table(path, table_format, options)
    if (frame["scope"] != "pass").any() and engine_name is None and frame["engine"][0].startswith("vLLM"):
        engine_name = "vLLM fused_moe"
    device = str(frame["device"][0])
    spec = lookup_device(device)
    if spec is None:
        raise InputError(f"{path}: device {device!r} is not in the catalog (known: {', '.join(catalog())}): give --device with one of them")
    engine = _engine_of(frame, engine_name, str(path), spec.backend)
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
            spec, engine.name, f"{build}; dispatch of builds since {era.key} ({era.since}), per-slot limit as the source or this run says"
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
    if share is not None and not 0.0 < share <= 1.0:
        raise InputError(f"--routed-share: is a share of the experts, in (0, 1], got {share:g}")

    def fit_at(share: float) -> tuple[LimitChoice, EngineFit]:
        choice = choose_limit(frame, engine, frame_, weight_format, build, architecture, share)
        moved = choice.limit is not None and choice.limit != choice.source_limit
        at = dataclasses.replace(frame_, dispatch=with_limit(source_dispatch, weight_format, choice.limit)) if moved else frame_
        return choice, fit_engine(pass_rows(frame, [at.dispatch] * frame.height, [build] * frame.height, share), engine, at)

    # at one token every share routes to the K experts: only passes of several tokens tell shares apart
    takes_share = any(r.takes_share and r.n_tokens > 1 for r in pass_rows(frame, [source_dispatch] * frame.height))
    shares = (share,) if share is not None else ROUTED_SHARES if takes_share else (1.0,)
    fits = {candidate: fit_at(candidate) for candidate in shares}
    errors = {candidate: median_error([fit_errors(fit)]) for candidate, (_, fit) in fits.items()} if len(shares) > 1 else {}
    routed = ShareChoice(least_error(errors, LEARN_MARGIN, SHARE_FLOOR) if errors else shares[0], errors, given=share is not None)
    choice, fit = fits[routed.share]
    fit.profile = used_sources(dataclasses.replace(fit.profile, notes=(*fit.profile.notes, routed.sentence())))
    return BenchFit(fit, fmt_name, choice, routed, (variant_note,) if variant_note else ())


@dataclass(frozen=True)
class BenchCheck:
    """A profile against the whole passes of a benchmark's output: one row per test, and what the import said."""

    table: pl.DataFrame
    notes: tuple[str, ...]

    def errors(self) -> np.ndarray:
        """Relative errors of the rows the profile predicts (its dispatch's family calibrated)."""
        return self.table["error_%"].drop_nulls().to_numpy() / 100


def predicted_rows(frame: pl.DataFrame, profile: HardwareProfile) -> pl.DataFrame:
    """Each row of a measurement table priced by an engine profile (its dispatch; null where the
    family it dispatches was not calibrated): tokens per pass, model, test, family, measured,
    predicted, error, and how far the row lies beyond its family's calibrated range (1 inside)."""
    if profile.dispatch is None:
        raise InputError(f"profile '{profile.name}' has no engine dispatch: a benchmark's whole passes need an engine profile")
    rows = pass_rows(frame, [profile.dispatch] * frame.height, share=profile.bench_routed_share)
    predicted = [predict_us(row, profile) if predicts(row, profile) else None for row in rows]
    beyond = [extrapolation_x(row, profile) if p is not None else None for row, p in zip(rows, predicted, strict=True)]
    measured = [row.time_us for row in rows]
    return pl.DataFrame(
        {
            "n_tokens": [row.n_tokens for row in rows],
            "model": [row.model for row in rows],
            "test": [row.test for row in rows],
            "family": [row.family_at(row.n_tokens) for row in rows],
            "measured_ms": [m / 1e3 for m in measured],
            "predicted_ms": [None if p is None else p / 1e3 for p in predicted],
            "error_%": [None if p is None else 100 * (p / m - 1) for p, m in zip(predicted, measured, strict=True)],
            "extrapolated_x": beyond,
        },
        schema_overrides={"predicted_ms": pl.Float64, "error_%": pl.Float64, "extrapolated_x": pl.Float64},
    )


def check_bench_output(path: Path, profile: HardwareProfile, options: ImportOptions, table_format: str | None = None) -> BenchCheck:
    """A benchmark's output (as `profile fit` reads it) predicted by a profile, row by row; an output
    that does not name its device is taken as run on the profile's (and says so)."""
    notes = []
    if options.device is None and not _names_device(path, table_format, options):
        options = dataclasses.replace(options, device=profile.device.name)
        notes.append(f"{path.name}: the output does not name its device: taken as the profile's ({profile.device.name})")
    options, note = choose_variant(path, table_format, options)
    _, frame = import_table(path, table_format, options)
    return BenchCheck(predicted_rows(frame, profile), tuple(notes) + ((note,) if note else ()))


def dispatched_table(path: Path) -> bool:
    """Whether a measurement table is an importer's (`profile import`): every row timed the engine's own choice."""
    frame = load_measurements(path)
    return frame.height > 0 and bool((frame["kernel"] == DISPATCH_KERNEL).all())


def check_measurement_table(path: Path, profile: HardwareProfile, filters: tuple[str, ...] = ()) -> BenchCheck:
    """An imported measurement table (`profile import`) predicted by an engine profile, row by row."""
    frame = apply_filters(load_measurements(path), parse_filters(list(filters)), str(path))
    return BenchCheck(predicted_rows(frame, profile), ())


def _names_device(path: Path, table_format: str | None, options: ImportOptions) -> bool:
    try:
        choose_variant(path, table_format, options)
    except InputError as exc:
        if "give --device" in str(exc):
            return False
        raise
    return True


def is_measurement_table(path: Path) -> bool:
    """Whether a file is a contract-3 table (a microbenchmark's), not a benchmark's output."""
    if path.suffix.lower() == ".parquet":
        return True
    if path.suffix.lower() != ".csv" or not path.is_file():
        return False
    with path.open(errors="replace") as handle:
        header = handle.readline().strip().split(",")
    return {"kernel", "n_tokens", "time_us"} <= set(header)
