"""How far the shared rows let an engine profile be judged: what a held-out split leaves in the fit,
and how closely the table repeats itself.

A split can only be as good as the data let it be. Three floors come from the table alone
(`data/public-bench/moe_pass_times.csv`, no fit):

- **repeats**: llama-bench's own spread over its repetitions, the `± s` a row's notes carry
  (s / value: the noise of one measured time);
- **another build**: two builds (variants, PRs, sources) timing the same test of the same model,
  format, microbatch and device, |t_a / t_b − 1| over every pair: what a perfect model of one build
  would miss on the other;
- **another build's shape**: the same for T(n)/T(n0) of a series timed by two builds over the same
  sizes (n0 the smallest common size).

Two come from the fit: leave one pass size out on every device (the device's rows at that size
predicted by its fit over its other sizes: what the model gets from sizes it did not see, with
their build and format in the fit), and whether leave one model out leaves in the fit any row of
the held-out model's build and weight format (`represented`).

One splits leave one model out by what the fit saw of each held-out row (`model_out_seen`): its
build, its weight format, both or neither in the other models' rows; and judges the same split
once more with an oracle, the held-out rows' unseen build priced at its own fixed times (per pass
and per layer, from the fit on all the device's rows, `with_fixed_times`). The oracle is not a
held-out figure: those fixed times are fitted on the judged rows, the only rows of their build. It
says how much of the error is the build the fit never saw, and how much the curves, the formats
and the models.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from itertools import combinations

import numpy as np

from moesim.hw_profiles.engines import ENGINES, Engine
from moesim.hw_profiles.fitting.engine_builtins import Recipe, profile_frame, recipe_rows
from moesim.hw_profiles.fitting.engine_fit import (
    Coefficients,
    ProfileFrame,
    fit_coefficients,
    heldout_predictions,
    predict_rows,
    profile_of,
)
from moesim.hw_profiles.fitting.engine_validation import Judged
from moesim.hw_profiles.fitting.whole_pass import PassRow, predicted_by_era
from moesim.hw_profiles.profile import HardwareProfile

_SPREAD = re.compile(r"±\s*([0-9.]+)")
_CONFIG = ("device", "backend", "model", "quant", "test")
RATE_UNIT = "t/s"  # rows whose time per pass is ubatch / value: two builds' times compare as their values' inverse


def represented(rows: Iterable[tuple[str, str, str]]) -> tuple[int, int]:
    """Rows (model, build, format) of a device: how many have their build and format in the rows of
    the device's other models (what leave one model out keeps in the fit), and how many rows."""
    rows = list(rows)
    kept = sum(1 for model, build, fmt in rows if any(m != model and (b, f) == (build, fmt) for m, b, f in rows))
    return kept, len(rows)


def repeat_spread(records: Iterable[dict[str, str]]) -> np.ndarray:
    """s / value of every row whose notes give llama-bench's spread `± s` over its repetitions."""
    out = []
    for record in records:
        found = _SPREAD.search(record.get("notes", ""))
        value = float(record["value"]) if record.get("value") else 0.0
        if found and value > 0:
            out.append(float(found[1]) / value)
    return np.array(out)


def _rate_series(records: Iterable[dict[str, str]]) -> dict[tuple[str, ...], dict[tuple[str, str], dict[int, float]]]:
    """Per config (`_CONFIG`), per build (source, variant), time per token by microbatch (1 / value)."""
    out: dict[tuple[str, ...], dict[tuple[str, str], dict[int, float]]] = {}
    for record in records:
        if record.get("unit") != RATE_UNIT or not record.get("ubatch", "").isdigit() or float(record["value"]) <= 0:
            continue
        build = (record["source_url"], record["variant"])
        series = out.setdefault(tuple(record[c] for c in _CONFIG), {}).setdefault(build, {})
        series.setdefault(int(record["ubatch"]), 1.0 / float(record["value"]))
    return out


def build_spread(records: Iterable[dict[str, str]]) -> np.ndarray:
    """|t_a / t_b − 1| over every pair of builds timing one config at one microbatch (t_a the later-listed build's)."""
    out = []
    for builds in _rate_series(records).values():
        for (_, a), (_, b) in combinations(builds.items(), 2):
            out += [abs(b[n] / a[n] - 1.0) for n in sorted(set(a) & set(b))]
    return np.array(out)


def build_shape_spread(records: Iterable[dict[str, str]]) -> np.ndarray:
    """|(T_b(n)/T_b(n0)) / (T_a(n)/T_a(n0)) − 1| over every pair of builds timing one config's series
    at two or more common microbatches (n0 the smallest; T = n · time per token)."""
    out = []
    for builds in _rate_series(records).values():
        for (_, a), (_, b) in combinations(builds.items(), 2):
            common = sorted(set(a) & set(b))
            if len(common) >= 2:
                n0 = common[0]
                out += [abs((b[n] / b[n0]) / (a[n] / a[n0]) - 1.0) for n in common[1:]]
    return np.array(out)


def leave_one_size_out(item: Recipe) -> Judged | None:
    """The device's rows at each pass size predicted by its fit over its rows of the other sizes
    (None where it has fewer than three sizes)."""
    rows = recipe_rows(item)
    sizes = np.array([r.n_tokens for r in rows])
    if len(set(sizes.tolist())) < 3:
        return None
    predicted = heldout_predictions(rows, ENGINES.create(item.engine), profile_frame(item), sizes)
    return Judged(item.name, "leave one size out", "same device, other sizes", rows, predicted)


def interior(judged: Judged) -> np.ndarray:
    """Whether each row's size lies strictly inside the sizes of its model and build on the device
    (its prediction interpolates between sizes the fit saw, not beyond them)."""
    spans: dict[tuple[str, str], list[int]] = {}
    for r in judged.rows:
        spans.setdefault((r.model, r.era), []).append(r.n_tokens)
    return np.array([min(spans[(r.model, r.era)]) < r.n_tokens < max(spans[(r.model, r.era)]) for r in judged.rows])


def with_fixed_times(profile: HardwareProfile, other: HardwareProfile) -> HardwareProfile:
    """The profile with the other's fixed times: per pass, and per layer of each family both have."""
    families = {
        name: dataclasses.replace(family, fixed_us=other.expert_families[name].fixed_us) if name in other.expert_families else family
        for name, family in profile.expert_families.items()
    }
    return dataclasses.replace(profile, expert_families=families, pass_fixed_us=other.pass_fixed_us)


@dataclass(frozen=True)
class ModelOut:
    """Leave one model out on one device, with what the fit saw of each held-out row."""

    judged: Judged  # as the built-ins' held-out error: a fit without the model's rows
    oracle: Judged  # the same, a row of an unseen build at that build's own fixed times (fitted on all rows)
    build_seen: np.ndarray  # per row: another model of the device ran its build
    format_seen: np.ndarray  # per row: another model of the device ran its weight format


@dataclass(frozen=True)
class Fits:
    """A fit without the judged rows, and the fit on all of them."""

    train: list[PassRow]
    fitted: Coefficients
    rows: list[PassRow]
    everything: Coefficients


def _own_fixed_times(fits: Fits, engine: Engine, frame: ProfileFrame, era: str) -> HardwareProfile:
    """The training fit's profile of a build era; of an era the training rows lack, at that era's own
    fixed times (the fit on all rows)."""
    profile = profile_of(fits.train, engine, fits.fitted, dataclasses.replace(frame, era=era), {})
    if any(r.era == era for r in fits.train):
        return profile
    return with_fixed_times(profile, profile_of(fits.rows, engine, fits.everything, dataclasses.replace(frame, era=era), {}))


def model_out_seen(item: Recipe) -> ModelOut | None:
    """Leave one model out on the recipe's device (None where it has one model), plain and with the
    unseen build's fixed times as an oracle (`ModelOut`)."""
    rows = recipe_rows(item)
    models = [r.model for r in rows]
    if len(set(models)) < 2:
        return None
    engine, frame = ENGINES.create(item.engine), profile_frame(item)
    everything = fit_coefficients(rows, engine, frame.roofline)
    plain, oracle = np.full(len(rows), np.nan), np.full(len(rows), np.nan)
    build_seen, format_seen = np.zeros(len(rows), bool), np.zeros(len(rows), bool)
    for model in dict.fromkeys(models):
        held = np.array([m == model for m in models])
        train = [r for r, h in zip(rows, held, strict=True) if not h]
        judged = [r for r, h in zip(rows, held, strict=True) if h]
        fitted = fit_coefficients(train, engine, frame.roofline)
        eras, formats = {r.era for r in train}, {r.shape.weight_format for r in train}
        build_seen[held] = [r.era in eras for r in judged]
        format_seen[held] = [r.shape.weight_format in formats for r in judged]
        plain[held] = predict_rows(judged, train, engine, fitted, frame)

        oracle[held] = predicted_by_era(judged, partial(_own_fixed_times, Fits(train, fitted, rows, everything), engine, frame))
    label = "same device, other models"
    return ModelOut(
        Judged(item.name, "leave one model out", label, rows, plain),
        Judged(item.name, "leave one model out, the unseen build's own fixed times", label, rows, oracle),
        build_seen,
        format_seen,
    )
