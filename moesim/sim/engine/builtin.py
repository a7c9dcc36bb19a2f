"""The built-in engine profiles' engine terms (`moesim/hw_profiles/data/spec_paths.toml`), fitted on
the shared engine-overheads rows of the engine each profile runs (`fit_engine_terms`; the MoE runs
of `data/public-bench/` only judge them, `docs/validation.md`):

- vLLM's fused-MoE profiles take vLLM V1's terms, llama.cpp's (CUDA, Metal, Vulkan) llama.cpp's;
  their kinds say `calibrated` where the profile's device is among the rows' devices, else
  `transferred` (the rows' devices to this one);
- MLX has no describable dense row: its profile takes llama.cpp's terms fitted on every row
  (kinds `transferred`, uncertainty 1: from another engine on other devices);
- CUDA graphs only where the profile's backend is CUDA (Metal, Vulkan and MLX run every forward eager);
- llama.cpp's profiles were fitted on whole llama-bench passes, whose time holds the engine's per
  forward (their fixed time per pass): there `pass_us` and `launch_us_per_layer` are 0 (said in
  the basis), and the speculative path's terms are added.

    python -m moesim.sim.engine.builtin      # rewrites moesim/hw_profiles/data/spec_paths.toml
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import polars as pl

from moesim.atomic import write_text_atomic
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.builtin import builtin_names, spec_paths_file, spec_paths_to_toml
from moesim.hw_profiles.catalog import device_of_profile
from moesim.hw_profiles.speculative import SPEC_TERMS, SpecPath
from moesim.sim.engine.fit import fit_engine_terms
from moesim.sim.engine.rows import DESCRIPTIONS, RUNS_TABLE, STEPS_TABLE, Described, describe

# A built-in profile's engine (its `engine` field) -> the engine whose rows fit its terms.
PROFILE_ENGINES = {"vLLM fused_moe": "vllm-v1", "llama.cpp CUDA": "llama.cpp", "llama.cpp Metal": "llama.cpp"}
PROFILE_ENGINES |= {"llama.cpp Vulkan": "llama.cpp", "MLX": "mlx-lm"}
TRANSFER = {"mlx-lm": "llama.cpp"}  # an engine without describable rows takes another's terms
TRANSFERRED_UNCERTAINTY = 1.0
WHOLE_PASS_ENGINES = ("llama.cpp",)  # built-in profiles fitted on whole passes of these engines

HEADER = """Engine terms of the built-in engine profiles (moesim.hw_profiles.speculative), fitted on the shared
engine-overheads rows (data/engine-overheads/) by `python -m moesim.sim.engine.builtin` (from the
repository root); tests check this file is current. docs/validation.md reports their held-out errors."""


def tables_sha256(*paths: Path) -> str:
    """One sha256 over the files' bytes in order (the fit reads all of them)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def engine_fits(described: Described) -> dict[str, SpecPath]:
    """Each engine's terms fitted on all its described rows."""
    source = f"{STEPS_TABLE} + {RUNS_TABLE} (described by {DESCRIPTIONS.name})"
    sha = tables_sha256(STEPS_TABLE, RUNS_TABLE, DESCRIPTIONS)
    fits = {}
    for engine in sorted(set(described.steps["engine_key"]) | set(described.runs["engine_key"])):
        steps = described.steps.filter(pl.col("engine_key") == engine)
        runs = described.runs.filter(pl.col("engine_key") == engine)
        fits[engine] = fit_engine_terms(steps, runs, engine, source_file=source, sha256=sha).spec
    return fits


def profile_spec(profile_name: str, fits: dict[str, SpecPath], described: Described) -> SpecPath | None:
    """The engine terms of one built-in profile (None for a profile of no serving engine)."""
    profile = load_profile(profile_name)
    engine = PROFILE_ENGINES.get(profile.device.engine)
    if engine is None:
        return None
    donor = engine if engine in fits else TRANSFER[engine]
    spec = fits[donor]
    device = device_of_profile(profile_name, profile.device.name)
    devices = set(described.steps.filter(pl.col("engine_key") == donor)["device_key"])
    devices |= set(described.runs.filter(pl.col("engine_key") == donor)["device_key"])
    calibrated_here = donor == engine and device is not None and device.key in devices
    kind = "calibrated" if calibrated_here else "transferred"
    kinds = {t: (kind if getattr(spec, t) > 0 else spec.kinds.get(t, "assumed")) for t in SPEC_TERMS}
    uncertainty = dict(spec.uncertainty)
    if donor != engine:
        uncertainty = dict.fromkeys(uncertainty, TRANSFERRED_UNCERTAINTY)
    graph = spec.graph_max_tokens if profile.device.backend == "cuda" else 0
    basis = dict(spec.basis)
    if engine in WHOLE_PASS_ENGINES:
        inside = "0: inside the profile, fitted on whole passes (its fixed time per pass holds the engine's time per forward)"
        spec = dataclasses.replace(spec, pass_us=0.0, launch_us_per_layer=0.0)
        basis |= dict.fromkeys(("pass_us", "launch_us_per_layer"), inside)
        kinds |= dict.fromkeys(("pass_us", "launch_us_per_layer"), "assumed")
        uncertainty = {t: u for t, u in uncertainty.items() if t not in ("pass_us", "launch_us_per_layer")}
    where = device.key if device is not None else profile.device.name
    covers = f"{spec.covers}; {kind} to {where}" + (f" from {spec.engine} (no describable {engine} row)" if donor != engine else "")
    return dataclasses.replace(spec, graph_max_tokens=graph, kinds=kinds, uncertainty=uncertainty, covers=covers, basis=basis)


def write_spec_paths(path: Path | None = None) -> Path:
    """Rewrite the built-in engine terms from the described rows."""
    described = describe()
    fits = engine_fits(described)
    specs = {name: profile_spec(name, fits, described) for name in builtin_names()}
    target = path or spec_paths_file()
    write_text_atomic(target, spec_paths_to_toml({n: s for n, s in specs.items() if s is not None}, HEADER))
    return target


if __name__ == "__main__":
    print(f"wrote {write_spec_paths()}")
