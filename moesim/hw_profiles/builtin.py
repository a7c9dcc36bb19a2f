"""Built-in profiles (TOML files in `profiles/`) and `load_profile`.

`nvidia-h200` is the lab calibration: fitted from `data/h200/calibration.parquet` by the command
in docs/profiles.md (hand-written kernels and torch's grouped GEMM, kernels no serving engine
runs). Every other built-in is an engine profile (an engine's kernels and dispatch on one device):
fitted on the shared public table (status `published-calibrated`) or scaled from such a fit of
the same engine to another device's datasheet (`datasheet-scaled`); `python -m
moesim.hw_profiles.fitting.regenerate` rewrites them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from functools import cache
from importlib import resources
from pathlib import Path

from moesim.atomic import protect
from moesim.errors import ConfigError, InputError
from moesim.hw_profiles.profile import HardwareProfile
from moesim.hw_profiles.schema import FORMAT_VERSION, read_profile, read_sources, sources_lines
from moesim.hw_profiles.speculative import SpecPath, spec_path_from_table
from moesim.tomlfile import read_toml, toml_section, toml_value

CALIBRATED = "nvidia-h200"
# The datasheet-scaled copies of the lab calibration these names held until this release, and the
# engine profiles that replace them (the old names still load, for one release).
RENAMED_PROFILES = {
    "nvidia-h100-sxm": "nvidia-h100-sxm-vllm",
    "nvidia-h800-sxm": "nvidia-h800-sxm-vllm",
    "nvidia-a100-80gb": "nvidia-a100-80gb-vllm",
    "nvidia-a800-80gb": "nvidia-a800-80gb-vllm",
    "nvidia-l40s": "nvidia-l40s-vllm",
    "nvidia-rtx-6000-ada": "nvidia-rtx-6000-ada-vllm",
    "nvidia-rtx-4090": "nvidia-rtx-4090-llamacpp",
    "apple-m2-ultra": "apple-m2-ultra-metal",
    "apple-m3-max": "apple-m3-max-metal",
    "apple-m4-max": "apple-m4-max-metal",
}


def profiles_dir() -> Path:
    """The folder of the built-in profile files."""
    return Path(str(resources.files("moesim.hw_profiles").joinpath("profiles")))


def builtin_names() -> list[str]:
    """Names of the built-in profiles: the lab calibration first, then the engine profiles."""
    return [CALIBRATED, *sorted(path.stem for path in profiles_dir().glob("*.toml") if path.stem != CALIBRATED)]


def spec_paths_file() -> Path:
    """The spec-path terms of the built-in engine profiles (`moesim.sim.validate.spec_runs` writes it)."""
    return Path(str(resources.files("moesim.hw_profiles").joinpath("data", "spec_paths.toml")))


SPEC_PATHS_FORMAT = "moesim-spec-paths"


def spec_paths_to_toml(paths: dict[str, SpecPath], header: str) -> str:
    """Spec-path terms of built-in profiles by profile name (`data/spec_paths.toml`), with their sources."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    toml_section(lines, None, {"format": SPEC_PATHS_FORMAT, "format_version": FORMAT_VERSION})
    for name, spec in paths.items():
        toml_section(lines, f"profiles.{toml_value(name)}", spec.table())
        for sub, table in spec.sub_tables().items():
            toml_section(lines, f"profiles.{toml_value(name)}.{sub}", table)
    sources_lines(lines, {spec.source_id: spec.provenance for spec in paths.values()})
    return "\n".join(lines) + "\n"


def read_spec_paths(path: Path) -> dict[str, SpecPath]:
    """The spec-path terms of `spec_paths_to_toml`, checked like a profile's `[speculative]` table."""
    data = read_toml(path, "spec-path table")
    origin = str(path)
    if data.get("format") != SPEC_PATHS_FORMAT:
        raise ConfigError(f"{origin}: field 'format' must be '{SPEC_PATHS_FORMAT}', got {data.get('format')!r}")
    sources = read_sources(data, origin)
    profiles = data.get("profiles", {})
    if not isinstance(profiles, dict):
        raise ConfigError(f"{origin}: field 'profiles' must be a table of profile name = spec-path table")

    def fail(where: str, what: str) -> ConfigError:
        return ConfigError(f"{origin}: field '{where}' {what}")

    return {name: spec_path_from_table(table, f"profiles.{name}", sources, fail) for name, table in profiles.items()}


@cache
def builtin_spec_paths() -> dict[str, SpecPath]:
    """Spec-path terms by built-in profile name."""
    path = spec_paths_file()
    return read_spec_paths(path) if path.is_file() else {}


def with_spec_path(profile: HardwareProfile, spec: SpecPath | None) -> HardwareProfile:
    """The profile carrying `spec` as its `[speculative]` table (its source added to the profile's)."""
    if spec is None:
        return dataclasses.replace(profile, speculative=None)
    return dataclasses.replace(profile, speculative=spec, sources={**profile.sources, spec.source_id: spec.provenance})


def profile_files(name_or_path: str | os.PathLike[str]) -> list[Path]:
    """The files a profile is read from: a built-in's TOML and `data/spec_paths.toml` (where there
    is one), else the path itself."""
    text = RENAMED_PROFILES.get(str(name_or_path), str(name_or_path))
    if text in builtin_names():
        return [profiles_dir() / f"{text}.toml", *([spec_paths_file()] if spec_paths_file().is_file() else [])]
    return [Path(text)]


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """A built-in profile by name (or by the name it had before it became an engine profile), or a
    profile TOML file by path. A built-in without its own `[speculative]` table takes the one of
    `data/spec_paths.toml`, where there is one."""
    text = RENAMED_PROFILES.get(str(name_or_path), str(name_or_path))
    if text in builtin_names():
        profile = _read_once(profiles_dir() / f"{text}.toml")
        spec = builtin_spec_paths().get(text)
        return profile if profile.speculative is not None or spec is None else with_spec_path(profile, spec)
    path = Path(text)
    if path.suffix == ".toml" or path.exists():
        return _read_once(path)
    raise InputError(f"unknown hardware profile '{text}' (built-in: {', '.join(builtin_names())}; or give a .toml path)")


PROFILES_KEPT = 16  # parsed profiles a process keeps (a sweep's cells load the same few again and again)
_PARSED: dict[tuple[str, str], HardwareProfile] = {}


def _read_once(path: Path) -> HardwareProfile:
    """`read_profile`, parsed once per process for each file content: kept by the file's resolved
    path and the SHA-256 of its bytes (an edited file is read again)."""
    key = _content_key(path)
    profile = _PARSED.get(key) if key is not None else None
    if profile is not None:
        protect(path)  # still an input of the running command
        return profile
    profile = read_profile(path)  # a missing or unreadable file: its one-line error
    if key is not None and _content_key(path) == key:  # kept only if the file did not change while read
        if len(_PARSED) >= PROFILES_KEPT:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = profile
    return profile


def _content_key(path: Path) -> tuple[str, str] | None:
    try:
        return str(path.resolve()), hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
