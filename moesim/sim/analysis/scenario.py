"""What every closed-form analysis starts from (issue 6): a `Scenario`, and the pass costs it implies.

Everything starts from a `Scenario`: a step-time model (target preset on a profile with an
engine), the trace whose routing it replays, the drafter and the context length. Results are
plain frozen dataclasses with `table()` (a polars frame) and `to_dict()` (for `--json`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moesim.errors import ConfigError, InputError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.families import extrapolated
from moesim.kernels.windows import MAX_PASS_LIMIT
from moesim.models import ModelPreset, builtin_names, load_target
from moesim.sim.cost.drafters import Drafter, make_drafter
from moesim.sim.cost.parallel import Devices
from moesim.sim.cost.pass_features import check_sizes, sampled_expected_costs, window_distributions
from moesim.sim.cost.steptime import PassCost, StepTimeModel, default_family
from moesim.tracegen.formats.trace import Trace, read_trace
from moesim.tracegen.routing.synth import Uniform, synthesize


@dataclass(frozen=True)
class Scenario:
    """A target on a device replaying a trace's routing, with a drafter and a context length."""

    model: StepTimeModel
    trace: Trace
    drafter: Drafter
    context_tokens: int = 512

    @property
    def top_k(self) -> int:
        """Experts per token."""
        return self.model.preset.top_k


def preset_for_trace(trace: Trace, model: str | None) -> ModelPreset:
    """The trace's own preset (its metadata names a built-in one), or `model`; checked against the routing."""
    g = trace.meta.geometry
    if model is None and g.model not in builtin_names("moe"):
        raise InputError(f"trace model '{g.model}' is not a built-in preset; give --model PRESET (a name, .toml or config.json)")
    preset = load_target(model or g.model)
    if (preset.top_k, preset.experts, preset.moe_layers) != (g.top_k, g.experts, g.moe_layers):
        raise InputError(
            f"trace of '{g.model}' routes top-{g.top_k} of {g.experts} experts in MoE layers {list(g.moe_layers)[:3]}..., "
            f"but preset '{preset.name}' has top-{preset.top_k} of {preset.experts} in {list(preset.moe_layers)[:3]}..."
        )
    return preset


def load_scenario(
    trace_path: str | Path,
    profile: str,
    engine: str | None = None,
    model: str | None = None,
    drafter: str = "ngram",
    weight_format: str | None = None,
    context_tokens: int = 512,
    devices: Devices | None = None,
) -> Scenario:
    """Read the trace, resolve preset, profile, family (`engine`; default: the engine profile's
    dispatch, else per_slot), drafter and devices (each a one-line error when wrong)."""
    if context_tokens < 0:
        raise InputError(f"context length must be >= 0, got {context_tokens}")
    trace = read_trace(trace_path)
    preset = preset_for_trace(trace, model)
    hw = load_profile(profile)
    fmt = weight_format or trace.meta.geometry.weight_format
    parallel = (devices or Devices()).parallelism(hw)
    try:
        parallel.check(preset)
    except ConfigError as exc:
        raise InputError(f"--expert-parallel: {exc}") from None
    step = StepTimeModel(preset, hw, default_family(hw, engine), fmt, parallel=parallel)
    return Scenario(step, trace, make_drafter(drafter, preset, fmt), context_tokens)


LARGEST_PASS = 4096  # batched verification, prefill chunks, kernel tables run to M = 4096
_GRID_ABOVE_WINDOWS = (96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def pass_sizes(max_pass: int, sizes: list[int] | None = None) -> np.ndarray:
    """The pass sizes of an analysis: `sizes` (sorted, distinct), or n = 1..max_pass, every n up
    to 64 and above it the grid 96, 128, 192, … (x1.5 / x2 steps) up to max_pass, which is kept."""
    chosen = sorted(set(sizes)) if sizes else [*range(1, min(max_pass, MAX_PASS_LIMIT) + 1)]
    if not sizes:
        chosen += [n for n in _GRID_ABOVE_WINDOWS if MAX_PASS_LIMIT < n < max_pass] + ([max_pass] if max_pass > MAX_PASS_LIMIT else [])
    if not chosen or not 1 <= chosen[0] <= chosen[-1] <= LARGEST_PASS:
        raise InputError(f"pass sizes must lie in 1..{LARGEST_PASS}, got {sizes or max_pass}")
    return np.asarray(chosen, np.int64)


def expected_costs(scenario: Scenario, sizes: np.ndarray, model: StepTimeModel | None = None, trace: Trace | None = None) -> PassCost:
    """Expected pass times over the trace's windows for every pass size (shape (len(sizes),)); expert
    parallel, the mean over sampled windows at each layer's slowest rank (`moesim.sim.cost.pass_features`)."""
    model, trace = model or scenario.model, trace or scenario.trace
    sizes = np.asarray(sizes, np.int64)
    if model.parallel.ranks > 1:
        return sampled_expected_costs(model, trace, check_sizes(trace, sizes), float(scenario.context_tokens))
    return model.expected_pass_cost(window_distributions(trace, sizes), float(scenario.context_tokens))


def uniform_twin(trace: Trace, preset: ModelPreset, seed: int = 0, batch: int = 1) -> Trace:
    """A uniform-routing trace of the same geometry and sequence lengths (for comparison), with
    sequences enough for batches of `batch` requests."""
    lengths = trace.seq_lengths()
    tokens = int(min(lengths.max(), 4096))
    seqs = max(1, min(int(lengths.sum()) // tokens, 16), min(batch, lengths.size))
    return synthesize(preset, Uniform(), tokens, seqs, seed, trace.meta.geometry.weight_format)


def extrapolation_warnings(noun: str, symbol: str, factor: np.ndarray, sizes: np.ndarray) -> list[str]:
    """One warning naming every prediction beyond the calibrated range ("passes of n = 1-3, 8") and its factors."""
    pairs = zip(np.asarray(sizes).ravel(), np.asarray(factor).ravel(), strict=True)
    flagged = [(int(size), float(f)) for size, f in pairs if extrapolated(f)]
    if not flagged:
        return []
    low, high = min(f for _, f in flagged), max(f for _, f in flagged)
    factors = f"factor {low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"factors {low:.2f}-{high:.2f}"
    if len(flagged) == 1:
        subject, verb, pronoun = f"{noun} of {symbol} = {flagged[0][0]}", "lies", "it"
    else:
        subject, verb, pronoun = f"{noun}es of {symbol} = {size_ranges([size for size, _ in flagged])}", "lie", "them"
    return [f"{subject} {verb} beyond the calibrated range (extrapolation {factors}); the roofline bounds {pronoun} from below"]


def size_ranges(sizes: list[int]) -> str:
    """Sorted sizes as runs of consecutive values: [1, 2, 3, 7, 9, 10] -> '1-3, 7, 9-10'."""
    runs: list[list[int]] = []
    for size in sorted(set(sizes)):
        if runs and size == runs[-1][1] + 1:
            runs[-1][1] = size
        else:
            runs.append([size, size])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
