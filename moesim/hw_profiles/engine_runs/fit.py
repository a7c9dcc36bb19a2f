"""The two simplest engine terms from a user's own runs, priced against the profile's kernels:
the host time per forward and, where a speculative run was given, the time per speculative
iteration beyond its draft and verify forwards.

This is the minimal fit `moesim profile fit-engine` ships on its own (issue 24, item 4): the
profile prices every forward's kernels (the slope of step time against batch, and the verify and
draft passes), the runs fix what is left. For each plain-decoding row, over its F forwards,

    r = (measured − kernels) / F                       host time per forward implied by the row
    pass_us = max(0, mean r)                           its intercept (the kernels are the slope)

(a batch latency of `vllm bench latency` is one prefill of batch · input_len tokens and
output_len − 1 decode forwards: F = output_len). For each speculative run with its tokens per
iteration τ (the mean accepted length, or 1 + a·k),

    O = τ · t_token − T_draft(k) − T_verify(k + 1) − pass_us      implied iteration overhead
    iteration_us = max(0, mean O)

(t_token: the run's time per generated token of one sequence). Held out: each batch size left
out of the fit of pass_us and predicted, each run left out of iteration_us. A term's uncertainty
is the spread of what its rows imply (the half-width of their range, relative to the term), at
least its held-out error; a term fixed by one row says so and takes 100 %.

The kernel times come as functions (`kernel_pass_us(tokens, context_tokens, sequences)`,
`draft_us(draft_len, context_tokens, batch)`), so this module prices nothing itself:
`moesim.sim.cost.steptime.StepTimeModel.dense_pass_us` and the drafter's cost are what the
command passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moesim.errors import InputError
from moesim.hw_profiles.engine_runs.rows import LATENCY_UNIT, DecodeStep, EngineRows, SpecRun

KernelPass = Callable[[float, float, float], float]
DraftTime = Callable[[int, float, int], float]  # (draft_len, context per sequence, batch) -> µs


@dataclass(frozen=True)
class ForwardRow:
    """One plain-decoding row in forwards: measured and kernel time over its F forwards (µs)."""

    source: str
    batch: int
    tokens_per_pass: int
    forwards: int
    measured_us: float
    kernel_us: float

    def implied_us(self) -> float:
        """r = (measured − kernels) / F."""
        return (self.measured_us - self.kernel_us) / self.forwards

    def predicted_us(self, pass_us: float) -> float:
        """kernels + F · pass_us."""
        return self.kernel_us + self.forwards * pass_us


@dataclass(frozen=True)
class IterationRow:
    """One speculative run in iterations: measured iteration time and its kernels' parts (µs)."""

    source: str
    batch: int
    draft_len: int
    tokens_per_iteration: float
    measured_us: float
    draft_us: float
    verify_us: float

    def implied_us(self, pass_us: float) -> float:
        """O = τ·t_token − T_draft − T_verify − pass_us."""
        return self.measured_us - self.draft_us - self.verify_us - pass_us

    def predicted_speedup(self, pass_us: float, iteration_us: float, baseline_token_us: float) -> float:
        """τ · t_baseline / (T_draft + T_verify + pass_us + iteration_us)."""
        return self.tokens_per_iteration * baseline_token_us / (self.draft_us + self.verify_us + pass_us + iteration_us)


@dataclass(frozen=True)
class EngineTerms:
    """The fitted terms with their basis, uncertainty (relative half-width) and held-out errors."""

    pass_us: float
    iteration_us: float
    basis: dict[str, str]
    uncertainty: dict[str, float]
    heldout_error: float
    forwards: tuple[ForwardRow, ...]
    iterations: tuple[IterationRow, ...]
    heldout: tuple[tuple[str, float], ...]  # (left-out group, relative error of its prediction)


def decode_context_tokens(step: DecodeStep) -> float:
    """Mean context per sequence over a row's decode forwards: the prompt and half the output."""
    return float(step.input_len or 0) + float(step.output_len or 0) / 2.0


def forward_row(step: DecodeStep, kernel_pass_us: KernelPass) -> ForwardRow:
    """A row in forwards: one forward for a step unit, prefill + output_len − 1 decodes for a batch latency."""
    batch = step.batch
    if step.unit == LATENCY_UNIT:
        prompt = float(step.input_len or 0)
        output = int(step.output_len or 0)
        prefill = kernel_pass_us(batch * prompt, batch * prompt / 2.0, batch)
        decode = kernel_pass_us(batch, batch * (prompt + output / 2.0), batch)
        return ForwardRow(step.source_url, batch, 1, output, step.value * 1e6, prefill + (output - 1) * decode)
    forward = step.forward_us()
    assert forward is not None
    tokens = batch * step.tokens_per_pass
    context = batch * (decode_context_tokens(step) if step.tokens_per_pass == 1 else float(step.input_len or 0) / 2.0)
    return ForwardRow(step.source_url, batch, step.tokens_per_pass, 1, forward, kernel_pass_us(tokens, context, batch))


def _spread(values: np.ndarray, centre: float) -> float:
    """Half the range of the implied values relative to the term (1.0 for one value or a term near 0)."""
    if len(values) < 2 or centre <= 0:
        return 1.0
    return float((values.max() - values.min()) / 2.0 / centre)


def fit_pass_us(rows: list[ForwardRow]) -> tuple[float, list[tuple[str, float]]]:
    """pass_us = max(0, mean r) and, leaving each batch size out, its rows' relative errors."""
    implied = np.array([r.implied_us() for r in rows])
    pass_us = max(0.0, float(implied.mean()))
    heldout = []
    for batch in sorted({r.batch for r in rows}):
        kept = [r.implied_us() for r in rows if r.batch != batch]
        if not kept:
            continue
        fitted = max(0.0, float(np.mean(kept)))
        heldout += [(f"batch {batch}: {r.source}", r.predicted_us(fitted) / r.measured_us - 1.0) for r in rows if r.batch == batch]
    return pass_us, heldout


def iteration_row(run: SpecRun, kernel_pass_us: KernelPass, draft_us: DraftTime) -> IterationRow | None:
    """A speculative run in iterations; None when it lacks τ or its draft length."""
    tau = run.tokens_per_iteration()
    if tau is None or run.draft_len is None:
        return None
    token_us = run.spec_value * 1000.0 if run.metric == "TPOT ms" else 1e6 / run.spec_value
    if run.metric == "t/s (batch total)":
        token_us *= run.batch
    context = float(run.input_len or 0) + float(run.output_len or 0) / 2.0
    verify = kernel_pass_us(run.batch * (run.draft_len + 1), run.batch * context, run.batch)
    return IterationRow(run.source_url, run.batch, run.draft_len, tau, tau * token_us, draft_us(run.draft_len, context, run.batch), verify)


def fit_engine_terms(rows: EngineRows, kernel_pass_us: KernelPass, draft_us: DraftTime | None = None) -> EngineTerms:
    """pass_us from the plain decoding, iteration_us from the speculative runs (module docstring)."""
    forwards = [forward_row(step, kernel_pass_us) for step in rows.steps]
    if not forwards:
        raise InputError("no plain-decoding row: give at least one run without speculation (a few batch sizes)")
    pass_us, heldout = fit_pass_us(forwards)
    implied = np.array([r.implied_us() for r in forwards])
    batches = sorted({r.batch for r in forwards})
    named = ", ".join(r.source for r in forwards)
    at = ", ".join(map(str, batches))
    basis = {"pass_us": f"mean of (measured - kernels) / forwards over {len(forwards)} rows at batch {at}: {named}"}
    heldout_error = float(np.median(np.abs([e for _, e in heldout]))) if heldout else math.nan
    spread = _spread(implied, pass_us)
    uncertainty = {"pass_us": max(spread, 0.0 if math.isnan(heldout_error) else heldout_error)}
    if len(forwards) == 1:
        basis["pass_us"] += " (one row: no spread, uncertainty 100 %)"
    iterations = [r for run in rows.runs if draft_us is not None and (r := iteration_row(run, kernel_pass_us, draft_us)) is not None]
    iteration_us = 0.0
    if iterations:
        overheads = np.array([r.implied_us(pass_us) for r in iterations])
        iteration_us = max(0.0, float(overheads.mean()))
        runs = ", ".join(r.source for r in iterations)
        basis["iteration_us"] = f"mean of tau * t_token - T_draft - T_verify - pass_us over {len(iterations)} speculative runs: {runs}"
        uncertainty["iteration_us"] = _spread(overheads, iteration_us)
        if len(iterations) > 1:
            for index, row in enumerate(iterations):
                others = max(0.0, float(np.delete(overheads, index).mean()))
                heldout.append((f"run {row.source}", (row.draft_us + row.verify_us + pass_us + others) / row.measured_us - 1.0))
    else:
        why = "no speculative run" if not rows.runs else "no speculative run with its acceptance, draft length and a drafter to price"
        basis["iteration_us"] = f"0: {why}"
    return EngineTerms(pass_us, iteration_us, basis, uncertainty, heldout_error, tuple(forwards), tuple(iterations), tuple(heldout))
