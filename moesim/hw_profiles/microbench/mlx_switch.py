"""Microbenchmark of one MoE layer's expert operation as mlx_lm runs it: `SwitchGLU`.

mlx_lm's `SwitchGLU` (mlx_lm/models/switch_layers.py) runs a MoE block's routed experts: every
(token, slot) becomes one row, gate and up projections then SwiGLU then the down projection, each
a `SwitchLinear` calling `mx.gather_mm` (or `QuantizedSwitchLinear`, `mx.gather_qmm`, once
`nn.quantize` has quantised it), and the block sums the rows with the gate weights. mlx_lm sorts
the rows by expert (`_gather_sort`, `sorted_indices=True`) once a pass has >= 64 (token, slot)
rows. Here each pass is run both ways, whatever its size, through the same mlx_lm modules and
helpers: `per_slot` (rows in token order) and `dedup_gather_sorted` (rows sorted by expert, as
mlx_lm sorts them; on Metal `gather_qmm_rhs` then reads each used expert once, on the CPU every
row is still its own matrix product but an expert's rows follow one another, so its weights are
read from memory once and from the cache after). `mlx_lm_sorts` says which one mlx_lm would run.

Formats: F32 through `gather_mm` (MLX's CPU `GatherMM` runs float32 only), and mlx_lm's
quantisations through `gather_qmm` (affine 8, 6 and 4 bits in groups of 64, MXFP4 in groups of
32), quantised from bf16 weights with bf16 activations, so scales and biases are bf16 as in the
formats' byte counts (checked against the arrays).

Timing (the process's CPU time by default, robust on a machine shared with other jobs; or wall
time): routing and inputs are built before timing; each repetition runs the operation over
`layers` copies of the weights (different memory each, so weights come from memory, not the cache
of the previous copy) with `mx.eval` after each; `time_us` is the repetition's time / layers,
median over `reps` after `warmup` discarded repetitions. Before timing, both orders are checked
against mlx_lm's own `SwitchGLU` on the same pass.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moesim.errors import ConfigError, InputError
from moesim.fields import option
from moesim.hw_profiles.measurements.table import STATISTICS
from moesim.hw_profiles.microbench.plan import Plan, PlannedPass, plan_shapes, planned_rows
from moesim.hw_profiles.microbench.routing import (
    DEFAULT_PASS_SIZES,
    PLANNED,
    ROUTINGS,
    gate_weights,
    pass_features,
    pass_sizes_option,
    planned_ids,
    routing_ids,
    routing_seed,
    routings_option,
)
from moesim.hw_profiles.microbench.table import MoeShape, measurement_row, summarize_times
from moesim.machine import cpu_facts
from moesim.models import load_target
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec
from moesim.tracegen.mlx.builder import TOKENIZER_TOKENS, tiny_mlx_model
from moesim.tracegen.mlx.runtime import CLOCKS, backend, engine_version, import_mlx

# weight format -> (group size, bits, mode) of mlx's quantize; F32 is not quantised
MLX_FORMATS: dict[str, tuple[int, int, str] | None] = {
    "F32": None,
    "AFFINE8": (64, 8, "affine"),
    "AFFINE6": (64, 6, "affine"),
    "AFFINE4": (64, 4, "affine"),
    "MXFP4": (32, 4, "mxfp4"),
}
FAMILIES = {"per_slot": False, "dedup_gather_sorted": True}  # family -> rows sorted by expert


def row_family(family: str, backend_name: str) -> str:
    """The family a row is written under: on Metal the sorted rows run `gather_qmm_rhs`, the engine
    `MLX`'s `dedup_gather_qmm` (hw_profiles/engines/others.py); on the CPU the names above."""
    return "dedup_gather_qmm" if backend_name == "metal" and FAMILIES[family] else family


MLX_LM_SORT_SLOTS = 64  # SwitchGLU sorts when indices.size >= 64
CHECK_TOLERANCE = {"F32": 1e-4, "quantized": 3e-2}  # max |y − y_mlx_lm| / max |y_mlx_lm|
DEFAULT_SHAPES = (MoeShape("moesim-mlx-cpu-a", 256, 128, 32, 4, "F32"), MoeShape("moesim-mlx-cpu-b", 384, 192, 16, 2, "F32"))


@dataclass(frozen=True)
class MlxBenchConfig:
    """What one MLX microbenchmark run measures."""

    pass_sizes: tuple[int, ...] = pass_sizes_option(DEFAULT_PASS_SIZES)
    routings: tuple[str, ...] = routings_option()
    formats: tuple[str, ...] = option(
        ("F32", "AFFINE4", "AFFINE8"), "F32, AFFINE8, AFFINE6, AFFINE4, MXFP4 (repeatable).", repeat="--format"
    )
    families: tuple[str, ...] = option(tuple(FAMILIES), "per_slot (token order), dedup_gather_sorted (repeatable).", repeat="--family")
    reps: int = option(15, "Timed repetitions per point (median reported).")
    warmup: int = option(3, "Discarded warm-up repetitions.")
    layers: int = option(4, "Weight copies rotated so weights come from memory, not cache.")
    seed: int = option(0, "Random seed (routings, weights, inputs).")
    max_seconds: float = option(900.0, "Stop before the next pass size after this many seconds.")
    statistic: str = option("min", "Statistic of the repetitions as time_us: min (a shared machine only adds time) or median.")
    clock: str = option("cpu", "cpu: the process's CPU time (robust on a shared machine), or wall.")
    dense_twins: bool = option(True, "Also time whole passes of dense twins (1 and 2 layers) for the dense part and fixed time.")
    heads: int = option(4, "Dense twins: attention heads.")
    kv_heads: int = option(2, "Dense twins: key/value heads.")
    vocab: int = option(1024, "Dense twins: vocabulary (the LM head).")

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        for name in ("reps", "layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"mlx microbench: field '{name}' must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or not self.max_seconds > 0:
            raise ConfigError("mlx microbench: 'warmup' must be >= 0 and 'max_seconds' > 0")
        if self.clock not in CLOCKS:
            raise ConfigError(f"mlx microbench: field 'clock' must be one of {', '.join(CLOCKS)}, got '{self.clock}'")
        if self.statistic not in STATISTICS:
            raise ConfigError(f"mlx microbench: field 'statistic' must be one of {', '.join(STATISTICS)}, got '{self.statistic}'")
        if min(self.heads, self.kv_heads) < 1 or self.heads % self.kv_heads or self.vocab < TOKENIZER_TOKENS:
            raise ConfigError(
                f"mlx microbench: heads {self.heads} must be a multiple of kv_heads {self.kv_heads}, vocab >= {TOKENIZER_TOKENS}"
            )
        for name, values, known in (("routings", self.routings, ROUTINGS), ("formats", self.formats, MLX_FORMATS),
                                    ("families", self.families, FAMILIES)):  # fmt: skip
            unknown = [v for v in values if v not in known]
            if unknown or not values:
                raise ConfigError(f"mlx microbench: field '{name}': unknown '{unknown[0] if unknown else ''}' (known: {', '.join(known)})")


def check_groups(shape: MoeShape, formats: tuple[str, ...]) -> None:
    """Quantised formats need both input widths (hidden, expert width) in whole groups (one line otherwise)."""
    for fmt in formats:
        spec = MLX_FORMATS[fmt]
        if spec is not None and (shape.hidden % spec[0] or shape.expert_intermediate % spec[0]):
            raise InputError(f"{shape.model}: format {fmt} quantises in groups of {spec[0]}: hidden {shape.hidden} and expert width "
                             f"{shape.expert_intermediate} must both be multiples of it")  # fmt: skip


def switch_glu(shape: MoeShape, weight_format: str, seed: int) -> Any:
    """mlx_lm's SwitchGLU of the shape, random weights (1/sqrt(fan-in)), quantised per the format."""
    mx, nn = import_mlx()
    from mlx_lm.models.switch_layers import SwitchGLU

    spec = MLX_FORMATS[weight_format]
    dtype = mx.float32 if spec is None else mx.bfloat16
    glu = SwitchGLU(shape.hidden, shape.expert_intermediate, shape.experts)
    key = mx.random.key(seed)
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        proj = getattr(glu, name)
        fan_in = proj.weight.shape[-1]
        proj.weight = (mx.random.uniform(-1.0, 1.0, proj.weight.shape, key=mx.random.split(key, 3)[i]) * (3.0 / fan_in) ** 0.5).astype(
            dtype
        )
    if spec is not None:
        group_size, bits, mode = spec
        nn.quantize(glu, group_size=group_size, bits=bits, mode=mode)
    mx.eval(glu.parameters())
    _check_bytes(glu, shape, weight_format)
    return glu


def _check_bytes(glu: Any, shape: MoeShape, weight_format: str) -> None:
    """The arrays hold the format's bytes per expert (what the table's expert_bytes says)."""
    nbytes = sum(
        int(v.nbytes) for p in (glu.gate_proj, glu.up_proj, glu.down_proj) for k, v in p.items() if k in ("weight", "scales", "biases")
    )
    expected = shape.expert_bytes * shape.experts
    if abs(nbytes - expected) > 1e-6 * expected:
        raise InputError(f"{weight_format}: mlx holds {nbytes} bytes of experts, the format's byte count says {expected:.0f}")


def expert_forward(glu: Any, x: Any, indices: Any, scores: Any, sort: bool) -> Any:
    """The block's expert operation through the SwitchGLU's own modules with the row order forced:
    rows sorted by expert (mlx_lm's `_gather_sort`, `sorted_indices=True`) or in token order; then
    the gate-weighted sum over the k slots, as the block does."""
    mx, _ = import_mlx()
    from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

    rows = mx.expand_dims(x, (-2, -3))
    idx, inverse = indices, None
    if sort:
        rows, idx, inverse = _gather_sort(rows, indices)
    up = glu.up_proj(rows, idx, sorted_indices=sort)
    gate = glu.gate_proj(rows, idx, sorted_indices=sort)
    out = glu.down_proj(glu.activation(up, gate), idx, sorted_indices=sort)
    if sort:
        out = _scatter_unsort(out, inverse, indices.shape)
    return (out.squeeze(-2) * scores[..., None]).sum(axis=-2)


def mlx_lm_forward(glu: Any, x: Any, indices: Any, scores: Any) -> Any:
    """The same through mlx_lm's SwitchGLU as it is (its own sort choice)."""
    return (glu(x, indices) * scores[..., None]).sum(axis=-2)


def check_orders(glu: Any, x: Any, indices: Any, scores: Any, weight_format: str) -> float:
    """Largest relative deviation of either forced order from mlx_lm's SwitchGLU (raises beyond tolerance)."""
    mx, _ = import_mlx()
    reference = np.array(mlx_lm_forward(glu, x, indices, scores).astype(mx.float32))
    scale = float(np.abs(reference).max()) or 1.0
    worst = 0.0
    for sort in (False, True):
        y = np.array(expert_forward(glu, x, indices, scores, sort).astype(mx.float32))
        worst = max(worst, float(np.abs(y - reference).max()) / scale)
    tolerance = CHECK_TOLERANCE["F32" if weight_format == "F32" else "quantized"]
    if not worst <= tolerance:
        raise InputError(f"{weight_format}: the forced row orders deviate from mlx_lm's SwitchGLU by {worst:.2e} (> {tolerance})")
    return worst


def mlx_shapes(models: list[str] | None, overrides: dict[str, int | None]) -> list[MoeShape]:
    """The expert shapes measured: the presets' (F32 here; the formats are the config's), or the defaults."""
    if not models:
        return [shape.with_overrides(**overrides) for shape in DEFAULT_SHAPES]
    return [MoeShape.from_preset(load_target(name), "F32").with_overrides(**overrides) for name in models]


@dataclass(frozen=True)
class MlxBenchResult:
    """Rows (contract 3) and the run's provenance."""

    rows: list[dict[str, Any]]
    provenance: dict[str, Any]


def device_name() -> str:
    """The device as the table names it: the CPU model, or MLX's GPU."""
    mx, _ = import_mlx()
    if backend() == "cpu":
        return str(cpu_facts().get("model_name") or platform.processor() or "cpu")
    return str(mx.device_info().get("device_name", "metal device"))


def _time_pass(glus: list[Any], x: Any, indices: Any, scores: Any, sort: bool, config: MlxBenchConfig) -> list[float]:
    mx, _ = import_mlx()
    now = CLOCKS[config.clock]
    samples = []
    for rep in range(config.warmup + config.reps):
        started = now()
        for glu in glus:
            mx.eval(expert_forward(glu, x, indices, scores, sort))
        if rep >= config.warmup:
            samples.append((now() - started) / 1e3 / len(glus))
    return samples


TWIN_LAYERS = 1  # dense twins of L and 2L layers
TWIN_FF = 16
TWIN_CONTEXT = 32  # tokens in the twins' KV cache when a pass is timed


def twin_spec(shape: MoeShape, config: MlxBenchConfig, layers: int) -> TinyModelSpec:
    """A dense llama of the shape's width with the config's attention and vocabulary, and a 16-wide FFN."""
    return TinyModelSpec(arch="llama", layers=layers, experts=0, hidden=shape.hidden, heads=config.heads, kv_heads=config.kv_heads,
                         vocab=config.vocab, dense_ff=TWIN_FF, seed=config.seed, name=f"{shape.model}-dense-twin-L{layers}")  # fmt: skip


def time_twins(shape: MoeShape, config: MlxBenchConfig) -> dict[int, dict[str, list[float]]]:
    """Per pass size, every timed repetition of a pass of the dense twins with L and 2L layers, each
    as mlx_lm decodes: through a KV cache holding TWIN_CONTEXT tokens (the pass's tokens trimmed
    off again after it); the two twins interleaved so that drifting load hits both alike."""
    mx, _ = import_mlx()
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    now = CLOCKS[config.clock]
    twins = {name: tiny_mlx_model(twin_spec(shape, config, layers))[0] for name, layers in (("L", TWIN_LAYERS), ("2L", 2 * TWIN_LAYERS))}
    caches = {name: make_prompt_cache(model) for name, model in twins.items()}
    context = mx.array(np.arange(TWIN_CONTEXT, dtype=np.int32) % TOKENIZER_TOKENS)[None]
    for name, model in twins.items():
        mx.eval(model(context, cache=caches[name]))
    out: dict[int, dict[str, list[float]]] = {}
    for n in config.pass_sizes:
        tokens = mx.array(np.arange(n, dtype=np.int32) % TOKENIZER_TOKENS)[None]
        samples: dict[str, list[float]] = {"L": [], "2L": []}
        for rep in range(config.warmup + config.reps):
            for name, model in twins.items():
                started = now()
                mx.eval(model(tokens, cache=caches[name]))
                if rep >= config.warmup:
                    samples[name].append((now() - started) / 1e3)
                trim_prompt_cache(caches[name], n)
        out[n] = samples
    return out


def mlx_plan_config(config: MlxBenchConfig, plan: Plan) -> MlxBenchConfig:
    """The config a plan runs under: its formats and pass sizes the plan's (formats MLX runs)."""
    formats = tuple(dict.fromkeys(p.weight_format.upper() for p in plan.passes))
    unknown = [f for f in formats if f not in MLX_FORMATS]
    if unknown:
        raise InputError(f"plan: weight format {unknown[0]} is not one MLX runs ({', '.join(MLX_FORMATS)})")
    return dataclasses.replace(config, formats=formats, pass_sizes=tuple(sorted({p.n_tokens for p in plan.passes})))


def mlx_plan_rows(config: MlxBenchConfig, plan: Plan) -> tuple[list[dict[str, Any]], list[str]]:
    """What `microbench mlx --plan` measures (`--dry-run` lists it): each pass with the config's row orders of its family."""
    mlx_plan_config(config, plan)
    return planned_rows(plan, {family: row_family(family, backend()) for family in config.families})


def _cells(config: MlxBenchConfig, shape: MoeShape, plan: Plan | None) -> dict[int, list[tuple[str, PlannedPass | None]]]:
    """Per pass size, the passes of one shape and format: every routing, or the plan's passes."""
    if plan is None:
        return {n: [(routing, None) for routing in config.routings] for n in config.pass_sizes}
    cells: dict[int, list[tuple[str, PlannedPass | None]]] = {}
    for p in sorted(plan.passes, key=lambda p: p.n_tokens):
        if p.model == shape.model and p.weight_format.upper() == shape.weight_format:
            cells.setdefault(p.n_tokens, []).append((PLANNED, p))
    return cells


def run_mlx_microbench(
    config: MlxBenchConfig, shapes: list[MoeShape], progress: Callable[[str], None] | None = None, plan: Plan | None = None
) -> MlxBenchResult:
    """Time every (shape, format, pass size, routing, family), or a plan's passes (each with the
    row orders of its family; `shapes` are then the plan's); rows in the measurement-table layout."""
    if plan is not None:
        config, shapes = mlx_plan_config(config, plan), plan_shapes(plan)
    config.validate()
    mx, _ = import_mlx()
    for shape in shapes:
        check_groups(shape, config.formats)
    say = progress or (lambda _message: None)
    started = time.monotonic()
    engine = "MLX CPU" if backend() == "cpu" else "MLX"
    device = device_name()
    rows: list[dict[str, Any]] = []
    checks: dict[str, float] = {}
    loadavg = [list(os.getloadavg())]
    stopped = None
    for base in shapes:
        for fmt in config.formats:
            shape = MoeShape(base.model, base.hidden, base.expert_intermediate, base.experts, base.top_k, fmt)
            cells = _cells(config, shape, plan)
            if not cells:
                continue
            twins = time_twins(shape, dataclasses.replace(config, pass_sizes=tuple(cells))) if config.dense_twins else {}
            glus = [switch_glu(shape, fmt, config.seed + copy) for copy in range(config.layers)]
            dtype = mx.float32 if MLX_FORMATS[fmt] is None else mx.bfloat16
            for n, at_n in cells.items():
                if time.monotonic() - started > config.max_seconds:
                    stopped = stopped or {"before_n_tokens": n, "shape": shape.model, "format": fmt}
                    break
                for routing, planned in at_n:
                    if planned is None:
                        seed = routing_seed(config.seed, shape.model, fmt, n, routing)
                        ids = routing_ids(routing, n, shape.experts, shape.top_k, seed)
                    else:
                        u, m = planned.distinct_experts, planned.max_tokens_per_expert
                        seed = routing_seed(config.seed, shape.model, fmt, n, routing, u, m)
                        ids = planned_ids(n, shape.experts, shape.top_k, u, m, seed)
                    indices = mx.array(ids.astype(np.uint32))
                    scores = mx.array(gate_weights(n, shape.top_k, seed)).astype(dtype)
                    x = mx.random.normal((n, shape.hidden), key=mx.random.key(seed)).astype(dtype)
                    mx.eval(indices, scores, x)
                    checks[f"{shape.model}/{fmt}/{n}/{routing}" + ("" if planned is None else f"/{u}/{m}")] = check_orders(
                        glus[0], x, indices, scores, fmt
                    )
                    features = pass_features(ids, shape.experts)
                    for family in config.families:
                        kernel = row_family(family, backend())
                        if planned is not None and kernel != planned.family:
                            continue
                        samples = _time_pass(glus, x, indices, scores, FAMILIES[family], config)
                        extra = {"backend": backend(), "engine_version": engine_version(), "mlx_lm_sorts": ids.size >= MLX_LM_SORT_SLOTS,
                                 "activation_dtype": "f32" if MLX_FORMATS[fmt] is None else "bf16", "reps_us": samples,
                                 "time_us_median": float(np.median(samples)), "statistic": config.statistic}  # fmt: skip
                        if twins:
                            extra.update(reps_us_dense_L=twins[n]["L"], reps_us_dense_2L=twins[n]["2L"], layers_differenced=TWIN_LAYERS)
                        if planned is not None:
                            extra.update(plan_rung=planned.rung, plan_time_share=planned.time_share)
                        timing = summarize_times(samples)
                        timing = dataclasses.replace(timing, time_us=STATISTICS[config.statistic](samples))
                        rows.append(measurement_row(kernel=kernel, engine=engine, device=device, shape=shape, routing=routing,
                                                    features=features, timing=timing, extra=extra))  # fmt: skip
                say(f"{shape.model} {fmt} n = {n}: done ({time.monotonic() - started:.0f} s)")
            del glus
    loadavg.append(list(os.getloadavg()))
    provenance = _provenance(config, shapes, engine, device, checks, loadavg, time.monotonic() - started)
    if stopped:
        provenance["stopped_early"] = stopped
    if plan is not None:
        provenance["plan"] = {"source": plan.source, "profile": plan.profile, "passes": len(plan.passes)}
    return MlxBenchResult(rows, provenance)


def _provenance(
    config: MlxBenchConfig,
    shapes: list[MoeShape],
    engine: str,
    device: str,
    checks: dict[str, float],
    loadavg: list[list[float]],
    seconds: float,
) -> dict[str, Any]:
    mx, _ = import_mlx()
    return {
        "method": __doc__,
        "engine": engine,
        "engine_version": engine_version(),
        "device": device,
        "mlx_device": str(mx.default_device()),
        "backend": backend(),
        "blas": _blas_libraries(),
        "config": {**asdict(config)},
        "shapes": [asdict(s) for s in shapes],
        "runs": [  # the dense twins, read by `profile fit` (hw_profiles/fitting/dense_twins.py)
            {
                "config": {"shape": {"model": s.model}, "statistic": config.statistic},
                "models": {"dense_L": asdict(twin_spec(s, config, TWIN_LAYERS))},
            }
            for s in shapes
        ]
        if config.dense_twins
        else [],
        "check_against_mlx_lm_max_relative": max(checks.values()) if checks else None,
        "machine": cpu_facts(),
        "loadavg_start_end": loadavg,
        "seconds": round(seconds, 1),
        "measured_at": time.strftime("%Y-%m-%d"),
    }


def _blas_libraries() -> list[str]:
    """The BLAS and LAPACK libraries bundled with the installed MLX (CPU backend), by file name."""
    mx, _ = import_mlx()
    folder = os.path.join(os.path.dirname(os.path.dirname(mx.__file__)), "mlx_cpu.libs")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []
