"""The MLX validation on this machine (issue 29), as the llama.cpp one (`llamacpp_cpu`): a target
written by the MLX tiny-model builder on the calibrated expert shape, a noisy copy as the draft,
the profile fitted from `moesim microbench mlx` (its dense family and fixed time from the dense
twins it times), speculative runs through mlx_lm's own speculative generation at several draft
lengths, compared with the predictions (`draft_lengths`): the cost model and the acceptance model
judged apart.

Calls are timed in the process's CPU time, as the microbenchmark times them (this machine is shared
with other jobs). Every run is repeated; each verify step keeps its minimum over the repetitions (greedy decoding
is deterministic, checked), as the microbenchmark keeps its minimum; the draft lengths are
interleaved within each repetition so that drifting load hits them alike. The step-time model
runs the engine's dispatch (`dispatch`: mlx_lm sorts rows by expert from 64 (token, slot) rows,
so a verify pass of 17 tokens at top-4 runs the sorted family).

Also here: u(n) against r(n) of MLX's gathered kernels from a measurement table (`measured_r`)."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.hw_profiles import load_profile
from moesim.hw_profiles.fitting.calibrate import fit_profile
from moesim.hw_profiles.measurements.table import load_measurements
from moesim.hw_profiles.microbench.mlx_switch import DEFAULT_SHAPES
from moesim.hw_profiles.microbench.table import MoeShape
from moesim.hw_profiles.schema import write_profile
from moesim.models import load_preset
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.validate.draft_lengths import DraftValidation, validate_draft_lengths
from moesim.sim.validate.llamacpp_cpu import (
    PROMPTS,
    MeasuredRuns,
    Progress,
    check_lengths_and_counts,
    measure,
    min_over_repetitions,
    repetition_spread,
    run_facts,
    start_validation,
    write_inputs,
    write_run,
    write_summary,
)
from moesim.tracegen.formats.specrun import SpecRun, SpecRunMeta, read_spec_run
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec
from moesim.tracegen.llamacpp.prompts import load_prompts
from moesim.tracegen.mlx.builder import build_mlx_model
from moesim.tracegen.mlx.runtime import ENGINE, backend, engine_version
from moesim.tracegen.mlx.speculate import MlxSpeculativeSession

TIMING = "process CPU time of each mlx_lm call with mx.eval of its logits; per step the minimum over {reps} repetitions"
KV_BYTES = 4.0  # the tiny models are float32: so is their KV cache


@dataclass(frozen=True)
class MlxValidationConfig:
    """What the MLX validation builds, fits and measures."""

    draft_lens: tuple[int, ...] = (1, 2, 4, 8, 16)
    noise: float = 0.03
    repetitions: int = 4
    max_tokens: int = 32
    moe_layers: int = 2
    vocab: int = 1024
    seed: int = 7
    shape: MoeShape = DEFAULT_SHAPES[0]
    heads: int = 4
    kv_heads: int = 2
    prompts: tuple[str, ...] = PROMPTS

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        check_lengths_and_counts(self, self.draft_lens, ("repetitions", "max_tokens", "moe_layers"))

    def target_spec(self) -> TinyModelSpec:
        """The target: the calibrated expert shape in a Mixtral-style model (the dense twins' attention)."""
        return self.shape.llama_spec(self.moe_layers, self.heads, self.kv_heads, self.vocab, self.seed, "moesim-mlx-validation-target")


def fit_calibration(calibration: Path, out: Path) -> None:
    """`profile fit` of the calibration's F32 rows into `out`."""
    report = fit_profile(calibration / "measurements.parquet", "mlx-cpu", ["dtype=f32"], backend="cpu")
    write_profile(out, report.profile)


def step_model(out_dir: Path) -> StepTimeModel:
    """The target on the fitted profile, priced by the engine's dispatch."""
    profile = load_profile(str(out_dir / "profile.toml"))
    return StepTimeModel(load_preset(out_dir / "target-preset.toml"), profile, "dispatch", "F32", kv_bytes_per_element=KV_BYTES)


@contextlib.contextmanager
def _session(config: MlxValidationConfig, models_dir: Path | None, say: Progress) -> Iterator[MlxSpeculativeSession]:
    """The target and its noisy copy written in a temporary folder (removed afterwards) and loaded."""
    spec = config.target_spec()
    folder = Path(tempfile.mkdtemp(prefix="moesim-mlx-validation-", dir=models_dir))
    try:
        say(f"building the MLX target and a draft with noise {config.noise}")
        build_mlx_model(folder / "target", spec)
        build_mlx_model(folder / "draft", dataclasses.replace(spec, noise=config.noise, name="moesim-mlx-validation-draft"))
        yield MlxSpeculativeSession(folder / "target", folder / "draft", "cpu")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _write_runs(out_dir: Path, measured: MeasuredRuns, session: MlxSpeculativeSession, config: MlxValidationConfig) -> dict[int, float]:
    """The per-step minimum runs as contract 2 files; returns the median repetition spread per draft length."""
    (out_dir / "runs").mkdir(exist_ok=True)
    prompts = load_prompts(out_dir / "prompts.txt")
    spread = {}
    for k, per_prompt in measured.runs.items():
        meta = SpecRunMeta(
            geometry=session.geometry,
            draft_model=session.draft.name,
            draft_len=k,
            engine=ENGINE,
            engine_version=engine_version(),
            backend=backend(),
            prompts=f"{prompts.describe()}; greedy, at least {config.max_tokens} generated tokens per prompt",
            timing=TIMING.format(reps=config.repetitions),
        )
        write_run(out_dir / "runs" / f"spec-k{k}.arrow", meta, [min_over_repetitions(reps) for reps in per_prompt])
        spread[k] = float(np.median(np.concatenate([repetition_spread(reps) for reps in per_prompt])))
    return spread


def runs(out_dir: Path, config: MlxValidationConfig) -> list[SpecRun]:
    """The measured runs in `out_dir`, shortest draft first."""
    return [read_spec_run(out_dir / "runs" / f"spec-k{k}.arrow") for k in sorted(config.draft_lens)]


def crossover(draft_len: np.ndarray, tokens_per_s: np.ndarray) -> int:
    """The longest draft length whose tokens/s beats plain decoding (k = 0), 0 when none does."""
    plain = float(tokens_per_s[draft_len == 0][0])
    paying = draft_len[(draft_len > 0) & (tokens_per_s > plain)]
    return int(paying.max()) if paying.size else 0


def analyze(out_dir: Path, config: MlxValidationConfig) -> DraftValidation:
    """The comparison from the files in `out_dir` alone: per_k.csv, from_source.csv, summary.json's best and crossovers."""
    validation = validate_draft_lengths(runs(out_dir, config), step_model(out_dir))
    validation.per_k.write_csv(out_dir / "per_k.csv")
    validation.source.write_csv(out_dir / "from_source.csv")
    k = validation.per_k["draft_len"].to_numpy()
    crossovers = {
        "measured": crossover(k, validation.per_k["tokens_per_s"].to_numpy()),
        "predicted_from_source": crossover(k, validation.per_k["tokens_per_s_from_source"].to_numpy()),
        "predicted_on_measured_passes": crossover(k, validation.per_k["tokens_per_s_predicted"].to_numpy()),
    }
    write_summary(out_dir, {"best_draft": validation.best(), "longest_paying_draft": crossovers,
                             "rank_agreement_from_source": validation.rank_agreement()})  # fmt: skip
    return validation


def run_mlx_validation(
    config: MlxValidationConfig, out_dir: Path, calibration: Path, models_dir: Path | None = None, progress: Progress | None = None
) -> tuple[DraftValidation, dict[str, Any]]:
    """Fit, build, measure, compare; write everything into `out_dir`."""
    say, started = start_validation(config, out_dir, progress)
    fit_calibration(calibration, out_dir / "profile.toml")
    prompts = write_inputs(out_dir, config.target_spec(), config.prompts)
    with _session(config, models_dir, say) as session:
        token_lists = [session.target.tokenize(p.text) for p in prompts.prompts]
        measured = measure(session, token_lists, config, say)
        spread = _write_runs(out_dir, measured, session, config)
    validation = analyze(out_dir, config)
    summary = write_summary(
        out_dir,
        {
            "config": {**dataclasses.asdict(config), "shape": dataclasses.asdict(config.shape)},
            "calibration": str(calibration),
            "verify_repetition_spread_median": spread,
            **run_facts(measured, started, engine_version()),
        },
    )
    return validation, summary


def measured_r(table: Path, routing: str = "uniform", weight_format: str = "f32") -> pl.DataFrame:
    """Per shape and pass size: the byte share u(n) = U / (n·k) and r(n) = u(n) · T_per_slot(n) / T_sorted(n)
    of MLX's gathered kernels, as measured; the sorted (deduplicating) rows pay where u < r."""
    frame = load_measurements(table).filter((pl.col("routing") == routing) & (pl.col("dtype") == weight_format))
    keys = ["model", "n_tokens", "top_k", "distinct_experts"]
    per_slot = frame.filter(pl.col("kernel") == "per_slot").select(*keys, pl.col("time_us").alias("per_slot_us"))
    ordered = frame.filter(pl.col("kernel") == "dedup_gather_sorted").select(*keys, pl.col("time_us").alias("sorted_us"))
    joined = per_slot.join(ordered, on=keys).sort("model", "n_tokens")
    u = pl.col("distinct_experts") / (pl.col("n_tokens") * pl.col("top_k"))
    return joined.with_columns(u.alias("u"), (u * pl.col("per_slot_us") / pl.col("sorted_us")).alias("r")).with_columns(
        (pl.col("u") < pl.col("r")).alias("sorted_faster")
    )
