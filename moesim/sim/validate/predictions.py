"""What every validated row shares: the options, predictions with their bounds, the profile and
the traces and presets read once, and whole passes through the step-time model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.families import ExpertFamily, extrapolated
from moesim.hw_profiles.ladder.rungs import RUNGS, worst_rung
from moesim.hw_profiles.profile import HardwareProfile
from moesim.kernels.features import RoutingFeatures
from moesim.models import ModelPreset, builtin_names, load_target
from moesim.sim.cost.steptime import StepTimeModel
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.importers import open_trace

FEATURE_COLUMNS = ("distinct_experts", "slots", "max_tokens_per_expert")
FEATURE_FIELDS = ("n_tokens", "slots", "distinct_experts", "max_tokens_per_expert")  # RoutingFeatures order
SPEC_COLUMNS = ("draft_len", "accepted_mean", "tokens_per_s")
SCOPES = ("expert", "pass")
RUN_SUFFIXES = (".arrow", ".ipc", ".feather")


@dataclass(frozen=True)
class ValidateOptions:
    """How to predict: the profile, a default trace, the target preset and kernel family of pass
    rows, the KV length of pass rows that carry no position, and row filters (COL=VALUE)."""

    profile: str
    trace: Path | None = None
    model: str | None = None
    family: str | None = None
    context_tokens: int = 512
    filters: tuple[str, ...] = ()


@dataclass(frozen=True)
class Predicted:
    """Predictions of some rows, in the rows' order: time with its bound, extrapolation factor, and
    the predicted time per rung of the lookup ladder (rows, 4)."""

    time_us: np.ndarray
    low_us: np.ndarray
    high_us: np.ndarray
    extrapolation: np.ndarray
    rung_us: np.ndarray

    def scaled(self, factor: np.ndarray) -> Predicted:
        """Times multiplied by a per-row factor (e.g. identical MoE layers)."""
        return Predicted(
            self.time_us * factor, self.low_us * factor, self.high_us * factor, self.extrapolation, self.rung_us * factor[:, None]
        )

    @classmethod
    def empty(cls, rows: int) -> Predicted:
        """Zero predictions (filled group by group)."""
        return cls(np.zeros(rows), np.zeros(rows), np.zeros(rows), np.ones(rows), np.zeros((rows, len(RUNGS))))

    def put(self, index: np.ndarray | list[int], part: Predicted) -> None:
        """Write a group's predictions at its rows."""
        for name in ("time_us", "low_us", "high_us", "extrapolation", "rung_us"):
            getattr(self, name)[index] = getattr(part, name)

    def columns(self) -> list[pl.Series]:
        """The prediction columns of predictions.parquet: time, bounds, the rung (the lowest one any
        layer needed) and each rung's share of the time; `extrapolated` (rung = extrapolated) is kept
        for one release."""
        total = self.rung_us.sum(axis=1, keepdims=True)
        shares = np.divide(self.rung_us, total, out=np.zeros_like(self.rung_us), where=total > 0)
        return [
            pl.Series("predicted_us", self.time_us),
            pl.Series("predicted_low_us", self.low_us),
            pl.Series("predicted_high_us", self.high_us),
            pl.Series("rung", worst_rung(self.rung_us).tolist(), pl.String),
            *(pl.Series(f"rung_{name}_share", shares[:, i]) for i, name in enumerate(RUNGS)),
            pl.Series("extrapolated", extrapolated(self.extrapolation)),
            pl.Series("_extrapolation", self.extrapolation),
        ]


class Context:
    """The profile, and the traces and presets read once per validation."""

    def __init__(self, options: ValidateOptions) -> None:
        self.options = options
        self.profile: HardwareProfile = load_profile(options.profile)
        self.warnings: list[str] = []
        self._traces: dict[Path, Trace] = {}
        self._presets: dict[str, ModelPreset] = {}
        families = self.profile.expert_families
        if options.family is not None and options.family not in families:
            known = ", ".join(families)
            raise InputError(f"--family '{options.family}': profile '{self.profile.name}' has no such expert family ({known})")
        if options.model is not None:
            self.preset(options.model)

    def trace(self, path: Path) -> Trace:
        """A trace, read once: a moesim trace, or a Parquet routing table with `moe_trace` metadata
        (imported with the geometry of the preset it names)."""
        key = path.resolve()
        if key not in self._traces:
            self._traces[key] = open_trace(path, self.options.model)
        return self._traces[key]

    def preset(self, name: str) -> ModelPreset:
        """A MoE target preset, loaded once."""
        if name not in self._presets:
            self._presets[name] = load_target(name)
        return self._presets[name]

    def family(self, kernel: str, where: str) -> ExpertFamily:
        """The profile's expert family a row names (a warning when it has no held-out error)."""
        if kernel == "dense":
            raise InputError(f"{where}: field 'kernel' is 'dense'; validate predicts expert families and whole passes, not dense rows")
        if kernel not in self.profile.expert_families:
            known = ", ".join(self.profile.expert_families)
            raise InputError(
                f"{where}: field 'kernel' is '{kernel}', but profile '{self.profile.name}' has no such expert family ({known})"
            )
        family = self.profile.expert_families[kernel]
        if not math.isfinite(family.heldout_error.epsilon):
            note = f"family '{kernel}' of profile '{self.profile.name}' has no held-out error: its bounds have zero width"
            if note not in self.warnings:
                self.warnings.append(note)
        return family


def is_preset_reference(name: str) -> bool:
    """A built-in MoE preset name or a preset file."""
    return name in builtin_names("moe") or Path(name).suffix in (".toml", ".json")


def pass_prediction(model: StepTimeModel, features: RoutingFeatures, context_tokens: np.ndarray) -> Predicted:
    """Whole passes (features shaped (passes, MoE layers)) through the step-time model."""
    cost = model.pass_cost(features, context_tokens)
    return Predicted(cost.total_us(), cost.low_us, cost.high_us, cost.extrapolation, cost.rung_us)


def target_preset(name: str | None, where: str, ctx: Context, geometry: TraceGeometry | None) -> ModelPreset:
    """The target preset of whole passes, checked against the routing it replays."""
    if name is None or not is_preset_reference(str(name)):
        raise InputError(f"{where}: a whole pass needs the target's preset: column 'model' naming a built-in preset, or --model")
    preset = ctx.preset(str(name))
    if geometry is not None and (preset.top_k, preset.experts, preset.moe_layers) != (
        geometry.top_k,
        geometry.experts,
        geometry.moe_layers,
    ):
        raise InputError(
            f"{where}: preset '{preset.name}' (top-{preset.top_k} of {preset.experts}, {len(preset.moe_layers)} MoE layers) does not "
            f"route like model '{geometry.model}' (top-{geometry.top_k} of {geometry.experts}, {len(geometry.moe_layers)} MoE layers)"
        )
    return preset
