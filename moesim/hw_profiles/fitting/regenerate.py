"""`python -m moesim.hw_profiles.fitting.regenerate`: rewrite the engine built-in profiles from the
shared public table (`data/public-bench/moe_pass_times.csv`, run from the repository root): the
calibrated ones (`engine_builtins.RECIPES`) and those scaled from them (`engine_builtins.SCALED`),
each scaled one stating the transfer uncertainty that held-out devices of its engine show
(`pooled.pool_validation.pair_bounds`: the largest p90 error between devices as alike as it and its base).
A calibrated family whose rows gave no FLOP rate is floored at the rate its engine reaches on the
other devices (`pooled.engine_pool.engine_floors`); the transfer bounds are those of the fits without it.
Tests check the shipped files are current. The H200 lab profile is refitted by the command in
docs/profiles.md."""

from __future__ import annotations

from pathlib import Path

from moesim.hw_profiles.builtin import profiles_dir
from moesim.hw_profiles.catalog import catalog
from moesim.hw_profiles.engines import ENGINES
from moesim.hw_profiles.fitting.derive import scaled_engine_profile
from moesim.hw_profiles.fitting.engine_builtins import PUBLIC_TABLE, RECIPES, SCALED, EngineFit, fit_recipe, recipe
from moesim.hw_profiles.fitting.engine_fit import single_token_order
from moesim.hw_profiles.fitting.engine_validation import VALIDATION
from moesim.hw_profiles.fitting.pooled.engine_pool import device_rows, engine_floors
from moesim.hw_profiles.fitting.pooled.pool_validation import engine_parts, pair_bounds, pair_kind, stated_transfer
from moesim.hw_profiles.profile import HardwareProfile
from moesim.hw_profiles.schema import profile_to_toml


def engine_builtins(table: Path = PUBLIC_TABLE) -> tuple[dict[str, HardwareProfile], dict[str, EngineFit]]:
    """Every engine built-in by name, and the fits of the calibrated ones (their profiles without the engine's FLOP floors)."""
    fits = {item.name: fit_recipe(item, table) for item in RECIPES}
    parts = {engine: engine_parts(engine, table, "dispatch") for engine in {item.engine for item in RECIPES}}
    profiles = {  # a family whose rows gave no FLOP rate takes the rate the engine reaches on its other devices
        item.name: engine_floors(parts[item.engine], device_rows(item, table, "dispatch"), fits[item.name].profile) for item in RECIPES
    }
    bounds = pair_bounds({**fits, **{item.name: fit_recipe(item, table) for item in VALIDATION}})
    specs = catalog()
    for item in SCALED:
        base = recipe(item.base)
        engine = ENGINES.create(base.engine)
        fit = fits[item.base]
        dispatch = engine.dispatch(None, item.architecture if item.architecture != "any" else base.architecture, "engine-source")
        stated = stated_transfer(bounds, base.engine, pair_kind(specs[item.device], specs[base.device]))
        transfer = (stated.bound, stated.note()) if stated is not None else None
        scaled = scaled_engine_profile(profiles[item.base], specs[item.device], specs[base.device], item.name, dispatch, transfer)
        families, notes = single_token_order(scaled.expert_families, fit.rows, dispatch)
        profiles[item.name] = scaled.__class__(**{**scaled.__dict__, "expert_families": families, "notes": (*scaled.notes, *notes)})
    return profiles, fits


def regenerate(directory: Path | None = None, table: Path = PUBLIC_TABLE) -> list[Path]:
    """Rewrite the engine built-in TOML files."""
    directory = directory or profiles_dir()
    written = []
    for name, profile in engine_builtins(table)[0].items():
        path = directory / f"{name}.toml"
        path.write_text(profile_to_toml(profile))
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in regenerate():
        print(f"wrote {written_path}")
