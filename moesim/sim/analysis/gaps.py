"""The gaps of an answer, exported as a measurement plan (`predict --out`, `validate --out`).

A gap is a pass (expert shape, kernel family, pass size n, distinct experts U, tokens of the busiest
expert M) whose expert time the lookup ladder took from the `fitted` or `extrapolated` rung, not
from measured points (`exact`, `interpolated`). Each carries the share of its pass's (or row's)
predicted time resting on it; the plan carries the share of the whole answer. `moesim microbench
torch --plan` measures exactly these passes (`moesim.hw_profiles.microbench.plan`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles.families import ExpertInputs
from moesim.hw_profiles.ladder.rungs import FITTED, RUNGS
from moesim.hw_profiles.microbench.plan import GAP_RUNGS, PLAN_FORMAT, Plan, PlannedPass, merged_passes
from moesim.kernels.features import RoutingFeatures
from moesim.sim.analysis.predict import Prediction
from moesim.sim.analysis.scenario import Scenario
from moesim.sim.cost.pass_features import window_distributions
from moesim.sim.cost.steptime import PassCost, StepTimeModel

TABLE_COLUMNS = ("kernel", "model", "hidden", "expert_intermediate", "experts", "top_k", "dtype", "n_tokens", "distinct_experts",
                 "max_tokens_per_expert")  # fmt: skip


def check_plannable(model: StepTimeModel, batch: int = 1) -> None:
    """One line where the passes' gaps cannot be planned: expert-parallel passes (each layer at its
    slowest rank's features) and batched passes (their unions are sampled, not distributed)."""
    if model.parallel.ranks > 1:
        raise InputError("--out: the plan of expert-parallel passes is not written (each layer runs at its slowest rank's features)")
    if batch != 1:
        raise InputError("--out with --batch > 1: the plan of batched passes is not written (predict one request per pass)")


def window_gaps(
    model: StepTimeModel, distributions: list[tuple[RoutingFeatures, np.ndarray]], cost: PassCost
) -> tuple[list[PlannedPass], float]:
    """The gaps of expected pass costs (`StepTimeModel.expected_pass_cost` of these distributions):
    per pass size, every feature value of the chosen family's fitted or extrapolated rung with
    probability > 0, its share p·t / Σ p·t of the family's layer time times the pass's expert
    share; and the share of Σ T over the pass sizes resting on them."""
    check_plannable(model)
    shape, preset = model.expert_shape, model.preset
    name = preset.name  # a tensor-parallel device's share of each expert is a shape of its own
    if shape.intermediate != preset.expert_intermediate:
        name = f"{preset.name}[expert_intermediate={shape.intermediate}]"
    total = np.asarray(cost.total_us(), np.float64)
    gaps, resting_us = [], 0.0
    for i, (features, probability) in enumerate(distributions):
        family = model.profile.expert_family(str(cost.family[i])).for_format(shape.weight_format)
        look = family.inputs_lookup(ExpertInputs.of(features, shape), whole_pass=True)
        weighted = probability * look.time_us
        layer_us = float(weighted.sum())
        if not layer_us > 0 or not total[i] > 0:
            continue
        pass_share = float(cost.expert_us[i]) / float(total[i])
        n_tokens = np.broadcast_to(features.n_tokens, weighted.shape)
        gap = (look.rung >= FITTED) & (probability > 0)
        resting_us += float(weighted[gap].sum()) / layer_us * pass_share * float(total[i])
        described = {"model": name, "hidden": shape.hidden, "expert_intermediate": shape.intermediate, "experts": preset.experts,
                     "top_k": preset.top_k, "weight_format": shape.weight_format, "family": family.name}  # fmt: skip
        for j in np.flatnonzero(gap):
            cell = {"n_tokens": int(n_tokens[j]), "distinct_experts": round(float(features.distinct_experts[j])),
                    "max_tokens_per_expert": round(float(features.max_tokens_per_expert[j])), "rung": RUNGS[int(look.rung[j])],
                    "time_share": min(1.0, float(weighted[j]) / layer_us * pass_share)}  # fmt: skip
            gaps.append(PlannedPass(**described, **cell))
    return _summed(gaps), min(1.0, resting_us / float(total.sum())) if total.sum() > 0 else 0.0


def _summed(gaps: list[PlannedPass]) -> list[PlannedPass]:
    """Cells of one pass with equal (U, M) (other reuse features) as one: their shares summed."""
    shares: dict[tuple[object, ...], float] = {}
    for g in gaps:
        key = (g.family, g.n_tokens, g.distinct_experts, g.max_tokens_per_expert)
        shares[key] = shares.get(key, 0.0) + g.time_share
    return [
        dataclasses.replace(g, time_share=min(1.0, shares[(g.family, g.n_tokens, g.distinct_experts, g.max_tokens_per_expert)]))
        for g in merged_passes(gaps)
    ]


def table_gaps(predictions: pl.DataFrame) -> tuple[list[PlannedPass], float, list[str]]:
    """The gaps of `validate`'s predicted rows: rows of one layer's features (n, U, M and the expert
    shape given) priced from a fitted or extrapolated rung; the share of the rows' summed predicted
    time resting on those rungs; a note for rows resting on them whose layers the table does not describe."""
    shares = [f"rung_{r}_share" for r in GAP_RUNGS]
    if predictions.height == 0 or not set(shares) <= set(predictions.columns):
        return [], 0.0, []
    frame = predictions.with_columns(_gap_share=pl.sum_horizontal(*shares).fill_null(0.0))
    predicted = frame["predicted_us"].fill_null(0.0).fill_nan(0.0)
    total = float(predicted.sum())
    share = float((predicted * frame["_gap_share"]).sum()) / total if total > 0 else 0.0
    gapped = frame.filter(pl.col("_gap_share") > 0)
    described = [c for c in TABLE_COLUMNS if c in gapped.columns]
    complete = gapped.clear()
    if len(described) == len(TABLE_COLUMNS):
        complete = gapped.filter(pl.all_horizontal(pl.col(c).is_not_null() for c in described))
    notes = []
    if complete.height < gapped.height:
        notes.append(f"{gapped.height - complete.height} predicted row(s) rest on fitted or extrapolated rungs but give no single "
                     "layer's features and shape (whole passes): not planned")  # fmt: skip
    gaps = [PlannedPass(**_row_pass(row)) for row in complete.iter_rows(named=True)]
    return merged_passes(gaps), min(1.0, share), notes


def _row_pass(row: dict[str, object]) -> dict[str, object]:
    """A planned pass's fields from a predicted row of one layer."""
    counts = ("hidden", "expert_intermediate", "experts", "top_k", "n_tokens", "distinct_experts", "max_tokens_per_expert")
    fields = {name: int(row[name]) for name in counts}  # type: ignore[call-overload]
    extrapolated = float(row["rung_extrapolated_share"] or 0.0) > 0  # type: ignore[arg-type]
    return {"model": str(row["model"]), "weight_format": str(row["dtype"]).upper(), "family": str(row["kernel"]), **fields,
            "rung": "extrapolated" if extrapolated else "fitted", "time_share": min(1.0, float(row["_gap_share"]))}  # type: ignore[arg-type]  # fmt: skip


def prediction_plan(scenario: Scenario, prediction: Prediction, source: str) -> Plan:
    """The plan of `predict`'s answer: the gaps of its passes over the trace's windows."""
    check_plannable(scenario.model, prediction.batch)
    distributions = window_distributions(scenario.trace, prediction.n)
    gaps, share = window_gaps(scenario.model, distributions, prediction.cost)
    return gap_plan(gaps, share, source, scenario.model.profile.name, [])


def gap_plan(gaps: list[PlannedPass], share: float, source: str, profile: str, notes: list[str]) -> Plan:
    """The plan of an answer's gaps (a note when the answer rests on measured points only)."""
    if not gaps:
        notes = [*notes, "no pass rests on a fitted or extrapolated rung: nothing to measure"]
    return Plan(format=PLAN_FORMAT, source=source, profile=profile, answer_share=share, notes=tuple(notes), passes=tuple(gaps))
