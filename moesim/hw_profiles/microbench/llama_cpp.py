"""Per-layer expert time through llama.cpp (llama-cpp-python), on the installed build's backend.

Models: GGUFs written by the tiny-model builder (llama/Mixtral architecture, one seed, shape and
vocabulary): MoE models with L and 2L layers and, unless `subtract_attention` is off, dense twins
with the same attention and a 16-wide FFN, also with L and 2L layers. A MoE layer's expert time is

    [(T_moe(2L) − T_moe(L)) − (T_dense(2L) − T_dense(L))] / L

so everything but the layers cancels (embedding, LM head, sampling, Python), and so does each
layer's attention; what remains is the router, llama.cpp's MUL_MAT_ID expert matmuls (gate, up,
down) and the MoE glue (softmax, top-k, SwiGLU, weighted sum).

Routing is designed, not left to chance. Each token of the vocabulary stands for one set of k
experts: its embedding is 1 on those k coordinates and 0 elsewhere, the router of every layer is
the identity on the first E coordinates, and the attention output and expert down projections are
zero, so the hidden state stays the embedding in every layer and each token routes to exactly its
set (zeros change no kernel's work: ggml's matmuls do not skip them). Passes follow the shared
routings (`same`, `uniform`, `distinct`) and their features are exact. Every pass's routing is
checked once by capturing it (llama.cpp's eval callback) on a separate context of the 2L model.

Timing: each context prefills `prefix` tokens; a pass decodes its n tokens at the same position
with logits for every token (otherwise the last layer would route only the output rows), is timed
(wall clock around the decode and the logits read, which synchronises the backend) and undone
with `llama_memory_seq_rm`. The four models run interleaved, one pass each per repetition, so
drift hits them alike; warm-up repetitions (the first pass of a new size rebuilds the graph) are
discarded. `time_us` is the difference above taken of a per-model statistic: the median by default
(right while fewer than half of each model's repetitions are disturbed, say by another process
taking a core, where a median of per-repetition differences would need all four passes of a
repetition clean), or the minimum (`statistic="min"`, for a shared machine whose interference
only ever adds time). Rows keep both (`time_us_median`, `time_us_min`), the layer parts
(`time_us_moe_layer`, `time_us_attention_layer`) and every repetition's raw times per model
(`reps_us_moe_L`, ...); p10/p90 are not defined for a difference of statistics.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import ConfigError, InputError
from moesim.fields import option
from moesim.hw_profiles.measurements.table import STATISTICS
from moesim.hw_profiles.microbench.llamacpp_kernels import llamacpp_family
from moesim.hw_profiles.microbench.plan import Plan, PlannedPass, measured_passes, plan_shapes, planned_rows
from moesim.hw_profiles.microbench.routing import (
    DEFAULT_PASS_SIZES,
    PLANNED,
    ROUTINGS,
    pass_features,
    pass_sizes_option,
    planned_ids,
    routing_ids,
    routing_seed,
    routings_option,
)
from moesim.hw_profiles.microbench.table import MoeShape, TimingSummary, measurement_row
from moesim.kernels.features import RoutingFeatures
from moesim.machine import cpu_facts, usable_cpus
from moesim.models import load_target
from moesim.tracegen.llamacpp.gguf_builder import (
    BYTE_TOKENS_START,
    MAX_VOCAB,
    MIN_VOCAB,
    TinyModelSpec,
    build_tiny_model,
    expert_weight_bytes,
    model_bytes,
)
from moesim.tracegen.llamacpp.runtime import LlamaContext, LlamaModel, RoutingCapture, engine_version

DEFAULT_SHAPE = MoeShape("deepseek-v2-lite", hidden=2048, expert_intermediate=1408, experts=64, top_k=6, weight_format="F16")
MODELS = ("moe_L", "moe_2L", "dense_L", "dense_2L")
DENSE_FF = 16
RETRIES = 2


@dataclass(frozen=True)
class LlamaBenchConfig:
    """What one llama.cpp microbenchmark run builds and measures."""

    shape: MoeShape = DEFAULT_SHAPE
    layers: int = option(1, "L: models with L and 2L MoE layers are differenced.")
    heads: int = option(16, "Attention heads of the built models.")
    kv_heads: int = option(1, "KV heads of the built models.")
    pass_sizes: tuple[int, ...] = pass_sizes_option(DEFAULT_PASS_SIZES)
    routings: tuple[str, ...] = routings_option()
    reps: int = option(9, "Timed repetitions per pass and model (medians differenced).")
    warmup: int = option(2, "Discarded warm-up repetitions.")
    prefix: int = option(32, "Tokens prefilled before the timed passes.")
    n_threads: int = option(0, "Decode threads (0: every CPU this process may use).", name="--threads")
    subtract_attention: bool = option(True, "Subtract the attention layer time measured on dense twins.")
    per_slot_max_tokens: int | None = option(None, "Largest pass size run per-slot (default: per backend).")
    statistic: str = option("median", "Per-model statistic differenced: median, or min on a shared machine.")
    seed: int = option(0, "Random seed (weights, routings).")
    planned: tuple[PlannedPass, ...] = ()  # a plan's passes of this shape (routing `planned`), instead of pass sizes x routings

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        shape = self.shape
        if self.statistic not in STATISTICS:
            raise ConfigError(f"llama.cpp microbench: statistic must be one of {', '.join(STATISTICS)}, got '{self.statistic}'")
        for name in ("layers", "reps", "prefix"):
            if getattr(self, name) < 1:
                raise ConfigError(f"llama.cpp microbench: field '{name}' must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.n_threads < 0:
            raise ConfigError("llama.cpp microbench: 'warmup' and 'n_threads' must be >= 0")
        if shape.weight_format not in ("F16", "F32"):
            raise ConfigError(f"llama.cpp microbench: weight format must be F16 or F32 (the builder's), got '{shape.weight_format}'")
        if not 1 <= shape.top_k < shape.experts <= shape.hidden:
            raise ConfigError(
                f"llama.cpp microbench: need 1 <= top_k < experts <= hidden (embeddings encode expert sets), got "
                f"top_k={shape.top_k}, experts={shape.experts}, hidden={shape.hidden}"
            )
        if not self.pass_sizes or min(self.pass_sizes) < 1:
            raise ConfigError(f"llama.cpp microbench: pass sizes must be >= 1, got {self.pass_sizes}")
        for routing in self.routings:
            if routing not in ROUTINGS:
                raise ConfigError(f"llama.cpp microbench: unknown routing '{routing}' (known: {', '.join(ROUTINGS)})")
        self.model_spec("moe_L", MIN_VOCAB)  # the builder checks heads, kv_heads and the rest

    def model_spec(self, model: str, vocab: int) -> TinyModelSpec:
        """The builder spec of one of the four models."""
        routed = {} if model.startswith("moe") else {"experts": 0, "top_k": 0}
        layers = self.layers * (2 if model.endswith("2L") else 1)
        context_length = max(4096, self.prefix + max(self.pass_sizes) + 8)
        return self.shape.llama_spec(layers, self.heads, self.kv_heads, vocab, self.seed, f"moesim-microbench-{model}",
                                     dense_ff=DENSE_FF, context_length=context_length, **routed)  # fmt: skip


@dataclass(frozen=True)
class PassDesign:
    """One benchmark pass: its routing, expert ids (n, k), token ids and exact features."""

    routing: str
    ids: np.ndarray
    tokens: tuple[int, ...]
    features: RoutingFeatures
    planned: PlannedPass | None = None  # the plan's pass it measures

    @property
    def n_tokens(self) -> int:
        """Tokens in the pass."""
        return self.ids.shape[0]


def design_passes(config: LlamaBenchConfig) -> tuple[list[PassDesign], list[tuple[int, ...]]]:
    """Every (routing, pass size) pass, and the expert set of each designed token (token id
    BYTE_TOKENS_START + i has set i); the control tokens are never used."""
    shape = config.shape
    sets: dict[tuple[int, ...], int] = {}
    passes = []
    designs = [(routing, n, None) for routing in config.routings for n in sorted(config.pass_sizes)] if not config.planned else [
        (PLANNED, p.n_tokens, p) for p in sorted(config.planned, key=lambda p: p.n_tokens)
    ]  # fmt: skip
    for routing, n_tokens, planned in designs:
        if planned is None:
            ids = routing_ids(routing, n_tokens, shape.experts, shape.top_k, routing_seed(config.seed, "llama", routing, n_tokens))
        else:
            u, m = planned.distinct_experts, planned.max_tokens_per_expert
            ids = planned_ids(n_tokens, shape.experts, shape.top_k, u, m, routing_seed(config.seed, "llama", routing, n_tokens, u, m))
        tokens = tuple(BYTE_TOKENS_START + sets.setdefault(tuple(sorted(row.tolist())), len(sets)) for row in ids)
        passes.append(PassDesign(routing, ids, tokens, pass_features(ids, shape.experts), planned))
    if BYTE_TOKENS_START + len(sets) > MAX_VOCAB:
        raise ConfigError(
            f"llama.cpp microbench: the passes need {len(sets)} distinct expert sets, more than the {MAX_VOCAB - BYTE_TOKENS_START} "
            "tokens of the builder's vocabulary; measure fewer pass sizes or routings per run"
        )
    return passes, list(sets)


def design_weights(path: Path, token_sets: list[tuple[int, ...]], experts: int) -> None:
    """Rewrite a built GGUF in place so each designed token routes to its set in every layer."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    for tensor in reader.tensors:
        data = tensor.data
        if tensor.name == "token_embd.weight":
            data[:] = 0
            for index, expert_set in enumerate(token_sets):
                data[BYTE_TOKENS_START + index, list(expert_set)] = 1
        elif tensor.name.endswith("ffn_gate_inp.weight"):
            data[:] = 0
            data[np.arange(experts), np.arange(experts)] = 1
        elif tensor.name.endswith(("attn_output.weight", "ffn_down_exps.weight", "ffn_down.weight")):
            data[:] = 0
    reader.data.flush()
    del reader


def model_specs(config: LlamaBenchConfig, token_sets: list[tuple[int, ...]]) -> dict[str, TinyModelSpec]:
    """Builder specs of the run's models (the dense twins only when attention is subtracted)."""
    vocab = max(MIN_VOCAB, BYTE_TOKENS_START + len(token_sets))
    return {model: config.model_spec(model, vocab) for model in (MODELS if config.subtract_attention else MODELS[:2])}


def build_models(config: LlamaBenchConfig, token_sets: list[tuple[int, ...]], folder: Path, say: Callable[[str], None]) -> dict[str, Path]:
    """The (two or four) GGUF models of a run, built and designed in `folder`."""
    paths = {}
    for model, spec in model_specs(config, token_sets).items():
        path = folder / f"{model}.gguf"
        staged = folder / f".{model}.unpatched.gguf"
        say(f"building {path.name}: {spec.layers} layers, {expert_weight_bytes(spec) / 1e9:.2f} GB of expert weights")
        build_tiny_model(staged, spec)
        design_weights(staged, token_sets, config.shape.experts)
        os.replace(staged, path)
        paths[model] = path
    return paths


def llama_backend() -> str:
    """The backend llama-cpp-python was built for: cpu, cuda or metal."""
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        return "cpu"
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    if "Metal" in info or sys.platform == "darwin":
        return "metal"
    if "CUDA" in info:
        return "cuda"
    raise InputError(f"llama-cpp-python was built for a GPU backend moesim does not classify ({info.strip()[:80]})")


def _check_room(specs: dict[str, TinyModelSpec], models_dir: Path | None) -> None:
    """Refuse, before building, models that would not fit in memory (all are loaded at once) or on disk."""
    need = sum(model_bytes(spec) for spec in specs.values())
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        available = int(fields.get("MemAvailable", "0 kB").split()[0]) * 1024
        if available and need > 0.8 * available:
            raise ConfigError(
                f"llama.cpp microbench: the models need {need / 1e9:.1f} GB, more than 80% of the {available / 1e9:.1f} GB of memory "
                "available; use fewer experts or layers"
            )
    folder = models_dir if models_dir is not None else Path(tempfile.gettempdir())
    probe = folder if folder.exists() else folder.parent
    if probe.exists() and need > shutil.disk_usage(probe).free:
        raise ConfigError(f"llama.cpp microbench: the models need {need / 1e9:.1f} GB of disk, more than is free in {probe}")


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """Inside the block SIGTERM raises SystemExit, so a killed run still removes its temporary
    models (gigabytes); outside the main thread signals are left alone."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


@dataclass
class LlamaBenchResult:
    """Rows of the table and the provenance written beside it."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _models_folder(models_dir: Path | None) -> Iterator[Path]:
    if models_dir is not None:
        models_dir.mkdir(parents=True, exist_ok=True)
        yield models_dir
        return
    with tempfile.TemporaryDirectory(prefix="moesim-microbench-") as folder:
        yield Path(folder)


class BenchContexts:
    """Timed contexts of every model (prefix prefilled) and a capturing one on the 2L MoE model."""

    def __init__(self, config: LlamaBenchConfig, paths: dict[str, Path], gpu: bool, stack: contextlib.ExitStack) -> None:
        self.prefix = config.prefix
        n_ctx = config.prefix + max(config.pass_sizes) + 8
        threads = config.n_threads or usable_cpus()
        prefix_tokens = [BYTE_TOKENS_START] * config.prefix
        self.timed = {}
        models = {}
        for name, path in paths.items():
            models[name] = stack.enter_context(LlamaModel(path, n_gpu_layers=-1 if gpu else 0))
            context = stack.enter_context(LlamaContext(models[name], n_ctx, threads, n_ubatch=n_ctx))
            context.decode(prefix_tokens, 0, all_logits=False)
            self.timed[name] = context
        self.capture = RoutingCapture(range(2 * config.layers), config.shape.top_k)
        self.capturing = stack.enter_context(LlamaContext(models["moe_2L"], n_ctx, threads, n_ubatch=n_ctx, capture=self.capture))
        self.capturing.decode(prefix_tokens, 0, all_logits=False)
        self.capture.discard()
        self.threads = threads

    def check_routing(self, design: PassDesign) -> None:
        """Capture the pass's routing on the 2L model: every layer must select each token's set."""
        self.capturing.decode(list(design.tokens), self.prefix)
        ids, _ = self.capture.take(design.n_tokens)
        self.capturing.truncate(self.prefix)
        want = np.sort(design.ids, axis=1)
        got = np.sort(ids, axis=2)
        bad = np.argwhere(np.any(got != want[:, None, :], axis=2))
        if bad.size:
            token, layer = (int(v) for v in bad[0])
            raise InputError(
                f"llama.cpp did not route as designed: {design.routing} pass of {design.n_tokens} tokens, token {token}, "
                f"layer {layer} chose {sorted(ids[token, layer].tolist())}, designed {sorted(design.ids[token].tolist())}"
            )

    def time_pass(self, design: PassDesign) -> dict[str, float]:
        """One repetition: each model decodes the pass once; wall time in µs per model."""
        times = {}
        tokens = list(design.tokens)
        for name, context in self.timed.items():
            start = time.perf_counter_ns()
            context.decode(tokens, self.prefix)
            times[name] = (time.perf_counter_ns() - start) / 1e3
            context.truncate(self.prefix)
        return times


def layer_time_us(
    config: LlamaBenchConfig, reps: list[dict[str, float]], statistic: Callable[[list[float]], float]
) -> tuple[float, float, float]:
    """[(s(T_moe 2L) − s(T_moe L)) − (s(T_dense 2L) − s(T_dense L))] / L for a per-model statistic s
    over the repetitions; returns (expert, MoE layer, dense layer) time in µs."""
    s = {name: float(statistic([r[name] for r in reps])) for name in reps[0]}
    moe = (s["moe_2L"] - s["moe_L"]) / config.layers
    dense = (s["dense_2L"] - s["dense_L"]) / config.layers if config.subtract_attention else 0.0
    return moe - dense, moe, dense


def run_llamacpp_microbench(
    config: LlamaBenchConfig, models_dir: Path | None = None, progress: Callable[[str], None] | None = None
) -> LlamaBenchResult:
    """Build the models, check the designed routing, time every pass; rows per (routing, n)."""
    config.validate()
    say = progress or (lambda _message: None)
    passes, token_sets = design_passes(config)
    backend = llama_backend()
    started = time.monotonic()
    facts = cpu_facts()
    result = LlamaBenchResult()
    failures: list[dict[str, Any]] = []
    _check_room(model_specs(config, token_sets), models_dir)
    with _models_folder(models_dir) as folder, contextlib.ExitStack() as stack:
        paths = build_models(config, token_sets, folder, say)
        contexts = BenchContexts(config, paths, backend != "cpu", stack)
        device = (facts.get("model_name") or platform.processor() or "cpu") if backend == "cpu" else f"{backend} device"
        load_before = _loadavg()
        for design in passes:
            contexts.check_routing(design)
            where = f"{design.routing} pass of {design.n_tokens} tokens"
            statistic = STATISTICS[config.statistic]
            reps = [contexts.time_pass(design) for _ in range(config.warmup + config.reps)][config.warmup :]
            for _ in range(RETRIES):  # a difference drowned in noise: measure as many repetitions again
                if layer_time_us(config, reps, statistic)[0] > 0:
                    break
                say(f"{where}: the layer difference is not above the noise yet; {len(reps)} more repetitions")
                reps += [contexts.time_pass(design) for _ in range(len(reps))]
            expert, moe, dense = layer_time_us(config, reps, statistic)
            by_median, by_min = (layer_time_us(config, reps, STATISTICS[name])[0] for name in ("median", "min"))
            timing = TimingSummary(expert, None, None, by_min, len(reps))
            if not timing.time_us > 0:
                failures.append({"routing": design.routing, "n_tokens": design.n_tokens, "error": "difference not above noise"})
                say(f"{where}: the layer difference ({timing.time_us:.0f} us) is not above the noise; row dropped")
                continue
            result.rows.append(
                measurement_row(
                    kernel=llamacpp_family(backend, design.n_tokens, config.per_slot_max_tokens),
                    engine="llama.cpp",
                    device=device,
                    shape=config.shape,
                    routing=design.routing,
                    features=design.features,
                    timing=timing,
                    extra={
                        "features": "exact",
                        "timing": f"wall; differences of per-model {config.statistic}s",
                        "time_us_median": by_median,
                        "backend": backend,
                        "engine_version": engine_version(),
                        "n_threads": contexts.threads,
                        "layers_differenced": config.layers,
                        "time_us_moe_layer": moe,
                        "time_us_attention_layer": dense,
                        **{f"reps_us_{name}": [r[name] for r in reps] for name in reps[0]},
                        **_plan_columns(design.planned),
                    },
                )
            )
            say(f"{where}: {timing.time_us:.0f} us per layer ({time.monotonic() - started:.0f} s)")
    result.provenance = _shape_provenance(config, model_specs(config, token_sets), failures, load_before, started)
    return result


def _plan_columns(planned: PlannedPass | None) -> dict[str, Any]:
    """The plan's rung and share of a planned pass's row (nothing for the other routings)."""
    return {} if planned is None else {"plan_rung": planned.rung, "plan_time_share": planned.time_share}


def _shape_provenance(
    config: LlamaBenchConfig,
    specs: dict[str, TinyModelSpec],
    failures: list[dict[str, Any]],
    load_before: list[float] | None,
    started: float,
) -> dict[str, Any]:
    """What one shape's run built and how the machine was loaded meanwhile."""
    return {
        "config": asdict(replace(config, pass_sizes=tuple(sorted(config.pass_sizes)))),
        "models": {name: asdict(spec) for name, spec in specs.items()},
        "expert_weight_bytes_2L": expert_weight_bytes(specs["moe_2L"]),
        "smallest_pass_expert_bytes_2L": config.shape.top_k * config.shape.expert_bytes * 2 * config.layers,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "elapsed_s": round(time.monotonic() - started, 1),
        "failures": failures,
    }


def preset_shapes(models: list[str] | None, weight_format: str, overrides: dict[str, int | None]) -> list[MoeShape]:
    """The expert shapes of model presets (default deepseek-v2-lite) in a weight format, with fields overridden."""
    return [MoeShape.from_preset(load_target(m), weight_format).with_overrides(**overrides) for m in models or [DEFAULT_SHAPE.model]]


def llamacpp_engines(config: LlamaBenchConfig) -> Callable[[PlannedPass], dict[str, str]]:
    """llama.cpp's family at a planned pass's size on this backend (its dispatch: `llamacpp_family`)."""
    backend = llama_backend()
    return lambda p: {"llama.cpp": llamacpp_family(backend, p.n_tokens, config.per_slot_max_tokens)}


def llamacpp_plan_rows(config: LlamaBenchConfig, plan: Plan) -> tuple[list[dict[str, Any]], list[str]]:
    """What `microbench llama-cpp --plan` measures (`--dry-run` lists it): the passes whose family
    llama.cpp dispatches at their size, in the builder's formats."""
    llamacpp_plan_configs(config, plan)
    return planned_rows(plan, llamacpp_engines(config))


def llamacpp_plan_configs(config: LlamaBenchConfig, plan: Plan) -> list[LlamaBenchConfig]:
    """One config per shape of the plan, its passes those llama.cpp runs in their family."""
    formats = sorted({p.weight_format.upper() for p in plan.passes} - {"F16", "F32"})
    if formats:
        raise InputError(f"plan: weight format {formats[0]} is not one the tiny-model builder writes (F16, F32)")
    kept = measured_passes(plan, llamacpp_engines(config))
    configs = []
    for shape in plan_shapes(kept):
        passes = tuple(p for p in kept.passes if p.model == shape.model)
        sizes = tuple(sorted({p.n_tokens for p in passes}))
        configs.append(replace(config, shape=shape, pass_sizes=sizes, planned=passes))
    return configs


def run_llamacpp_shapes(
    config: LlamaBenchConfig, shapes: list[MoeShape], models_dir: Path | None = None, progress: Callable[[str], None] | None = None
) -> LlamaBenchResult:
    """One run per expert shape (its models built, measured and freed in turn), rows concatenated;
    every shape is checked before anything is built."""
    return run_llamacpp_configs([replace(config, shape=shape) for shape in shapes], models_dir, progress)


def run_llamacpp_configs(
    configs: list[LlamaBenchConfig], models_dir: Path | None = None, progress: Callable[[str], None] | None = None
) -> LlamaBenchResult:
    """`run_llamacpp_shapes` of one config per shape (a plan's: `llamacpp_plan_configs`)."""
    import llama_cpp

    if not configs or len({c.shape.model for c in configs}) < len(configs):
        raise ConfigError("llama.cpp microbench: give one or more distinct model shapes")
    for one in configs:
        one.validate()
        _check_room(model_specs(one, design_passes(one)[1]), models_dir)
    result = LlamaBenchResult()
    runs = []
    with _terminate_as_exit():
        for one in configs:
            folder = None if models_dir is None else models_dir / one.shape.model
            part = run_llamacpp_microbench(one, folder, progress)
            result.rows += part.rows
            runs.append(part.provenance)
    result.provenance = {
        "runner": "moesim.hw_profiles.microbench.llama_cpp",
        "method": __doc__,
        "backend": llama_backend(),
        "machine": cpu_facts(),
        "versions": {
            "llama_cpp_python": llama_cpp.__version__,
            "gguf": metadata.version("gguf"),
            "numpy": np.__version__,
            "python": platform.python_version(),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        },
        "command": " ".join(sys.argv),
        "measured_at": time.strftime("%Y-%m-%d"),
        "runs": runs,
    }
    return result
