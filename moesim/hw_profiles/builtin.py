"""Built-in profiles (TOML files in `profiles/`) and `load_profile`.

`nvidia-h200` is fitted from `data/h200/calibration.parquet` by the command in docs/profiles.md;
every other built-in is that profile scaled to a catalog device (`fitting.derive.profile_for_device`).
`python -m moesim.hw_profiles.fitting.regenerate` rewrites the scaled files from the shipped H200 profile.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from moesim.errors import InputError
from moesim.hw_profiles.catalog import catalog
from moesim.hw_profiles.profile import HardwareProfile
from moesim.hw_profiles.schema import read_profile

CALIBRATED = "nvidia-h200"


def profiles_dir() -> Path:
    """The folder of the built-in profile files."""
    return Path(str(resources.files("moesim.hw_profiles").joinpath("profiles")))


def builtin_names() -> list[str]:
    """Names of the built-in profiles: the calibrated H200 first, then the catalog's order."""
    return [CALIBRATED, *(key for key in catalog() if key != CALIBRATED)]


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """A built-in profile by name, or a profile TOML file by path."""
    text = str(name_or_path)
    if text in builtin_names():
        return read_profile(profiles_dir() / f"{text}.toml")
    path = Path(text)
    if path.suffix == ".toml" or path.exists():
        return read_profile(path)
    raise InputError(f"unknown hardware profile '{text}' (built-in: {', '.join(builtin_names())}; or give a .toml path)")
