"""Routing geometry of any GGUF model, read from its metadata and tensor table (not from the user).

- `layers`: `{arch}.block_count`; `moe_layers`: the blocks that hold routed expert tensors
  (`blk.N.ffn_{gate,up,down,gate_up}_exps.weight`), so leading dense layers (DeepSeek) and
  interleaved dense layers are handled whatever the architecture;
- `experts`, `top_k`: `{arch}.expert_count`, `{arch}.expert_used_count`;
- `hidden`: `{arch}.embedding_length`; `expert_intermediate`: from the shape of a
  `ffn_down_exps` tensor (ggml `{ff, hidden, experts}`), so per-architecture key names don't matter;
- `expert_bytes`: exact, the bytes of one MoE layer's expert tensors divided by the experts (mixed
  quantisations such as Q4_K gate/up with Q6_K down are counted exactly);
- `weight_format`: the GGML type of the expert tensors when they share one that moesim knows
  (F32, F16, BF16, Q8_0, Q6_K, Q5_K, Q4_K, Q4_0, MXFP4); with mixed or other types, the known
  format nearest in bytes per weight (`expert_bytes` stays exact; the types are named in
  `GGUFModelInfo.expert_types`);
- shared experts: `{arch}.expert_shared_count` (DeepSeek: expert-sized shared experts) or, without
  it, the width of the `ffn_*_shexp` tensors (Qwen-MoE: one shared FFN).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from moesim.errors import InputError, MoesimError
from moesim.fields import option_name
from moesim.models import WEIGHT_FORMATS, bytes_per_weight
from moesim.tracegen.formats.schema import TraceGeometry, checked_geometry
from moesim.tracegen.llamacpp.gguf_builder import SPEC_KEY, TinyModelSpec, build_draft_model, build_tiny_model

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
_SHARED_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_down_shexp\.weight$")


@dataclass(frozen=True)
class GGUFModelInfo:
    """What moesim needs to know about a GGUF model besides its weights."""

    path: Path
    arch: str
    name: str
    geometry: TraceGeometry
    expert_types: tuple[str, ...]
    context_length: int
    tiny_spec: TinyModelSpec | None  # the spec, for files written by `moesim trace tiny-model`


def _reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise InputError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError, TypeError) as exc:
        text = str(exc).strip().splitlines()
        raise InputError(f"{path}: not a readable GGUF file ({text[0] if text else exc.__class__.__name__})") from None


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _int_key(reader: Any, path: Path, key: str, required: bool = True) -> int:
    value = _field(reader, key)
    if value is None:
        if required:
            raise InputError(f"{path}: metadata key '{key}' is missing")
        return 0
    if isinstance(value, (list, bool)) or not isinstance(value, int):
        raise InputError(f"{path}: metadata key '{key}' must be an integer, got {value!r}")
    return value


def _known_format(types: list[str], bytes_per_expert_weight: Fraction) -> str:
    known = [t for t in types if t in WEIGHT_FORMATS]
    if known and len(set(types)) == 1:
        return known[0]
    return min(WEIGHT_FORMATS, key=lambda f: (abs(bytes_per_weight(f) - bytes_per_expert_weight), f))


def read_gguf_info(path: str | Path) -> GGUFModelInfo:
    """Read a GGUF model's architecture, routing geometry and (if moesim wrote it) its tiny spec."""
    path = Path(path)
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InputError(f"{path}: metadata key 'general.architecture' is missing")
    name = _field(reader, "general.name") or path.stem
    layers = _int_key(reader, path, f"{arch}.block_count")
    experts = _int_key(reader, path, f"{arch}.expert_count", required=False)
    tensors = {t.name: t for t in reader.tensors}
    expert_tensors: dict[int, list[Any]] = {}
    for tensor_name, tensor in tensors.items():
        match = _EXPERT_TENSOR.match(tensor_name)
        if match:
            expert_tensors.setdefault(int(match.group(1)), []).append(tensor)
    if experts < 1 or not expert_tensors:
        raise InputError(
            f"{path}: the model has no routed experts (metadata key '{arch}.expert_count' is {experts}, "
            f"{len(expert_tensors)} blocks hold expert tensors); a routing trace needs a MoE model"
        )
    top_k = _int_key(reader, path, f"{arch}.expert_used_count")
    hidden = _int_key(reader, path, f"{arch}.embedding_length")
    moe_layers = tuple(sorted(expert_tensors))
    first = expert_tensors[moe_layers[0]]
    down = [t for t in first if ".ffn_down_exps." in t.name]
    if not down:
        raise InputError(f"{path}: tensor 'blk.{moe_layers[0]}.ffn_down_exps.weight' is missing")
    expert_intermediate = int(down[0].shape[0])  # ggml ne = {ff, hidden, experts}
    total_bytes = sum(int(t.n_bytes) for t in first)
    total_weights = sum(int(t.n_elements) for t in first)
    types = sorted({t.tensor_type.name for t in first})
    weight_format = _known_format(types, Fraction(total_bytes, total_weights))
    shared_experts = _int_key(reader, path, f"{arch}.expert_shared_count", required=False)
    shared_intermediate = 0
    if not shared_experts:
        shared = [t for n, t in tensors.items() if _SHARED_TENSOR.match(n)]
        shared_intermediate = int(shared[0].shape[0]) if shared else 0
    geometry = checked_geometry(
        path,
        model=str(name),
        layers=layers,
        moe_layers=moe_layers,
        experts=experts,
        top_k=top_k,
        hidden=hidden,
        expert_intermediate=expert_intermediate,
        weight_format=weight_format,
        shared_experts=shared_experts,
        shared_intermediate=shared_intermediate,
        expert_bytes=total_bytes / experts,
    )
    tiny_spec = _tiny_spec(reader)
    context_length = _int_key(reader, path, f"{arch}.context_length", required=False)
    return GGUFModelInfo(path, arch, str(name), geometry, tuple(types), context_length, tiny_spec)


def read_gguf_name(path: str | Path) -> str:
    """`general.name` of any GGUF model (dense ones too), else the file's stem."""
    path = Path(path)
    name = _field(_reader(path), "general.name")
    return name if isinstance(name, str) and name else path.stem


def read_gguf_geometry(path: str | Path) -> TraceGeometry:
    """The routing geometry of any GGUF MoE model (InputError if it has no experts)."""
    return read_gguf_info(path).geometry


def _tiny_spec(reader: Any) -> TinyModelSpec | None:
    text = _field(reader, SPEC_KEY)
    if not isinstance(text, str):
        return None
    try:
        return TinyModelSpec(**json.loads(text))
    except (json.JSONDecodeError, TypeError, MoesimError):
        return None


def read_tiny_spec(path: str | Path) -> TinyModelSpec:
    """The TinyModelSpec of a GGUF written by moesim (InputError for any other file)."""
    spec = _tiny_spec(_reader(Path(path)))
    if spec is None:
        raise InputError(f"{path}: metadata key '{SPEC_KEY}' is missing or malformed (the file was not written by moesim trace tiny-model)")
    return spec


def write_tiny_model(out: Path, shape: dict[str, Any], draft_of: Path | None = None, noise: float | None = None) -> TinyModelSpec:
    """`trace tiny-model`: a random model of `shape` (TinyModelSpec fields; the rest default), or,
    with `draft_of`, a copy of that moesim-built GGUF with `noise` added to every weight (a draft);
    returns the spec written."""
    if draft_of is not None:
        if shape:
            raise InputError(f"--draft-of takes the shape from {draft_of}; drop {option_name(TinyModelSpec, sorted(shape)[0])}")
        if noise is None:
            raise InputError("--draft-of needs --noise (0 gives an identical copy)")
        build_draft_model(read_tiny_spec(draft_of), noise, out)
        return read_tiny_spec(out)
    if noise is not None:
        raise InputError("--noise needs --draft-of TARGET.gguf")
    spec = TinyModelSpec(**shape)
    build_tiny_model(out, spec)
    return spec
