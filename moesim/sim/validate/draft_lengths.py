"""Validation of speculative decoding through llama.cpp: the cost model's error apart from the
acceptance model's (issue 8).

Inputs are measured speculative runs (contract 2) of one target and draft at several draft
lengths, one of them the longest (the *source*, k = 16), and the step-time model of the target on
a profile calibrated on the same machine. The draft is a noisy copy of the target (same
architecture), so its passes go through the same step-time model; each draft pass is routed like
the target routed the same tokens (the noise perturbs the draft's routing a little).

- Acceptance: greedy acceptance accepts a prefix of the drafts, so a source step that accepted a
  of its 16 drafts would have accepted min(a, k) of its first k: the empirical tokens per pass
  τ(k) = mean(min(a, k) + 1), for every k <= 16, from the source alone.
- Pass times: a verify pass of k + 1 tokens at a source step routes exactly like the first k + 1
  slots of the source's pass (attention is causal), so the verify time for every k is predicted
  from the source's routing; a draft step is the catch-up pass (the bonus token, and the last
  draft when all were accepted) plus k − 1 one-token passes.
- Predicted tokens/s(k) = τ(k) / (T̂_draft(k) + T̂_verify(k + 1)); k = 0 is plain decoding, 1 / T̂(1).
- Measured runs at each k give τ(k), the draft and verify times and tokens/s; every measured pass
  is also predicted on its own routing, which gives the cost model's error per k alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles.heldout import ErrorStats, relative_errors
from moesim.sim.cost.measured_passes import plain_decode_us, predicted_step_times, truncated_tokens_per_pass
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.validate.metrics import best_draft_length, rank_agreement
from moesim.tracegen.formats.specrun import SpecRun


def _plain_measured_us(run: SpecRun) -> float:
    times = [s.plain_decode_us for s in run.meta.sequences]
    if not times or not np.all(np.isfinite(times)):
        raise InputError("plain decoding was not timed in every sequence of the run (run with the baseline)")
    return float(np.mean(times))


def source_predictions(source: SpecRun, model: StepTimeModel) -> pl.DataFrame:
    """From the longest run alone: τ(k) by truncation and predicted times and tokens/s, k = 0..k_max."""
    drafted = source.steps["drafted"].to_numpy()
    k_max = int(drafted.max())
    if np.any(drafted != k_max):
        raise InputError(f"the source run must draft the same length in every step, found {sorted(set(drafted.tolist()))}")
    tau = truncated_tokens_per_pass(source.steps["accepted"].to_numpy(), k_max)
    context = source.steps["pos0"].to_numpy().astype(np.float64) + 1.0
    rows = [{"draft_len": 0, "tokens_per_pass": 1.0, "draft_us": 0.0, "verify_us": float(plain_decode_us(model, context).mean())}]
    for k in range(1, k_max + 1):
        draft, verify = predicted_step_times(source, model, k)
        rows.append({"draft_len": k, "tokens_per_pass": float(tau[k]), "draft_us": float(draft.mean()), "verify_us": float(verify.mean())})
    frame = pl.DataFrame(rows)
    return frame.with_columns((pl.col("tokens_per_pass") * 1e6 / (pl.col("draft_us") + pl.col("verify_us"))).alias("tokens_per_s"))


def measured_draft_length(run: SpecRun, model: StepTimeModel) -> dict[str, float]:
    """One measured run: τ, mean draft and verify times, tokens/s, and the same passes predicted."""
    steps = run.steps
    accepted = steps["accepted"].to_numpy().astype(np.float64)
    draft_meas, verify_meas = steps["draft_us"].to_numpy(), steps["verify_us"].to_numpy()
    draft_pred, verify_pred = predicted_step_times(run, model)
    tokens = float((accepted + 1).sum())
    verify_errors = ErrorStats.from_errors(relative_errors(verify_pred, verify_meas))
    draft_errors = ErrorStats.from_errors(relative_errors(draft_pred, draft_meas))
    return {
        "draft_len": int(steps["drafted"].max()),  # type: ignore[arg-type]
        "steps": steps.height,
        "tokens_per_pass": tokens / steps.height,
        "draft_us": float(draft_meas.mean()),
        "verify_us": float(verify_meas.mean()),
        "tokens_per_s": tokens * 1e6 / float(draft_meas.sum() + verify_meas.sum()),
        "draft_us_predicted": float(draft_pred.mean()),
        "verify_us_predicted": float(verify_pred.mean()),
        "tokens_per_s_predicted": tokens * 1e6 / float(draft_pred.sum() + verify_pred.sum()),
        "verify_abs_error_median_pct": 100 * verify_errors.median,
        "verify_abs_error_p90_pct": 100 * verify_errors.p90,
        "verify_signed_error_mean_pct": 100 * float(np.mean(relative_errors(verify_pred, verify_meas))),
        "draft_abs_error_median_pct": 100 * draft_errors.median,
        "draft_signed_error_mean_pct": 100 * float(np.mean(relative_errors(draft_pred, draft_meas))),
    }


@dataclass(frozen=True)
class DraftValidation:
    """Per draft length: measured, predicted on the measured passes, and predicted from the source alone."""

    per_k: pl.DataFrame  # measured draft lengths (and k = 0)
    source: pl.DataFrame  # every k <= k_max, from the source run alone

    def best(self) -> dict[str, int]:
        """Best draft length over the measured set: measured, predicted from the source alone, and on
        the measured passes; and the source's best over every k."""
        k = self.per_k["draft_len"].to_numpy()
        return {
            "measured": best_draft_length(k, self.per_k["tokens_per_s"].to_numpy()),
            "predicted_from_source": best_draft_length(k, self.per_k["tokens_per_s_from_source"].to_numpy()),
            "predicted_on_measured_passes": best_draft_length(k, self.per_k["tokens_per_s_predicted"].to_numpy()),
            "predicted_from_source_any_k": best_draft_length(self.source["draft_len"].to_numpy(), self.source["tokens_per_s"].to_numpy()),
        }

    def rank_agreement(self) -> float:
        """Spearman's ρ between measured tokens/s and those predicted from the source, over the measured k."""
        return rank_agreement(self.per_k["tokens_per_s"].to_numpy(), self.per_k["tokens_per_s_from_source"].to_numpy())


def validate_draft_lengths(runs: list[SpecRun], model: StepTimeModel) -> DraftValidation:
    """Compare measured runs at several draft lengths with the predictions; the longest run is the source."""
    if not runs:
        raise InputError("no speculative runs to validate")
    lengths = [int(r.steps["drafted"].max()) for r in runs]  # type: ignore[arg-type]
    if len(set(lengths)) != len(lengths):
        raise InputError(f"one run per draft length, got draft lengths {sorted(lengths)}")
    source = runs[int(np.argmax(lengths))]
    predicted = source_predictions(source, model)
    plain = min(_plain_measured_us(r) for r in runs)
    context = source.steps["pos0"].to_numpy().astype(np.float64) + 1.0
    plain_row = {
        "draft_len": 0,
        "steps": 0,
        "tokens_per_pass": 1.0,
        "draft_us": 0.0,
        "verify_us": plain,
        "tokens_per_s": 1e6 / plain,
        "draft_us_predicted": 0.0,
        "verify_us_predicted": float(plain_decode_us(model, context).mean()),
    }
    plain_row["tokens_per_s_predicted"] = 1e6 / plain_row["verify_us_predicted"]
    rows = [plain_row] + [measured_draft_length(r, model) for r in sorted(runs, key=lambda r: int(r.steps["drafted"].max()))]  # type: ignore[arg-type]
    per_k = pl.DataFrame(rows, infer_schema_length=None).join(
        predicted.rename({c: f"{c}_from_source" for c in ("tokens_per_pass", "draft_us", "verify_us", "tokens_per_s")}),
        on="draft_len",
        how="left",
    )
    return DraftValidation(per_k, predicted)
