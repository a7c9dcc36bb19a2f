"""The shared speculative runs judged (issue 19): every run moesim can describe
(`data/public-bench/speculative_runs_moesim.toml` says how, or why not), its predicted speedup
against the measured one, the spec-path terms fitted on the runs, leave one run out and leave one
engine out (issue 19's reading; since issue 24 the built-in profiles' `[speculative]` tables are
fitted on the dense engine-overheads rows, `moesim.sim.engine.builtin`, and these MoE runs judge them).

A run's prediction, with the target's pass times from its profile (without a spec path), the
drafter's time and its tree's verify width from moesim:

    S = τ·(T(1) + F) / (T_draft + T(width) + F + O),   O = iteration + draft_step·steps + verified_token·tokens

F (`pass_us`) is the engine's time per target forward beyond the profile, fixed by the training
runs' plain-decode baselines (mean of 1e6 / baseline − T(1)); each training run then implies the
overhead O_i = τ_i·(T_i(1) + F) / S_i − T_draft,i − T_i(width) − F, and the O terms are fitted to
those by non-negative least squares on relative residuals. A term the training runs cannot
separate from the ones before it (every run drafts in one step, or verifies as many tokens) is 0,
and its basis says so."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from scipy.optimize import nnls

from moesim.errors import ConfigError
from moesim.fields import build
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.builtin import with_spec_path
from moesim.hw_profiles.speculative import SpecPath
from moesim.models import load_preset
from moesim.sim.analysis.scenario import Scenario, expected_costs
from moesim.sim.cost.drafters import draft_steps, draft_us, make_drafter
from moesim.sim.cost.steptime import StepTimeModel, default_family
from moesim.sim.cost.tree import TreeSpec, solve_alpha
from moesim.tomlfile import read_toml
from moesim.tracegen.routing.synth import Uniform, synthesize

RUNS_TABLE = Path("data/public-bench/speculative_runs.csv")
DESCRIPTIONS = Path("data/public-bench/speculative_runs_moesim.toml")
O_TERMS = ("iteration_us", "draft_step_us", "verified_token_us")
READINGS = ("per_drafted", "share_of_output")


@dataclass(frozen=True)
class RunDescription:
    """One shared run in moesim's terms, or the reason it cannot be described."""

    row: int
    describable: bool = False
    reason: str = ""
    preset: str = ""
    profile: str = ""
    weight_format: str = ""
    drafter: str = ""
    draft_len: int = 0
    acceptance: float = math.nan
    acceptance_reading: str = ""
    context_tokens: int = 0
    engine: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.describable:
            if self.acceptance_reading not in READINGS:
                raise ConfigError(
                    f"run {self.row}: acceptance_reading must be one of {', '.join(READINGS)}, got {self.acceptance_reading!r}"
                )
            if not 0.0 <= self.acceptance < 1.0 or self.draft_len < 1:
                raise ConfigError(f"run {self.row}: needs an acceptance in [0, 1) and a draft length >= 1")
        elif not self.reason:
            raise ConfigError(f"run {self.row}: a run moesim cannot describe says why (reason)")

    def tokens_per_pass(self) -> float:
        """τ from the acceptance as read: 1 + a·k, or 1 / (1 − a)."""
        if self.acceptance_reading == "per_drafted":
            return 1.0 + self.acceptance * self.draft_len
        return 1.0 / (1.0 - self.acceptance)


def read_descriptions(path: Path = DESCRIPTIONS) -> list[RunDescription]:
    """Every [[run]] of the descriptions file, checked (one line naming the file and key otherwise)."""
    tables = read_toml(path, "run descriptions").get("run", [])
    return [build(RunDescription, table, f"run[{i}]", str(path), path.parent) for i, table in enumerate(tables)]


@dataclass(frozen=True)
class RunCosts:
    """One described run: what moesim predicts of its parts (µs) and what was measured."""

    row: int
    source: str
    engine: str
    profile: str
    drafter: str
    draft_steps: int
    verify_tokens: int
    tau: float
    measured_speedup: float
    baseline_us: float
    single_us: float
    verify_us: float
    draft_us: float

    def implied_overhead_us(self, pass_us: float) -> float:
        """O the measured speedup implies: τ·(T(1) + F)/S − T_draft − T(width) − F."""
        return self.tau * (self.single_us + pass_us) / self.measured_speedup - self.draft_us - self.verify_us - pass_us

    def predicted_speedup(self, terms: dict[str, float]) -> float:
        """τ·(T(1) + F) / (T_draft + T(width) + F + O)."""
        f = terms.get("pass_us", 0.0)
        o = terms.get("iteration_us", 0.0) + terms.get("draft_step_us", 0.0) * self.draft_steps
        o += terms.get("verified_token_us", 0.0) * self.verify_tokens
        return self.tau * (self.single_us + f) / (self.draft_us + self.verify_us + f + o)


def run_costs(description: RunDescription, runs: pl.DataFrame, seed: int = 0) -> RunCosts:
    """Predicted parts of a described run on a synthetic uniform-routing trace of its target."""
    record = runs.row(description.row - 1, named=True)
    preset = load_preset(description.preset)
    profile = with_spec_path(load_profile(description.profile), None)
    fmt = description.weight_format
    drafter = make_drafter(description.drafter, preset, fmt)
    width = drafter.tree.width(description.draft_len)
    trace = synthesize(preset, Uniform(), max(512, 2 * width), 2, seed, fmt)
    scenario = Scenario(StepTimeModel(preset, profile, default_family(profile), fmt), trace, drafter, description.context_tokens)
    single, verify = expected_costs(scenario, np.array([1, width])).total_us()
    drafted = draft_us(drafter, np.array([description.draft_len]), description.context_tokens, scenario.model.dense_family_us)
    return RunCosts(
        row=description.row,
        source=str(record["source_url"]),
        engine=description.engine,
        profile=description.profile,
        drafter=f"{description.drafter} k={description.draft_len}",
        draft_steps=draft_steps(drafter, description.draft_len),
        verify_tokens=width,
        tau=description.tokens_per_pass(),
        measured_speedup=float(record["tokens_per_s"]) / float(record["baseline_tokens_per_s"]),
        baseline_us=1e6 / float(record["baseline_tokens_per_s"]),
        single_us=float(single),
        verify_us=float(verify),
        draft_us=float(drafted),
    )


def described_costs(runs_table: Path = RUNS_TABLE, descriptions: Path = DESCRIPTIONS) -> list[RunCosts]:
    """RunCosts of every describable shared run."""
    runs = pl.read_csv(runs_table, infer_schema_length=0)
    return [run_costs(d, runs) for d in read_descriptions(descriptions) if d.describable]


@dataclass(frozen=True)
class TermFit:
    """Spec-path terms fitted on some runs, with what fixed each (or why it is 0)."""

    terms: dict[str, float]
    basis: dict[str, str]
    rows: tuple[int, ...]


def fit_terms(runs: list[RunCosts]) -> TermFit:
    """F from the runs' baselines, then O's terms by NNLS on the overheads the runs imply (relative
    residuals); a column equal across the runs to a combination of earlier ones is left at 0."""
    rows = tuple(r.row for r in runs)
    named = ", ".join(str(r) for r in rows)
    f = max(0.0, float(np.mean([r.baseline_us - r.single_us for r in runs])))
    basis = {"pass_us": f"mean of 1e6 / baseline - T(1) over the plain-decode baselines of rows {named}"}
    implied = np.array([r.implied_overhead_us(f) for r in runs])
    scale = np.array([r.tau * (r.single_us + f) / r.measured_speedup for r in runs])  # each run's iteration time
    columns = {"iteration_us": np.ones(len(runs)), "draft_step_us": np.array([float(r.draft_steps) for r in runs])}
    columns["verified_token_us"] = np.array([float(r.verify_tokens) for r in runs])
    kept: list[str] = []
    for name in columns:
        trial = np.stack([columns[k] for k in (*kept, name)], axis=1)
        if np.linalg.matrix_rank(trial) > len(kept):
            kept.append(name)
        else:
            what = name.removesuffix("_us").replace("_", " ")
            basis[name] = f"0: not separated by rows {named} (their {what} counts follow the terms before it)"
    design = np.stack([columns[k] for k in kept], axis=1) / scale[:, None]
    solution, _ = nnls(design, implied / scale)
    terms = {"pass_us": f, **dict.fromkeys(O_TERMS, 0.0)}
    for name, value in zip(kept, solution, strict=True):
        terms[name] = float(value)
        basis[name] = f"NNLS on the overheads rows {named} imply" + (" (at the bound 0: they imply none)" if value == 0 else "")
    return TermFit(terms, {name: basis[name] for name in ("pass_us", *O_TERMS)}, rows)


@dataclass(frozen=True)
class HeldOut:
    """Predicted against measured speedups of runs held out of the fit, by split."""

    frame: pl.DataFrame

    def summary(self) -> dict[str, float]:
        """Median |error| and share of right verdicts (speedup above or below 1), with and without the terms."""
        f = self.frame
        return {
            "runs": float(f.height),
            "median_abs_error": float(f["error"].abs().median()),  # type: ignore[arg-type]
            "right_verdicts": float(f["verdict_right"].mean()),  # type: ignore[arg-type]
            "median_abs_error_without_terms": float(f["error_without_terms"].abs().median()),  # type: ignore[arg-type]
            "right_verdicts_without_terms": float(f["verdict_right_without_terms"].mean()),  # type: ignore[arg-type]
        }


def held_out(runs: list[RunCosts], group: str = "row") -> HeldOut:
    """Leave one run out (`group` 'row') or one engine out ('engine'): terms fitted on the rest."""
    keys = [str(getattr(r, group)) for r in runs]
    records = []
    for key in dict.fromkeys(keys):
        train = [r for r, k in zip(runs, keys, strict=True) if k != key]
        fit = fit_terms(train) if train else TermFit({}, {}, ())
        for run in (r for r, k in zip(runs, keys, strict=True) if k == key):
            predicted, plain = run.predicted_speedup(fit.terms), run.predicted_speedup({})
            records.append(
                {
                    "row": run.row,
                    "engine": run.engine,
                    "drafter": run.drafter,
                    "tokens_per_pass": run.tau,
                    "measured": run.measured_speedup,
                    "predicted": predicted,
                    "error": predicted / run.measured_speedup - 1.0,
                    "verdict_right": (predicted > 1.0) == (run.measured_speedup > 1.0),
                    "predicted_without_terms": plain,
                    "error_without_terms": plain / run.measured_speedup - 1.0,
                    "verdict_right_without_terms": (plain > 1.0) == (run.measured_speedup > 1.0),
                    **{f"fit_{k}": v for k, v in fit.terms.items()},
                }
            )
    return HeldOut(pl.DataFrame(records))


def sensitivity(runs: list[RunCosts], reading: str, descriptions: list[RunDescription]) -> list[RunCosts]:
    """The runs with every share-of-output acceptance read the other way (`reading`), to see how far the reading moves the result."""
    by_row = {d.row: d for d in descriptions}
    out = []
    for run in runs:
        d = by_row[run.row]
        if d.acceptance_reading != reading and d.acceptance_reading == "share_of_output":
            tau = 1.0 + d.acceptance * d.draft_len
            run = RunCosts(**{**run.__dict__, "tau": tau})
        out.append(run)
    return out


def splits(runs: list[RunCosts]) -> dict[str, HeldOut]:
    """Leave one run out and leave one engine out."""
    return {"leave one run out": held_out(runs, "row"), "leave one engine out": held_out(runs, "engine")}


PUBLISHED = Path("data/validation/spec-published/runs.toml")
JUDGE_SETTING = {"preset": "qwen3-30b-a3b", "profile": "nvidia-h100-sxm-vllm", "weight_format": "BF16", "context_tokens": 512}


@dataclass(frozen=True)
class PublishedRun:
    """A published run outside the shared file (judging only): SGLang's tree settings, accepted length, speeds."""

    source: str
    devices: str
    baseline_tokens_per_s: float
    steps: int
    topk: int
    tokens: int
    tokens_per_s: float
    accept_length: float

    @property
    def tree(self) -> TreeSpec:
        """The SGLang tree family (topk, tokens); steps is the draft length."""
        return TreeSpec(topk=self.topk, tokens=self.tokens if self.topk > 1 else None)


def read_published(path: Path = PUBLISHED) -> list[PublishedRun]:
    """The judging-only runs."""
    tables = read_toml(path, "published runs").get("run", [])
    return [build(PublishedRun, table, f"run[{i}]", str(path), path.parent) for i, table in enumerate(tables)]


def judge_tree_acceptance(published: list[PublishedRun]) -> pl.DataFrame:
    """Accepted lengths of each source's trees predicted from its smallest tree's (α solved there,
    the default sibling rate), against the measured ones."""
    records = []
    for source in dict.fromkeys(r.source for r in published):
        group = [r for r in published if r.source == source]
        anchor = min(group, key=lambda r: (r.tokens, r.topk))
        alpha = solve_alpha(anchor.tree, anchor.steps, anchor.accept_length)
        for run in group:
            predicted = float(run.tree.tokens_per_pass(run.steps, np.array([alpha]))[0])
            records.append(
                {
                    "source": source.rsplit("/", 3)[-3] + "#" + source.rsplit("/", 1)[-1],
                    "tree": f"({run.steps},{run.topk},{run.tokens})",
                    "anchor": run is anchor,
                    "alpha": alpha,
                    "measured": run.accept_length,
                    "predicted": predicted,
                    "error": predicted / run.accept_length - 1.0,
                }
            )
    return pl.DataFrame(records)


def judge_verdicts(published: list[PublishedRun], setting: dict[str, object] = JUDGE_SETTING) -> pl.DataFrame:
    """Speedups of the runs as moesim describes them on one device (EAGLE-3 head with SGLang's tree,
    the run's own accepted length, the profile's engine terms), against the measured ones, and the
    overhead per iteration beyond those the measured speedup implies."""
    preset = load_preset(str(setting["preset"]))
    profile = load_profile(str(setting["profile"]))
    fmt, context = str(setting["weight_format"]), int(setting["context_tokens"])  # type: ignore[call-overload]
    trace = synthesize(preset, Uniform(), 256, 2, 0, fmt)
    model = StepTimeModel(preset, profile, default_family(profile), fmt)
    records = []
    for run in published:
        drafter = make_drafter("eagle3" + (f",{run.tree.label()}" if not run.tree.is_chain else ""), preset, fmt)
        scenario = Scenario(model, trace, drafter, context)
        single, verify = expected_costs(scenario, np.array([1, drafter.tree.width(run.steps)])).total_us()
        drafted = draft_us(drafter, np.array([run.steps]), context, scenario.model.dense_family_us)
        width = drafter.tree.width(run.steps)
        spec = profile.speculative  # the profile's engine terms: its time per forward is in T already, O added here
        drafted += spec.overhead_us(draft_steps(drafter, run.steps), width, 0, 1, preset.layers) if spec is not None else 0.0
        tau = run.accept_length
        predicted = tau * single / (drafted + verify)
        measured = run.tokens_per_s / run.baseline_tokens_per_s
        records.append(
            {
                "devices": run.devices,
                "tree": f"({run.steps},{run.topk},{run.tokens})",
                "verify_tokens": drafter.tree.width(run.steps),
                "tokens_per_pass": tau,
                "measured": measured,
                "predicted": predicted,
                "verdict_right": (predicted > 1.0) == (measured > 1.0),
                "implied_overhead_us": tau * single / measured - drafted - verify,
                "plain_us": float(single),
            }
        )
    return pl.DataFrame(records)


def judge_engine_terms(runs: list[RunCosts], descriptions: list[RunDescription]) -> pl.DataFrame:
    """The described MoE runs predicted with the engine terms of their built-in profile (fitted on
    dense rows only, `moesim.sim.engine.builtin`): S = τ·(T(1) + E(1)) / (T_draft + T(width) + E(width) + O),
    with the interval over the terms' box (`SpecPath.corner_scales`)."""
    by_row = {d.row: d for d in descriptions}
    records = []
    for run in runs:
        spec = load_profile(run.profile).speculative
        if spec is None:
            continue
        layers = load_preset(by_row[run.row].preset).layers

        def speedup(scale: dict[str, float] | None, run: RunCosts = run, spec: SpecPath = spec, layers: int = layers) -> float:
            base = run.single_us + spec.forward_us(1, layers, scale)
            spent = run.draft_us + run.verify_us + spec.forward_us(run.verify_tokens, layers, scale)
            return run.tau * base / (spent + spec.overhead_us(run.draft_steps, run.verify_tokens, 0, 1, layers, scale))

        nominal = speedup(None)
        ends = [speedup(s) for s in spec.corner_scales()]
        records.append(
            {
                "row": run.row, "engine": run.engine, "drafter": run.drafter, "terms": spec.engine, "tau": run.tau,
                "measured": run.measured_speedup, "predicted": nominal, "low": min(ends), "high": max(ends),
                "error": nominal / run.measured_speedup - 1.0, "verdict_right": (nominal > 1.0) == (run.measured_speedup > 1.0),
                "covered": min(ends) <= run.measured_speedup <= max(ends),
            }
        )  # fmt: skip
    return pl.DataFrame(records)
