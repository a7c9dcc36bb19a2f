"""A user's own runs fitted: the rows `moesim.hw_profiles.engine_runs` reads from what they ran on
their machine, put in the fit layout of `fit_engine_terms` (`moesim.sim.engine`), fitted, and
written into their profile's `[speculative]` table (`moesim profile fit-engine`).

Each plain-decoding row is one forward (`time_us`): its time per forward as its unit gives it
(`DecodeStep.forward_us`), at the mean context of each sequence, prompt plus half the output. A
`vllm bench latency` batch latency is one prefill forward and output_len − 1 decode forwards: its
row is a decode forward, the latency less the prefill's kernels beyond a decode forward's, over
output_len (each forward's host time stays in it):

    time_us = (latency − (K(batch · input_len) − K(batch))) / output_len

with K priced as `fit_engine_terms` prices a forward (`forward_model`).
A forward runs eager when the row says CUDA graphs were off, else when it is wider than the
engine captures (`graph_limit`). A speculative run needs its tokens per iteration (mean accepted
length, or 1 + a·k), its draft length, the drafter that ran (`drafter`, a moesim drafter spec)
and its plain baseline (the plain row of its batch, `engine_runs.rows.pair_baselines`); a run
without one of them is left out with the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles import HardwareProfile
from moesim.hw_profiles.builtin import with_spec_path
from moesim.hw_profiles.catalog import catalog, device_of_profile, device_spec
from moesim.hw_profiles.engine_runs import DecodeStep, EngineRows, SpecRun
from moesim.hw_profiles.engine_runs.rows import LATENCY_UNIT, NA
from moesim.hw_profiles.engines.host import ENGINE_HOSTS, engine_of
from moesim.hw_profiles.importers.names import resolve_formats
from moesim.hw_profiles.speculative import SPEC_TERMS
from moesim.models import load_preset
from moesim.sim.engine.fit import EngineFit, fit_engine_terms, forward_model, graph_limit
from moesim.sim.engine.rows import step_logits


@dataclass(frozen=True)
class UserFit:
    """The fit of a user's runs, the profile carrying it, and the rows it could not use (with why)."""

    fit: EngineFit
    profile: HardwareProfile
    engine_key: str
    device_key: str
    left_out: tuple[tuple[str, str], ...]

    def terms_table(self) -> pl.DataFrame:
        """term, value, uncertainty (%), kind, basis."""
        spec = self.fit.spec
        return pl.DataFrame(
            {
                "term": list(SPEC_TERMS),
                "value_us": [round(getattr(spec, t), 2) for t in SPEC_TERMS],
                "uncertainty_pct": [round(100 * spec.uncertainty[t], 1) if t in spec.uncertainty else None for t in SPEC_TERMS],
                "kind": [spec.kinds.get(t, "") for t in SPEC_TERMS],
                "basis": [spec.basis.get(t, "") for t in SPEC_TERMS],
            }
        )

    def rows_table(self) -> pl.DataFrame:
        """Every equation: its row, measured µs, kernel µs and the fit's prediction."""
        terms = {t: getattr(self.fit.spec, t) for t in SPEC_TERMS}
        return pl.DataFrame(
            [
                {
                    "row": e.source, "equation": e.table, "tokens": e.tokens, "measured_us": round(e.measured_us, 1),
                    "kernel_us": round(e.kernel_us, 1), "predicted_us": round(e.predicted_us(terms), 1),
                }
                for e in self.fit.equations
            ]
        )  # fmt: skip

    def runs_table(self) -> pl.DataFrame:
        """Each speculative run's measured speedup and the fit's."""
        terms = {t: getattr(self.fit.spec, t) for t in SPEC_TERMS}
        return pl.DataFrame(
            [{"run": r.source, "tau": round(r.tau, 3), "measured_speedup": round(r.measured_speedup, 3),
              "predicted_speedup": round(r.speedup(terms), 3)} for r in self.fit.runs]
        )  # fmt: skip


def engine_key_of(rows: EngineRows, where: str) -> str:
    """The one engine (an `ENGINE_HOSTS` key) every row ran; one line when several or none we know."""
    keys = {}
    for row in (*rows.steps, *rows.runs):
        key = engine_of(row.engine, "" if row.engine_version == NA else row.engine_version)
        if key is None:
            raise InputError(
                f"{row.source_url}: engine '{row.engine}' version '{row.engine_version}' is none moesim knows "
                f"(known: {', '.join(ENGINE_HOSTS)}): give --engine-version (vLLM: its release, V1 from 0.8)"
            )
        keys[key] = row.engine
    if len(keys) > 1:
        raise InputError(f"{where}: the runs are of several engines ({', '.join(sorted(keys))}): fit one engine at a time")
    return next(iter(keys))


def device_key_of(profile: HardwareProfile, device: str | None) -> str:
    """The catalog device the runs ran on: --device, else the profile's device."""
    if device:
        return device_spec(device).key
    spec = device_of_profile(profile.name, profile.device.name)
    if spec is None:
        known = ", ".join(catalog())
        raise InputError(
            f"profile '{profile.name}': its device {profile.device.name!r} is not in the catalog: give --device (known: {known})"
        )
    return spec.key


def _eager(step: DecodeStep, tokens: int, limit: int) -> bool:
    graphs = step.cuda_graphs.lower()
    if graphs.startswith("no"):
        return True
    return False if graphs.startswith("yes") else tokens > limit


def latency_forward_us(step: DecodeStep, preset: str, weight_format: str, device_key: str) -> float:
    """A batch latency as one decode forward: (latency − (K(prefill) − K(decode))) / output_len."""
    model = forward_model(preset, device_key, weight_format, step.tp)
    prompt, output, batch = float(step.input_len or 0), float(step.output_len or 1), step.batch
    prefill = model.dense_pass_us(batch * prompt, batch * prompt / 2, batch, span=max(prompt, 1.0))  # the causal prompt's key counts
    decode = model.dense_pass_us(batch, batch * (prompt + output / 2), batch, span=max(output, 1.0))  # the output's contexts
    return (step.value * 1e6 - (prefill - decode)) / output


def step_frame(steps: tuple[DecodeStep, ...], preset: str, weight_format: str, engine_key: str, device_key: str) -> pl.DataFrame:
    """The plain-decoding rows in fit layout (`rows.STEP_COLUMNS`), one forward each."""
    limit = graph_limit(engine_key, device_key)
    records = []
    for number, step in enumerate(steps, start=1):
        forward = step.forward_us()
        time_us = forward if forward is not None else latency_forward_us(step, preset, weight_format, device_key)
        tokens = step.batch * step.tokens_per_pass
        prompt, output = float(step.input_len or 0), float(step.output_len or 0)
        context = prompt + output / 2 if step.tokens_per_pass == 1 or step.unit == LATENCY_UNIT else prompt / 2
        head_share, logit_rows = step_logits(engine_key, step.input_len or 0, step.output_len or 0, tokens)
        records.append(
            {"row": number, "source_url": step.source_url, "engine": step.engine, "engine_key": engine_key, "device_key": device_key,
             "preset": preset, "weight_format": weight_format, "tp": step.tp, "batch": step.batch, "sequences": step.batch,
             "tokens_per_forward": tokens, "context_tokens": context, "eager": _eager(step, tokens, limit), "verified_tokens": 0,
             "time_us": time_us, "head_share": head_share, "logit_rows": logit_rows}
        )  # fmt: skip
    return pl.DataFrame(records, schema_overrides={"context_tokens": pl.Float64}) if records else pl.DataFrame()


def _token_us(value: float, metric: str, batch: int) -> float:
    """One request's time per output token from a run's value in its metric."""
    if metric == "TPOT ms":
        return 1000.0 * value
    return (batch if metric == "t/s (batch total)" else 1) * 1e6 / value


def run_frame(
    runs: tuple[SpecRun, ...], preset: str, weight_format: str, engine_key: str, device_key: str, drafter: str | None
) -> tuple[pl.DataFrame, list[tuple[str, str]]]:
    """The speculative runs in fit layout (`rows.RUN_COLUMNS`), and those left out with why."""
    records, left = [], []
    for number, run in enumerate(runs, start=1):
        tau = run.tokens_per_iteration()
        reason = (
            "no --drafter: the run's drafting cannot be priced" if not drafter
            else "acceptance not in the output (tokens per iteration unknown)" if tau is None
            else "draft length not in the output: give --draft-len or FILE@draft_len=K" if run.draft_len is None
            else "no plain run of the same engine, device, model and batch to be its baseline" if run.baseline_value is None
            else ""
        )  # fmt: skip
        if reason:
            left.append((run.source_url, reason))
            continue
        records.append(
            {"row": number, "source_url": run.source_url, "engine": run.engine, "engine_key": engine_key, "device_key": device_key,
             "preset": preset, "weight_format": weight_format, "tp": run.tp, "batch": run.batch,
             "context_tokens": float(run.input_len or 0) + float(run.output_len or 0) / 2, "drafter": drafter,
             "draft_format": "", "draft_len": run.draft_len, "tau": tau, "token_us": _token_us(run.spec_value, run.metric, run.batch),
             "baseline_token_us": _token_us(run.baseline_value, run.metric, run.batch)}
        )  # fmt: skip
    return (pl.DataFrame(records) if records else pl.DataFrame()), left


def printed_format(rows: EngineRows) -> str | None:
    """The weight format every plain row names (llama-bench prints it with the model), None when they name none or several."""
    named = {step.dtype for step in rows.steps if step.dtype != NA}
    if len(named) != 1:
        return None
    return resolve_formats(named.pop(), "the runs' weight format")[1]


def inputs_sha256(paths: list[Path]) -> str:
    """sha256 of the input files' bytes, concatenated in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fit_user_engine(
    rows: EngineRows,
    inputs: list[Path],
    profile: HardwareProfile,
    preset: str,
    weight_format: str | None = None,
    drafter: str | None = None,
    device: str | None = None,
    name: str | None = None,
) -> UserFit:
    """The engine's terms from a user's runs (`fit_engine_terms`), and their profile carrying them as its `[speculative]` table."""
    target = load_preset(preset)
    if target.kind != "dense":
        raise InputError(f"model '{target.name}' is a {target.kind} preset: fit-engine prices dense targets (the engine's own path)")
    fmt = weight_format or printed_format(rows) or target.default_format
    where = str(inputs[0]) if inputs else "runs"
    engine_key = engine_key_of(rows, where)
    device_key = device_key_of(profile, device)
    steps = step_frame(rows.steps, preset, fmt, engine_key, device_key)
    runs, left = run_frame(rows.runs, preset, fmt, engine_key, device_key, drafter)
    if not steps.height and not runs.height:
        raise InputError(f"{where}: no row to fit: give plain decoding at a few batch sizes (and a speculative run with --drafter)")
    files = ", ".join(p.name for p in inputs)
    fit = fit_engine_terms(steps, runs, engine_key, source_file=files, sha256=inputs_sha256(inputs))
    spec = dataclasses.replace(fit.spec, note=f"fitted by moesim profile fit-engine on {files}; {fit.spec.note}")
    fitted = with_spec_path(profile, spec)
    fitted = dataclasses.replace(fitted, name=name or profile.name, description=f"{profile.description}; engine terms fitted on {files}")
    return UserFit(dataclasses.replace(fit, spec=spec), fitted, engine_key, device_key, tuple(left))
