"""vLLM's `benchmarks/kernels/benchmark_moe.py` and SGLang's `tuning_fused_moe_triton.py` (adapted
from it) in benchmark mode: the argument namespace, then per batch size M

    Batch size: 1, config: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 32, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 1}
    Kernel time: 189.20 us

The time is one MoE layer's fused operation (top-k, w1, activation, w2) averaged over CUDA-graph
replays with fresh random gating (near-uniform routing). The kernel re-reads an expert's weights
once per BLOCK_SIZE_M of its token slots, so each row's family is `dedup_fused_bm<BLOCK_SIZE_M>`
(the config printed is the one the engine ran: a tuned file's entry nearest to M, or vLLM's
defaults). The expert shape is the model's (`--model PRESET`, or the namespace's model named by a
preset), its intermediate split over `tp_size` (or its experts, with expert parallelism).
"""

from __future__ import annotations

import ast
import re

from moesim.errors import InputError
from moesim.hw_profiles.importers.names import ExpertGeometry, resolve_model
from moesim.hw_profiles.importers.rows import Measured, PassScope
from moesim.models import load_preset
from moesim.parsing import parse_float, parse_int

_NAMESPACE = re.compile(r"^Namespace\((?P<args>.*)\)\s*$")
_BATCH = re.compile(r"^Batch size: (?P<m>\S+), config: (?P<config>\{.*\})\s*$")
_TIME = re.compile(r"^Kernel time: (?P<us>\S+) us\s*$")
MAX_BATCH = 1 << 20  # tokens of one fused MoE call (vLLM tunes up to 4096)
MAX_BLOCK = 1 << 12
_DTYPES = {"auto": "BF16", "bf16": "BF16", "fp8_w8a8": "FP8"}


def _namespace(text: str) -> dict[str, object]:
    args: dict[str, object] = {}
    for match in re.finditer(r"(\w+)=('(?:[^'\\]|\\.)*'|\"[^\"]*\"|[^,()]+)", text):
        try:
            args[match[1]] = ast.literal_eval(match[2].strip())
        except (ValueError, SyntaxError):
            args[match[1]] = match[2].strip()
    return args


def parse_benchmark_moe(text: str, where: str, model: str | None = None) -> list[Measured]:
    """Every (batch size, config, kernel time) of a benchmark-mode run."""
    args: dict[str, object] = {}
    pending: tuple[int, dict[str, object], int] | None = None
    measured = []
    for number, line in enumerate(text.splitlines(), start=1):
        if match := _NAMESPACE.match(line.strip()):
            args = _namespace(match["args"])
        elif match := _BATCH.match(line.strip()):
            try:
                config = ast.literal_eval(match["config"])
            except (ValueError, SyntaxError):
                raise InputError(f"{where}: line {number}: config {match['config'][:60]!r} is not a Python dict") from None
            if not isinstance(config, dict) or "BLOCK_SIZE_M" not in config:
                raise InputError(f"{where}: line {number}: config has no BLOCK_SIZE_M")
            block = parse_int(config["BLOCK_SIZE_M"], f"{where}: line {number}: config 'BLOCK_SIZE_M'", 1, MAX_BLOCK)
            pending = (
                parse_int(match["m"], f"{where}: line {number}: 'Batch size'", 1, MAX_BATCH),
                {**config, "BLOCK_SIZE_M": block},
                number,
            )
        elif match := _TIME.match(line.strip()):
            if pending is None:
                raise InputError(f"{where}: line {number}: 'Kernel time' without a 'Batch size' line before it")
            m, config, at = pending
            us = parse_float(match["us"], f"{where}: line {number}: 'Kernel time' (µs)", 0.0, 1e12)
            if not us > 0:
                raise InputError(f"{where}: line {number}: 'Kernel time' must be positive, got {match['us']!r}")
            measured.append((m, config, us, at))
            pending = None
    if not measured:
        raise InputError(f"{where}: no 'Batch size: M, config: {{...}}' / 'Kernel time: T us' pairs (benchmark_moe.py without --tune)")
    dtype = str(args.get("dtype", "auto"))
    if dtype not in _DTYPES:
        raise InputError(f"{where}: field 'dtype' is {dtype!r}: moesim knows {', '.join(_DTYPES)}")
    name = model or str(args.get("model", ""))
    if not name:
        raise InputError(f"{where}: the output names no model (no Namespace line): give --model PRESET")
    preset = load_preset(resolve_model(name, where))
    tp = parse_int(args.get("tp_size", 1) or 1, f"{where}: field 'tp_size'", 1, 1 << 12)
    expert_parallel = bool(args.get("enable_expert_parallel", False))
    geometry = ExpertGeometry(
        preset.hidden,
        preset.expert_intermediate if expert_parallel else preset.expert_intermediate // tp,
        preset.experts // tp if expert_parallel else preset.experts,
        preset.top_k,
    )
    return [
        Measured(
            time_us=us,
            scope="op",
            passes=PassScope(m),
            model=preset.name if tp == 1 else "",
            expert_format=_DTYPES[dtype],
            geometry=geometry,
            kernel=f"dedup_fused_bm{int(config['BLOCK_SIZE_M'])}",
            engine="vLLM fused_moe (Triton)",
            variant=f"BLOCK_SIZE_M {int(config['BLOCK_SIZE_M'])}",
            source=where,
            source_row=at,
            time_source="Kernel time (one MoE layer: top-k, w1, activation, w2)",
            test=f"fused_moe M={m}",
        )
        for m, config, us, at in measured
    ]
