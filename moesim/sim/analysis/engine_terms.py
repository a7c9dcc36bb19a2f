"""What does my engine spend beyond the kernels? A user's own runs (`hw_profiles.engine_runs`)
fitted against a profile's kernel times, written into that profile's `[speculative]` table.

The target's forwards are priced by the step-time model on the profile without its own spec path
(`StepTimeModel.dense_pass_us`: the dense family, KV at the context, the profile's fixed time),
a speculative run's drafting by the drafter's cost model (`moesim.sim.cost.drafters`); the terms
are `engine_runs.fit.fit_engine_terms`'s: `pass_us`, the host time of every forward, and
`iteration_us`, what a speculative iteration costs beyond its draft and verify forwards.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moesim.errors import InputError
from moesim.hw_profiles import HardwareProfile
from moesim.hw_profiles.builtin import with_spec_path
from moesim.hw_profiles.engine_runs import EngineRows
from moesim.hw_profiles.engine_runs.fit import EngineTerms, fit_engine_terms
from moesim.hw_profiles.provenance import Provenance
from moesim.hw_profiles.speculative import SpecPath
from moesim.models import ModelPreset
from moesim.sim.cost.drafters import draft_us, make_drafter
from moesim.sim.cost.steptime import StepTimeModel, default_engine

SOURCE_ID = "engine-runs"


@dataclass(frozen=True)
class EngineFit:
    """The fitted terms and the profile that carries them."""

    terms: EngineTerms
    profile: HardwareProfile
    engines: tuple[str, ...]


def inputs_sha256(paths: list[Path]) -> str:
    """sha256 of the input files' bytes, concatenated in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fit_engine(
    rows: EngineRows,
    inputs: list[Path],
    profile: HardwareProfile,
    preset: ModelPreset,
    weight_format: str | None = None,
    drafter: str | None = None,
    name: str | None = None,
) -> EngineFit:
    """The engine's terms on the profile's device from the rows, and the profile with them as its `[speculative]` table."""
    engines = tuple(sorted({f"{r.engine} {r.engine_version}".strip() for r in (*rows.steps, *rows.runs)}))
    if len({e.split()[0] for e in engines}) > 1:
        raise InputError(f"{inputs[0]}: the runs are of several engines ({'; '.join(engines)}): fit one engine at a time")
    bare = with_spec_path(profile, None)
    model = StepTimeModel(preset, bare, default_engine(bare), weight_format or "")
    priced = None
    if drafter:
        made = make_drafter(drafter, preset, model.weight_format)

        def priced(draft_len: int, context_tokens: float, batch: int) -> float:
            return draft_us(made, np.full(batch, draft_len), context_tokens, model.dense_family_us)

    terms = fit_engine_terms(rows, model.dense_pass_us, priced)
    files = ", ".join(p.name for p in inputs)
    provenance = Provenance(
        "calibrated",
        files,
        inputs_sha256(inputs),
        note=f"{preset.name} runs of {'; '.join(engines)} (sha256 of the files concatenated in this order)",
    )
    heldout = terms.heldout_error if np.isfinite(terms.heldout_error) else terms.uncertainty["pass_us"]
    spec = SpecPath(
        pass_us=terms.pass_us,
        iteration_us=terms.iteration_us,
        draft_step_us=0.0,
        verified_token_us=0.0,
        heldout_error=float(heldout),
        provenance=provenance,
        basis={
            **terms.basis,
            "draft_step_us": "0: not fitted by profile fit-engine",
            "verified_token_us": "0: not fitted by profile fit-engine",
        },
        covers=f"{'; '.join(engines)} on {preset.name} ({files})",
        note=f"fitted by moesim profile fit-engine against the kernels of profile '{profile.name}'",
        source_id=SOURCE_ID,
    )
    fitted = with_spec_path(profile, spec)
    description = f"{profile.description}; engine terms fitted on {files}"
    return EngineFit(terms, dataclasses.replace(fitted, name=name or profile.name, description=description), engines)
