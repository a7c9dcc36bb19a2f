"""An engine profile fitted on whole passes and kernel timings (`whole_pass`), judged on rows it never saw.

Coefficients (all >= 0; µs per column unit): the fixed time per pass; per kernel family its bytes
(1 / bandwidth), compute (1 / FLOP rate, and for a tiled kernel the rate of its whole tiles),
fixed time per layer, and where its reads say so a cost per distinct expert (a launch per used
expert) or per slot (a dispatch per token); the dense work's compute. Fixed times are fitted per
build era of the rows (`<name>@<era>`: launch and synchronisation overheads change from build to
build, rates much less); a profile takes the era it describes, or the nearest era with data.

Ties and orders that are physics, not fitting: the non-expert weights and the KV cache stream at
the bandwidth of the engine's mat-vec family (its per-slot kernel, or the most used one);
attention's FLOPs run at the dense FLOP rate; no family reads faster than the device's peak
bandwidth; where the engine has a per-slot kernel, no other family reads bytes faster than it
(each family's bytes coefficient is per_slot's plus a non-negative excess: at one token every
family reads the same experts). The fit is NNLS on relative residuals with a Huber weight
(`family_fit.solve_relative`). Before it, every column is checked for whether the rows separate
it from the columns before it (residual of the relative, unit-norm column after projecting on
them below `SEPARABLE`): the dense compute, if not, is tied to the most used deduplicating
family's compute; any other such column is left out, and the notes say which terms it stays in
(e.g. a family's fixed time per layer and the fixed time per pass, for one model: the data give
only their sum). A fixed time (per pass or per layer, of a build era) whose rows are all of one
pass size is left out as well: at one size only the models' different work could tell it from that
work, and per-format costs confound it (four rows at n = 512 had put a whole 1 s pass into the
fixed time, 21x off once scaled to another device's sizes); the work there carries it. Except at
one token: a kernel (or the dense part) timed at one token only does two FLOPs per weight it reads,
far below every device's ridge point, so its FLOPs ride under its reads. Its FLOP and tile rates
are left out (the roofline floor still bounds its FLOPs at larger passes), and its fixed time
stays, to carry what the reads do not take: a vLLM kernel timed at one token had put 11 µs of its
launch into a 32 TFLOP/s rate, which grew with every token once scaled to another device.

Held-out error: leave one model out when the rows hold two or more, else leave one pass size out
(a user's single-model run); each split repeats the whole procedure on its training rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles.dispatch import Dispatch
from moesim.hw_profiles.engines import Engine
from moesim.hw_profiles.families import CalibratedRange, DenseFamily, ExpertFamily, ExpertInputs, Roofline
from moesim.hw_profiles.fitting.family_fit import solve_relative
from moesim.hw_profiles.fitting.whole_pass import PassRow, expert_columns, predicted_by_era, uniform_features
from moesim.hw_profiles.heldout import ErrorStats, HeldoutError, relative_errors
from moesim.hw_profiles.profile import DeviceFacts, HardwareProfile
from moesim.hw_profiles.provenance import Provenance
from moesim.models import ExpertShape, builtin_names, load_preset

SEPARABLE = 1e-3
NO_SPLIT_BOUND = 0.25  # assumed bound where no row of a profile could be held out
PASS_FIXED, DENSE_COMPUTE = "pass.fixed", "dense.compute"


@dataclass(frozen=True)
class Design:
    """Columns of the rows (one per coefficient), what was tied or left out, and why."""

    names: tuple[str, ...]
    matrix: np.ndarray
    notes: tuple[str, ...]
    stream_family: str
    ties: dict[str, str]
    eras: tuple[str, ...]
    pinned: tuple[tuple[str, np.ndarray], ...] = ()  # bytes columns the rows do not separate: held at their floor


def _main_families(rows: list[PassRow]) -> list[str]:
    counts: dict[str, int] = {}
    for row in rows:
        family = row.family_at(row.n_tokens)
        counts[family] = counts.get(family, 0) + 1
    return sorted(counts, key=lambda f: (-counts[f], f))


# The order in which a family's terms enter the design: where the rows cannot tell two apart, the
# earlier one carries both. A bandwidth the rows do not separate is held at the device's peak
# (`floored`), so the terms the datasheet does not bound come first: FLOPs (in a llama-bench ppN
# series the KV context grows with the pass size exactly as the FLOPs do, N/2 + n/2 tokens), the
# fixed time per layer (every launch costs it whatever the kernel reads: a user's run of one model
# with a kernel switch needs it at the switch, else the bytes carry the jump and miss both sides)
# and the FLOPs of whole tiles; then the bytes above the peak. A kernel that computes every column of
# tiles picked from the pass's tokens (`Kernel.tiles_first`: llama.cpp Vulkan's matmul_id) has its
# whole tiles first: they are what its ALUs run.
TERM_ORDER = ("compute", "fixed", "tile", "bytes", "per_expert", "per_slot")
MIN_SIZES = 2  # a fixed time is told from the work it comes with only by rows of two or more pass sizes


def floored(name: str, stream_family: str) -> bool:
    """Whether a coefficient is a bytes term bounded below by the device's peak bandwidth: every
    family's where no per-slot kernel streams, else per_slot's (the others are its excess)."""
    return name.endswith(".bytes") and (stream_family != "per_slot" or name == "per_slot.bytes")


def term_kind(name: str) -> str:
    """What a column's coefficient prices: 'bytes' (1 / bandwidth), 'compute' (1 / FLOP rate) or a time."""
    term = name.split(".", 1)[1].split("@")[0].split("[")[0]
    return term if term in ("bytes", "compute") else "compute" if term == "tile" else "time"


def build_design(rows: list[PassRow], engine: Engine, scales: dict[str, np.ndarray] | None = None) -> Design:
    """The design of the rows: candidate columns in priority order, ties, separability. `scales`
    multiplies each row's columns by kind (`term_kind`: 'bytes', 'compute', 'time'), e.g. by the
    inverse of the row's device peaks, so that one coefficient serves devices of different datasheets."""
    structures = {k.family: k.structure for k in engine.kernels}
    experts = [expert_columns(row, structures) for row in rows]
    dense = np.array([row.dense_work() for row in rows])
    families = _main_families(rows)
    used = sorted(
        {name.split(".")[0] for cols in experts for name in cols},
        key=lambda f: (f not in families, families.index(f) if f in families else 0, f),
    )
    stream = "per_slot" if "per_slot" in used else used[0]
    dedups = [f for f in used if f != stream] or [stream]
    eras = sorted({r.era for r in rows})
    candidates: list[tuple[str, np.ndarray]] = [
        (f"{PASS_FIXED}@{era}", np.array([1.0 if r.scope == "pass" and r.era == era else 0.0 for r in rows])) for era in eras
    ]
    for position, term in enumerate(("tile", *TERM_ORDER)):  # a `tiles_first` kernel's whole tiles enter before everything
        for family in used:
            kernel = engine.kernel(family)
            if term == "tile" and (position == 0) != kernel.tiles_first:
                continue
            per_slot_kernel = kernel.tokens_per_read == 1
            skip = {
                "compute": per_slot_kernel,  # a mat-vec kernel is bandwidth-bound: its FLOPs ride on its reads
                "tile": not kernel.tile_tokens,
                "per_expert": not kernel.per_expert,
                "per_slot": not per_slot_kernel,
            }
            if skip.get(term, False):
                continue
            for name in [f"{family}.{term}@{era}" for era in eras] if term == "fixed" else [f"{family}.{term}"]:
                column = np.array([cols.get(name, 0.0) for cols in experts])
                if term == "bytes" and family == stream:
                    column = column + dense[:, 0]
                    if stream == "per_slot":  # every family's bytes coefficient is per_slot's plus its own excess
                        column = column + sum(np.array([c.get(f"{f}.bytes", 0.0) for c in experts]) for f in used if f != stream)
                candidates.append((name, column))
    for family in used:
        formats = sorted({r.shape.weight_format for r, cols in zip(rows, experts, strict=True) if cols.get(f"{family}.bytes")})
        if len(formats) >= 2:
            candidates += [(f"{family}.bytes[{fmt}]", np.array([c.get(f"{family}.bytes[{fmt}]", 0.0) for c in experts])) for fmt in formats]
    candidates.append((DENSE_COMPUTE, dense[:, 1] + dense[:, 2]))
    if scales is not None:
        candidates = [(name, column * scales[term_kind(name)]) for name, column in candidates]
    measured = np.array([r.time_us for r in rows])
    chosen: list[tuple[str, np.ndarray]] = []
    basis: list[np.ndarray] = []
    merged: list[str] = []
    pinned: list[tuple[str, np.ndarray]] = []
    notes, ties = [], {}
    sizes = np.array([r.n_tokens for r in rows])
    for name, column in candidates:
        if not np.any(column):
            continue
        timed_at = set(sizes[column != 0].tolist())
        one_token = timed_at == {1} and not name.startswith(PASS_FIXED)
        if one_token and term_kind(name) == "compute":
            merged.append(f"{describe_term(name, eras)} (timed at one token only: its FLOPs ride under the reads)")
            continue
        if term_kind(name) == "time" and "@" in name and len(timed_at) < MIN_SIZES and not one_token:
            merged.append(f"{describe_term(name, eras)} (timed at one pass size only: the work there carries it)")
            continue
        relative = column / measured
        unit = relative / np.linalg.norm(relative)
        residual = unit
        for q in basis:
            residual = residual - q * float(q @ residual)
        if np.linalg.norm(residual) >= SEPARABLE:
            chosen.append((name, column))
            basis.append(residual / np.linalg.norm(residual))
            continue
        partner = f"{dedups[0]}.compute" if name == DENSE_COMPUTE else ""
        names = [n for n, _ in chosen]
        if floored(name, stream):
            pinned.append((name, column))
            carried = " and ".join(describe_term(n, eras) for n in _nearest(unit, chosen, measured))
            notes.append(f"the rows do not tell {describe_term(name, eras)} from {carried}: it is held at the device's peak")
        elif partner in names:
            index = names.index(partner)
            chosen[index] = (partner, chosen[index][1] + column)
            ties[DENSE_COMPUTE] = partner
            notes.append(f"the rows do not tell the dense FLOP rate from {describe_term(partner, eras)}: one rate for both")
        else:
            carried = " and ".join(describe_term(n, eras) for n in _nearest(unit, chosen, measured))
            merged.append(f"{describe_term(name, eras)} (carried by {carried})")
    if merged:
        notes.append("the rows do not tell these terms from others, so they are 0 and the terms named carry them: " + "; ".join(merged))
    names = tuple(n for n, _ in chosen)
    return Design(names, np.column_stack([c for _, c in chosen]), tuple(notes), stream, ties, tuple(eras), tuple(pinned))


def _nearest(unit: np.ndarray, chosen: list[tuple[str, np.ndarray]], measured: np.ndarray) -> list[str]:
    """The (at most two) chosen columns that carry most of a dependent column."""
    columns = np.column_stack([c / measured / np.linalg.norm(c / measured) for _, c in chosen])
    weights = np.abs(np.linalg.lstsq(columns, unit, rcond=None)[0])
    return [chosen[i][0] for i in np.argsort(-weights)[:2] if weights[i] > 1e-6]


_TERM_WORDS = {
    "fixed": "{f}'s fixed time per layer",
    "bytes": "{f}'s bandwidth",
    "compute": "{f}'s FLOP rate",
    "tile": "{f}'s rate per token tile",
    "per_expert": "{f}'s time per used expert",
    "per_slot": "{f}'s time per token slot",
}


def describe_term(name: str, eras: list[str]) -> str:
    """A coefficient's name in words: 'per_slot.fixed@<build>' -> "per_slot's fixed time per layer (build <build>)"."""
    name, _, era = name.partition("@")
    family, _, term = name.partition(".")
    if name == PASS_FIXED:
        words = "the fixed time per pass"
    elif name == DENSE_COMPUTE:
        words = "the dense FLOP rate"
    elif "[" in term:
        words = f"{family}'s extra time per byte of {term.split('[')[1][:-1]} weights (their dequantisation)"
    else:
        words = _TERM_WORDS.get(term, "{f}'s " + term).format(f=family)
    if era and len(eras) > 1:
        words += f" (build {'of this run' if era.startswith('unknown') else era})"
    return words


def _rate(coefficient: float, unit: float) -> float:
    return math.inf if coefficient <= 0 else 1.0 / (coefficient * unit)


@dataclass(frozen=True)
class Coefficients:
    """Fitted coefficients by name (µs per unit), and the design they belong to."""

    design: Design
    values: dict[str, float]

    def bytes(self, family: str) -> float:
        """µs per byte a family reads at: with a per-slot kernel, its coefficient plus the family's excess."""
        own = self.get(f"{family}.bytes")
        stream = self.design.stream_family
        return own + self.get(f"{stream}.bytes") if stream == "per_slot" and family != stream else own

    def get(self, name: str, era: str = "") -> float:
        """A coefficient, through its tie; 0 for a term that was left out. A fixed time is the era's
        (0 where the era's rows did not separate it: it is in the era's other terms); for an era
        without rows, the latest era before it, else the earliest after it."""
        name = self.design.ties.get(name, name)
        fitted = sorted(key.split("@", 1)[1] for key in self.values if key.startswith(f"{name}@"))
        if era in self.design.eras:
            return self.values.get(f"{name}@{era}", 0.0)
        if fitted:
            before = [e for e in fitted if e <= era]
            name = f"{name}@{before[-1] if before else fitted[0]}"
        return self.values.get(name, 0.0)


def fit_coefficients(rows: list[PassRow], engine: Engine, roofline: Roofline, scales: dict[str, np.ndarray] | None = None) -> Coefficients:
    """Separable design, then NNLS on relative residuals with every bytes coefficient at least
    1 / peak bandwidth (no family streams faster than the device's memory; with `scales`, whose
    bytes columns are µs at each row's peak, at least 1)."""
    design = build_design(rows, engine, scales)
    least = 1.0 if scales is not None else 1.0 / (roofline.peak_bandwidth_gbps * 1e3)
    floor = np.array([least if floored(name, design.stream_family) else 0.0 for name in design.names])
    offset = design.matrix @ floor + sum((least * column for _, column in design.pinned), np.zeros(len(rows)))
    theta = solve_relative(design.matrix, np.array([r.time_us for r in rows]), offset_us=offset) + floor
    values = dict(zip(design.names, (float(t) for t in theta), strict=True))
    return Coefficients(design, {**values, **{name: least for name, _ in design.pinned}})


@dataclass(frozen=True)
class ProfileFrame:
    """What a fitted profile is besides its coefficients: name, device, roofline, sources."""

    name: str
    description: str
    device: DeviceFacts
    roofline: Roofline
    dispatch: Dispatch
    sources: dict[str, Provenance]
    section_sources: dict[str, str]
    calibration: str
    dense_fallback: DenseFamily
    era: str = ""
    notes: tuple[str, ...] = ()
    partial: bool = False
    status: str = "published-calibrated"


def single_token_shapes(rows: list[PassRow], dispatch: Dispatch | None) -> set[tuple[ExpertShape, int, int]]:
    """Where the one-token order is checked: the calibration shapes, and every built-in model's
    experts in every weight format the engine's dispatch names (BF16 where it names none)."""
    formats = {fmt for rule in (dispatch.rules if dispatch else ()) for fmt in rule.formats} or {"BF16"}
    presets = [load_preset(name) for name in builtin_names("moe")]
    return {(r.shape, r.experts, r.top_k) for r in rows} | {(p.expert_shape(fmt), p.experts, p.top_k) for p in presets for fmt in formats}


def single_token_order(
    families: dict[str, ExpertFamily], rows: list[PassRow], dispatch: Dispatch | None = None
) -> tuple[dict[str, ExpertFamily], list[str]]:
    """Physics: at one token a deduplicating kernel reads what the per-slot kernel reads (U = S), so
    it is not faster, unless a row timed it there. Where the fitted terms say otherwise (an
    extrapolation below the calibrated sizes), its fixed time is raised to tie at one token on
    every shape of `single_token_shapes`."""
    if "per_slot" not in families:
        return families, []
    timed_at_one = {r.family_at(1) for r in rows if r.n_tokens == 1}
    shapes = single_token_shapes(rows, dispatch)
    per_slot, out, notes = families["per_slot"], dict(families), []
    for name, family in families.items():
        if name == "per_slot" or name in timed_at_one:
            continue
        deficit = max(
            float(per_slot.time_us(uniform_features(1, e, k), shape)) - float(family.time_us(uniform_features(1, e, k), shape))
            for shape, e, k in shapes
        )
        if deficit > 0:
            out[name] = dataclasses.replace(family, fixed_us=family.fixed_us + deficit)
            notes.append(f"{name}: fixed time raised by {deficit:.1f} µs so that it is not faster than per_slot at one token")
    return out, notes


def _range(rows: list[PassRow]) -> CalibratedRange:
    """The inputs the rows measured: their sizes and shapes; for the routing features, every value a
    routing can give at the sizes measured (the rows route at random, a trace routes otherwise: a
    measured size is inside the range whatever its routing; k to min(E, n·k) distinct experts, 1 to
    n tokens on the busiest)."""
    inputs = [ExpertInputs.of(uniform_features(r.n_tokens, r.experts, r.top_k), r.shape) for r in rows]
    bounds = {}
    for name in ("n_tokens", "slots", "expert_bytes", "hidden", "intermediate"):
        values = [float(x.field(name)) for x in inputs]
        bounds[name] = (min(values), max(values))
    bounds["distinct_experts"] = (float(min(r.top_k for r in rows)), float(max(min(r.experts, r.n_tokens * r.top_k) for r in rows)))
    bounds["max_tokens_per_expert"] = (1.0, float(max(r.n_tokens for r in rows)))
    return CalibratedRange(bounds)


def profile_of(
    rows: list[PassRow], engine: Engine, fitted: Coefficients, frame: ProfileFrame, errors: dict[str, HeldoutError]
) -> HardwareProfile:
    """The engine profile of fitted coefficients: one family per kernel that ran in the rows; the
    dispatch keeps the rules whose family was calibrated."""
    provenance = frame.sources[frame.calibration]
    families: dict[str, ExpertFamily] = {}
    section_sources = dict(frame.section_sources)
    for kernel in engine.kernels:
        ran = [r for r in rows if r.family_at(r.n_tokens) == kernel.family]
        if not ran:
            continue
        f = kernel.family
        base = fitted.bytes(f)
        bandwidth = _rate(base, 1e3)
        formats = {key.split("[")[1][:-1]: value for key, value in fitted.values.items() if key.startswith(f"{f}.bytes[") and value > 0}
        families[f] = ExpertFamily(
            name=f,
            structure=kernel.structure,
            fixed_us=fitted.get(f"{f}.fixed", frame.era),
            hbm_bandwidth_gbps=bandwidth,
            cache_bandwidth_gbps=bandwidth,
            cache_bytes=0.0,
            compute_tflops=(_rate(fitted.get(f"{f}.compute"), 1e6),),
            serial_ns=(0.0,),
            per_expert_us=fitted.get(f"{f}.per_expert"),
            per_slot_us=fitted.get(f"{f}.per_slot"),
            calibrated_range=_range(ran),
            heldout_error=errors.get(f, HeldoutError()),
            provenance=provenance,
            roofline=frame.roofline,
            note=kernel.description,
            tile_tflops=_rate(fitted.get(f"{f}.tile"), 1e6),
            format_bandwidth_gbps={fmt: _rate(base + extra, 1e3) for fmt, extra in sorted(formats.items())},
        )
        section_sources[f"families.{f}"] = frame.calibration
    rules = tuple(rule for rule in frame.dispatch.rules if rule.family in families)
    dropped = sorted({rule.family for rule in frame.dispatch.rules} - set(families))
    notes = list(frame.notes) + list(fitted.design.notes)
    if dropped:
        notes.append(f"not calibrated on this device, left out of the dispatch: {', '.join(dropped)}")
    families, ordered = single_token_order(families, rows, frame.dispatch)
    notes += ordered
    share = min((r.routed_share for r in rows), default=1.0)
    if share < 1.0:
        notes.append(
            f"the benchmark's whole passes were priced with its random tokens routed uniformly over {share:.0%} of the experts; "
            "a routing trace is priced as it routes"
        )
    has_passes = any(r.scope == "pass" for r in rows)
    dense = frame.dense_fallback
    if has_passes:
        stream = fitted.design.stream_family
        rate = _rate(fitted.get(DENSE_COMPUTE), 1e6)
        dense = DenseFamily(
            bandwidth_gbps=_rate(fitted.bytes(stream), 1e3),
            tflops=rate,
            launch_us=0.0,
            provenance=provenance,
            heldout_error=errors.get("dense", HeldoutError()),
            note=f"non-expert weights and KV stream at the {stream} family's bandwidth; attention FLOPs at the dense rate",
            attention_tflops=rate,
        )
        section_sources["families.dense"] = frame.calibration
        section_sources["pass"] = frame.calibration
        notes.append(
            "the fixed time per pass is what the whole passes cost beyond the preset's attention, dense and shared weights, "
            "routed experts and LM head at the fitted rates (launches, synchronisation, ops not counted): the engine's time "
            "per forward, fitted per build so that it is not fitted into the expert terms"
        )
    return HardwareProfile(
        name=frame.name,
        description=frame.description,
        status=frame.status,
        device=frame.device,
        roofline=frame.roofline,
        pass_fixed_us=fitted.get(PASS_FIXED, frame.era) if has_passes else 0.0,
        expert_families=families,
        dense=dense,
        sources=frame.sources,
        field_sources={},
        notes=tuple(notes),
        section_sources=section_sources,
        dispatch=Dispatch(rules, frame.dispatch.source),
        partial=frame.partial,
        bench_routed_share=share,
    )


@dataclass
class EngineFit:
    """The fitted profile, its coefficients, and the rows' in-sample and held-out predictions."""

    profile: HardwareProfile
    coefficients: Coefficients
    rows: list[PassRow]
    in_sample_us: np.ndarray
    heldout_us: np.ndarray
    split: str
    group_errors: dict[str, ErrorStats] = field(default_factory=dict)

    def families_of_rows(self) -> list[str]:
        """The family each row's main layers ran."""
        return [r.family_at(r.n_tokens) for r in self.rows]

    def table(self) -> pl.DataFrame:
        """One row per measurement: tokens per pass, family, measured, fitted and held-out times (ms)."""
        measured = np.array([r.time_us for r in self.rows])
        return pl.DataFrame(
            {
                "n_tokens": [r.n_tokens for r in self.rows],
                "model": [r.model for r in self.rows],
                "family": self.families_of_rows(),
                "measured_ms": measured / 1e3,
                "fitted_ms": self.in_sample_us / 1e3,
                "held_out_ms": self.heldout_us / 1e3,
                "held_out_error_%": 100 * (self.heldout_us / measured - 1),
            }
        )


def _groups(rows: list[PassRow]) -> tuple[str, np.ndarray | None]:
    models = np.array([r.model for r in rows])
    if len(set(models)) >= 2:
        return "leave_one_shape_out", models
    sizes = np.array([str(r.n_tokens) for r in rows])
    return ("leave_one_size_out", sizes) if len(set(sizes)) >= 3 else ("", None)


def predict_rows(rows: list[PassRow], train: list[PassRow], engine: Engine, fitted: Coefficients, frame: ProfileFrame) -> np.ndarray:
    """Each row predicted by the fitted profile of its build era (NaN where a family it needs never
    ran in the training rows)."""
    return predicted_by_era(rows, lambda era: profile_of(train, engine, fitted, dataclasses.replace(frame, era=era), {}))


def heldout_predictions(rows: list[PassRow], engine: Engine, frame: ProfileFrame, groups: np.ndarray) -> np.ndarray:
    """Each group's rows predicted by a profile fitted without them."""
    predicted = np.full(len(rows), np.nan)
    for group in dict.fromkeys(groups.tolist()):
        held = groups == group
        train = [r for r, h in zip(rows, held, strict=True) if not h]
        try:
            fitted = fit_coefficients(train, engine, frame.roofline)
        except InputError:
            continue
        predicted[held] = predict_rows([r for r, h in zip(rows, held, strict=True) if h], train, engine, fitted, frame)
    return predicted


def _errors(rows: list[PassRow], predicted: np.ndarray, keep: np.ndarray) -> ErrorStats | None:
    measured = np.array([r.time_us for r in rows])
    mask = keep & np.isfinite(predicted)
    return ErrorStats.from_errors(relative_errors(predicted[mask], measured[mask])) if mask.any() else None


def fit_engine(rows: list[PassRow], engine: Engine, frame: ProfileFrame) -> EngineFit:
    """Fit, judge on held-out rows, and build the profile with each family's errors."""
    if not rows:
        raise InputError(f"{frame.name}: no rows to fit")
    fitted = fit_coefficients(rows, engine, frame.roofline)
    in_sample = predict_rows(rows, rows, engine, fitted, frame)
    split, groups = _groups(rows)
    heldout = heldout_predictions(rows, engine, frame, groups) if groups is not None else np.full(len(rows), np.nan)
    ran = np.array([r.family_at(r.n_tokens) for r in rows])
    errors: dict[str, HeldoutError] = {}
    for family in [*dict.fromkeys(ran.tolist()), "dense"]:
        keep = np.array([r.scope == "pass" for r in rows]) if family == "dense" else ran == family
        if not keep.any():
            continue
        stats = {"in_sample": _errors(rows, in_sample, keep)}
        if split:
            stats[split] = _errors(rows, heldout, keep)
        errors[family] = HeldoutError(**stats)  # type: ignore[arg-type]
    worst = max((e.epsilon for e in errors.values() if not math.isnan(e.epsilon)), default=NO_SPLIT_BOUND)
    for family, error in errors.items():
        if math.isnan(error.epsilon):
            p90 = error.in_sample.p90 if error.in_sample else 0.0
            note = (
                "no held-out row of this family (it ran in one held-out group only): bound = the worst held-out p90 "
                "of the profile's families, at least 25 % (assumed)"
            )
            errors[family] = error.with_transfer(max(NO_SPLIT_BOUND, p90, worst), note)
    profile = profile_of(rows, engine, fitted, frame, errors)
    group_errors = {}
    if groups is not None:
        for group in dict.fromkeys(groups.tolist()):
            stats = _errors(rows, heldout, groups == group)
            if stats is not None:
                group_errors[group] = stats
    return EngineFit(profile, fitted, rows, in_sample, heldout, split, group_errors)
