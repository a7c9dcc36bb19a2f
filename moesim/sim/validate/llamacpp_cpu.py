"""Running the llama.cpp validation on this machine (issue 8): build a target with at least 1 GB of
expert weights and a noisy draft with the tiny-model builder, calibrate a profile with the
llama.cpp microbenchmark on the target's expert shape, measure speculative runs at several draft
lengths, and compare them with the predictions (`llamacpp_validation`).

Shared machines only ever add time, so every run is repeated and each verify step keeps its
minimum over the repetitions (greedy decoding is deterministic: the repetitions decode the same
tokens, which is checked); the microbenchmark uses the minimum too. The draft lengths are
interleaved within each repetition so that drifting load hits them alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import polars as pl

from moesim.atomic import atomic_path, write_text_atomic
from moesim.errors import ConfigError, InputError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.fitting.calibrate import fit_profile
from moesim.hw_profiles.microbench.llama_cpp import DEFAULT_SHAPE, LlamaBenchConfig, run_llamacpp_shapes
from moesim.hw_profiles.microbench.table import MoeShape, write_measurements
from moesim.hw_profiles.schema import write_profile
from moesim.machine import cpu_facts
from moesim.models import AttentionShape, ModelPreset, load_preset
from moesim.sim.cost.measured_passes import verify_passes
from moesim.sim.cost.steptime import StepTimeModel
from moesim.sim.validate.draft_lengths import DraftValidation, validate_draft_lengths
from moesim.tracegen.formats.specrun import SpecRun, SpecRunMeta, SpecRunWriter, read_spec_run
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, build_draft_model, build_tiny_model, expert_weight_bytes
from moesim.tracegen.llamacpp.gguf_reader import GGUFModelInfo, read_gguf_info
from moesim.tracegen.llamacpp.prompts import PromptSet, load_prompts
from moesim.tracegen.llamacpp.runtime import BACKEND, ENGINE, engine_version
from moesim.tracegen.llamacpp.speculate import PromptSpeculation, SpeculativeSession

Progress = Callable[[str], None]

PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts.",
    "Speculative decoding drafts tokens cheaply and verifies them in one pass.",
    "abc def ghi jkl mno pqr stu vwx yz",
    "Memory bandwidth limits decoding on small machines.",
    "Once upon a time there was a little model that could.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10",
    "How many tokens per pass does the draft buy?",
)
MIN_EXPERT_BYTES = 1e9
TIMING = "perf_counter wall time on contexts without the eval callback; per step the minimum over {reps} repetitions"


def check_lengths_and_counts(config: object, draft_lens: tuple[int, ...], counts: tuple[str, ...]) -> None:
    """Raise ConfigError unless the draft lengths are distinct and >= 1 and each named count field is >= 1."""
    if not draft_lens or min(draft_lens) < 1 or len(set(draft_lens)) != len(draft_lens):
        raise ConfigError(f"draft lengths must be distinct and >= 1, got {draft_lens}")
    for name in counts:
        if getattr(config, name) < 1:
            raise ConfigError(f"field '{name}' must be >= 1, got {getattr(config, name)}")


@dataclass(frozen=True)
class CpuValidationConfig:
    """What the validation builds, calibrates and measures."""

    draft_lens: tuple[int, ...] = (1, 2, 4, 8, 16)
    noise: float = 0.03
    repetitions: int = 6
    max_tokens: int = 40
    n_threads: int = 1
    moe_layers: int = 2
    vocab: int = 1024
    seed: int = 7
    shape: MoeShape = DEFAULT_SHAPE
    heads: int = 16
    kv_heads: int = 1
    bench_reps: int = 9
    bench_warmup: int = 2
    bench_pass_sizes: tuple[int, ...] = (*range(1, 18), 24, 32)
    statistic: str = "min"
    prompts: tuple[str, ...] = PROMPTS
    min_expert_bytes: float = MIN_EXPERT_BYTES

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        check_lengths_and_counts(self, self.draft_lens, ("repetitions", "max_tokens", "n_threads", "moe_layers"))
        if max(self.draft_lens) + 1 > max(self.bench_pass_sizes):
            raise ConfigError(f"the calibration's pass sizes must reach the longest verify pass ({max(self.draft_lens) + 1} tokens)")
        if expert_weight_bytes(self.target_spec()) < self.min_expert_bytes:
            raise ConfigError(
                f"the target holds {expert_weight_bytes(self.target_spec()) / 1e9:.2f} GB of expert weights, below the minimum"
            )

    def target_spec(self) -> TinyModelSpec:
        """The target: the calibrated expert shape in a llama (Mixtral-style) model."""
        return self.shape.llama_spec(self.moe_layers, self.heads, self.kv_heads, self.vocab, self.seed, "moesim-validation-target")

    def bench_config(self) -> LlamaBenchConfig:
        """The microbenchmark on the target's expert shape, attention and threads."""
        return LlamaBenchConfig(
            shape=self.shape,
            heads=self.heads,
            kv_heads=self.kv_heads,
            pass_sizes=self.bench_pass_sizes,
            reps=self.bench_reps,
            warmup=self.bench_warmup,
            n_threads=self.n_threads,
            statistic=self.statistic,
            seed=self.seed,
        )


def preset_from_tiny_spec(spec: TinyModelSpec) -> ModelPreset:
    """The model preset (contract 5) of a llama-architecture model the tiny-model builder writes."""
    if spec.arch != "llama" or not spec.is_moe:
        raise ConfigError(f"a preset is derived for llama MoE models only, got arch '{spec.arch}' with {spec.experts} experts")
    kind = "mha" if spec.kv_heads == spec.heads else "gqa"
    return ModelPreset(
        name=spec.model_name,
        kind="moe",
        layers=spec.layers,
        hidden=spec.hidden,
        vocab=spec.vocab,
        attention=AttentionShape(kind, spec.heads, spec.kv_heads, spec.head_dim),
        experts=spec.experts,
        top_k=spec.top_k,
        expert_intermediate=spec.expert_ff,
        default_format=spec.weight_type,
    )


def preset_toml(preset: ModelPreset) -> str:
    """A preset as a TOML table that `load_preset` reads back."""
    keys = ("kind", "layers", "hidden", "vocab", "experts", "top_k", "expert_intermediate", "default_format")
    a = preset.attention
    lines = [f"# {preset.name}: written by moesim.sim.validate.llamacpp_cpu", f'["{preset.name}"]']
    lines += [f"{key} = {json.dumps(getattr(preset, key))}" for key in keys]
    lines += [
        f'["{preset.name}".attention]',
        f'kind = "{a.kind}"',
        f"heads = {a.heads}",
        f"kv_heads = {a.kv_heads}",
        f"head_dim = {a.head_dim}",
    ]
    return "\n".join(lines) + "\n"


# ---- measuring ------------------------------------------------------------------------------------


def min_over_repetitions(repetitions: list[PromptSpeculation]) -> PromptSpeculation:
    """One prompt's runs combined: the same steps (checked), each with its minimum times."""
    first = repetitions[0]
    for i, other in enumerate(repetitions[1:], start=1):
        same = len(other.steps) == len(first.steps) and all(
            np.array_equal(a.tokens, b.tokens) and a.accepted == b.accepted for a, b in zip(first.steps, other.steps, strict=True)
        )
        if not same:
            raise InputError(f"repetition {i} decoded differently from repetition 0 (greedy decoding should be deterministic)")
    steps = [
        dataclasses.replace(
            step,
            weights=None,
            draft_us=min(r.steps[j].draft_us for r in repetitions),
            verify_us=min(r.steps[j].verify_us for r in repetitions),
        )
        for j, step in enumerate(first.steps)
    ]
    info = dataclasses.replace(
        first.info,
        prefill_us=min(r.info.prefill_us for r in repetitions),
        plain_decode_us=min(r.info.plain_decode_us for r in repetitions),
    )
    return PromptSpeculation(steps, info, first.generated)


def repetition_spread(repetitions: list[PromptSpeculation]) -> np.ndarray:
    """Per step, (max − min) / min of the verify time over the repetitions."""
    times = np.array([[s.verify_us for s in r.steps] for r in repetitions])
    return (times.max(axis=0) - times.min(axis=0)) / times.min(axis=0)


def write_run(path: Path, meta: SpecRunMeta, prompts: list[PromptSpeculation]) -> None:
    """A combined run as contract 2."""
    with SpecRunWriter(path, meta, with_weights=False) as writer:
        for prompt in prompts:
            for step in prompt.steps:
                writer.append_step(step)
            writer.end_sequence(prompt.info)


@dataclass
class MeasuredRuns:
    """Per draft length, every prompt's runs (one per repetition), and the load meanwhile."""

    runs: dict[int, list[list[PromptSpeculation]]] = field(default_factory=dict)
    loadavg: list[list[float]] = field(default_factory=list)
    seconds: float = 0.0


class PromptRunner(Protocol):
    """What `measure` needs of a session (llama.cpp's `SpeculativeSession`, MLX's `MlxSpeculativeSession`)."""

    def run_prompt(
        self, tokens: list[int], draft_len: int, max_tokens: int, baseline: bool = True, check: Callable[[], None] | None = None
    ) -> PromptSpeculation:
        """One prompt's speculative decoding."""
        ...


class RunPlan(Protocol):
    """What `measure` needs of a validation config (read-only, as frozen dataclasses are)."""

    @property
    def draft_lens(self) -> tuple[int, ...]:
        """Draft lengths, interleaved within each repetition."""
        ...

    @property
    def repetitions(self) -> int:
        """Repetitions of every run."""
        ...

    @property
    def max_tokens(self) -> int:
        """Tokens generated per prompt at least."""
        ...


def measure(session: PromptRunner, token_lists: list[list[int]], config: RunPlan, say: Progress) -> MeasuredRuns:
    """Every draft length × repetition × prompt; draft lengths interleaved within each repetition."""
    started = time.monotonic()
    out = MeasuredRuns({k: [[] for _ in token_lists] for k in config.draft_lens})
    session.run_prompt(token_lists[0], max(config.draft_lens), config.max_tokens, baseline=False)  # warm-up, discarded
    for rep in range(config.repetitions):
        out.loadavg.append(list(os.getloadavg()))
        for k in config.draft_lens:
            for i, tokens in enumerate(token_lists):
                out.runs[k][i].append(session.run_prompt(tokens, k, config.max_tokens, baseline=True))
            say(f"repetition {rep + 1}/{config.repetitions}, k = {k}: done ({time.monotonic() - started:.0f} s)")
    out.loadavg.append(list(os.getloadavg()))
    out.seconds = time.monotonic() - started
    return out


ISOLATED_SIZES = (1, 2, 5, 9, 17)


def isolated_passes(
    session: SpeculativeSession, token_lists: list[list[int]], source: SpecRun, model: StepTimeModel, reps: int = 12, prompts: int = 4
) -> pl.DataFrame:
    """The source's first verify pass of the first prompts, truncated to each size in ISOLATED_SIZES
    and timed `reps` times back to back on the target alone (minimum and median), with its prediction:
    the cost model on the same passes as in the runs, without the runs' conditions (a draft model
    between passes, one timing per repetition)."""
    first = source.steps.with_row_index("index").filter(pl.col("step") == 0).head(prompts)
    sizes = [n for n in ISOLATED_SIZES if n - 1 <= int(source.steps["drafted"].min())]  # type: ignore[arg-type]
    predicted = {n: model.pass_cost(*verify_passes(source, n - 1)).total_us() for n in sizes}
    rows = []
    for step in first.iter_rows(named=True):
        i, pos0 = step["index"], step["pos0"]
        session.timed.clear()
        session.timed.decode(token_lists[step["seq"]], 0, all_logits=False)
        feed = [int(t) for t in source.token[source.slot_start[i] : source.slot_start[i + 1]]]
        for n in sizes:
            times = []
            for _ in range(reps):
                started = time.perf_counter_ns()
                session.timed.decode(feed[:n], pos0)
                times.append((time.perf_counter_ns() - started) / 1e3)
                session.timed.truncate(pos0)
            rows.append({"seq": step["seq"], "n_tokens": n, "time_us_min": min(times), "time_us_median": float(np.median(times)),
                         "predicted_us": float(predicted[n][i])})  # fmt: skip
    return pl.DataFrame(rows).with_columns((pl.col("predicted_us") / pl.col("time_us_min") - 1.0).mul(100).alias("error_vs_min_pct"))


# ---- the whole pipeline ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuValidationResult:
    """Where everything was written, and the comparison."""

    out_dir: Path
    validation: DraftValidation
    summary: dict[str, Any]


def _calibrate(config: CpuValidationConfig, out_dir: Path, calibration: Path | None, say: Progress) -> None:
    """The microbenchmark's table (run now, unless an existing folder is given), fitted into profile.toml."""
    if calibration is None:
        calibration = out_dir / "calibration"
        say(f"calibrating: llama.cpp microbenchmark on the target's expert shape, {config.n_threads} thread(s)")
        result = run_llamacpp_shapes(config.bench_config(), [config.shape], progress=say)
        write_measurements(result.rows, calibration, result.provenance)
    table = calibration / "measurements.parquet"
    report = fit_profile(table, "llamacpp-cpu-validation", backend="cpu")
    write_profile(out_dir / "profile.toml", report.profile)


@contextlib.contextmanager
def _session(config: CpuValidationConfig, prompts: PromptSet, models_dir: Path | None, say: Progress) -> Iterator[_Models]:
    """The target and the draft built in a temporary folder (removed afterwards) and loaded."""
    spec = config.target_spec()
    folder = Path(tempfile.mkdtemp(prefix="moesim-validation-", dir=models_dir))
    try:
        target, draft = folder / "target.gguf", folder / "draft.gguf"
        say(f"building the target ({expert_weight_bytes(spec) / 1e9:.2f} GB of experts) and a draft with noise {config.noise}")
        build_tiny_model(target, spec)
        build_draft_model(spec, config.noise, draft)
        n_ctx = -(-(64 + config.max_tokens + 2 * max(config.draft_lens) + 8) // 64) * 64
        with SpeculativeSession(target, draft, n_ctx, config.n_threads) as session:
            token_lists = [session.target.tokenize(p.text) for p in prompts.prompts]
            if max(len(t) for t in token_lists) > 64:
                raise ConfigError("prompts must tokenize to at most 64 tokens")
            yield _Models(session, read_gguf_info(target), token_lists)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class _Models:
    session: SpeculativeSession
    info: GGUFModelInfo
    token_lists: list[list[int]]


def _write_runs(
    out_dir: Path, measured: MeasuredRuns, models: _Models, prompts: PromptSet, config: CpuValidationConfig
) -> dict[int, float]:
    """The per-step minimum runs as contract 2 files; returns the median repetition spread per draft length."""
    (out_dir / "runs").mkdir(exist_ok=True)
    spread = {}
    for k, per_prompt in measured.runs.items():
        meta = SpecRunMeta(
            geometry=models.info.geometry,
            draft_model=models.session.draft_name,
            draft_len=k,
            engine=ENGINE,
            engine_version=engine_version(),
            backend=BACKEND,
            prompts=f"{prompts.describe()}; greedy, at least {config.max_tokens} generated tokens per prompt",
            n_threads=config.n_threads,
            timing=TIMING.format(reps=config.repetitions),
        )
        write_run(out_dir / "runs" / f"spec-k{k}.arrow", meta, [min_over_repetitions(reps) for reps in per_prompt])
        spread[k] = float(np.median(np.concatenate([repetition_spread(reps) for reps in per_prompt])))
    return spread


def _step_model(out_dir: Path, config: CpuValidationConfig) -> StepTimeModel:
    profile = load_profile(str(out_dir / "profile.toml"))
    return StepTimeModel(load_preset(out_dir / "target-preset.toml"), profile, "dedup_llamacpp_cpu", config.shape.weight_format)


def _runs(out_dir: Path, config: CpuValidationConfig) -> list[SpecRun]:
    return [read_spec_run(out_dir / "runs" / f"spec-k{k}.arrow") for k in sorted(config.draft_lens)]


def _write_isolated(out_dir: Path, models: _Models, source: SpecRun, model: StepTimeModel, say: Progress) -> dict[str, float]:
    say("timing isolated passes (the source's first verify passes, back to back)")
    isolated = isolated_passes(models.session, models.token_lists, source, model)
    isolated.write_csv(out_dir / "isolated_passes.csv")
    medians = isolated.group_by("n_tokens").agg(pl.col("error_vs_min_pct").median()).sort("n_tokens")
    return {str(n): float(e) for n, e in medians.iter_rows()}


def write_summary(out_dir: Path, updates: dict[str, Any]) -> dict[str, Any]:
    """OUT/summary.json with `updates` written over what it held."""
    path = out_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary.update(updates)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n")
    return summary


def start_validation(config: Any, out_dir: Path, progress: Progress | None) -> tuple[Progress, float]:
    """A validation begun: its config checked, `out_dir` made without a summary; (what it says, when it started)."""
    config.validate()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").unlink(missing_ok=True)
    return progress or (lambda _message: None), time.monotonic()


def write_inputs(out_dir: Path, spec: TinyModelSpec, prompts: tuple[str, ...]) -> PromptSet:
    """The target's preset and the prompts written into `out_dir`; the prompts read back."""
    write_text_atomic(out_dir / "target-preset.toml", preset_toml(preset_from_tiny_spec(spec)))
    write_text_atomic(out_dir / "prompts.txt", "\n".join(prompts) + "\n")
    return load_prompts(out_dir / "prompts.txt")


def run_facts(measured: MeasuredRuns, started: float, version: str) -> dict[str, Any]:
    """The summary's facts of the run: the load and time it took, the machine, the engine's version, the date."""
    return {
        "loadavg_per_repetition": measured.loadavg,
        "measure_seconds": round(measured.seconds, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "machine": cpu_facts(),
        "engine_version": version,
        "measured_at": time.strftime("%Y-%m-%d"),
    }


def run_cpu_validation(
    config: CpuValidationConfig,
    out_dir: Path,
    calibration: Path | None = None,
    models_dir: Path | None = None,
    progress: Progress | None = None,
) -> CpuValidationResult:
    """Build, calibrate, measure, compare; write everything into `out_dir`."""
    say, started = start_validation(config, out_dir, progress)
    _calibrate(config, out_dir, calibration, say)
    spec = config.target_spec()
    prompts = write_inputs(out_dir, spec, config.prompts)
    model = _step_model(out_dir, config)
    with _session(config, prompts, models_dir, say) as models:
        measured = measure(models.session, models.token_lists, config, say)
        spread = _write_runs(out_dir, measured, models, prompts, config)
        runs = _runs(out_dir, config)
        isolated = _write_isolated(out_dir, models, runs[-1], model, say)
        draft_name = models.session.draft_name
    validation = analyze(out_dir, config)
    summary = write_summary(
        out_dir,
        {
            "config": {**dataclasses.asdict(config), "shape": dataclasses.asdict(config.shape)},
            "target": {"spec": dataclasses.asdict(spec), "expert_weight_bytes": expert_weight_bytes(spec)},
            "draft": draft_name,
            "verify_repetition_spread_median": spread,
            "isolated_error_vs_min_pct_median": isolated,
            **run_facts(measured, started, engine_version()),
        },
    )
    return CpuValidationResult(out_dir, validation, summary)


def analyze(out_dir: Path, config: CpuValidationConfig) -> DraftValidation:
    """The comparison from the files in `out_dir` alone (runs, profile, preset): per_k.csv,
    from_source.csv and the best draft lengths in summary.json."""
    validation = validate_draft_lengths(_runs(out_dir, config), _step_model(out_dir, config))
    validation.per_k.write_csv(out_dir / "per_k.csv")
    validation.source.write_csv(out_dir / "from_source.csv")
    write_summary(out_dir, {"best_draft": validation.best(), "rank_agreement_from_source": validation.rank_agreement()})
    return validation


def run_isolated_check(
    config: CpuValidationConfig, out_dir: Path, models_dir: Path | None = None, progress: Progress | None = None
) -> dict[str, float]:
    """Only the isolated-pass check, against the runs and profile already in `out_dir` (same config)."""
    say = progress or (lambda _message: None)
    prompts = load_prompts(out_dir / "prompts.txt")
    with _session(config, prompts, models_dir, say) as models:
        isolated = _write_isolated(out_dir, models, _runs(out_dir, config)[-1], _step_model(out_dir, config), say)
    write_summary(out_dir, {"isolated_error_vs_min_pct_median": isolated})
    return isolated


def per_k_display(validation: DraftValidation) -> pl.DataFrame:
    """The comparison per measured draft length, for printing."""
    return validation.per_k.select(
        "draft_len",
        "tokens_per_pass",
        "tokens_per_pass_from_source",
        "verify_us",
        "verify_us_predicted",
        "verify_abs_error_median_pct",
        "verify_signed_error_mean_pct",
        "draft_us",
        "draft_us_predicted",
        "tokens_per_s",
        "tokens_per_s_predicted",
        "tokens_per_s_from_source",
    )
