"""An engine's terms on one kind of device fitted from benchmark rows (issue 24; the stable API other
commands call, signature in `moesim.sim.engine`).

Every row is one linear equation in the terms θ = (pass_us, launch_us_per_layer, iteration_us,
draft_step_us, verified_token_us) once its kernels are priced (the device's dense family from its
datasheet, `device_profile`; `moesim.hw_profiles.speculative` defines the terms):

    decode step   t        = K(n) + pass_us + launch·L·[eager] + verified_token·v
    baseline      t_1      = K(B) + pass_us + launch·L·[eager]
    spec run      τ·t_spec = K_draft(k) + K(B·w) + pass_us·(1 + m·s) + launch·(L·[eager verify] + m·s·L_d·[eager draft])
                             + iteration + draft_step·s + verified_token·B·w

(n tokens per forward, L the target's layers, s draft steps, w the verify width, B requests,
m = 1 for a draft *model* of L_d layers, 0 for a head). θ ≥ 0 by non-negative least squares on
relative residuals. A term no row separates is 0 and its basis says so. Each term's
uncertainty is the largest relative move of it when one source is left out (0.5, assumed, when one
source fixed it); `heldout_error` the median relative error of the rows of each source predicted
from the others' fit.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
import polars as pl
from scipy.optimize import nnls

from moesim.hw_profiles import HardwareProfile, load_profile
from moesim.hw_profiles.catalog import device_spec, link_spec
from moesim.hw_profiles.engines.host import ENGINE_HOSTS
from moesim.hw_profiles.families import DenseFamily
from moesim.hw_profiles.fitting.engine_builtins import DENSE_COMPUTE_SHARE, DENSE_SHARE
from moesim.hw_profiles.heldout import HeldoutError
from moesim.hw_profiles.provenance import FittedRow, Provenance
from moesim.hw_profiles.speculative import SPEC_TERMS, SpecPath
from moesim.models import load_preset
from moesim.sim.cost.drafters import Drafter, draft_model_layers, draft_steps, draft_us, make_drafter
from moesim.sim.cost.parallel import Parallelism
from moesim.sim.cost.steptime import StepTimeModel

ONE_SOURCE_UNCERTAINTY = 0.5  # assumed relative half-width of a term one source alone fixed
MIN_UNCERTAINTY = 0.05


@cache
def device_profile(device_key: str) -> HardwareProfile:
    """A profile whose dense family is the catalog device's datasheet at the engine profiles' assumed
    shares (DENSE_SHARE of the bandwidth, DENSE_COMPUTE_SHARE of the tensor peak): the kernels of a
    dense target on any device, priced alike (no expert family is used)."""
    spec = device_spec(device_key)
    note = f"assumed: {100 * DENSE_SHARE:.0f} % of {spec.name}'s datasheet bandwidth, {100 * DENSE_COMPUTE_SHARE:.0f} % of its tensor peak"
    source = Provenance("assumed", note=note)
    dense = DenseFamily(
        DENSE_SHARE * spec.peak_bandwidth_gbps, DENSE_COMPUTE_SHARE * spec.tensor_tflops, 0.0, source, HeldoutError(transfer=0.2)
    )
    base = load_profile("nvidia-h200")
    name = f"{device_key} (datasheet dense)"
    return dataclasses.replace(base, name=name, dense=dense, speculative=None, pass_fixed_us=0.0, dispatch=None)


def forward_model(preset: str, device_key: str, weight_format: str, tp: int) -> StepTimeModel:
    """A forward's kernels as the fit prices them: the preset on the device's datasheet dense family, TP over its peer link."""
    spec = device_spec(device_key)
    parallel = Parallelism(tp, link=link_spec(spec.peer_link)) if tp > 1 else Parallelism()
    return StepTimeModel(load_preset(preset), device_profile(device_key), "per_slot", weight_format, parallel=parallel)


def graph_limit(engine_key: str, device_key: str) -> int:
    """The widest forward the engine captures on this device (0 off CUDA: Metal and MLX encode every forward)."""
    return ENGINE_HOSTS[engine_key].graph_max_tokens if device_spec(device_key).backend == "cuda" else 0


def flags(engine_key: str, device_key: str) -> SpecPath:
    """The engine's forwards on this device (graph capture, eager verify) with every term 0."""
    host = ENGINE_HOSTS[engine_key]
    zero = dict.fromkeys(("pass_us", "iteration_us", "draft_step_us", "verified_token_us", "heldout_error"), 0.0)
    source = Provenance("assumed", note="flags only")
    return SpecPath(**zero, provenance=source, graph_max_tokens=graph_limit(engine_key, device_key), verify_eager=host.verify_eager)


def _coefficients(shape: SpecPath, cost: Callable[[SpecPath], float]) -> tuple[float, ...]:
    """Each term's coefficient in a cost linear in the terms: the cost at that term = 1, the others 0."""
    return tuple(cost(shape.unit(term)) for term in SPEC_TERMS)


def run_drafter(preset: str, drafter: str, weight_format: str, draft_format: str) -> Drafter:
    """The run's drafter; a separate draft model in its own weight format."""
    made = make_drafter(drafter, load_preset(preset), weight_format)
    if draft_model_layers(made) and draft_format:
        model = dataclasses.replace(made.model, default_format=draft_format)  # type: ignore[attr-defined]
        made = dataclasses.replace(made, model=model)  # type: ignore[type-var]
    return made


@dataclass(frozen=True)
class Equation:
    """One row's equation: measured µs = kernel µs + coefficients · θ, and what it came from."""

    row: int
    table: str  # "decode step", "speculative run", "baseline of run"
    source: str
    tokens: int
    measured_us: float
    kernel_us: float
    coefficients: tuple[float, ...]  # per SPEC_TERMS

    def predicted_us(self, terms: dict[str, float]) -> float:
        """kernel + Σ coefficient · term."""
        return self.kernel_us + sum(c * terms.get(t, 0.0) for c, t in zip(self.coefficients, SPEC_TERMS, strict=True))


def step_equations(frame: pl.DataFrame) -> list[Equation]:
    """The equations of decode-step rows (fit layout: `moesim.sim.engine.rows.STEP_COLUMNS`): a
    forward as measured (eager or in a graph), a batch-expansion scorer's expanded tokens verified."""
    out = []
    for r in frame.iter_rows(named=True):
        model = forward_model(r["preset"], r["device_key"], r["weight_format"], int(r["tp"]))
        n, sequences, layers = int(r["tokens_per_forward"]), int(r["sequences"]), model.preset.layers
        logits = (float(r.get("head_share", 1.0)), float(r.get("logit_rows", n)))
        kernel = model.dense_pass_us(n, float(r["context_tokens"]) * sequences, sequences, logits)
        verified, eager = int(r["verified_tokens"]), bool(r["eager"])

        def cost(unit: SpecPath, n: int = n, layers: int = layers, eager: bool = eager, verified: int = verified) -> float:
            return unit.forward_us(n, layers, eager=eager) + unit.verified_token_us * verified

        coefficients = _coefficients(flags(r["engine_key"], r["device_key"]), cost)
        out.append(Equation(int(r["row"]), "decode step", r["source_url"], n, float(r["time_us"]), float(kernel), coefficients))
    return out


@dataclass(frozen=True)
class RunParts:
    """A speculative run's kernels and shape: what its speedup is predicted from."""

    row: int
    source: str
    engine_key: str
    tau: float
    measured_speedup: float
    baseline: Equation
    iteration: Equation

    def speedup(self, terms: dict[str, float], kernel_scale: float = 1.0) -> float:
        """S = τ·t_1 / t_iteration, both predicted (kernels times kernel_scale)."""
        base = dataclasses.replace(self.baseline, kernel_us=self.baseline.kernel_us * kernel_scale).predicted_us(terms)
        spent = dataclasses.replace(self.iteration, kernel_us=self.iteration.kernel_us * kernel_scale).predicted_us(terms)
        return self.tau * base / spent


def run_parts(frame: pl.DataFrame) -> list[RunParts]:
    """Kernel times and equations of speculative-run rows (fit layout: `rows.RUN_COLUMNS`)."""
    out = []
    for r in frame.iter_rows(named=True):
        model = forward_model(r["preset"], r["device_key"], r["weight_format"], int(r["tp"]))
        drafter = run_drafter(r["preset"], r["drafter"], r["weight_format"], r["draft_format"])
        k, batch, context = int(r["draft_len"]), int(r["batch"]), float(r["context_tokens"])
        width, layers = drafter.tree.width(k), model.preset.layers
        single = float(model.dense_pass_us(batch, context * batch, batch))
        verify = float(model.dense_pass_us(batch * width, context * batch, batch))
        drafted = float(draft_us(drafter, np.full(batch, k), context, model.dense_family_us))
        steps, draft_layers = draft_steps(drafter, k), draft_model_layers(drafter)
        shape = flags(r["engine_key"], r["device_key"])

        def spent(
            unit: SpecPath, batch: int = batch, width: int = width, layers: int = layers, steps: int = steps, d: int = draft_layers
        ) -> float:
            return unit.forward_us(batch * width, layers) + unit.overhead_us(steps, batch * width, d, batch, layers)

        iteration = Equation(
            int(r["row"]), "speculative run", r["source_url"], batch * width, float(r["tau"]) * float(r["token_us"]), drafted + verify,
            _coefficients(shape, spent),
        )  # fmt: skip
        baseline = Equation(
            int(r["row"]), "baseline of run", r["source_url"], batch, float(r["baseline_token_us"]), single,
            _coefficients(shape, lambda unit, batch=batch, layers=layers: unit.forward_us(batch, layers)),
        )  # fmt: skip
        measured = float(r["baseline_token_us"]) / float(r["token_us"])
        out.append(RunParts(int(r["row"]), r["source_url"], r["engine_key"], float(r["tau"]), measured, baseline, iteration))
    return out


def solve(equations: list[Equation]) -> tuple[dict[str, float], dict[str, str]]:
    """θ ≥ 0 by NNLS on relative residuals; a term no equation separates is 0 (its basis says why)."""
    tables = ", ".join(f"{sum(e.table == t for e in equations)} × {t}" for t in dict.fromkeys(e.table for e in equations))
    rows = f"{tables} ({len({e.source for e in equations})} sources; the source's rows list them)"
    design = np.array([e.coefficients for e in equations], np.float64)
    target = np.array([e.measured_us - e.kernel_us for e in equations])
    weight = 1.0 / np.array([e.measured_us for e in equations])
    kept: list[int] = []
    basis = {}
    for j, term in enumerate(SPEC_TERMS):
        trial = design[:, [*kept, j]]
        if np.any(design[:, j]) and np.linalg.matrix_rank(trial) > len(kept):
            kept.append(j)
        else:
            basis[term] = "0: no row separates it" if not np.any(design[:, j]) else "0: not separated from the terms before it"
    terms = dict.fromkeys(SPEC_TERMS, 0.0)
    if kept:
        solution, _ = nnls(design[:, kept] * weight[:, None], target * weight)
        for j, value in zip(kept, solution, strict=True):
            terms[SPEC_TERMS[j]] = float(value)
            basis[SPEC_TERMS[j]] = f"NNLS over {rows}" + (" (at the bound 0)" if value == 0 else "")
    return terms, basis


@dataclass(frozen=True)
class EngineFit:
    """The fitted terms (a `[speculative]` table) and the equations they rest on."""

    spec: SpecPath
    equations: tuple[Equation, ...]
    runs: tuple[RunParts, ...]


def equations_of(decode_rows: pl.DataFrame, spec_rows: pl.DataFrame) -> tuple[list[Equation], list[RunParts]]:
    """Every equation of both tables (a run gives its iteration and, where it has one, its baseline)."""
    steps = step_equations(decode_rows) if decode_rows.height else []
    runs = run_parts(spec_rows) if spec_rows.height else []
    baselines = {(r.source, r.baseline.measured_us, r.baseline.kernel_us): r.baseline for r in runs}  # a sweep's one baseline once
    return [*steps, *(r.iteration for r in runs), *baselines.values()], runs


def fit_engine_terms(
    decode_rows: pl.DataFrame, spec_rows: pl.DataFrame, engine: str, *, source_file: str = "", sha256: str = ""
) -> EngineFit:
    """The engine's terms from its rows (`engine` a key of `ENGINE_HOSTS`; both frames in fit layout,
    either may be empty), with their uncertainty, held-out error and provenance listing every row used."""
    equations, runs = equations_of(decode_rows, spec_rows)
    if not equations:
        raise ValueError(f"no rows to fit engine '{engine}' on")
    terms, basis = solve(equations)
    sources = list(dict.fromkeys(e.source for e in equations))
    spread: dict[str, float] = {}
    errors = []
    for source in sources:
        rest = [e for e in equations if e.source != source]
        if not rest:
            continue
        partial, _ = solve(rest)
        errors += [abs(e.predicted_us(partial) / e.measured_us - 1.0) for e in equations if e.source == source]
        for term in SPEC_TERMS:
            if terms[term] > 0:
                spread[term] = max(spread.get(term, 0.0), abs(partial[term] / terms[term] - 1.0))
    uncertainty = {
        t: min(1.0, max(MIN_UNCERTAINTY, spread[t])) if len(sources) > 1 else ONE_SOURCE_UNCERTAINTY for t in SPEC_TERMS if terms[t] > 0
    }
    kinds = {t: "calibrated" if terms[t] > 0 else "assumed" for t in SPEC_TERMS}
    host = ENGINE_HOSTS[engine]
    digest = sha256 or hashlib.sha256(source_file.encode()).hexdigest()
    provenance = Provenance(
        kind="calibrated",
        file=source_file or "engine rows",
        sha256=digest,
        note=f"engine terms of {host.name} fitted by moesim.sim.engine.fit_engine_terms",
        rows=tuple(FittedRow(e.row, e.source, e.table, e.tokens) for e in equations),
    )
    spec = SpecPath(
        **{t: terms[t] for t in ("pass_us", "iteration_us", "draft_step_us", "verified_token_us")},
        heldout_error=float(min(1.0, np.median(errors))) if errors else 1.0,
        provenance=provenance,
        basis=basis,
        covers=f"{host.name}: {len(equations)} rows from {len(sources)} sources",
        note=host.citation,
        source_id=f"engine-{engine.replace('.', '')}",
        launch_us_per_layer=terms["launch_us_per_layer"],
        graph_max_tokens=host.graph_max_tokens,
        verify_eager=host.verify_eager,
        engine=host.name,
        uncertainty=uncertainty,
        kinds=kinds,
    )
    return EngineFit(spec, tuple(equations), tuple(runs))
