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
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles import HardwareProfile
from moesim.hw_profiles.builtin import with_spec_path
from moesim.hw_profiles.engine_runs import EngineRows
from moesim.hw_profiles.engine_runs.fit import EngineTerms, fit_engine_terms
from moesim.hw_profiles.engine_runs.rows import NA
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

    def terms_table(self) -> pl.DataFrame:
        """term, value_us, uncertainty_pct, basis."""
        t = self.terms
        return pl.DataFrame(
            {
                "term": ["pass_us", "iteration_us"],
                "value_us": [round(t.pass_us, 1), round(t.iteration_us, 1)],
                "uncertainty_pct": [_pct(t.uncertainty.get("pass_us")), _pct(t.uncertainty.get("iteration_us"))],
                "basis": [t.basis["pass_us"], t.basis["iteration_us"]],
            }
        )

    def rows_table(self) -> pl.DataFrame:
        """Every row in forwards: what it measured, what the kernels take, what it implies."""
        t = self.terms
        plain = [
            {"row": r.source, "batch": r.batch, "forwards": r.forwards, "measured_us": round(r.measured_us / r.forwards, 1),
             "kernels_us": round(r.kernel_us / r.forwards, 1), "implied_us": round(r.implied_us(), 1), "term": "pass_us"}
            for r in t.forwards
        ]  # fmt: skip
        spec = [
            {"row": r.source, "batch": r.batch, "forwards": 1, "measured_us": round(r.measured_us, 1),
             "kernels_us": round(r.draft_us + r.verify_us, 1), "implied_us": round(r.implied_us(t.pass_us), 1), "term": "iteration_us"}
            for r in t.iterations
        ]  # fmt: skip
        return pl.DataFrame(plain + spec)

    def heldout_table(self) -> pl.DataFrame:
        """Each left-out group's relative error, in %."""
        return pl.DataFrame(
            {"left_out": [g for g, _ in self.terms.heldout], "error_pct": [round(100 * e, 2) for _, e in self.terms.heldout]}
        )


def _pct(value: float | None) -> float | None:
    return None if value is None else round(100 * value, 1)


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
    if preset.kind != "dense":
        raise InputError(f"model '{preset.name}' is a {preset.kind} preset: fit-engine prices dense targets (the engine's own path)")
    engines = tuple(sorted({r.engine if r.engine_version == NA else f"{r.engine} {r.engine_version}" for r in (*rows.steps, *rows.runs)}))
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
