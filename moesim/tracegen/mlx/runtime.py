"""MLX through mlx_lm: loading a model folder, the routing geometry, routing capture, timed calls.

Routing capture wraps the model's own sparse-MoE blocks, found in the loaded module tree (a block
is a module with a `gate` router and a `switch_mlp`, mlx_lm's `SwitchGLU`): the router is
replaced by a tap that keeps its logits (and, when asked, its input) and the `SwitchGLU` by a tap
that keeps the expert ids the block hands it, each then calling the wrapped module unchanged, so
the block runs mlx_lm's code as it is. Nothing is evaluated by the taps: the arrays they keep are
parts of the graph MLX evaluates anyway, and are read into numpy after the pass (`end_pass`).

Gate weights are the ones the block applies, from the router logits and the block's rule
(ml-explore/mlx-lm mlx_lm/models: `qwen3_moe.py`, `olmoe.py` softmax over all experts, the top-k
renormalised when `norm_topk_prob`; `qwen2_moe.py` never renormalised; `mixtral.py` softmax over
the top-k logits, which equals the renormalised top-k of the full softmax). Ids are written
highest weight first (mlx_lm's `argpartition` leaves them in no order).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import InputError, MoesimError
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.mlx import INSTALL_HINT

ENGINE = "mlx_lm"
ROUTED_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")  # whose gate rule this module knows
_DTYPE_FORMATS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


class MlxError(MoesimError):
    """mlx_lm refused or failed an operation (load, forward)."""


def import_mlx() -> tuple[Any, Any]:
    """(mlx.core, mlx.nn) with mlx_lm importable, or the one-line error naming the install command."""
    try:
        import mlx.core as mx
        import mlx.nn as nn
        import mlx_lm  # noqa: F401
    except ImportError:
        raise InputError(f"MLX is not installed: install it with {INSTALL_HINT} (mlx, mlx-lm; the CPU backend on Linux)") from None
    return mx, nn


def engine_version() -> str:
    """The versions written into traces and runs."""
    mx, _ = import_mlx()
    import mlx_lm

    return f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}"


def backend() -> str:
    """The device MLX computes on: 'metal' (a Mac's GPU) or 'cpu'."""
    mx, _ = import_mlx()
    return "cpu" if mx.default_device() == mx.cpu else "metal"


@dataclass
class MlxModel:
    """A model folder loaded through mlx_lm: the model, its tokenizer, its config and its MoE blocks."""

    path: Path
    model: Any
    tokenizer: Any
    config: dict[str, Any]
    blocks: list[tuple[int, Any]]  # (layer index, sparse-MoE block)

    @property
    def name(self) -> str:
        """The model's name: the config's `moesim_name` (tiny models) or the folder's name."""
        return str(self.config.get("moesim_name") or self.path.name)

    @property
    def n_vocab(self) -> int:
        """Rows of the output layer."""
        return int(self.config["vocab_size"])

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` with the tokenizer's special tokens (BOS where it adds one)."""
        return [int(t) for t in self.tokenizer.encode(text)]

    def eos_ids(self) -> set[int]:
        """Tokens that end generation."""
        return {int(t) for t in getattr(self.tokenizer, "eos_token_ids", ()) or ()}


def read_config(path: str | Path) -> dict[str, Any]:
    """The folder's config.json (one line when unreadable)."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{config_path}: unreadable MLX model config ({exc.__class__.__name__})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError(f"{config_path}: field 'model_type' is missing")
    return config


def load_model(path: str | Path, require_moe: bool = True) -> MlxModel:
    """Load an MLX model folder (local only: nothing is downloaded) and find its sparse-MoE blocks
    (a draft may be dense: `require_moe` False)."""
    import_mlx()
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: no such MLX model folder")
    config = read_config(path)
    if require_moe and config["model_type"] not in ROUTED_TYPES:
        raise InputError(f"{path / 'config.json'}: model_type '{config['model_type']}': routing is read from {', '.join(ROUTED_TYPES)}")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", *(("num_experts_per_tok",) if require_moe else ())):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{path / 'config.json'}: field '{key}' = {value!r}: must be an integer >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mlx_lm.utils import load

    try:
        model, tokenizer = load(str(path))
    except Exception as exc:  # mlx_lm's loader and the tokenizer's raise whatever a malformed folder makes them raise
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MlxError(f"{path}: mlx_lm could not load the model ({why})") from None
    blocks = [(i, block) for i, layer in enumerate(model.layers) for block in _moe_blocks(layer)]
    if require_moe and not blocks:
        raise InputError(f"{path}: the model has no sparse-MoE block (a module with 'gate' and 'switch_mlp')")
    return MlxModel(path, model, tokenizer, config, blocks)


def _moe_blocks(layer: Any) -> list[Any]:
    """The sparse-MoE blocks inside one decoder layer (at most one in the architectures known here)."""
    return [module for _, module in layer.named_modules() if "gate" in module and "switch_mlp" in module]


def _projections(block: Any) -> list[Any]:
    switch = block.switch_mlp
    switch = getattr(switch, "inner", switch)
    return [switch.gate_proj, switch.up_proj, switch.down_proj]


def weight_format(block: Any) -> tuple[str, float]:
    """(weight format, bytes of one expert) of a block's routed experts, from the arrays themselves."""
    projections = _projections(block)
    experts = int(projections[0].weight.shape[0])
    nbytes = sum(int(v.nbytes) for p in projections for k, v in p.items() if k in ("weight", "scales", "biases"))
    first = projections[0]
    if "scales" not in first:
        name = _DTYPE_FORMATS.get(str(first.weight.dtype).removeprefix("mlx.core."))
    elif first.mode == "affine":
        name = f"AFFINE{first.bits}"
    else:
        name = first.mode.upper()
    if name is None:
        raise InputError(f"expert weights of dtype {first.weight.dtype}: no weight format known for it")
    return name, nbytes / experts


def model_geometry(loaded: MlxModel) -> TraceGeometry:
    """The routing geometry from the model's config, checked against the expert weights it loaded."""
    c = loaded.config
    experts = c.get("num_experts") or c.get("num_local_experts")
    intermediate = c.get("moe_intermediate_size") or c.get("intermediate_size")
    fmt, expert_bytes = weight_format(loaded.blocks[0][1])
    shape = tuple(int(n) for n in _projections(loaded.blocks[0][1])[1].weight.shape[:2])
    if shape != (experts, intermediate):
        raise InputError(f"{loaded.path / 'config.json'}: config says {experts} experts of width {intermediate}, the weights {shape}")
    shared = int(c.get("shared_expert_intermediate_size") or 0)
    return TraceGeometry(
        model=loaded.name,
        layers=int(c["num_hidden_layers"]),
        moe_layers=tuple(i for i, _ in loaded.blocks),
        experts=int(experts),
        top_k=int(c["num_experts_per_tok"]),
        hidden=int(c["hidden_size"]),
        expert_intermediate=int(intermediate),
        weight_format=fmt,
        shared_experts=1 if shared else 0,
        shared_intermediate=shared,
        expert_bytes=expert_bytes,
    )


def _normalizes(model_type: str, block: Any) -> bool:
    """Whether the block renormalises its top-k gate weights (module docstring)."""
    return model_type == "mixtral" or bool(getattr(block, "norm_topk_prob", False))


def gate_weights(logits: np.ndarray, ids: np.ndarray, normalize: bool) -> np.ndarray:
    """w = softmax(logits)[ids], divided by its sum over the k when `normalize` (float32)."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    w = np.take_along_axis(p, ids.astype(np.int64), axis=-1)
    return (w / w.sum(axis=-1, keepdims=True) if normalize else w).astype(np.float32)


@dataclass
class _Sink:
    """What the taps of one block kept during the current pass."""

    logits: list[Any] = field(default_factory=list)
    inputs: list[Any] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)


class RoutingCapture:
    """Taps on every sparse-MoE block of a loaded model; one round of (ids, weights) per pass."""

    def __init__(self, loaded: MlxModel, keep_inputs: bool = False) -> None:
        _, nn = import_mlx()
        self.top_k = int(loaded.config["num_experts_per_tok"])
        self.keep_inputs = keep_inputs
        self.active = True  # False: the taps keep nothing (passes run without capture)
        self._sinks = [_Sink() for _ in loaded.blocks]
        self._normalize = [_normalizes(loaded.config["model_type"], block) for _, block in loaded.blocks]
        self.passes: list[tuple[np.ndarray, np.ndarray]] = []  # per pass: ids (T, L, K), weights (T, L, K)
        self.inputs: list[np.ndarray] = []  # per pass, when kept: router inputs (T, L, hidden)
        capture = self

        class RouterTap(nn.Module):
            def __init__(self, inner: Any, sink: _Sink) -> None:
                super().__init__()
                self.inner = inner
                self.sink = sink

            def __call__(self, x: Any) -> Any:
                out = self.inner(x)
                if capture.active:
                    self.sink.logits.append(out)
                    if capture.keep_inputs:
                        self.sink.inputs.append(x)
                return out

        class SwitchTap(nn.Module):
            def __init__(self, inner: Any, sink: _Sink) -> None:
                super().__init__()
                self.inner = inner
                self.sink = sink

            def __call__(self, x: Any, indices: Any) -> Any:
                if capture.active:
                    self.sink.ids.append(indices)
                return self.inner(x, indices)

        for (_, block), sink in zip(loaded.blocks, self._sinks, strict=True):
            if not isinstance(block.gate, RouterTap):
                block.gate = RouterTap(block.gate, sink)
                block.switch_mlp = SwitchTap(block.switch_mlp, sink)
            else:  # a second capture on the same model takes the taps over
                block.gate.sink = block.switch_mlp.sink = sink

    def end_pass(self) -> None:
        """Read the pass's routing into numpy: ids highest weight first, with their gate weights."""
        ids, weights, inputs = [], [], []
        for sink, normalize in zip(self._sinks, self._normalize, strict=True):
            if len(sink.ids) != 1 or len(sink.logits) != 1:
                raise MlxError(f"a MoE block routed {len(sink.ids)} times in one pass (expected once)")
            layer_ids = np.array(sink.ids[0]).reshape(-1, self.top_k).astype(np.int64)
            logits = np.array(sink.logits[0].astype(_float32())).reshape(layer_ids.shape[0], -1)
            w = gate_weights(logits, layer_ids, normalize)
            order = np.argsort(-w, axis=1, kind="stable")
            ids.append(np.take_along_axis(layer_ids, order, axis=1))
            weights.append(np.take_along_axis(w, order, axis=1))
            if self.keep_inputs:
                inputs.append(np.array(sink.inputs[0].astype(_float32())).reshape(layer_ids.shape[0], -1))
            sink.ids.clear()
            sink.logits.clear()
            sink.inputs.clear()
        self.passes.append((np.stack(ids, axis=1).astype(np.int32), np.stack(weights, axis=1)))
        if self.keep_inputs:
            self.inputs.append(np.stack(inputs, axis=1))

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """Every pass since the last take, concatenated in order: ids and weights (T, L, K)."""
        if not self.passes:
            raise MlxError("no pass was routed since the last take")
        ids = np.concatenate([p[0] for p in self.passes])
        weights = np.concatenate([p[1] for p in self.passes])
        self.passes.clear()
        return ids, weights


def _float32() -> Any:
    mx, _ = import_mlx()
    return mx.float32


@dataclass
class PassLog:
    """Every call of a timed model: tokens fed, wall time (µs) of the call with its evaluation, the
    fed ids and the greedy choice at every position."""

    tokens: list[int] = field(default_factory=list)
    time_us: list[float] = field(default_factory=list)
    inputs: list[np.ndarray] = field(default_factory=list)
    argmax: list[np.ndarray] = field(default_factory=list)

    def clear(self) -> None:
        """Forget the calls logged."""
        for values in (self.tokens, self.time_us, self.inputs, self.argmax):
            values.clear()


# How a call is timed: wall time, or the process's CPU time (all its threads: MLX's CPU backend
# computes on one stream thread while the caller waits, so on a quiet machine the two agree; on a
# machine shared with other jobs CPU time leaves out the time the process waited for a core).
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.process_time_ns}


def clock(name: str) -> Any:
    """The nanosecond clock of a name in CLOCKS (one line when unknown)."""
    if name not in CLOCKS:
        raise InputError(f"unknown clock '{name}' (known: {', '.join(CLOCKS)})")
    return CLOCKS[name]


class TimedModel:
    """A model whose every call is evaluated at once and timed (the clock around the forward and
    `mx.eval` of its logits), then, if it captures, its routing read into numpy outside the timing.
    Everything else (layers, make_cache, ...) is the wrapped model's, so mlx_lm's generators run it."""

    def __init__(self, model: Any, capture: RoutingCapture | None = None, clock_name: str = "wall") -> None:
        self._model = model
        self.capture = capture
        self.log = PassLog()
        self._now = clock(clock_name)

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's logits, evaluated; the call logged (and its routing read)."""
        mx, _ = import_mlx()
        started = self._now()
        out = self._model(inputs, *args, **kwargs)
        mx.eval(out)
        self.log.time_us.append((self._now() - started) / 1e3)
        self.log.tokens.append(int(inputs.shape[-1]))
        self.log.inputs.append(np.array(inputs).reshape(-1))
        self.log.argmax.append(np.array(mx.argmax(out, axis=-1)).reshape(-1))
        if self.capture is not None and self.capture.active:
            self.capture.end_pass()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
