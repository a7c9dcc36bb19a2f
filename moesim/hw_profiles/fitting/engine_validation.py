"""Judging the engine profiles inside the shared tables: leave one model out on every device with
two or more models, leave one device out within each engine (a device's rows predicted by another
device's calibration of the same engine, scaled by their datasheets), and per series of one model
and build, the error of T(n)/T(n0) and the measured against the predicted kernel switch.

`VALIDATION` holds recipes of devices that only judge (no built-in profile rests on them): the
HIP builds of llama.cpp's CUDA code on two AMD GPUs, three Vulkan devices and an older Metal build.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from moesim.hw_profiles.catalog import catalog
from moesim.hw_profiles.engines import ENGINES
from moesim.hw_profiles.fitting.derive import scaled_engine_profile
from moesim.hw_profiles.fitting.engine_builtins import RECIPES, Group, Recipe, recipe_rows
from moesim.hw_profiles.fitting.engine_fit import EngineFit
from moesim.hw_profiles.fitting.whole_pass import PassRow, predict_us, predicts
from moesim.hw_profiles.heldout import ErrorStats
from moesim.hw_profiles.profile import HardwareProfile
from moesim.hw_profiles.report import dedup_comparison
from moesim.models import load_preset

VALIDATION: tuple[Recipe, ...] = (
    Recipe(
        "amd-rx-7900-xtx-hip",
        "amd-rx-7900-xtx",
        "llama.cpp CUDA",
        "rdna3",
        (Group((129, 131, 133, 135, 137, 139, 141), "2026-03-29", "2026-09-02 #24546 master"),),
    ),
    Recipe(
        "amd-mi100-hip",
        "amd-mi100",
        "llama.cpp CUDA",
        "cdna",
        (Group((84, 86, 88, 90), "2026-03-29", "2026-04-23 #22298 master"), Group((224, 226), "2026-03-29", "2026-07-15 #25441 b10032")),
    ),
    Recipe(
        "amd-w7800-vulkan",
        "amd-w7800",
        "llama.cpp Vulkan",
        "any",
        (Group(tuple(range(429, 460, 2)), "2026-01-21", "2026-08-06 #26686 before"),),
    ),
    Recipe(
        "nvidia-rtx-5090-vulkan", "nvidia-rtx-5090", "llama.cpp Vulkan", "any", (Group((258, 259, 260), "2024-11-01", "2025-08-24 #15546"),)
    ),
    Recipe(
        "amd-radeon-pro-vii-vulkan",
        "amd-radeon-pro-vii",
        "llama.cpp Vulkan",
        "any",
        (Group((292, 294, 296, 298), "2024-11-01", "2025-08-23 #15524 after"),),
    ),
    Recipe(
        "apple-m2-max-metal", "apple-m2-max-30", "llama.cpp Metal", "any", (Group((245, 246, 247), "2025-03-28", "2025-04-02 a6f32f0b3"),)
    ),
)
CLIFF_SLOPE = 3.0
DROP = 0.98


def all_recipes() -> tuple[Recipe, ...]:
    """The built-ins' recipes and the judging-only ones."""
    return (*RECIPES, *VALIDATION)


@dataclass(frozen=True)
class Judged:
    """Rows of one device predicted without them: by leaving their model out, or their device."""

    target: str
    split: str
    source: str
    rows: list[PassRow]
    predicted_us: np.ndarray

    def errors(self) -> np.ndarray:
        """Relative errors of the predicted rows (NaN where none was predicted)."""
        return self.predicted_us / np.array([r.time_us for r in self.rows]) - 1.0

    def stats(self) -> ErrorStats | None:
        """Absolute relative errors of the rows predicted."""
        errors = self.errors()
        errors = errors[np.isfinite(errors)]
        return ErrorStats.from_errors(errors) if errors.size else None


def leave_one_model_out(fit: EngineFit, name: str) -> Judged | None:
    """The fit's own leave-one-model-out predictions, where its rows hold two or more models."""
    if fit.split != "leave_one_shape_out":
        return None
    return Judged(name, "leave one model out", "same device, other models", fit.rows, fit.heldout_us)


def leave_one_device_out(target: Recipe, source: Recipe, source_fit: EngineFit, rows: list[PassRow] | None = None) -> Judged:
    """The target's rows (or those given) predicted by the source device's fit scaled to the
    target's datasheet (same engine), each row with its own build's dispatch (NaN where that build
    runs a family the source never ran)."""
    specs = catalog()
    scaled = scaled_engine_profile(source_fit.profile, specs[target.device], specs[source.device], target.name, source_fit.profile.dispatch)
    rows = recipe_rows(target) if rows is None else rows
    predicted = np.array([predict_us(row, scaled) if predicts(row, scaled) else np.nan for row in rows])
    return Judged(target.name, "leave one device out", source.name, rows, predicted)


def series_of(rows: list[PassRow]) -> dict[tuple[str, str, str], list[int]]:
    """Rows of one model, build and test (batched decode of any batch size is one test), by pass
    size; a size timed twice counts once (its first row)."""
    groups: dict[tuple[str, str, str], dict[int, int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault((row.model, row.era, re.sub(r" B\d+$", "", row.test)), {}).setdefault(row.n_tokens, i)
    return {key: [by_size[n] for n in sorted(by_size)] for key, by_size in groups.items() if len(by_size) >= 2}


def ratio_errors(judged: Judged) -> np.ndarray:
    """Errors of T(n)/T(n0) within each series (n0 its smallest pass size)."""
    errors = []
    for indices in series_of(judged.rows).values():
        measured = np.array([judged.rows[i].time_us for i in indices])
        predicted = judged.predicted_us[indices]
        if np.isfinite(predicted).all():
            errors.append((predicted[1:] / predicted[0]) / (measured[1:] / measured[0]) - 1.0)
    return np.concatenate(errors) if errors else np.array([])


def measured_cliff(sizes: list[int], times: np.ndarray) -> int | None:
    """The first pass size past a cliff: a drop in time, or a ms-per-token slope over 3x both neighbours'."""
    slopes = np.diff(times) / np.diff(np.asarray(sizes, np.float64))
    for i, slope in enumerate(slopes):
        if times[i + 1] < DROP * times[i]:
            return sizes[i + 1]
        neighbours = [slopes[j] for j in (i - 1, i + 1) if 0 <= j < len(slopes)]
        if neighbours and slope > 0 and all(slope > CLIFF_SLOPE * max(n, 0.0) for n in neighbours):
            return sizes[i + 1]
    return None


@dataclass(frozen=True)
class Switch:
    """One series: its model, build and test, sizes, the measured cliff and the dispatch's switch."""

    model: str
    build: str
    test: str
    sizes: list[int]
    measured: int | None
    dispatched: int | None


def switches(rows: list[PassRow]) -> list[Switch]:
    """Per series, the measured cliff and where the row's build switches kernel family."""
    out = []
    for (model, build, test), indices in series_of(rows).items():
        sizes = [rows[i].n_tokens for i in indices]
        families = [rows[i].family_at(n) for i, n in zip(indices, sizes, strict=True)]
        dispatched = next((sizes[j] for j in range(1, len(sizes)) if families[j] != families[j - 1]), None)
        out.append(Switch(model, build, test, sizes, measured_cliff(sizes, np.array([rows[i].time_us for i in indices])), dispatched))
    return out


@dataclass(frozen=True)
class ShareAnswer:
    """The paper's question on one engine profile: r(n) of its mat-mat family against u(n)."""

    profile: str
    model: str
    weight_format: str
    family: str
    ratio: dict[int, float]
    dedup_faster: list[int]
    engine_switch: int | None


def byte_share_answers(profile: HardwareProfile, model: str, weight_format: str, sizes: tuple[int, ...]) -> list[ShareAnswer]:
    """u(n) against r(n) = u·T_per_slot / T_dedup of each deduplicating family the engine runs for
    the format, under uniform routing; where dedup is faster (u < r), and where the engine switches."""
    preset = load_preset(model)
    shape = preset.expert_shape(weight_format)
    dispatch = profile.dispatch
    runs = dispatch.families_for(weight_format) if dispatch else profile.dedup_families
    families = [f for f in runs if f in profile.dedup_families]
    table = dedup_comparison(profile, shape, preset.experts, preset.top_k, sizes, dedup_families=tuple(families)).to_dicts()
    answers = []
    for family in families:
        moves = dispatch.switches(weight_format, preset.experts, preset.top_k, 4096) if dispatch else []
        switch = next((n for n, _, to in moves if to == family), None)
        answers.append(
            ShareAnswer(
                profile.name,
                model,
                weight_format,
                family,
                {int(row["n"]): float(row[f"r_{family}"]) for row in table},
                [int(row["n"]) for row in table if row[f"{family}_us"] < row["per_slot_us"]],
                switch,
            )
        )
    return answers


def engine_of(item: Recipe) -> str:
    """The registered engine a recipe's rows ran."""
    return ENGINES.create(item.engine).name
