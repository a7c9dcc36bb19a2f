"""Planning a sweep (in the driver, every check before anything runs): work units, one per
(model, routing, batch), in a fixed order."""

from __future__ import annotations

from dataclasses import dataclass

from moesim.errors import ConfigError, InputError, MoesimError
from moesim.models import ModelPreset
from moesim.sim.cost.pass_features import fitting_lanes
from moesim.sim.sweep.config import MODEL_PLACEHOLDER, SweepConfig
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace, read_trace


@dataclass(frozen=True)
class WorkUnit:
    """One model with one routing at one batch size: routing features computed once."""

    model: str
    routing: int  # index into the config's routing list
    batch: int

    @staticmethod
    def file_name(index: int) -> str:
        """The file of the plan's unit `index` in the partial-results folder (the folder names the config)."""
        return f"unit-{index:05d}.parquet"


# ---- planning (in the driver: every check before anything runs) -----------------------------------


def routes_like(geometry: TraceGeometry, preset: ModelPreset) -> bool:
    """A trace can stand for a model when top-k, experts and MoE layers agree."""
    return (geometry.top_k, geometry.experts, geometry.moe_layers) == (preset.top_k, preset.experts, preset.moe_layers)


def _check_trace(config: SweepConfig, index: int, trace: Trace, batches: tuple[int, ...]) -> None:
    """Every batch size finds lanes of at least N positions in the trace."""
    need = config.grid.max_tokens
    for batch in batches:
        try:
            fitting_lanes(trace, batch, need)
        except InputError as exc:
            raise ConfigError(
                f"{config.key(f'routing[{index}].trace')}: {exc} (the grid passes max_pass, or max_draft + 1, tokens per sequence)"
            ) from None


def plan_units(config: SweepConfig) -> list[WorkUnit]:
    """The units in a fixed order (model, routing, batch); trace routings apply to the models
    that route like them."""
    units = []
    for i, routing in enumerate(config.routing):
        matched = []
        for model, preset in config.presets.items():
            path = routing.trace_for(model)
            if path is not None:
                try:
                    trace = read_trace(path)
                except MoesimError as exc:
                    raise ConfigError(f"{config.key(f'routing[{i}].trace')}: {exc}") from None
                if not routes_like(trace.meta.geometry, preset):
                    if MODEL_PLACEHOLDER in str(routing.trace):
                        raise ConfigError(f"{config.key(f'routing[{i}].trace')}: {path} does not route like model '{model}'")
                    continue
                _check_trace(config, i, trace, config.grid.batch)
            matched.append(model)
        if not matched:
            raise ConfigError(f"{config.key(f'routing[{i}].trace')}: {routing.trace} routes like none of the grid's models")
        units += [WorkUnit(model, i, batch) for model in matched for batch in config.grid.batch]
    for model in config.grid.models:
        if not any(u.model == model for u in units):
            raise ConfigError(f"{config.key('routing')}: no routing applies to model '{model}'")
    return sorted(units, key=lambda u: (config.grid.models.index(u.model), u.routing, config.grid.batch.index(u.batch)))
