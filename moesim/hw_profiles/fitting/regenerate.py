"""`python -m moesim.hw_profiles.fitting.regenerate`: rewrite the datasheet-scaled built-in profiles from
the shipped calibrated one (run after refitting `nvidia-h200`; tests check the files are current)."""

from __future__ import annotations

from pathlib import Path

from moesim.hw_profiles.builtin import CALIBRATED, load_profile, profiles_dir
from moesim.hw_profiles.catalog import catalog
from moesim.hw_profiles.fitting.derive import profile_for_device
from moesim.hw_profiles.profile import HardwareProfile
from moesim.hw_profiles.schema import profile_to_toml


def scaled_builtins(base: HardwareProfile) -> dict[str, HardwareProfile]:
    """Every non-calibrated built-in, scaled from the calibrated base."""
    specs = catalog()
    return {key: profile_for_device(base, spec, specs[CALIBRATED]) for key, spec in specs.items() if key != CALIBRATED}


def regenerate(directory: Path | None = None) -> list[Path]:
    """Rewrite the scaled built-in TOML files from the shipped calibrated profile."""
    directory = directory or profiles_dir()
    written = []
    for key, profile in scaled_builtins(load_profile(CALIBRATED)).items():
        path = directory / f"{key}.toml"
        path.write_text(profile_to_toml(profile))
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in regenerate():
        print(f"wrote {written_path}")
