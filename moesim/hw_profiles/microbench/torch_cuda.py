"""Microbenchmark of one MoE layer's expert operation through torch on a CUDA GPU.

Like the shared H200 table: one layer's routed-expert operation run alone, SwiGLU experts in
bf16 (gate and up stacked in one matrix, then down), for every pass size, routing and engine.
Engines (a registry; family in brackets), all built from plain torch ops:

- `torch_slot_graph` [per_slot]: one GEMV per token slot (x_t · W_gate_up[e]ᵀ, then the down
  projection), so every slot reads its expert: n·k expert reads per pass; slots sharing an expert
  may hit L2, as a hand-written per-slot kernel does. SwiGLU and the weighted combine run once
  over all slots.
- `torch_expert_graph` [dedup]: slots sorted by expert, one GEMM per distinct expert over its
  tokens: each distinct expert is read once per pass (U reads), compute grows with its tokens.
- `torch_grouped_mm` [dedup_grouped_gemm]: `grouped_mm` over the expert-sorted tokens with
  offsets over all E experts (an empty group reads nothing); gather and combine included.
- `torch_loop` [dedup_loop]: the eager Hugging Face loop (one_hot, nonzero, a `where` per expert,
  each a host synchronisation); launch-bound by design.

Timing: routing index tensors are built on the host before timing. The first three engines are
captured in a CUDA graph and replayed with CUDA events queued ahead, so a time is device time
without host gaps; the loop engine runs eagerly (its host syncs are part of what it costs). Each
replay runs the operation over `layers` copies of the weights, different memory each, so weights
come from HBM rather than L2; `time_us` is replay time / layers. Warm-up replays are discarded and
`time_us` is the median of `reps`. Before timing, every engine's output is checked against a
float32 reference on the device; an engine that disagrees is dropped and the drop recorded.

`device="cpu"` runs the same code without graphs and with wall-clock timing: it exists to test
the code, its times are not a calibration.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from moesim.errors import ConfigError, InputError, first_line
from moesim.fields import option
from moesim.hw_profiles.microbench.plan import Plan, PlannedPass, plan_shapes, planned_rows
from moesim.hw_profiles.microbench.routing import (
    PLANNED,
    ROUTINGS,
    expert_plan,
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
from moesim.registry import Registry

DEFAULT_MODELS = ("deepseek-v2-lite", "qwen3-30b-a3b")  # expert shapes measured when none is named
TORCH_PASS_SIZES = (*range(1, 17), 24, 32, 48, 64, 96, 128)
TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
CHECK_TOLERANCE = 3e-2  # max |y − ref| / max |ref| allowed for bf16 outputs


def import_torch() -> Any:
    """torch, or a one-line error saying how to install it."""
    try:
        import torch
    except ImportError:
        raise InputError("torch is not installed: install it with pip install 'moesim[gpu]' (torch >= 2.13 with CUDA)") from None
    return torch


@dataclass(frozen=True)
class TorchBenchConfig:
    """What one torch microbenchmark run measures."""

    pass_sizes: tuple[int, ...] = pass_sizes_option(TORCH_PASS_SIZES)
    routings: tuple[str, ...] = routings_option()
    engines: tuple[str, ...] = option(
        ("torch_slot_graph", "torch_expert_graph", "torch_grouped_mm", "torch_loop"),
        "Engines to time (repeatable; default all).",
        repeat="--engine",
    )
    reps: int = option(30, "Timed repetitions per point (median reported).")
    loop_reps: int = option(10, "Timed repetitions of the eager loop engine (slow: fewer).")
    warmup: int = option(5, "Discarded warm-up repetitions.")
    layers: int = option(4, "Weight copies rotated so weights come from memory, not cache.")
    seed: int = option(0, "Random seed (routings, weights).")
    device: str = option("cuda", "cuda, cuda:N, or cpu (tests the code path; not a calibration).")
    dtype: str = option("bf16", "Weight format: bf16, f16, f32.", name="--format", parse=str.lower, show=str)
    max_seconds: float = option(200.0, "Stop before the next pass size after this many seconds.")

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        for name in ("reps", "loop_reps", "layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"torch microbench: field '{name}' must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.max_seconds <= 0:
            raise ConfigError("torch microbench: 'warmup' must be >= 0 and 'max_seconds' > 0")
        if not self.pass_sizes or min(self.pass_sizes) < 1:
            raise ConfigError(f"torch microbench: pass sizes must be >= 1, got {self.pass_sizes}")
        for routing in self.routings:
            if routing not in ROUTINGS:
                raise ConfigError(f"torch microbench: unknown routing '{routing}' (known: {', '.join(ROUTINGS)})")
        for engine in self.engines:
            if engine not in TORCH_ENGINES:
                raise ConfigError(f"torch microbench: {TORCH_ENGINES.unknown(engine)}")
        if self.dtype not in TORCH_DTYPES:
            raise ConfigError(f"torch microbench: unknown weight format '{self.dtype}' (known: {', '.join(TORCH_DTYPES)})")
        if self.device not in ("cuda", "cpu") and not self.device.startswith("cuda:"):
            raise ConfigError(f"torch microbench: device must be cuda, cuda:N or cpu, got '{self.device}'")


@dataclass(frozen=True)
class LayerWeights:
    """One layer's routed experts: gate and up stacked (E, 2I, h), down (E, h, I)."""

    gate_up: Any
    down: Any


@dataclass
class DevicePass:
    """One pass's routing as device tensors and host lists, built before timing."""

    n_tokens: int
    top_k: int
    experts: int
    ids: Any  # (n, k) long
    weights: Any  # (n, k) in the weight dtype
    slot_tokens: Any  # (S,) long, slot s = t·k + j
    slot_weights: Any  # (S,)
    slot_groups: list[tuple[int, int, int]]  # (expert, s, s + 1) per slot
    sorted_tokens: Any  # (S,) long, slots in expert order
    sorted_weights: Any  # (S,)
    groups: list[tuple[int, int, int]]  # (expert, first, end) in expert order
    group_ends: Any  # (E,) int32 cumulative counts over all experts


def device_pass(torch: Any, ids: np.ndarray, weights: np.ndarray, experts: int, device: Any, dtype: Any) -> DevicePass:
    """Move one pass's routing (and its expert grouping, computed on the host) to the device."""
    plan = expert_plan(ids, experts)
    slot_weights = weights.ravel()

    def tensor(array: np.ndarray, kind: Any) -> Any:
        return torch.as_tensor(np.ascontiguousarray(array)).to(device=device, dtype=kind)

    return DevicePass(
        n_tokens=ids.shape[0],
        top_k=ids.shape[1],
        experts=experts,
        ids=tensor(ids, torch.long),
        weights=tensor(weights, dtype),
        slot_tokens=tensor(plan.slot_tokens, torch.long),
        slot_weights=tensor(slot_weights, dtype),
        slot_groups=[(int(e), s, s + 1) for s, e in enumerate(plan.slot_experts)],
        sorted_tokens=tensor(plan.sorted_tokens, torch.long),
        sorted_weights=tensor(slot_weights[plan.order], dtype),
        groups=[(int(e), int(a), int(b)) for e, a, b in zip(plan.present, plan.starts[:-1], plan.starts[1:], strict=True)],
        group_ends=tensor(plan.group_ends, torch.int32),
    )


def _swiglu(torch: Any, gate_up: Any) -> Any:
    """silu(gate) · up for rows holding [gate | up]."""
    half = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[:, :half]) * gate_up[:, half:]


class TorchEngine(Protocol):
    """One way of running a layer's expert operation; `family` labels its rows."""

    name: ClassVar[str]
    family: ClassVar[str]
    graph: ClassVar[bool]

    def forward(self, torch: Any, w: LayerWeights, x: Any, p: DevicePass) -> Any:
        """Output of the layer's routed experts for tokens x (n, h)."""
        ...


TORCH_ENGINES: Registry[TorchEngine] = Registry("torch engine")


def _experts_by_group(torch: Any, w: LayerWeights, rows: Any, groups: list[tuple[int, int, int]]) -> Any:
    """For each (expert, first, end) group of rows: a gate+up matmul with that expert's weights,
    SwiGLU over all rows, then a down matmul per group; one kernel per group and projection."""
    hidden = torch.empty((rows.shape[0], w.gate_up.shape[1]), dtype=rows.dtype, device=rows.device)
    for e, a, b in groups:
        torch.mm(rows[a:b], w.gate_up[e].t(), out=hidden[a:b])
    act = _swiglu(torch, hidden)
    out = torch.empty_like(rows)
    for e, a, b in groups:
        torch.mm(act[a:b], w.down[e].t(), out=out[a:b])
    return out


def _combine_sorted(torch: Any, x: Any, out: Any, p: DevicePass) -> Any:
    """y_t = Σ over t's slots of gate weight × expert output, from outputs in expert order."""
    return torch.zeros_like(x).index_add_(0, p.sorted_tokens, out * p.sorted_weights[:, None])


@TORCH_ENGINES.register
class SlotGraph:
    """Per-slot: one GEMV per token slot for gate+up and one for down."""

    name: ClassVar[str] = "torch_slot_graph"
    family: ClassVar[str] = "per_slot"
    graph: ClassVar[bool] = True

    def forward(self, torch: Any, w: LayerWeights, x: Any, p: DevicePass) -> Any:
        """Each slot reads its own expert's weights (a group of one row per slot)."""
        out = _experts_by_group(torch, w, x.index_select(0, p.slot_tokens), p.slot_groups)
        return (out * p.slot_weights[:, None]).view(p.n_tokens, p.top_k, -1).sum(dim=1)


@TORCH_ENGINES.register
class ExpertGraph:
    """Deduplicating: one GEMM per distinct expert over its tokens."""

    name: ClassVar[str] = "torch_expert_graph"
    family: ClassVar[str] = "dedup"
    graph: ClassVar[bool] = True

    def forward(self, torch: Any, w: LayerWeights, x: Any, p: DevicePass) -> Any:
        """Each distinct expert's weights are read once for all its tokens."""
        out = _experts_by_group(torch, w, x.index_select(0, p.sorted_tokens), p.groups)
        return _combine_sorted(torch, x, out, p)


@TORCH_ENGINES.register
class GroupedMM:
    """Deduplicating: torch grouped_mm over expert-sorted tokens (CUTLASS on CUDA)."""

    name: ClassVar[str] = "torch_grouped_mm"
    family: ClassVar[str] = "dedup_grouped_gemm"
    graph: ClassVar[bool] = True

    def forward(self, torch: Any, w: LayerWeights, x: Any, p: DevicePass) -> Any:
        """Two grouped GEMMs; groups of absent experts are empty."""
        grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        rows = x.index_select(0, p.sorted_tokens)
        hidden = grouped_mm(rows, w.gate_up.transpose(-2, -1), offs=p.group_ends)
        out = grouped_mm(_swiglu(torch, hidden), w.down.transpose(-2, -1), offs=p.group_ends)
        return _combine_sorted(torch, x, out, p)


@TORCH_ENGINES.register
class HFLoop:
    """Deduplicating, eager: the Hugging Face per-expert loop with host synchronisations."""

    name: ClassVar[str] = "torch_loop"
    family: ClassVar[str] = "dedup_loop"
    graph: ClassVar[bool] = False

    def forward(self, torch: Any, w: LayerWeights, x: Any, p: DevicePass) -> Any:
        """one_hot mask, nonzero over hit experts, then per expert where/gather/linear/index_add."""
        functional = torch.nn.functional
        y = torch.zeros_like(x)
        mask = functional.one_hot(p.ids, p.experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit.flatten().tolist():
            slot, token = torch.where(mask[e])
            act = _swiglu(torch, functional.linear(x[token], w.gate_up[e]))
            out = functional.linear(act, w.down[e]) * p.weights[token, slot, None]
            y.index_add_(0, token, out)
        return y


def reference_output(torch: Any, w: LayerWeights, x: Any, p: DevicePass) -> Any:
    """y_t = Σ_j g_tj · W_down[e_tj] (silu(W_gate[e_tj] x_t) ⊙ W_up[e_tj] x_t), in float32, slot by slot."""
    xf = x.float()
    y = torch.zeros_like(xf)
    ids = p.ids.tolist()
    for t in range(p.n_tokens):
        for j, e in enumerate(ids[t]):
            act = _swiglu(torch, xf[t : t + 1] @ w.gate_up[e].float().t())
            y[t] += (act @ w.down[e].float().t())[0] * p.weights[t, j].float()
    return y


def _time_replays(torch: Any, run: Callable[[], object], graph: bool, reps: int, warmup: int, on_cuda: bool) -> tuple[list[float], str]:
    """Per-call times in µs and the timing mode: a CUDA graph replayed with events queued ahead,
    eager CUDA with events (host syncs included), or wall clock on the CPU."""
    if not on_cuda:
        for _ in range(warmup):
            run()
        samples = []
        for _ in range(reps):
            start = time.perf_counter_ns()
            run()
            samples.append((time.perf_counter_ns() - start) / 1e3)
        return samples, "cpu_wall"
    cuda = torch.cuda
    call = run
    mode = "cuda_eager_sync"
    if graph:
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            run()
        cuda.current_stream().wait_stream(side)
        try:
            captured = cuda.CUDAGraph()
            with cuda.graph(captured):
                run()
            call = captured.replay
            mode = "cuda_graph"
        except RuntimeError:  # an op that cannot be captured: launches queued ahead instead
            cuda.synchronize()
            mode = "cuda_eager_queued"
    for _ in range(warmup):
        call()
    events = [(cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        call()
        end.record()
    cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events], mode


@dataclass
class TorchBenchResult:
    """Rows of the table, the provenance written beside it, and (on CUDA) device facts in the
    `device.json` format `profile fit` reads."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)
    device: dict[str, Any] | None = None


def _device_facts(torch: Any, device: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "numpy": np.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(
            device=props.name,
            backend="cuda",
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            total_memory_gib=round(props.total_memory / 2**30, 2),
            l2_cache_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            torch_cuda=torch.version.cuda,
        )
    else:
        cpu = cpu_facts()
        facts.update(device=cpu.get("model_name") or platform.processor() or "cpu", backend="cpu", cpu=cpu)
    return facts


def _ceilings(torch: Any, device: Any, dtype: Any) -> dict[str, float]:
    """Device-to-device copy (read + write) and read-only (sum) bandwidth over 1 GiB, in GB/s."""
    elements = 2**30 // torch.empty((), dtype=dtype).element_size()
    source = torch.ones(elements, dtype=dtype, device=device)
    target = torch.empty_like(source)
    copy_us, _ = _time_replays(torch, lambda: target.copy_(source), False, 10, 2, True)
    read_us, _ = _time_replays(torch, lambda: source.sum(dtype=torch.float32), False, 10, 2, True)
    return {
        "copy_gbps_read_write": round(2 * 2**30 / float(np.median(copy_us)) / 1e3, 1),
        "read_gbps": round(2**30 / float(np.median(read_us)) / 1e3, 1),
    }


def device_json(facts: dict[str, Any], ceilings: dict[str, float]) -> dict[str, Any]:
    """Device facts and measured ceilings under the keys of `data/h200/device.json`."""
    device = {
        "device": facts["device"],
        "backend": "torch",
        "torch": facts["torch"],
        "torch_cuda": facts.get("torch_cuda") or "",
        "capability": facts.get("capability", ""),
        "sm_count": facts.get("sm_count"),
        "total_memory_GB": round(facts.get("total_memory_gib", 0) * 2**30 / 1e9, 2),
        "l2_cache_MB": round(facts.get("l2_cache_mib", 0) * 2**20 / 1e6, 1),
    }
    return {"device": device, "ceilings": {"read_GBps": ceilings["read_gbps"], "d2d_copy_GBps_rw": ceilings["copy_gbps_read_write"]}}


def _random_layers(torch: Any, shape: MoeShape, copies: int, device: Any, dtype: Any) -> list[LayerWeights]:
    """`copies` independent layers of experts, N(0, 1/hidden) weights."""
    std = shape.hidden**-0.5

    def matrix(*dims: int) -> Any:
        return torch.empty(dims, dtype=dtype, device=device).normal_(0, std)

    inter, hidden = shape.expert_intermediate, shape.hidden
    return [LayerWeights(matrix(shape.experts, 2 * inter, hidden), matrix(shape.experts, hidden, inter)) for _ in range(copies)]


class _Run:
    """State of one run: device, weights, engines, and the engines dropped so far (with why)."""

    def __init__(self, torch: Any, config: TorchBenchConfig, shapes: Sequence[MoeShape], say: Callable[[str], None]) -> None:
        self.torch = torch
        self.config = config
        self.say = say
        self.on_cuda = config.device.startswith("cuda")
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, TORCH_DTYPES[config.dtype])
        self.weights = {s.model: _random_layers(torch, s, config.layers, self.device, self.dtype) for s in shapes}
        self.engines = {name: TORCH_ENGINES.create(name) for name in config.engines}
        self.dropped: set[tuple[str, str]] = set()
        self.checks: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []

    def drop(self, shape: MoeShape, name: str, reason: str, **where: Any) -> None:
        self.dropped.add((shape.model, name))
        self.failures.append({"model": shape.model, "engine": name, **where, "error": reason})
        self.say(f"dropping {name} on {shape.model}: {reason}")

    def pass_for(
        self, shape: MoeShape, routing: str, n_tokens: int, seed: int, planned: PlannedPass | None = None
    ) -> tuple[DevicePass, Any]:
        if planned is not None:
            ids = planned_ids(n_tokens, shape.experts, shape.top_k, planned.distinct_experts, planned.max_tokens_per_expert, seed)
        else:
            ids = routing_ids(routing, n_tokens, shape.experts, shape.top_k, seed)
        p = device_pass(self.torch, ids, gate_weights(n_tokens, shape.top_k, seed), shape.experts, self.device, self.dtype)
        return p, pass_features(ids, shape.experts)

    def check(self, shape: MoeShape) -> None:
        """Compare every engine's output with the float32 reference on one uniform pass."""
        n_check = min(5, max(self.config.pass_sizes))
        p, _ = self.pass_for(shape, "uniform", n_check, routing_seed(self.config.seed, "check", shape.model))
        x = self.torch.randn((n_check, shape.hidden), dtype=self.dtype, device=self.device)
        layer = self.weights[shape.model][0]
        ref = reference_output(self.torch, layer, x, p)
        for name, engine in self.engines.items():
            try:
                output = engine.forward(self.torch, layer, x, p)
            except Exception as exc:  # one engine failing (an op this torch lacks, out of memory) must not lose the run
                self.drop(shape, name, f"{exc.__class__.__name__}: {first_line(exc)}", n_tokens=n_check)
                continue
            error = float((output.float() - ref).abs().max() / ref.abs().max())
            self.checks.append({"model": shape.model, "engine": name, "n_tokens": n_check, "max_rel_error": error})
            if not error <= CHECK_TOLERANCE:
                self.drop(shape, name, f"output differs from the float32 reference (relative error {error:.3g})", n_tokens=n_check)

    def measure(
        self, shape: MoeShape, routing: str, n_tokens: int, device_name: str, planned: PlannedPass | None = None
    ) -> list[dict[str, Any]]:
        """Rows of every engine still running on this shape (of the planned pass's family only), for one pass."""
        parts = (shape.model, routing, n_tokens) if planned is None else (shape.model, routing, n_tokens, planned.distinct_experts,
                                                                          planned.max_tokens_per_expert)  # fmt: skip
        p, features = self.pass_for(shape, routing, n_tokens, routing_seed(self.config.seed, *parts), planned)
        x = self.torch.randn((n_tokens, shape.hidden), dtype=self.dtype, device=self.device)
        layers = self.weights[shape.model]
        rows = []
        for name, engine in self.engines.items():
            if (shape.model, name) in self.dropped or (planned is not None and engine.family != planned.family):
                continue

            def run(engine: TorchEngine = engine) -> None:
                for w in layers:
                    engine.forward(self.torch, w, x, p)

            reps = self.config.reps if engine.graph else self.config.loop_reps
            try:
                samples, mode = _time_replays(self.torch, run, engine.graph, reps, self.config.warmup, self.on_cuda)
            except Exception as exc:  # as in check(): record, drop the engine, keep measuring the others
                self.drop(shape, name, f"{exc.__class__.__name__}: {first_line(exc)}", n_tokens=n_tokens, routing=routing)
                continue
            rows.append(
                measurement_row(
                    kernel=engine.family,
                    engine=name,
                    device=device_name,
                    shape=shape,
                    routing=routing,
                    features=features,
                    timing=summarize_times([s / len(layers) for s in samples]),
                    extra={"timing": mode, "weight_copies": len(layers), "engine_version": f"torch {self.torch.__version__}"},
                )
            )
        return rows


def run_torch_microbench(
    config: TorchBenchConfig, shapes: Sequence[MoeShape], progress: Callable[[str], None] | None = None, plan: Plan | None = None
) -> TorchBenchResult:
    """Measure every (pass size, shape, routing, engine) of `config`, or a plan's passes (each with
    the engines of its family; `shapes` are then the plan's). Pass sizes go in ascending order, so a
    run stopped by `max_seconds` keeps complete small-n data for every shape."""
    if plan is not None:
        config, shapes = with_plan(config, plan), plan_shapes(plan)
    config.validate()
    if not shapes:
        raise ConfigError("torch microbench: no model shapes given")
    torch = import_torch()
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("torch sees no CUDA device (torch.cuda.is_available() is False); --device cpu runs the code path only")
    say = progress or (lambda _message: None)
    started = time.monotonic()
    torch.manual_seed(config.seed)
    run = _Run(torch, config, shapes, say)
    facts = _device_facts(torch, run.device)
    result = TorchBenchResult()
    result.provenance = {
        "runner": "moesim.hw_profiles.microbench.torch_cuda",
        "method": __doc__,
        "config": asdict(config),
        "shapes": [asdict(s) for s in shapes],
        "device": facts,
        "command": " ".join(sys.argv),
        "measured_at": time.strftime("%Y-%m-%d"),
        "engines": {name: TORCH_ENGINES.get(name).family for name in config.engines},
        "checks": run.checks,
        "failures": run.failures,
    }
    if run.on_cuda:
        result.provenance["ceilings"] = ceilings = _ceilings(torch, run.device, run.dtype)
        result.device = device_json(facts, ceilings)
    for shape in shapes:
        run.check(shape)
    if plan is not None:
        _measure_plan(run, plan, facts["device"], result, started)
        result.provenance["elapsed_s"] = round(time.monotonic() - started, 1)
        return result
    for n_tokens in sorted(config.pass_sizes):
        if time.monotonic() - started > config.max_seconds:
            result.provenance["stopped_early"] = {"before_n_tokens": n_tokens, "max_seconds": config.max_seconds}
            say(f"time budget of {config.max_seconds:.0f} s used up: stopping before n = {n_tokens}")
            break
        for shape in shapes:
            for routing in config.routings:
                result.rows.extend(run.measure(shape, routing, n_tokens, facts["device"]))
            say(f"n = {n_tokens}: {shape.model} done ({time.monotonic() - started:.0f} s)")
    result.provenance["elapsed_s"] = round(time.monotonic() - started, 1)
    return result


def with_plan(config: TorchBenchConfig, plan: Plan) -> TorchBenchConfig:
    """The config a plan runs under: its weight format the plan's (one torch format for all passes)."""
    formats = {p.weight_format.lower() for p in plan.passes}
    unknown = sorted(formats - set(TORCH_DTYPES))
    if unknown or len(formats) != 1:
        why = f"weight format {unknown[0]} is not a torch format ({', '.join(TORCH_DTYPES)})" if unknown else "passes in several formats"
        raise InputError(f"plan: {why}: torch measures one of {', '.join(TORCH_DTYPES)} per run")
    return dataclasses.replace(config, dtype=formats.pop())


def torch_plan_rows(config: TorchBenchConfig, plan: Plan) -> tuple[list[dict[str, Any]], list[str]]:
    """What `microbench torch --plan` measures (`--dry-run` lists it): each pass with the config's engines of its family."""
    return planned_rows(plan, {name: TORCH_ENGINES.get(name).family for name in with_plan(config, plan).engines})


def torch_grid_rows(config: TorchBenchConfig, models: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """What `microbench torch` measures without a plan: every (pass size, shape, routing, engine)."""
    shapes = torch_shapes(models, config.dtype)
    rows = [{"engine": e, "kernel": TORCH_ENGINES.get(e).family, "model": s.model, "n_tokens": n, "routing": r}
            for n in sorted(config.pass_sizes) for s in shapes for r in config.routings for e in config.engines]  # fmt: skip
    return rows, []


def _measure_plan(run: _Run, plan: Plan, device: str, result: TorchBenchResult, started: float) -> None:
    """The plan's passes in ascending n, each with the engines of its family."""
    shapes = {s.model: s for s in plan_shapes(plan)}
    result.provenance["plan"] = {"source": plan.source, "profile": plan.profile, "passes": len(plan.passes)}
    for planned in sorted(plan.passes, key=lambda p: p.n_tokens):
        if time.monotonic() - started > run.config.max_seconds:
            result.provenance["stopped_early"] = {"before_n_tokens": planned.n_tokens, "max_seconds": run.config.max_seconds}
            run.say(f"time budget of {run.config.max_seconds:.0f} s used up: stopping before n = {planned.n_tokens}")
            break
        rows = run.measure(shapes[planned.model], PLANNED, planned.n_tokens, device, planned)
        result.rows.extend(row | {"plan_rung": planned.rung, "plan_time_share": planned.time_share} for row in rows)


def torch_shapes(models: Sequence[str], dtype: str) -> list[MoeShape]:
    """The routed-expert shapes of model presets (names or preset files) in a torch dtype."""
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"torch microbench: unknown weight format '{dtype}' (known: {', '.join(TORCH_DTYPES)})")
    return [MoeShape.from_preset(load_target(model), dtype.upper()) for model in models]
