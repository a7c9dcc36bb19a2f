"""Measured speculative runs (contract 2): every verify step predicted through the step-time model;
tokens per second per draft length, measured and predicted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.sim.cost.measured_passes import plain_decode_us, verify_passes
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.validate.metrics import (
    curve_key,
    speculative_curves,
)
from moesim.sim.validate.predictions import (
    Context,
    pass_prediction,
    target_preset,
)
from moesim.tracegen.formats.specrun import SpecRun


def run_family(ctx: Context, source: Path) -> str:
    """The family of a run's kernel: --family, else the profile's only expert family."""
    family = ctx.options.family
    families = list(ctx.profile.expert_families)
    if family is None:
        if len(families) != 1:
            raise InputError(f"{source}: profile '{ctx.profile.name}' has several expert families ({', '.join(families)}): give --family")
        family = families[0]
    ctx.family(family, f"{source}: --family")
    return family


def predict_run(run: SpecRun, source: Path, ctx: Context) -> tuple[pl.DataFrame, StepTimeModel]:
    """One row per verify step: the measured pass and its prediction through the step-time model."""
    g = run.meta.geometry
    family = run_family(ctx, source)
    preset = target_preset(ctx.options.model or g.model, f"{source}", ctx, g)
    model = StepTimeModel(preset, ctx.profile, family, g.weight_format)
    steps = run.steps
    n_tokens = (steps["drafted"].cast(pl.Int64) + 1).to_numpy()
    predicted = pass_prediction(model, *verify_passes(run))
    plain = [s.plain_decode_us for s in run.meta.sequences]
    frame = pl.DataFrame(
        {
            "kernel": family,
            "model": g.model,
            "draft_model": run.meta.draft_model,
            "_scope": "pass",
            "seq": steps["seq"].cast(pl.Int64),
            "step": steps["step"].cast(pl.Int64),
            "window_start": steps["pos0"].cast(pl.Int64),
            "n_tokens": n_tokens,
            "draft_len": steps["drafted"].cast(pl.Int64),
            "accepted": steps["accepted"].cast(pl.Float64),
            "draft_us": steps["draft_us"],
            "time_us": steps["verify_us"],
            "plain_decode_us": [plain[s] for s in steps["seq"].to_list()],
        }
    )
    return frame.with_columns(predicted.columns()), model


def speculative_curves_of(tables: list[pl.DataFrame], runs: list[tuple[pl.DataFrame, StepTimeModel]]) -> list[dict[str, Any]]:
    """Tokens per second per draft length, measured and predicted with the measured acceptance
    and drafting time; k = 0 from plain decoding where the runs timed it."""
    per_draft = []
    for rows in tables:
        if rows.height == 0:
            continue
        columns = [c for c in curve_key(rows) if c not in ("_scope", "layers", "window_start", "seq", "_source", "_row")]
        tokens = 1.0 + pl.col("accepted")
        grouped = rows.group_by(*columns, "draft_len").agg(
            pl.col("tokens_per_s").mean().alias("tokens_per_s_measured"),
            (tokens * 1e6 / (pl.col("draft_us") + pl.col("predicted_us"))).mean().alias("tokens_per_s_predicted"),
            tokens.mean().alias("tokens_per_pass"),
        )
        per_draft.append((grouped, columns))
    run_rows = []
    for steps, model in runs:
        tokens = float((steps["accepted"] + 1.0).sum())
        row = {
            "model": steps["model"][0],
            "draft_model": steps["draft_model"][0],
            "draft_len": int(steps["draft_len"].max()),  # type: ignore[arg-type]
            "tokens_per_s_measured": tokens * 1e6 / float((steps["draft_us"] + steps["time_us"]).sum()),
            "tokens_per_s_predicted": tokens * 1e6 / float((steps["draft_us"] + steps["predicted_us"]).sum()),
            "tokens_per_pass": tokens / steps.height,
        }
        run_rows.append(row)
        plain = steps["plain_decode_us"].drop_nans().drop_nulls()
        if plain.len() == steps.height:
            context = steps["window_start"].to_numpy().astype(np.float64) + 1.0
            one_token = plain_decode_us(model, context)
            run_rows.append({**row, "draft_len": 0, "tokens_per_pass": 1.0, "tokens_per_s_measured": 1e6 / float(plain.mean()),
                             "tokens_per_s_predicted": 1e6 / float(one_token.mean())})  # fmt: skip
    if run_rows:
        frame = pl.DataFrame(run_rows).group_by("model", "draft_model", "draft_len", maintain_order=True).agg(pl.all().mean())
        per_draft.append((frame, ["model", "draft_model"]))
    return [curve for grouped, columns in per_draft for curve in speculative_curves(grouped, columns)]
